"""The LoRA fold as a lazy tensor operation, with Model Zoo's arithmetic reproduced bit for bit.

Model Zoo folds a LoRA module when it is switched to eval mode (``LoRA_Linear.train(False)``)::

    Linear:     W + (lora_B @ lora_A) * scaling        W [out, in],  A [r, in],  B [out, r]
    Embedding:  W + (lora_B @ lora_A)ᵀ * scaling       W [num, dim], A [r, num], B [dim, r]

in the checkpoint's dtype on CPU: the matmul, the multiplication by the Python-float scaling (rounded to float32
first, as torch does with a scalar) and the addition each round once. Every element of ``B @ A`` is the FMA chain
``acc = fma(B[o, k], A[k, i], acc)`` over ``k`` ascending from ``acc = 0`` (what torch's CPU matmul computed on the
machine that made the fixtures; a multiply-then-add chain differs in about a sixth of the elements). numpy has no
fused multiply-add, so ``fma32`` computes one exactly: a float32 product is exact in float64, the float64 sum's
rounding error is known exactly (TwoSum), and rounding that sum to odd before rounding to float32 makes the
double rounding come out as a single correct one.

A row block of a folded Linear weight reads the same rows of W and B and the box's columns of A (all of A for
whole rows); of a folded Embedding, the same rows of W, the matching columns of A and the box's rows of B.
"""
from __future__ import annotations

import numpy as np

from ...dtypes import FLOAT32, FLOAT64
from ...errors import MappingError
from ...tensor.base import Box, VirtualTensor
from ...tensor import floats


#: float64 bits below float32 precision but the highest: a float64 sum whose lower 28 bits are zero may sit on a
#: float32 rounding midpoint (or be a float32 value, or be in float32's subnormal range), the only sums whose
#: rounding to float32 can differ from the correctly rounded exact sum
_LOW28 = np.uint64((1 << 28) - 1)


def fma32(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """float32 ``x * y + z`` with a single rounding (IEEE fusedMultiplyAdd), elementwise with broadcasting."""
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 is NaN and a huge sum inf, as in IEEE fma
        p = np.multiply(np.asarray(x, np.float64), np.asarray(y, np.float64))  # exact: 24 + 24 bits fit in 53
        p, z = np.broadcast_arrays(p, np.asarray(z, np.float32))
        return _round_sum(p, np.ascontiguousarray(z))


def _round_sum(p: np.ndarray, z: np.ndarray) -> np.ndarray:
    """float32 of the exact ``p + z`` (``p`` float64 exact products, ``z`` float32), correctly rounded."""
    s = p + z
    out = s.astype(np.float32)
    suspect = (s.view(np.uint64) & _LOW28) == 0
    if suspect.any():
        idx = np.nonzero(suspect)
        out[idx] = _round_sum_exact(p[idx], z[idx].astype(np.float64))
    return out


def _round_sum_exact(p: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Correctly rounded float32 of ``p + c`` (float64 inputs) for any values: TwoSum gives the float64 sum's
    exact error; an inexact sum is then rounded to odd (the neighbour with an odd last bit), after which the
    rounding to float32 (24 bits, far fewer than 53 - 2) equals a single rounding of the exact sum."""
    s = p + c
    bv = s - p
    err = (p - (s - bv)) + (c - bv)
    fix = (err != 0) & np.isfinite(s) & ((s.view(np.int64) & 1) == 0)
    s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def fma_matmul(b: np.ndarray, a: np.ndarray) -> np.ndarray:
    """float32 ``b @ a`` ([m, r] @ [r, n]) where every element is an FMA chain over k ascending from 0."""
    b64, a64 = np.asarray(b, np.float64), np.asarray(a, np.float64)
    acc = np.zeros((b.shape[0], a.shape[1]), np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for k in range(b.shape[1]):
            acc = _round_sum(np.multiply(b64[:, k:k + 1], a64[k:k + 1, :]), acc)
    return acc


class LoraFold(VirtualTensor):
    """``weight`` with its LoRA update folded in, computed on read (see the module docstring).

    ``embedding`` selects the transposed form of ``nn.Embedding``; ``scaling`` is the group's ``alpha / r``
    as a Python float (rounded to the compute type when it multiplies, as torch rounds a scalar).
    """

    def __init__(self, weight: VirtualTensor, lora_A: VirtualTensor, lora_B: VirtualTensor, scaling: float,
                 embedding: bool = False, name: str = ""):
        where = f"LoRA fold of {name or weight.describe()}"
        if weight.ndim != 2 or lora_A.ndim != 2 or lora_B.ndim != 2:
            raise MappingError(None, f"{where}: weight, lora_A and lora_B must be 2-D")
        r = lora_A.shape[0]
        rows, cols = weight.shape
        want_a, want_b = ((r, rows), (cols, r)) if embedding else ((r, cols), (rows, r))
        if lora_A.shape != want_a or lora_B.shape != want_b:
            raise MappingError(None, f"{where}: lora_A {list(lora_A.shape)} and lora_B {list(lora_B.shape)} do "
                                     f"not fit weight {list(weight.shape)} (expected {list(want_a)} and "
                                     f"{list(want_b)})")
        for t in (lora_A, lora_B):
            if t.dtype != weight.dtype:
                raise MappingError(None, f"{where}: {t.describe()} has another dtype than the weight "
                                         f"({weight.dtype.name})")
        if not floats.is_float(weight.dtype) or weight.dtype == FLOAT64:
            raise MappingError(None, f"{where}: folding {weight.dtype.name} weights is not supported (float32, "
                                     f"bfloat16 and float16 are)")
        super().__init__(weight.shape, weight.dtype)
        self.weight, self.lora_A, self.lora_B = weight, lora_A, lora_B
        self.scaling, self.embedding, self.rank = float(scaling), bool(embedding), r

    def read(self, box: Box) -> np.ndarray:
        box = tuple((int(a), int(b)) for a, b in box)
        (r0, r1), (c0, c1) = box
        rank = ((0, self.rank),)
        w = self.weight.read(box)
        if self.embedding:  # delta[e, d] = sum_k B[d, k] A[k, e]
            b = self._wide(self.lora_B.read(((c0, c1),) + rank))
            a = self._wide(self.lora_A.read(rank + ((r0, r1),)))
            delta = fma_matmul(b, a).T
        else:  # delta[o, i] = sum_k B[o, k] A[k, i]
            b = self._wide(self.lora_B.read(((r0, r1),) + rank))
            a = self._wide(self.lora_A.read(rank + ((c0, c1),)))
            delta = fma_matmul(b, a)
        delta = self._round(delta)  # the matmul's result in the weight's dtype
        delta = self._round(delta * np.float32(self.scaling))  # tensor * Python scalar: scalar as float32
        out = self._round(self._wide(w) + delta)
        return np.ascontiguousarray(floats.narrow(out, self.dtype))

    def _wide(self, storage: np.ndarray) -> np.ndarray:
        return floats.widen(storage, self.dtype).astype(np.float32, copy=False)

    def _round(self, values: np.ndarray) -> np.ndarray:
        """float32 values rounded to the weight's dtype (and back): a no-op for float32."""
        if self.dtype == FLOAT32:
            return values
        return floats.widen(floats.narrow(values, self.dtype), self.dtype)

    def sources(self):
        return [self.weight, self.lora_A, self.lora_B]

    def describe(self) -> str:
        form = "(B @ A)^T" if self.embedding else "(B @ A)"
        return (f"lora_fold[{self.weight.describe()} + {form} * {self.scaling!r}, r={self.rank}; "
                f"A {self.lora_A.describe()}, B {self.lora_B.describe()}]")
