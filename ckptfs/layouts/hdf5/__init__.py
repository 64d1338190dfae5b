"""The format-0.5 ``.mdl`` layout: HDF5 metadata built once, tensor bytes on read."""
