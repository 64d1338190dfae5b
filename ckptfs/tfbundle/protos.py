"""The two messages of a tensor bundle's ``.index``, as TensorFlow's ``tensor_bundle.proto`` defines them, with their
wire encoding (what C++ ``SerializeToString`` writes: fields in number order, proto3 zero values left out, the
entry's ``shape`` always present) and a bounded decoding.

``BundleHeaderProto`` (the value under the key ``""``): ``num_shards`` (1, int32), ``endianness`` (2, enum,
LITTLE = 0), ``version`` (3, ``VersionDef``: ``producer`` 1, ``min_consumer`` 2, ``bad_consumers`` 3 repeated).

``BundleEntryProto`` (one per tensor, and one per saved slice of a sliced tensor): ``dtype`` (1, ``DataType``
enum), ``shape`` (2, ``TensorShapeProto``: ``dim`` 2 repeated {``size`` 1, ``name`` 2}, ``unknown_rank`` 3),
``shard_id`` (3, int32), ``offset`` (4, int64), ``size`` (5, int64), ``crc32c`` (6, fixed32: the masked CRC-32C of
the tensor's bytes in its data file), ``slices`` (7, repeated ``TensorSliceProto``: ``extent`` 1 repeated {``start``
1, ``length`` 2 (absent: the whole dimension)}).

One deviation is deliberate: ``encode_entry`` writes ``crc32c`` even when it is 0 (C++ would leave it out), so that
an entry's size never depends on the data (a masked CRC is 0 for one tensor in 2**32; TF reads either form);
only the entry of a sliced tensor (``slices`` set: its bytes are in its slices' entries) goes without it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ckptfs.tfbundle.wire import (FIXED32, LENGTH, VARINT, BundleFormatError, field_bytes, field_fixed32,
                                  field_varint, iter_fields, signed64)

__all__ = ["DT", "DT_NAMES", "DT_ITEMSIZE", "BundleHeader", "BundleEntry", "encode_header", "decode_header",
           "encode_entry", "decode_entry", "TENSOR_BUNDLE_VERSION"]

#: TensorFlow ``DataType`` numbers by numpy-style name (those a bundle of ckptfs's tensors can hold, and strings)
DT = {"float32": 1, "float64": 2, "int32": 3, "uint8": 4, "int16": 5, "int8": 6, "string": 7, "complex64": 8,
      "int64": 9, "bool": 10, "bfloat16": 14, "uint16": 17, "complex128": 18, "float16": 19, "uint32": 22,
      "uint64": 23, "float8_e5m2": 24, "float8_e4m3fn": 25}
DT_NAMES = {v: k for k, v in DT.items()}
#: bytes per element of each fixed-size type (strings have none)
DT_ITEMSIZE = {"float32": 4, "float64": 8, "int32": 4, "uint8": 1, "int16": 2, "int8": 1, "complex64": 8,
               "int64": 8, "bool": 1, "bfloat16": 2, "uint16": 2, "complex128": 16, "float16": 2, "uint32": 4,
               "uint64": 8, "float8_e5m2": 1, "float8_e4m3fn": 1}

#: what ``BundleWriter`` puts in the header's ``version``: producer 1, min_consumer 0
TENSOR_BUNDLE_VERSION = 1

_I32 = (-(1 << 31), (1 << 31) - 1)
_I64 = (-(1 << 63), (1 << 63) - 1)


@dataclass(frozen=True)
class BundleHeader:
    """The ``""`` entry: how many data shards, their byte order (0 = little endian) and the format version."""

    num_shards: int = 1
    endianness: int = 0
    producer: int = TENSOR_BUNDLE_VERSION
    min_consumer: int = 0
    bad_consumers: tuple = ()


@dataclass(frozen=True)
class BundleEntry:
    """One tensor (or one saved slice): where its bytes are (``shard_id``, ``offset``, ``size``) and their masked
    CRC-32C. ``dims`` are the shape's sizes; ``dim_names`` only when a dimension has a name; ``slices`` is a tuple
    of slices, each a tuple of ``(start, length or None)`` per dimension."""

    dtype: int
    dims: tuple = ()
    shard_id: int = 0
    offset: int = 0
    size: int = 0
    crc32c: int = 0
    slices: tuple = ()
    dim_names: tuple = ()
    unknown_rank: bool = False

    @property
    def dtype_name(self) -> str:
        return DT_NAMES.get(self.dtype, f"DataType {self.dtype}")


def _check(value: int, bounds, what: str) -> int:
    if not bounds[0] <= value <= bounds[1]:
        raise BundleFormatError(f"{what} = {value} is out of range")
    return value


def encode_header(h: BundleHeader) -> bytes:
    version = b""
    if h.producer:
        version += field_varint(1, h.producer)
    if h.min_consumer:
        version += field_varint(2, h.min_consumer)
    for b in h.bad_consumers:
        version += field_varint(3, b)
    out = b""
    if h.num_shards:
        out += field_varint(1, h.num_shards)
    if h.endianness:
        out += field_varint(2, h.endianness)
    out += field_bytes(3, version)  # C++ sets the version message always (mutable_version)
    return out


def decode_header(buf) -> BundleHeader:
    num_shards = endianness = producer = min_consumer = 0
    bad: list = []
    for number, wire, value in iter_fields(buf, "bundle header"):
        if number == 1 and wire == VARINT:
            num_shards = _check(signed64(value), _I32, "bundle header num_shards")
        elif number == 2 and wire == VARINT:
            endianness = _check(signed64(value), _I32, "bundle header endianness")
        elif number == 3 and wire == LENGTH:
            for n2, w2, v2 in iter_fields(value, "bundle header version"):
                if w2 != VARINT:
                    raise BundleFormatError(f"bundle header version: field {n2} has wire type {w2}")
                v2 = _check(signed64(v2), _I32, f"bundle header version field {n2}")
                if n2 == 1:
                    producer = v2
                elif n2 == 2:
                    min_consumer = v2
                elif n2 == 3:
                    bad.append(v2)
        else:
            raise BundleFormatError(f"bundle header: unexpected field {number} (wire type {wire})")
    return BundleHeader(num_shards, endianness, producer, min_consumer, tuple(bad))


def _encode_shape(dims, names, unknown_rank: bool) -> bytes:
    out = b""
    for i, d in enumerate(dims):
        dim = field_varint(1, d) if d else b""
        name = names[i] if i < len(names) else ""
        if name:
            dim += field_bytes(2, name.encode("utf-8"))
        out += field_bytes(2, dim)
    if unknown_rank:
        out += field_varint(3, 1)
    return out


def _encode_slice(extents) -> bytes:
    out = b""
    for start, length in extents:
        ext = field_varint(1, start) if start else b""
        if length is not None:
            ext += field_varint(2, length)  # a oneof member: written even when 0
        out += field_bytes(1, ext)
    return out


def encode_entry(e: BundleEntry) -> bytes:
    out = field_varint(1, e.dtype) if e.dtype else b""
    out += field_bytes(2, _encode_shape(e.dims, e.dim_names, e.unknown_rank))
    if e.shard_id:
        out += field_varint(3, e.shard_id)
    if e.offset:
        out += field_varint(4, e.offset)
    if e.size:
        out += field_varint(5, e.size)
    if e.crc32c or not e.slices:  # a sliced tensor's own entry holds no bytes and no CRC
        out += field_fixed32(6, e.crc32c)
    for s in e.slices:
        out += field_bytes(7, _encode_slice(s))
    return out


def _decode_shape(buf) -> tuple:
    dims, names, unknown = [], [], False
    for number, wire, value in iter_fields(buf, "tensor shape"):
        if number == 2 and wire == LENGTH:
            size, name = 0, ""
            for n2, w2, v2 in iter_fields(value, "tensor shape dim"):
                if n2 == 1 and w2 == VARINT:
                    size = _check(signed64(v2), _I64, "tensor shape dim size")
                elif n2 == 2 and w2 == LENGTH:
                    try:
                        name = bytes(v2).decode("utf-8")
                    except UnicodeDecodeError:
                        raise BundleFormatError("tensor shape dim name is not UTF-8") from None
                else:
                    raise BundleFormatError(f"tensor shape dim: unexpected field {n2}")
            if size < 0:
                raise BundleFormatError(f"tensor shape dim size {size} is negative")
            dims.append(size)
            names.append(name)
        elif number == 3 and wire == VARINT:
            unknown = bool(value)
        else:
            raise BundleFormatError(f"tensor shape: unexpected field {number}")
    return tuple(dims), (tuple(names) if any(names) else ()), unknown


def _decode_slice(buf) -> tuple:
    extents = []
    for number, wire, value in iter_fields(buf, "tensor slice"):
        if number != 1 or wire != LENGTH:
            raise BundleFormatError(f"tensor slice: unexpected field {number}")
        start, length = 0, None
        for n2, w2, v2 in iter_fields(value, "tensor slice extent"):
            if w2 != VARINT or n2 not in (1, 2):
                raise BundleFormatError(f"tensor slice extent: unexpected field {n2}")
            v2 = _check(signed64(v2), _I64, "tensor slice extent")
            if v2 < 0:
                raise BundleFormatError(f"tensor slice extent field {n2} is negative ({v2})")
            if n2 == 1:
                start = v2
            else:
                length = v2
        extents.append((start, length))
    return tuple(extents)


def decode_entry(buf, key: str = "") -> BundleEntry:
    what = f"bundle entry {key!r}"
    dtype, shape, shard, offset, size, crc = 0, ((), (), False), 0, 0, 0, 0
    slices = []
    for number, wire, value in iter_fields(buf, what):
        if number == 1 and wire == VARINT:
            dtype = _check(signed64(value), _I32, f"{what} dtype")
        elif number == 2 and wire == LENGTH:
            shape = _decode_shape(value)
        elif number == 3 and wire == VARINT:
            shard = _check(signed64(value), _I32, f"{what} shard_id")
        elif number == 4 and wire == VARINT:
            offset = _check(signed64(value), _I64, f"{what} offset")
        elif number == 5 and wire == VARINT:
            size = _check(signed64(value), _I64, f"{what} size")
        elif number == 6 and wire == FIXED32:
            crc = value
        elif number == 7 and wire == LENGTH:
            slices.append(_decode_slice(value))
        else:
            raise BundleFormatError(f"{what}: unexpected field {number} (wire type {wire})")
    if shard < 0 or offset < 0 or size < 0:
        raise BundleFormatError(f"{what}: negative shard_id, offset or size ({shard}, {offset}, {size})")
    dims, names, unknown = shape
    return BundleEntry(dtype, dims, shard, offset, size, crc, tuple(slices), names, unknown)
