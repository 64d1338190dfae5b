"""The TensorFlow reader: a TF saver checkpoint (its prefix, .index or folder), TF1 name-based and TF2 object-based, sharded or not, read without TensorFlow."""
