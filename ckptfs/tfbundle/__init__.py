"""TensorFlow tensor bundles (the ``<prefix>.index`` + ``<prefix>.data-0000i-of-0000N`` files of a saver checkpoint):
a pure codec, no I/O. Public names (stable; other modules import them from here):

- ``parse_index(data, path=None) -> BundleIndex`` — the header and entries of an ``.index`` file's bytes; every
  count, varint, offset, block size and checksum is checked, and bad input raises ``BundleFormatError`` (a
  ``CheckpointError``, one line naming ``path``). ``BundleIndex.header``, ``.entries`` (``(key bytes,
  BundleEntry)`` in key order), ``.tensors()`` (``{name: BundleEntry}``).
- ``encode_index(header, entries) -> bytes`` — the ``.index`` bytes TensorFlow's ``BundleWriter`` writes for them.
- ``BundleHeader(num_shards, endianness, producer, min_consumer, bad_consumers)``; ``BundleEntry(dtype, dims,
  shard_id, offset, size, crc32c, slices, dim_names, unknown_rank)``; ``encode_header`` / ``decode_header``,
  ``encode_entry`` / ``decode_entry`` (the protobuf messages alone).
- ``DT`` (``{"float32": 1, ...}``, TF ``DataType`` numbers), ``DT_NAMES`` (the reverse), ``DT_ITEMSIZE``.
- ``crc32c(data, crc=0)``, ``mask(crc)``, ``unmask(masked)``: an entry's ``crc32c`` is
  ``mask(crc32c(its bytes in the data file))``.
- ``data_file_name(prefix, shard, num_shards)`` — ``<prefix>.data-00000-of-00001``.
- ``checkpoint_state(prefix_name) -> bytes`` — the ``checkpoint`` text file a Saver writes beside them.
- ``write_table(items, options)`` / ``read_table(data)`` — the LevelDB-style table underneath.
- ``encode_string_tensor(values) -> (bytes, masked crc)`` / ``decode_string_tensor(blob, count)`` — a string
  tensor's bytes in the data file (its CRC is not the plain CRC of those bytes).
- ``encode_slice_key(name, extents)`` / ``decode_slice_key(key)`` — the key of one saved slice of a sliced tensor.

What TF writes (checked against its sources and real checkpoints): the data file holds each tensor's C-order
little-endian bytes end to end, no alignment, in the order the saver adds them (a TF1 ``Saver``: sorted by name;
``ckptfs.layouts.tfsaver`` uses that order); the index is sorted bytewise by key, header first.
"""
from ckptfs.tfbundle.bundle import MAX_SHARDS, BundleIndex, data_file_name, encode_index, key_bytes, parse_index
from ckptfs.tfbundle.crc32c import crc32c, mask, unmask
from ckptfs.tfbundle.protos import (DT, DT_ITEMSIZE, DT_NAMES, BundleEntry, BundleHeader, decode_entry,
                                    decode_header, encode_entry, encode_header)
from ckptfs.tfbundle.slices import decode_slice_key, encode_slice_key
from ckptfs.tfbundle.state import checkpoint_state
from ckptfs.tfbundle.strings import decode_string_tensor, encode_string_tensor
from ckptfs.tfbundle.table import TableOptions, read_table, write_table
from ckptfs.tfbundle.wire import BundleFormatError

__all__ = ["BundleEntry", "BundleFormatError", "BundleHeader", "BundleIndex", "DT", "DT_ITEMSIZE", "DT_NAMES",
           "MAX_SHARDS", "TableOptions", "checkpoint_state", "crc32c", "data_file_name", "decode_entry",
           "decode_header", "decode_slice_key", "decode_string_tensor", "encode_entry", "encode_header", "encode_index", "encode_slice_key",
           "encode_string_tensor",
           "key_bytes", "mask", "parse_index", "read_table", "unmask", "write_table"]
