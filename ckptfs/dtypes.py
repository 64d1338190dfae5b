"""Element types shared by every layer: torch name, raw numpy storage, safetensors code, torch storage class.

bfloat16 has no numpy dtype: its elements travel as raw ``<u2`` bit patterns (``DType.storage``)
and only the layouts give them their real name.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str  # torch name without the "torch." prefix
    storage: np.dtype  # numpy dtype of the raw element bits, little-endian
    safetensors: str  # safetensors dtype code
    torch_storage: str | None  # legacy torch.<X>Storage class, None → _rebuild_tensor_v3 path
    npy_native: bool = True  # False when numpy cannot represent the real type (bf16, float8)

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize

    @property
    def torch_name(self) -> str:
        return "torch." + self.name

    def __repr__(self) -> str:
        return f"DType({self.name})"


def _d(name, storage, st, ts, native=True):
    return DType(name, np.dtype(storage), st, ts, native)


_ALL = [
    _d("bool", "|b1", "BOOL", "BoolStorage"),
    _d("uint8", "|u1", "U8", "ByteStorage"),
    _d("int8", "|i1", "I8", "CharStorage"),
    _d("int16", "<i2", "I16", "ShortStorage"),
    _d("int32", "<i4", "I32", "IntStorage"),
    _d("int64", "<i8", "I64", "LongStorage"),
    _d("uint16", "<u2", "U16", None),
    _d("uint32", "<u4", "U32", None),
    _d("uint64", "<u8", "U64", None),
    _d("float16", "<f2", "F16", "HalfStorage"),
    _d("bfloat16", "<u2", "BF16", "BFloat16Storage", native=False),
    _d("float32", "<f4", "F32", "FloatStorage"),
    _d("float64", "<f8", "F64", "DoubleStorage"),
    _d("complex64", "<c8", "C64", "ComplexFloatStorage"),
    _d("complex128", "<c16", "C128", "ComplexDoubleStorage"),
    _d("float8_e4m3fn", "|u1", "F8_E4M3", None, native=False),
    _d("float8_e5m2", "|u1", "F8_E5M2", None, native=False),
]

BY_NAME: dict[str, DType] = {d.name: d for d in _ALL}
BOOL, UINT8, INT8, INT16, INT32, INT64 = (BY_NAME[n] for n in ("bool", "uint8", "int8", "int16", "int32", "int64"))
FLOAT16, BFLOAT16, FLOAT32, FLOAT64 = (BY_NAME[n] for n in ("float16", "bfloat16", "float32", "float64"))

_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32",
            "short": "int16", "bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


def by_name(name: str) -> DType:
    """``"torch.float32"``, ``"float32"``, ``"bf16"`` … → DType; KeyError with the name otherwise."""
    n = name[6:] if name.startswith("torch.") else name
    n = _ALIASES.get(n, n)
    try:
        return BY_NAME[n]
    except KeyError:
        raise KeyError(f"unknown dtype {name!r}") from None


def from_numpy(dt) -> DType:
    """The DType whose storage is numpy dtype ``dt`` (uint16 maps to uint16, never bf16)."""
    dt = np.dtype(dt)
    if dt.kind == "b":
        return BOOL
    key = dt.newbyteorder("<") if dt.byteorder == ">" else dt
    for d in _ALL:
        if d.npy_native and d.storage == key:
            return d
    raise KeyError(f"no tensor dtype for numpy dtype {dt}")
