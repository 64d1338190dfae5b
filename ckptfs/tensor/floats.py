"""Element-type arithmetic the way torch does it on CPU, on raw storage arrays.

bfloat16 travels as ``<u2`` bit patterns (see ``ckptfs.dtypes``); these helpers widen such arrays to a
compute type, narrow results back with torch's rounding (round-to-nearest-even, canonical NaN), and cast
between any two ckptfs dtypes bit-exactly where torch defines the result.
"""
from __future__ import annotations

import numpy as np

from ..dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, DType

#: float types torch computes in float32 ("opmath") and rounds back after every operation
REDUCED_FLOATS = (BFLOAT16, FLOAT16)


def is_float(dtype: DType) -> bool:
    return dtype in (BFLOAT16, FLOAT16, FLOAT32, FLOAT64)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (any integer array of 16-bit values) -> float32, exactly."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


#: NaN bits torch's CPU float32 -> bfloat16 conversion writes (its vectorised kernel; c10's scalar one
#: and the float16 -> bfloat16 path write 0x7FC0)
BF16_NAN_FROM_F32 = 0xFFFF
BF16_NAN_CANONICAL = 0x7FC0


def f32_to_bf16_bits(values: np.ndarray, nan_bits: int = BF16_NAN_FROM_F32) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even like ``torch.Tensor.to``."""
    v = np.ascontiguousarray(values, dtype=np.float32)
    u = v.view(np.uint32)
    rounded = (u + (((u >> 16) & 1) + 0x7FFF)) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(v)
    if nan.any():
        out[nan] = nan_bits
    return out


def compute_type(dtype: DType) -> np.dtype:
    """The numpy type torch does elementwise float arithmetic in for ``dtype`` (its "opmath" type)."""
    return np.dtype(np.float64) if dtype == FLOAT64 else np.dtype(np.float32)


def widen(storage: np.ndarray, dtype: DType) -> np.ndarray:
    """Storage array of ``dtype`` -> array of ``compute_type(dtype)`` holding the same values."""
    if dtype == BFLOAT16:
        return bf16_bits_to_f32(storage)
    return np.asarray(storage).astype(compute_type(dtype), copy=False)


def narrow(values: np.ndarray, dtype: DType) -> np.ndarray:
    """Compute-type values -> storage array of ``dtype`` (torch rounding for floats)."""
    if dtype == BFLOAT16:
        return f32_to_bf16_bits(values.astype(np.float32, copy=False))
    return np.ascontiguousarray(values.astype(dtype.storage, copy=False))


def cast(storage: np.ndarray, src: DType, dst: DType) -> np.ndarray:
    """Convert a storage array from ``src`` to ``dst`` as ``torch.Tensor.to(dst)`` would."""
    if src == dst:
        return np.ascontiguousarray(storage)
    if dst.name == "bool":
        vals = bf16_bits_to_f32(storage) if src == BFLOAT16 else np.asarray(storage)
        return np.ascontiguousarray(vals != 0)
    if src == BFLOAT16:
        # bf16 -> float32 is exact; every other target goes through float32 like torch does
        return narrow(bf16_bits_to_f32(storage), dst) if dst != FLOAT32 else bf16_bits_to_f32(storage)
    if dst == BFLOAT16:
        # torch converts double -> float -> bfloat16 (c10::BFloat16 is built from a float)
        nan_bits = BF16_NAN_FROM_F32 if src == FLOAT32 else BF16_NAN_CANONICAL
        return f32_to_bf16_bits(np.asarray(storage).astype(np.float32), nan_bits)
    if not dst.npy_native or not src.npy_native:
        raise TypeError(f"no defined cast from {src.name} to {dst.name}")
    return np.ascontiguousarray(np.asarray(storage).astype(dst.storage))
