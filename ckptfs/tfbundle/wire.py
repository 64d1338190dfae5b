"""Protocol-buffer wire format, as much of it as a tensor bundle needs: varints, fixed32/64, tagged fields.

Pure functions over bytes. Decoding is bounded: a varint longer than 10 bytes, a length past the end of the
buffer, a wire type the bundle's messages never use — each raises ``BundleFormatError`` with one line.
"""
from __future__ import annotations

import struct

from ckptfs.errors import CheckpointError

__all__ = ["BundleFormatError", "put_varint", "get_varint", "put_fixed32", "get_fixed32", "put_fixed64",
           "get_fixed64", "field_varint", "field_bytes", "field_fixed32", "iter_fields", "VARINT", "FIXED64",
           "LENGTH", "FIXED32"]

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5


class BundleFormatError(CheckpointError):
    """A tensor bundle (``.index`` table, entry, header) is not what TensorFlow writes: ``str()`` is one line."""

    def __init__(self, problem: str, path=None):
        super().__init__(path, problem)


def put_varint(value: int) -> bytes:
    """``value`` as an unsigned LEB128 varint; a negative int is written as its 64-bit two's complement (10 bytes),
    as protobuf writes a negative int32/int64."""
    if value < 0:
        value &= (1 << 64) - 1
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def get_varint(buf, pos: int, end: int | None = None, what: str = "varint") -> tuple[int, int]:
    """``(value, next position)`` of the varint at ``buf[pos]`` (at most 10 bytes, not past ``end``)."""
    end = len(buf) if end is None else end
    value, shift = 0, 0
    for i in range(10):
        if pos + i >= end:
            raise BundleFormatError(f"{what} runs past the end of its data at byte {pos}")
        b = buf[pos + i]
        value |= (b & 0x7F) << shift
        if b < 0x80:
            if value >= 1 << 64:
                raise BundleFormatError(f"{what} at byte {pos} does not fit in 64 bits")
            return value, pos + i + 1
        shift += 7
    raise BundleFormatError(f"{what} at byte {pos} is longer than 10 bytes")


def put_fixed32(value: int) -> bytes:
    return struct.pack("<I", value & 0xFFFFFFFF)


def get_fixed32(buf, pos: int) -> int:
    return struct.unpack_from("<I", buf, pos)[0]


def put_fixed64(value: int) -> bytes:
    return struct.pack("<Q", value & 0xFFFFFFFFFFFFFFFF)


def get_fixed64(buf, pos: int) -> int:
    return struct.unpack_from("<Q", buf, pos)[0]


def _tag(number: int, wire: int) -> bytes:
    return put_varint(number << 3 | wire)


def field_varint(number: int, value: int) -> bytes:
    return _tag(number, VARINT) + put_varint(value)


def field_bytes(number: int, value: bytes) -> bytes:
    return _tag(number, LENGTH) + put_varint(len(value)) + value


def field_fixed32(number: int, value: int) -> bytes:
    return _tag(number, FIXED32) + put_fixed32(value)


def signed64(value: int) -> int:
    """A varint's 64 bits as a signed int64 (protobuf's int32/int64)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def iter_fields(buf, what: str):
    """``(field number, wire type, value)`` for each field of the message ``buf``: an int for varint / fixed
    fields, a ``memoryview`` slice for length-delimited ones. Groups (wire types 3, 4) are refused."""
    view = memoryview(buf)
    pos, end = 0, len(view)
    while pos < end:
        key, pos = get_varint(view, pos, end, f"{what}: field tag")
        number, wire = key >> 3, key & 7
        if number == 0:
            raise BundleFormatError(f"{what}: field number 0 at byte {pos}")
        if wire == VARINT:
            value, pos = get_varint(view, pos, end, f"{what}: field {number}")
        elif wire == FIXED64:
            if pos + 8 > end:
                raise BundleFormatError(f"{what}: fixed64 field {number} runs past the end")
            value, pos = get_fixed64(view, pos), pos + 8
        elif wire == FIXED32:
            if pos + 4 > end:
                raise BundleFormatError(f"{what}: fixed32 field {number} runs past the end")
            value, pos = get_fixed32(view, pos), pos + 4
        elif wire == LENGTH:
            n, pos = get_varint(view, pos, end, f"{what}: length of field {number}")
            if n > end - pos:
                raise BundleFormatError(f"{what}: field {number} claims {n} bytes, {end - pos} are left")
            value, pos = view[pos:pos + n], pos + n
        else:
            raise BundleFormatError(f"{what}: field {number} has wire type {wire}, which a bundle never uses")
        yield number, wire, value
