"""Operations on virtual tensors: the building blocks mapping rules compose.

Each operation is a ``VirtualTensor`` whose shape and dtype come from its inputs' metadata, and whose
``read(box)`` asks its inputs only for the region the box needs (rows [a, b) of a transpose read columns
[a, b) of its source; a row block of a concatenation reads only the parts it overlaps; a row block of a
RoPE row permutation reads the matching source rows in as few contiguous runs as possible).

Operations: ``Transpose``, ``Slice``, ``Select``, ``Concat``, ``Stack``, ``PermuteRows``, ``Affine``,
``Cast`` and the generated tensors ``CausalMask``, ``Constant``, ``PositionIds``, ``AlibiSlopes``.
Copy/rename needs no operation (the same tensor object is reused); a drop is simply not emitted.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..dtypes import FLOAT32, INT64, UINT8, DType, by_name, from_numpy
from ..errors import MappingError
from .base import Box, VirtualTensor, box_shape
from . import floats


def _check_box(t: VirtualTensor, box: Box) -> Box:
    box = tuple((int(a), int(b)) for a, b in box)
    if len(box) != t.ndim or any(not (0 <= a <= b <= n) for (a, b), n in zip(box, t.shape)):
        raise ValueError(f"box {box} outside {t.describe()}")
    return box


def _empty(t: VirtualTensor, box: Box) -> np.ndarray:
    return np.empty(box_shape(box), t.dtype.storage)


# -- layout operations -----------------------------------------------------------------------------


class Transpose(VirtualTensor):
    """Dimensions reordered: output dim ``d`` is source dim ``perm[d]`` (default: swap a 2-D tensor)."""

    def __init__(self, src: VirtualTensor, perm: Sequence[int] | None = None):
        perm = tuple(range(src.ndim))[::-1] if perm is None else tuple(int(p) for p in perm)
        if sorted(perm) != list(range(src.ndim)):
            raise MappingError(None, f"transpose: permutation {list(perm)} does not fit {src.describe()}")
        super().__init__([src.shape[p] for p in perm], src.dtype)
        self.src, self.perm = src, perm

    def read(self, box: Box) -> np.ndarray:
        box = _check_box(self, box)
        src_box = [None] * self.ndim
        for d, p in enumerate(self.perm):
            src_box[p] = box[d]
        return np.ascontiguousarray(self.src.read(tuple(src_box)).transpose(self.perm))

    def sources(self):
        return [self.src]

    def element_source(self, index):
        src = [0] * self.ndim
        for d, p in enumerate(self.perm):
            src[p] = index[d]
        return self.src, tuple(src)

    def chunk_shape(self):
        c = self.src.chunk_shape()
        return tuple(c[p] for p in self.perm) if c else None

    def describe(self) -> str:
        return f"transpose{list(self.perm)}({self.src.describe()})"


class Slice(VirtualTensor):
    """Elements [start, stop) of ``src`` along ``dim`` (e.g. one of q, k, v of a fused projection)."""

    def __init__(self, src: VirtualTensor, dim: int, start: int, stop: int):
        dim = _dim(dim, src.ndim, "slice")
        if not 0 <= start <= stop <= src.shape[dim]:
            raise MappingError(None, f"slice: [{start}, {stop}) outside dim {dim} of {src.describe()}")
        shape = list(src.shape)
        shape[dim] = stop - start
        super().__init__(shape, src.dtype)
        self.src, self.dim, self.start, self.stop = src, dim, int(start), int(stop)

    def read(self, box: Box) -> np.ndarray:
        box = list(_check_box(self, box))
        a, b = box[self.dim]
        box[self.dim] = (a + self.start, b + self.start)
        return self.src.read(tuple(box))

    def sources(self):
        return [self.src]

    def element_source(self, index):
        idx = list(index)
        idx[self.dim] += self.start
        return self.src, tuple(idx)

    def chunk_shape(self):
        c = self.src.chunk_shape()
        return c if c and self.start % c[self.dim] == 0 else None

    def describe(self) -> str:
        return f"slice(dim={self.dim}, {self.start}:{self.stop}) of {self.src.describe()}"


class Select(VirtualTensor):
    """Index ``index`` of ``src`` along ``dim``, that dimension removed (Mixtral expert ``X[:, e, :]``)."""

    def __init__(self, src: VirtualTensor, dim: int, index: int):
        dim = _dim(dim, src.ndim, "select")
        if not 0 <= index < src.shape[dim]:
            raise MappingError(None, f"select: index {index} outside dim {dim} of {src.describe()}")
        super().__init__(src.shape[:dim] + src.shape[dim + 1:], src.dtype)
        self.src, self.dim, self.index = src, dim, int(index)

    def read(self, box: Box) -> np.ndarray:
        box = _check_box(self, box)
        src_box = box[:self.dim] + ((self.index, self.index + 1),) + box[self.dim:]
        return np.ascontiguousarray(self.src.read(src_box).reshape(box_shape(box)))

    def sources(self):
        return [self.src]

    def element_source(self, index):
        return self.src, tuple(index[:self.dim]) + (self.index,) + tuple(index[self.dim:])

    def chunk_shape(self):
        c = self.src.chunk_shape()
        return c[:self.dim] + c[self.dim + 1:] if c else None

    def describe(self) -> str:
        return f"select(dim={self.dim}, index={self.index}) of {self.src.describe()}"


class Concat(VirtualTensor):
    """``srcs`` joined along ``dim`` (e.g. q, k, v -> GPT-2 c_attn)."""

    def __init__(self, srcs: Sequence[VirtualTensor], dim: int = 0):
        srcs = list(srcs)
        if not srcs:
            raise MappingError(None, "concat: no inputs")
        first = srcs[0]
        dim = _dim(dim, first.ndim, "concat")
        for s in srcs[1:]:
            if s.dtype != first.dtype or s.ndim != first.ndim or any(
                    a != b for d, (a, b) in enumerate(zip(s.shape, first.shape)) if d != dim):
                raise MappingError(None, f"concat: {s.describe()} does not fit {first.describe()} along dim {dim}")
        shape = list(first.shape)
        shape[dim] = sum(s.shape[dim] for s in srcs)
        super().__init__(shape, first.dtype)
        self.srcs, self.dim = srcs, dim
        self.offsets = np.cumsum([0] + [s.shape[dim] for s in srcs]).tolist()

    def read(self, box: Box) -> np.ndarray:
        box = _check_box(self, box)
        a, b = box[self.dim]
        parts = []
        for s, lo, hi in zip(self.srcs, self.offsets, self.offsets[1:]):
            if hi <= a or lo >= b or hi == lo:
                continue
            sub = list(box)
            sub[self.dim] = (max(a, lo) - lo, min(b, hi) - lo)
            parts.append(s.read(tuple(sub)))
        if not parts:
            return _empty(self, box)
        return parts[0] if len(parts) == 1 else np.ascontiguousarray(np.concatenate(parts, axis=self.dim))

    def sources(self):
        return list(self.srcs)

    def element_source(self, index):
        i = int(np.searchsorted(self.offsets, index[self.dim], side="right")) - 1
        idx = list(index)
        idx[self.dim] -= self.offsets[i]
        return self.srcs[i], tuple(idx)

    def chunk_shape(self):
        cs = {s.chunk_shape() for s in self.srcs}
        c = cs.pop() if len(cs) == 1 else None
        return c if c and all(o % c[self.dim] == 0 for o in self.offsets[1:-1]) else None

    def describe(self) -> str:
        return f"concat(dim={self.dim}: " + ", ".join(s.describe() for s in self.srcs) + ")"


class Stack(VirtualTensor):
    """``srcs`` stacked along a new ``dim`` (CS fuses Mixtral experts into ``[out, E, in]`` on dim 1)."""

    def __init__(self, srcs: Sequence[VirtualTensor], dim: int = 0):
        srcs = list(srcs)
        if not srcs:
            raise MappingError(None, "stack: no inputs")
        first = srcs[0]
        for s in srcs[1:]:
            if s.shape != first.shape or s.dtype != first.dtype:
                raise MappingError(None, f"stack: {s.describe()} does not match {first.describe()}")
        dim = _dim(dim, first.ndim + 1, "stack")
        super().__init__(first.shape[:dim] + (len(srcs),) + first.shape[dim:], first.dtype)
        self.srcs, self.dim = srcs, dim

    def read(self, box: Box) -> np.ndarray:
        box = _check_box(self, box)
        a, b = box[self.dim]
        inner = box[:self.dim] + box[self.dim + 1:]
        if a == b:
            return _empty(self, box)
        return np.ascontiguousarray(np.stack([self.srcs[i].read(inner) for i in range(a, b)], axis=self.dim))

    def sources(self):
        return list(self.srcs)

    def element_source(self, index):
        return self.srcs[index[self.dim]], tuple(index[:self.dim]) + tuple(index[self.dim + 1:])

    def chunk_shape(self):
        c = self.srcs[0].chunk_shape()
        return c[:self.dim] + (1,) + c[self.dim:] if c else None

    def describe(self) -> str:
        return f"stack(dim={self.dim}: " + ", ".join(s.describe() for s in self.srcs) + ")"


class PermuteRows(VirtualTensor):
    """Per-head RoPE row reorder between the HF rotate-half layout and the CS interleaved layout.

    Rows (dim 0) are ``heads`` groups of ``head_dim`` rows. Inside each head, the first ``rotary_dim``
    rows satisfy CS row ``2j`` = HF row ``j`` and CS row ``2j+1`` = HF row ``j + rotary_dim/2``; rows at
    or beyond ``rotary_dim`` are unchanged. ``direction`` "cs_to_hf" produces the HF layout from a CS
    tensor, "hf_to_cs" the reverse. For k under GQA, ``heads`` is the number of KV heads.
    """

    DIRECTIONS = ("cs_to_hf", "hf_to_cs")

    def __init__(self, src: VirtualTensor, heads: int, rotary_dim: int, direction: str = "cs_to_hf"):
        if src.ndim not in (1, 2):
            raise MappingError(None, f"permute_rows: needs a 1-D or 2-D tensor, got {src.describe()}")
        if direction not in self.DIRECTIONS:
            raise MappingError(None, f"permute_rows: direction {direction!r} is not one of {self.DIRECTIONS}")
        heads, rotary_dim = int(heads), int(rotary_dim)
        rows = src.shape[0]
        if heads <= 0 or rows % heads:
            raise MappingError(None, f"permute_rows: {rows} rows are not {heads} heads ({src.describe()})")
        head_dim = rows // heads
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise MappingError(None, f"permute_rows: rotary_dim {rotary_dim} must be even and within "
                                     f"head_dim {head_dim} ({src.describe()})")
        super().__init__(src.shape, src.dtype)
        self.src, self.heads, self.head_dim = src, heads, head_dim
        self.rotary_dim, self.direction = rotary_dim, direction

    def source_rows(self, start: int, stop: int) -> np.ndarray:
        """The source row each output row in [start, stop) is read from."""
        rows = np.arange(start, stop, dtype=np.int64)
        head, local = np.divmod(rows, self.head_dim)
        half = self.rotary_dim // 2
        if self.direction == "cs_to_hf":
            moved = np.where(local < half, 2 * local, 2 * (local - half) + 1)
        else:
            moved = np.where(local % 2 == 0, local // 2, local // 2 + half)
        return head * self.head_dim + np.where(local < self.rotary_dim, moved, local)

    def read(self, box: Box) -> np.ndarray:
        box = _check_box(self, box)
        a, b = box[0]
        if a == b:
            return _empty(self, box)
        rows = self.source_rows(a, b)
        needed = np.sort(rows)  # the reorder is a permutation: no source row twice
        rest = box[1:]
        lo, hi = int(needed[0]), int(needed[-1]) + 1
        if hi - lo <= 2 * len(needed):  # dense (a few rows of a head read every other row): one read of the span
            return np.ascontiguousarray(self.src.read(((lo, hi),) + rest)[rows - lo])
        # maximal runs of consecutive source rows, each read with one request
        breaks = np.nonzero(np.diff(needed) != 1)[0] + 1
        runs = np.split(needed, breaks)
        blocks = [self.src.read(((int(r[0]), int(r[-1]) + 1),) + rest) for r in runs]
        gathered = blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=0)
        position = np.searchsorted(needed, rows)
        return np.ascontiguousarray(gathered[position])

    def sources(self):
        return [self.src]

    def element_source(self, index):
        return self.src, (int(self.source_rows(index[0], index[0] + 1)[0]),) + tuple(index[1:])

    def chunk_shape(self):
        c = self.src.chunk_shape()  # whole heads of whole chunk rows read the same source rows
        return (math.lcm(c[0], self.head_dim),) + c[1:] if c else None

    def describe(self) -> str:
        return (f"permute_rows({self.direction}, heads={self.heads}, head_dim={self.head_dim}, "
                f"rotary_dim={self.rotary_dim}) of {self.src.describe()}")


class Alias(VirtualTensor):
    """The same data under a second name (safetensors cannot share bytes between names; an HDF5 checkpoint would
    link a repeated object). Its bytes are the target's cache blocks: same ``cache_key``, same block size, so a
    tied tensor is computed once."""

    def __init__(self, target: VirtualTensor):
        super().__init__(target.shape, target.dtype)
        self.target = target

    @property
    def cache_key(self):
        return self.target.cache_key

    def block_elems(self) -> int:
        return self.target.block_elems()

    def chunk_shape(self):
        return self.target.chunk_shape()

    def element_source(self, index):
        return self.target, index

    def read(self, box):
        return self.target.read(box)

    def will_need(self, start: int, stop: int, continuing: bool = False) -> None:
        self.target.will_need(start, stop, continuing)

    def sources(self):
        return [self.target]

    def describe(self) -> str:
        return "alias of " + self.target.describe()


# -- value operations ------------------------------------------------------------------------------

AFFINE_STEPS = ("mul", "div", "add", "sub")


class Elementwise(VirtualTensor):
    """An operation whose element ``i`` is computed from element ``i`` of one input ``src`` alone."""

    src: VirtualTensor

    def sources(self):
        return [self.src]

    def element_source(self, index):
        return self.src, index

    def chunk_shape(self):
        return self.src.chunk_shape()

    def will_need(self, start: int, stop: int, continuing: bool = False) -> None:
        """The input's bytes of the same elements (element for element: only their size may differ)."""
        mine, theirs = self.dtype.itemsize, self.src.dtype.itemsize
        self.src.will_need(start // mine * theirs, -(-stop // mine) * theirs, continuing)


class Affine(Elementwise):
    """Elementwise ``x * s``, ``x / s``, ``x + c``, ``x - c`` steps, exactly as torch computes them.

    Each step is one torch operation with a Python scalar: float32 tensors compute in float32 with the
    scalar rounded to float32 (gemma2 HF norm = ``w_cs - 1``; muP ``alpha * w / sqrt(d)``), float64 in
    float64, bfloat16/float16 in float32 with the result rounded back after every step.
    """

    def __init__(self, src: VirtualTensor, steps: Sequence[tuple]):
        if not floats.is_float(src.dtype):
            raise MappingError(None, f"affine: needs a floating-point tensor, got {src.describe()}")
        inner = src
        all_steps: list = []
        if isinstance(src, Affine):  # fold nested steps into one pass over the source
            inner, all_steps = src.src, list(src.steps)
        for op, value in steps:
            if op not in AFFINE_STEPS:
                raise MappingError(None, f"affine: unknown step {op!r}")
            all_steps.append((op, float(value)))
        super().__init__(src.shape, src.dtype)
        self.src, self.steps = inner, tuple(all_steps)

    def read(self, box: Box) -> np.ndarray:
        box = _check_box(self, box)
        x = floats.widen(self.src.read(box), self.dtype)
        ct = floats.compute_type(self.dtype)
        reduced = self.dtype in floats.REDUCED_FLOATS
        for op, value in self.steps:
            v = ct.type(value)
            if op == "mul":
                x = x * v
            elif op == "div":
                x = x / v
            elif op == "add":
                x = x + v
            else:
                x = x - v
            if reduced:  # torch rounds a reduced-precision result after each operation
                x = floats.widen(floats.narrow(x, self.dtype), self.dtype)
        return floats.narrow(x, self.dtype)

    def describe(self) -> str:
        sym = {"mul": "*", "div": "/", "add": "+", "sub": "-"}
        return "(" + self.src.describe() + "".join(f" {sym[o]} {v!r}" for o, v in self.steps) + ")"


class Cast(Elementwise):
    """``src`` converted to ``dtype`` like ``torch.Tensor.to(dtype)`` (fp32 -> bf16 rounds to nearest even)."""

    def __init__(self, src: VirtualTensor, dtype: DType | str):
        dtype = by_name(dtype) if isinstance(dtype, str) else dtype
        super().__init__(src.shape, dtype)
        self.src = src
        try:
            floats.cast(np.zeros(0, src.dtype.storage), src.dtype, dtype)
        except TypeError as e:
            raise MappingError(None, f"cast: {e}") from None

    def read(self, box: Box) -> np.ndarray:
        box = _check_box(self, box)
        return floats.cast(self.src.read(box), self.src.dtype, self.dtype)

    def describe(self) -> str:
        return f"cast({self.dtype.name}) of {self.src.describe()}"


# -- generated tensors -----------------------------------------------------------------------------


class Generated(VirtualTensor):
    """A tensor computed from configuration values only (no source tensor)."""

    def sources(self):
        return []


class CausalMask(Generated):
    """GPT-2's legacy ``attn.bias`` buffer: lower-triangular ones, uint8 ``[1, 1, P, P]``."""

    def __init__(self, positions: int):
        positions = int(positions)
        super().__init__((1, 1, positions, positions), UINT8)
        self.positions = positions

    def read(self, box: Box) -> np.ndarray:
        box = _check_box(self, box)
        (a0, b0), (a1, b1), (r0, r1), (c0, c1) = box
        rows = np.arange(r0, r1)[:, None]
        cols = np.arange(c0, c1)[None, :]
        mask = (cols <= rows).astype(np.uint8)
        return np.ascontiguousarray(np.broadcast_to(mask, box_shape(box)))

    def describe(self) -> str:
        return f"generated causal mask [1,1,{self.positions},{self.positions}] uint8"


class Constant(Generated):
    """Every element equal to ``value`` (e.g. GPT-2 ``attn.masked_bias`` = -1e4 as a float32 scalar)."""

    def __init__(self, value, dtype: DType | str = FLOAT32, shape: Sequence[int] = ()):
        dtype = by_name(dtype) if isinstance(dtype, str) else dtype
        super().__init__(shape, dtype)
        self.value = value
        # the element's bits, converted once the way torch.tensor(value, dtype=...) would
        src = np.array([value], dtype=np.float64 if isinstance(value, float) else None)
        self._element = floats.cast(src, from_numpy(src.dtype), dtype)[0]

    def read(self, box: Box) -> np.ndarray:
        box = _check_box(self, box)
        return np.full(box_shape(box), self._element, dtype=self.dtype.storage)

    def describe(self) -> str:
        return f"generated constant {self.value!r} {list(self.shape)} {self.dtype.name}"


class PositionIds(Generated):
    """``arange(P)`` as int64 ``[1, P]`` (BERT's ``embeddings.position_ids`` buffer)."""

    def __init__(self, positions: int):
        positions = int(positions)
        super().__init__((1, positions), INT64)
        self.positions = positions

    def read(self, box: Box) -> np.ndarray:
        box = _check_box(self, box)
        (a, b), (c, d) = box
        return np.ascontiguousarray(np.broadcast_to(np.arange(c, d, dtype=np.int64), box_shape(box)))

    def describe(self) -> str:
        return f"generated position ids arange({self.positions}) [1,{self.positions}] int64"


def alibi_slopes(heads: int) -> list:
    """ALiBi head slopes (Press et al.): geometric for a power of two, interleaved extras otherwise."""

    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    if math.log2(heads).is_integer():
        return power_of_2(heads)
    closest = 2 ** math.floor(math.log2(heads))
    return power_of_2(closest) + alibi_slopes(2 * closest)[0::2][: heads - closest]


class AlibiSlopes(Generated):
    """ALiBi slopes as float32 ``[heads, 1]`` (the CS ``position_embed_helper.slopes`` buffer)."""

    def __init__(self, heads: int):
        heads = int(heads)
        super().__init__((heads, 1), FLOAT32)
        self.heads = heads
        self._values = np.array(alibi_slopes(heads), dtype=np.float64).astype(np.float32).reshape(heads, 1)

    def read(self, box: Box) -> np.ndarray:
        box = _check_box(self, box)
        return np.ascontiguousarray(self._values[tuple(slice(a, b) for a, b in box)])

    def describe(self) -> str:
        return f"generated ALiBi slopes [{self.heads},1] float32"


def _dim(dim: int, ndim: int, what: str) -> int:
    d = int(dim)
    if d < 0:
        d += ndim
    if not 0 <= d < ndim:
        raise MappingError(None, f"{what}: dim {dim} out of range for {ndim} dimensions")
    return d


__all__ = ["Alias", "Transpose", "Slice", "Select", "Concat", "Stack", "PermuteRows", "Affine", "Cast", "Generated",
           "CausalMask", "Constant", "PositionIds", "AlibiSlopes", "alibi_slopes"]
