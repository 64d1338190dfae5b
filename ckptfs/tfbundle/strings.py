"""A string tensor's bytes in a bundle's data file (TF's ``WriteStringTensor``) and the CRC its entry holds.

Bytes = each element's length as a varint64, then the masked CRC-32C of the lengths (each taken as a
little-endian uint32, or uint64 when above 2**32 - 1) as fixed32, then the elements' bytes end to end. The
entry's ``crc32c`` is the masked CRC-32C of: those lengths (as uint32/uint64), the 4 checksum bytes, the elements.
"""
from __future__ import annotations

import struct

from ckptfs.tfbundle.crc32c import crc32c, mask
from ckptfs.tfbundle.wire import BundleFormatError, get_varint, put_fixed32, put_varint

__all__ = ["encode_string_tensor", "decode_string_tensor"]


def _length_bytes(n: int) -> bytes:
    return struct.pack("<I", n) if n <= 0xFFFFFFFF else struct.pack("<Q", n)


def encode_string_tensor(values) -> tuple[bytes, int]:
    """``(bytes in the data file, masked CRC-32C for the entry)`` of the string tensor ``values`` (C order)."""
    values = [bytes(v) for v in values]
    crc = 0
    for v in values:
        crc = crc32c(_length_bytes(len(v)), crc)
    check = put_fixed32(mask(crc))
    crc = crc32c(check, crc)
    for v in values:
        crc = crc32c(v, crc)
    return b"".join(put_varint(len(v)) for v in values) + check + b"".join(values), mask(crc)


def decode_string_tensor(blob, count: int) -> list[bytes]:
    """The ``count`` elements of a string tensor's bytes ``blob``; checks the lengths' checksum and sizes."""
    view = memoryview(blob)
    pos, lengths = 0, []
    for _ in range(count):
        n, pos = get_varint(view, pos, len(view), "string tensor length")
        lengths.append(n)
    if pos + 4 > len(view):
        raise BundleFormatError("string tensor ends before its lengths' checksum")
    crc = 0
    for n in lengths:
        crc = crc32c(_length_bytes(n), crc)
    if bytes(view[pos:pos + 4]) != put_fixed32(mask(crc)):
        raise BundleFormatError("string tensor lengths' checksum does not match")
    pos += 4
    if sum(lengths) != len(view) - pos:
        raise BundleFormatError(f"string tensor holds {len(view) - pos} bytes for lengths summing to {sum(lengths)}")
    out = []
    for n in lengths:
        out.append(bytes(view[pos:pos + n]))
        pos += n
    return out
