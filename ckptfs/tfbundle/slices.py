"""The key of one saved slice of a tensor: TF's ``EncodeTensorNameSlice`` (saved_tensor_slice_util.cc), built on
``OrderedCode`` (strings/ordered_code.cc).

Key = ``WriteNumIncreasing(0)`` (one 0x00 byte: slice keys sort before every name), ``WriteString(name)`` (0x00
written 0x00 0xff, 0xff written 0xff 0x00, then 0x00 0x01), ``WriteNumIncreasing(rank)``, then per dimension
``WriteSignedNumIncreasing(start)`` and ``WriteSignedNumIncreasing(length)`` (-1 and -1 for a full extent).
"""
from __future__ import annotations

from ckptfs.tfbundle.wire import BundleFormatError

__all__ = ["encode_slice_key", "decode_slice_key"]

_HEADER = [(0, 0), (0x80, 0), (0xC0, 0), (0xE0, 0), (0xF0, 0), (0xF8, 0), (0xFC, 0), (0xFE, 0), (0xFF, 0),
           (0xFF, 0x80), (0xFF, 0xC0)]


def _num_increasing(value: int) -> bytes:
    body = value.to_bytes((value.bit_length() + 7) // 8, "big") if value else b""
    return bytes([len(body)]) + body


def _signed_increasing(value: int) -> bytes:
    x = ~value if value < 0 else value
    if x < 64:
        return bytes([(_HEADER[1][0] ^ value) & 0xFF])
    n = x.bit_length() // 7 + 1
    buf = bytearray(value.to_bytes(10, "big", signed=True))[10 - n:]
    buf[0] ^= _HEADER[n][0]
    buf[1] ^= _HEADER[n][1]
    return bytes(buf)


def _string(text: bytes) -> bytes:
    return text.replace(b"\xff", b"\xff\x00").replace(b"\x00", b"\x00\xff") + b"\x00\x01"


def encode_slice_key(name, extents) -> bytes:
    """The key of the slice ``extents`` (``(start, length)`` per dimension; ``length`` None or -1: all of it)."""
    raw = name.encode("utf-8") if isinstance(name, str) else bytes(name)
    out = _num_increasing(0) + _string(raw) + _num_increasing(len(extents))
    for start, length in extents:
        if length is None or length < 0:
            start, length = -1, -1
        out += _signed_increasing(start) + _signed_increasing(length)
    return out


def _read_signed(key: bytes, pos: int) -> tuple[int, int]:
    if pos >= len(key):
        raise BundleFormatError("slice key ends inside a number")
    first = key[pos]
    negative = first < 0x80
    b0 = first ^ (0xFF if negative else 0)
    n = 1
    if b0 & 0x80:  # count the header's leading ones (two bytes of them for n > 8)
        n = 0
        while n < 8 and b0 & (0x80 >> n):
            n += 1
        if n == 8:
            if pos + 1 >= len(key):
                raise BundleFormatError("slice key ends inside a number")
            b1 = key[pos + 1] ^ (0xFF if negative else 0)
            n = 8 + (1 if b1 & 0x80 else 0) + (1 if b1 & 0xC0 == 0xC0 else 0)
    if pos + n > len(key) or n > 10:
        raise BundleFormatError("slice key ends inside a number")
    buf = bytearray(key[pos:pos + n])
    buf[0] ^= _HEADER[n][0]
    if n > 1:
        buf[1] ^= _HEADER[n][1]
    sign = b"\xff" if negative else b"\x00"
    value = int.from_bytes(sign * (10 - n) + bytes(buf), "big", signed=True)
    return value, pos + n


def decode_slice_key(key: bytes) -> tuple[str, tuple]:
    """``(name, ((start, length or None), ...))`` of a slice key; ``BundleFormatError`` if it is not one."""
    if key[:1] != b"\x00":
        raise BundleFormatError(f"key {key[:40]!r} is not a slice key")
    pos, out = 1, bytearray()
    while True:
        if pos >= len(key):
            raise BundleFormatError("slice key: unterminated name")
        b = key[pos]
        if b == 0:
            nxt = key[pos + 1:pos + 2]
            if nxt == b"\x01":
                pos += 2
                break
            if nxt != b"\xff":
                raise BundleFormatError("slice key: bad escape in name")
            out.append(0)
            pos += 2
        elif b == 0xFF:
            if key[pos + 1:pos + 2] != b"\x00":
                raise BundleFormatError("slice key: bad escape in name")
            out.append(0xFF)
            pos += 2
        else:
            out.append(b)
            pos += 1
    if pos >= len(key) or key[pos] > 8 or pos + 1 + key[pos] > len(key):
        raise BundleFormatError("slice key: bad rank")
    rank = int.from_bytes(key[pos + 1:pos + 1 + key[pos]], "big")
    pos += 1 + key[pos]
    if rank > 64:
        raise BundleFormatError(f"slice key: rank {rank}")
    extents = []
    for _ in range(rank):
        start, pos = _read_signed(key, pos)
        length, pos = _read_signed(key, pos)
        extents.append((0, None) if length == -1 else (start, length))  # -1, -1: the whole dimension
    if pos != len(key):
        raise BundleFormatError("slice key: bytes after its last extent")
    try:
        name = out.decode("utf-8")
    except UnicodeDecodeError:
        raise BundleFormatError("slice key: name is not UTF-8") from None
    return name, tuple(extents)
