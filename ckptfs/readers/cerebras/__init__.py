"""The Cerebras HDF5 reader: ``checkpoint_<step>.mdl`` files of formats 0.1-0.5, local or as one object, and their LZ4 chunks."""
