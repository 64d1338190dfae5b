"""Tensors that are byte regions of a blob, or constants: file regions (``FileRegionTensor``), filled
tensors (``FullTensor``), and the element helpers they share."""
from __future__ import annotations

import itertools
import math
import os
from pathlib import Path

import numpy as np

from ckptfs.dtypes import BFLOAT16, DType
from ckptfs.errors import SourceChangedError, TensorReadError
from ckptfs.guard.confine import Confinement, RefusedReference, open_regular
from ckptfs.errors import one_line
from ckptfs.storage.local import FileIdentity
from ckptfs.tensor.base import Box, VirtualTensor, box_shape


def _shape_str(shape) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


def _to_storage(arr: np.ndarray, st: np.dtype) -> np.ndarray:
    """Reinterpret/convert an array read from disk to the DType's storage (bf16 int16 bits -> '<u2').

    C-contiguous, but may come back 1-d for a 0-d input: callers reshape to the box.
    """
    if arr.dtype == st:
        return np.ascontiguousarray(arr)
    if arr.dtype.kind in "iu" and st.kind in "iu" and arr.dtype.itemsize == st.itemsize:
        le = arr.dtype.newbyteorder("<")
        return np.ascontiguousarray(arr, dtype=le).view(st)  # same bits, other integer type
    return np.ascontiguousarray(arr.astype(st))


def float_to_bf16_bits(value: float) -> int:
    """Round a float to bfloat16 (nearest-even, as torch does) and return its 16-bit pattern."""
    u = int(np.array(value, dtype=np.float32).view(np.uint32))
    if (u & 0x7F800000) == 0x7F800000 and (u & 0x007FFFFF):
        return 0x7FC0 | ((u >> 16) & 0x8000)  # NaN
    u += 0x7FFF + ((u >> 16) & 1)
    return (u >> 16) & 0xFFFF


def fill_element(value, dtype: DType):
    """The storage element for a constant fill ``value`` (None -> zero)."""
    if value is None:
        value = 0
    if dtype is BFLOAT16 or dtype.name == "bfloat16":
        return np.uint16(float_to_bf16_bits(float(value)))
    if dtype.name == "bool":
        return np.bool_(bool(value))
    if not dtype.npy_native:
        raise ValueError(f"constant fill of {dtype.name} is not supported")
    return np.array(value).astype(dtype.storage)[()]


class FullTensor(VirtualTensor):
    """A tensor whose every element is ``fill`` (DeferredFullTensor; ``fill=None`` means zeros)."""

    __slots__ = ("fill", "_elem")

    def __init__(self, shape, dtype: DType, fill):
        super().__init__(shape, dtype)
        self.fill = fill
        self._elem = fill_element(fill, dtype)

    def describe(self) -> str:
        v = "uninitialised (zeros)" if self.fill is None else repr(self.fill)
        return f"constant {v} {_shape_str(self.shape)} {self.dtype.name}"

    def read(self, box: Box) -> np.ndarray:
        return np.full(box_shape(box), self._elem, dtype=self.dtype.storage)


def box_runs(shape, box) -> list[tuple[int, int]]:
    """The box as C-order ``(first element, element count)`` runs of consecutive elements.

    Trailing dimensions the box covers completely are merged, so a row range is one run.
    """
    shape = tuple(int(n) for n in shape)
    box = tuple((int(a), int(b)) for a, b in box)
    if not shape:
        return [(0, 1)]
    k = len(shape) - 1  # the box covers dims k+1.. fully
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1
    inner = math.prod(shape[k + 1:])
    run = (box[k][1] - box[k][0]) * inner
    if run == 0 or any(b <= a for a, b in box[:k]):
        return []
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    runs = []
    for idx in itertools.product(*(range(a, b) for a, b in box[:k])):
        start = sum(i * s for i, s in zip(idx, strides)) + box[k][0] * strides[k]
        runs.append((start, run))
    return runs


class FileRegionTensor(VirtualTensor):
    """Raw little-endian C-order elements of a plain file starting at ``offset``.

    ``path`` is where a confined reference led (``confine``); every read re-checks it against ``confinement``,
    opens it as a regular file only, and compares the file with ``identity`` (its version when the catalog was
    built; None when it did not exist then) before and after reading, so bytes never mix two versions."""

    __slots__ = ("path", "offset", "key", "checkpoint_path", "referenced_as", "what", "identity", "confinement")

    def __init__(self, path: Path, offset: int, shape, dtype: DType, key: str, checkpoint_path: Path,
                 referenced_as: str | None = None, what: str = "file", *, identity: FileIdentity | None = None,
                 confinement: Confinement | None = None):
        super().__init__(shape, dtype)
        self.path = path if isinstance(path, Path) else Path(path)  # shared, not copied: a model's tensors
        self.offset = int(offset)  # share a few paths
        self.key = key
        self.checkpoint_path = checkpoint_path if isinstance(checkpoint_path, Path) else Path(checkpoint_path)
        self.referenced_as = referenced_as
        self.what = what
        self.identity = identity
        self.confinement = confinement

    def describe(self) -> str:
        return f"{self.what} {self.path.name} @{self.offset} {_shape_str(self.shape)} {self.dtype.name}"

    def _fail(self, problem) -> TensorReadError:
        return TensorReadError(self.checkpoint_path, f"tensor {self.key}: {one_line(problem)}")

    def _missing(self) -> TensorReadError:
        ref = f" (referenced as {self.referenced_as!r})" if self.referenced_as else ""
        return self._fail(f"external {self.what} {self.path} not found{ref}")

    def _changed(self, now: FileIdentity | None) -> None:
        """``SourceChangedError`` when the file is not the version the catalog saw (the first version seen is kept
        when the catalog saw none)."""
        if self.identity is None:
            self.identity = now
            return
        why = "removed" if now is None else self.identity.difference(now)
        if why:
            raise SourceChangedError(self.checkpoint_path, f"tensor {self.key}: external {self.what} {self.path} "
                                                           f"changed since it was opened ({why}); remount to serve "
                                                           "the new version")

    def open(self) -> int:
        """A descriptor on the file, confined, regular and of the expected version."""
        if not self.path.exists():
            raise self._missing()
        try:
            if self.confinement is not None:
                self.confinement.recheck(self.path)
            fd = open_regular(self.path)
        except RefusedReference as e:
            raise self._fail(f"external reference refused: {e.problem}") from None
        except FileNotFoundError:
            raise self._missing() from None
        except OSError as e:
            raise self._fail(e) from e
        try:
            self._changed(FileIdentity.of_stat(os.fstat(fd)))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def data_offset(self) -> int:
        """Absolute offset of the first element in the file."""
        return self.offset

    def read(self, box: Box) -> np.ndarray:
        shape = box_shape(box)
        st = self.dtype.storage
        runs = box_runs(self.shape, box)
        item = st.itemsize
        out = np.empty(math.prod(shape), dtype=st)
        if not runs:
            return out.reshape(shape)
        base = self.data_offset()
        buf = memoryview(out.view(np.uint8))
        pos = 0
        fd = self.open()
        try:
            for start, n in runs:
                nb = n * item
                at = base + start * item
                while nb:  # every pass makes progress or fails
                    got = os.preadv(fd, [buf[pos:pos + nb]], at)
                    if got <= 0:
                        raise self._fail(f"external {self.what} {self.path.name} is truncated")
                    pos, nb, at = pos + got, nb - got, at + got
            self._changed(FileIdentity.of_stat(os.fstat(fd)))
        except OSError as e:
            raise self._fail(e) from e
        finally:
            os.close(fd)
        return out.reshape(shape)
