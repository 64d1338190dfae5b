"""The virtual tensor: shape and dtype known from metadata, data produced on demand by region.

Every layer speaks this interface. Sources (HDF5 datasets, external files, constant fills) and the
mapping core's operations (transpose, slice, concat, permute, scale, cast, generated) are all
``VirtualTensor`` subclasses that implement ``read(box)``. Layouts only ever call ``read_bytes``,
which turns a C-order byte range into boxes and goes through the shared bounded ``BlockCache``.

A *box* is a tuple of ``(start, stop)`` pairs, one per dimension (``()`` for a 0-d tensor).
``read(box)`` returns a C-contiguous numpy array of ``dtype.storage`` with the box's shape.
"""
from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from typing import Iterator, Sequence

import numpy as np

from .dtypes import DType

Box = tuple  # tuple[tuple[int, int], ...]

_ids = itertools.count(1)

#: target size of one cached block of a tensor's bytes
BLOCK_BYTES = 1 << 20


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_shape(box: Box) -> tuple:
    return tuple(b - a for a, b in box)


def flat_range_to_boxes(shape: Sequence[int], start: int, stop: int) -> Iterator[Box]:
    """Split the C-order element range [start, stop) of ``shape`` into boxes, in order.

    At most ``2*ndim - 1`` boxes; their elements, flattened and concatenated, are exactly the range.
    """
    shape = tuple(int(n) for n in shape)
    if start >= stop:
        return
    if not shape:
        yield ()
        return
    inner = math.prod(shape[1:])
    if inner == 0:
        return
    r0, off0 = divmod(start, inner)
    r1, off1 = divmod(stop, inner)
    rest = shape[1:]
    if off0 == 0 and off1 == 0:
        yield ((r0, r1),) + full_box(rest)
        return
    if r0 == r1:  # inside one row
        for sub in flat_range_to_boxes(rest, off0, off1):
            yield ((r0, r0 + 1),) + sub
        return
    if off0:
        for sub in flat_range_to_boxes(rest, off0, inner):
            yield ((r0, r0 + 1),) + sub
        r0 += 1
    if r1 > r0:
        yield ((r0, r1),) + full_box(rest)
    if off1:
        for sub in flat_range_to_boxes(rest, 0, off1):
            yield ((r1, r1 + 1),) + sub


class VirtualTensor(ABC):
    """A tensor whose bytes are computed on demand. Subclasses set ``shape``/``dtype`` and ``read``."""

    shape: tuple
    dtype: DType

    def __init__(self, shape: Sequence[int], dtype: DType):
        self.shape = tuple(int(n) for n in shape)
        self.dtype = dtype
        self.uid = next(_ids)  # identity for caches; stable for the object's life

    # -- metadata ---------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def describe(self) -> str:
        """One line saying where the data comes from (used in README.txt and errors)."""
        return f"{type(self).__name__}{list(self.shape)} {self.dtype.name}"

    def sources(self) -> list["VirtualTensor"]:
        """The tensors this one reads from (empty for a source)."""
        return []

    # -- data ---------------------------------------------------------------------------------------
    @abstractmethod
    def read(self, box: Box) -> np.ndarray:
        """Elements inside ``box`` as a C-contiguous array of ``dtype.storage``."""

    def read_all(self) -> np.ndarray:
        return self.read(full_box(self.shape))

    def block_elems(self) -> int:
        """Elements per cache block: whole trailing sub-arrays so that a block is one box if possible.
        Computed once per tensor (block keys must stay stable)."""
        be = self.__dict__.get("_be")
        if be is None:
            be = self.__dict__["_be"] = self._default_block_elems()
        return be

    def _default_block_elems(self) -> int:
        item = self.dtype.itemsize
        target = max(1, BLOCK_BYTES // item)
        # find the smallest k such that one slab prod(shape[k:]) fits in the target
        for k in range(self.ndim + 1):
            slab = math.prod(self.shape[k:])
            if slab <= target:
                if slab == 0:
                    return target
                return slab * max(1, target // slab)
        return target

    def read_flat(self, start: int, stop: int) -> np.ndarray:
        """Elements [start, stop) in C order, as a 1-D array (no caching)."""
        parts = [self.read(b).reshape(-1) for b in flat_range_to_boxes(self.shape, start, stop)]
        if not parts:
            return np.empty(0, self.dtype.storage)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def read_bytes(self, start: int, stop: int, cache: "BlockCache | None" = None) -> bytes:
        """Bytes [start, stop) of the tensor's C-order little-endian image, through the block cache."""
        from .cache import default_cache

        stop = min(stop, self.nbytes)
        if start >= stop:
            return b""
        cache = cache if cache is not None else default_cache()
        item = self.dtype.itemsize
        be = self.block_elems()
        bb = be * item
        out = []
        for blk in range(start // bb, (stop - 1) // bb + 1):
            data = cache.get_or_compute((self.uid, blk), lambda blk=blk: self._block(blk, be))
            lo = max(start - blk * bb, 0)
            hi = min(stop - blk * bb, len(data))
            out.append(data[lo:hi])  # memoryview slices: no copy until the one below
        return bytes(out[0]) if len(out) == 1 else b"".join(out)

    def _block(self, blk: int, be: int) -> memoryview:
        """One cache block: a read-only byte view of the block's elements (no copy beyond computing them)."""
        e0 = blk * be
        e1 = min(e0 + be, self.numel)
        arr = np.ascontiguousarray(self.read_flat(e0, e1).reshape(-1)).astype(self.dtype.storage, copy=False)
        arr.flags.writeable = False
        return memoryview(arr).cast("B")


class ArrayTensor(VirtualTensor):
    """A tensor backed by an in-memory numpy array of storage dtype (tests, small generated values)."""

    def __init__(self, array: np.ndarray, dtype: DType | None = None):
        from .dtypes import from_numpy

        array = np.asarray(array, order="C")  # keeps 0-d arrays 0-d (ascontiguousarray makes them 1-d)
        dtype = dtype or from_numpy(array.dtype)
        if array.dtype != dtype.storage:
            array = array.view(dtype.storage) if array.dtype.itemsize == dtype.itemsize else array.astype(dtype.storage)
        super().__init__(array.shape, dtype)
        self.array = array

    def read(self, box: Box) -> np.ndarray:
        return np.asarray(self.array[tuple(slice(a, b) for a, b in box) + (Ellipsis,)], order="C")

    def describe(self) -> str:
        return f"array{list(self.shape)} {self.dtype.name}"
