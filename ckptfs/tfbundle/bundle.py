"""A whole ``.index``: the header entry (key ``""``) and one entry per key, to bytes and back.

``parse_index(data, path)`` → ``BundleIndex``; ``encode_index(header, entries)`` → bytes (``entries``: ``(key,
BundleEntry)`` pairs, keys as ``str`` or ``bytes``, in any order: the table is sorted bytewise as TF's
``BundleWriter`` sorts it). Checks made when parsing: the table (``table.read_table``), the header first and
decodable, every entry decodable, a known byte order (little endian), ``shard_id < num_shards``, and for a
fixed-size dtype that ``size`` is the shape's element count times the element size (whole tensors only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ckptfs.tfbundle.protos import (DT_ITEMSIZE, BundleEntry, BundleHeader, decode_entry, decode_header,
                                    encode_entry, encode_header)
from ckptfs.tfbundle.table import TableOptions, read_table, write_table
from ckptfs.tfbundle.wire import BundleFormatError

__all__ = ["BundleIndex", "parse_index", "encode_index", "key_bytes", "data_file_name", "MAX_SHARDS"]

#: the most data shards a parsed header may announce
MAX_SHARDS = 1 << 20


def key_bytes(key) -> bytes:
    return key if isinstance(key, (bytes, bytearray)) else key.encode("utf-8")


def data_file_name(prefix: str, shard: int, num_shards: int) -> str:
    """``<prefix>.data-00000-of-00001``: TF's ``DataFilename`` (``%05d``)."""
    return f"{prefix}.data-{shard:05d}-of-{num_shards:05d}"


@dataclass(frozen=True)
class BundleIndex:
    """A parsed ``.index``: its header and its entries in key order (``(key bytes, BundleEntry)``)."""

    header: BundleHeader
    entries: tuple

    def tensors(self) -> dict:
        """``{name: entry}`` of the entries whose key is a tensor name (UTF-8, not a slice key: those start with
        a NUL byte)."""
        out = {}
        for key, e in self.entries:
            if key[:1] != b"\0":
                try:
                    out[key.decode("utf-8")] = e
                except UnicodeDecodeError:
                    pass
        return out


def parse_index(data, path=None) -> BundleIndex:
    """The header and entries of the ``.index`` bytes ``data``; ``BundleFormatError`` (one line, naming ``path``)
    for anything TF would not have written."""
    try:
        rows = read_table(data)
        if not rows or rows[0][0] != b"":
            raise BundleFormatError("the first key is not the header entry (\"\")")
        header = decode_header(rows[0][1])
        if header.endianness != 0:
            raise BundleFormatError(f"the header says byte order {header.endianness}; only little endian is read")
        if not 0 < header.num_shards <= MAX_SHARDS:
            raise BundleFormatError(f"the header announces {header.num_shards} data shards")
        entries = []
        for key, value in rows[1:]:
            e = decode_entry(value, key.decode("utf-8", "backslashreplace"))
            if e.shard_id >= header.num_shards:
                raise BundleFormatError(f"entry {key!r} is in shard {e.shard_id} of {header.num_shards}")
            item = DT_ITEMSIZE.get(e.dtype_name)
            if item is not None and not e.slices:
                if len(e.dims) > 64:
                    raise BundleFormatError(f"entry {key!r} has {len(e.dims)} dimensions")
                want = math.prod(e.dims) * item
                if want != e.size:
                    raise BundleFormatError(f"entry {key!r} ({e.dtype_name} {list(e.dims)}) should hold {want} "
                                            f"bytes, it says {e.size}")
            entries.append((key, e))
        return BundleIndex(header, tuple(entries))
    except BundleFormatError as err:
        if path is None:
            raise
        raise BundleFormatError(err.problem, path) from None


def encode_index(header: BundleHeader, entries, options: TableOptions = TableOptions()) -> bytes:
    """The ``.index`` bytes of ``header`` and ``entries`` (``(key, BundleEntry)``, keys str or bytes)."""
    rows = sorted(((key_bytes(k), encode_entry(e)) for k, e in entries), key=lambda r: r[0])
    if rows and rows[0][0] == b"":
        raise ValueError("a tensor cannot be named \"\" (the header's key)")
    return write_table([(b"", encode_header(header))] + rows, options)
