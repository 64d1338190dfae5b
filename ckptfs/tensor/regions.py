"""Tensors that are byte regions of a blob, or constants: file regions (``FileRegionTensor``), filled
tensors (``FullTensor``), and the element helpers they share."""
from __future__ import annotations

import itertools
import math
import threading
from pathlib import Path

import numpy as np

from ckptfs.dtypes import BFLOAT16, DType
from ckptfs.errors import SourceChangedError, TensorReadError, one_line
from ckptfs.guard.confine import Confinement, RefusedReference, open_regular
from ckptfs.storage.base import ShortRead, page_aligned
from ckptfs.storage.local import FileIdentity, LocalFile
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


class RegionFile:
    """One plain file that region tensors read from, opened on the first read (its reference confined, a regular file,
    the version the catalog saw) and then kept open as a ``LocalFile`` shared by those tensors: storage is the one
    door to its bytes, and a read does not pay an open per block."""

    __slots__ = ("path", "confinement", "_blob", "_lock")

    def __init__(self, path: Path, confinement: Confinement | None = None):
        self.path = Path(path)
        self.confinement = confinement
        self._blob: LocalFile | None = None
        self._lock = threading.Lock()

    def blob(self) -> LocalFile:
        """The open file (``RefusedReference``, ``FileNotFoundError`` or ``OSError`` when it cannot be opened)."""
        b = self._blob
        if b is None:
            with self._lock:
                if self._blob is None:
                    if self.confinement is not None:
                        self.confinement.recheck(self.path)
                    self._blob = LocalFile(self.path, fd=open_regular(self.path))
                b = self._blob
        return b

    @property
    def is_open(self) -> bool:
        return self._blob is not None

    def __reduce__(self):  # a copy opens the file again, on its own first read
        return RegionFile, (self.path, self.confinement)

    def close(self) -> None:
        with self._lock:
            b, self._blob = self._blob, None
        if b is not None:
            b.close()


class FileRegionTensor(VirtualTensor):
    """Raw little-endian C-order elements of a plain file starting at ``offset``.

    ``path`` is where a confined reference led (``confine``); the file is opened once, confined and as a regular file
    only (``RegionFile``: pass one ``file`` to the tensors of one file to share it), and every read compares the file
    with ``identity`` (its version when the catalog was built; None when it did not exist then) before and after
    reading, so bytes never mix two versions."""

    __slots__ = ("path", "offset", "key", "checkpoint_path", "referenced_as", "what", "identity", "confinement",
                 "file")

    def __init__(self, path: Path, offset: int, shape, dtype: DType, key: str, checkpoint_path: Path,
                 referenced_as: str | None = None, what: str = "file", *, identity: FileIdentity | None = None,
                 confinement: Confinement | None = None, file: RegionFile | None = None):
        super().__init__(shape, dtype)
        self.path = path if isinstance(path, Path) else Path(path)  # shared, not copied: a model's tensors
        self.offset = int(offset)  # share a few paths
        self.key = key
        self.checkpoint_path = checkpoint_path if isinstance(checkpoint_path, Path) else Path(checkpoint_path)
        self.referenced_as = referenced_as
        self.what = what
        self.identity = identity
        self.confinement = confinement
        self.file = file if file is not None else RegionFile(self.path, confinement)

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

    def _now(self, blob: LocalFile) -> FileIdentity | None:
        try:
            return blob.current_version()
        except FileNotFoundError:
            return None

    def blob(self) -> LocalFile:
        """The file (``RegionFile``), of the expected version (one ``stat`` of its path per read once it is open)."""
        if not self.file.is_open and not self.path.exists():
            raise self._missing()
        try:
            b = self.file.blob()
        except RefusedReference as e:
            raise self._fail(f"external reference refused: {e.problem}") from None
        except FileNotFoundError:
            raise self._missing() from None
        except OSError as e:
            raise self._fail(e) from e
        now = self._now(b)
        if now is None:  # gone since it was opened: as a file missing at the first read
            raise self._missing()
        self._changed(b.version)
        self._changed(now)
        return b

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
        b = self.blob()
        spans = [(base + start * item, base + (start + n) * item) for start, n in runs]
        try:
            got, starts = b.read_spans(spans, page_aligned, hint=False)
            self._changed(self._now(b))
        except ShortRead:
            raise self._fail(f"external {self.what} {self.path.name} is truncated") from None
        except OSError as e:
            raise self._fail(e) from e
        flat = memoryview(out.view(np.uint8))
        mv, pos = memoryview(got), 0
        for (lo, end), at in zip(spans, starts):
            flat[pos:pos + end - lo] = mv[at:at + end - lo]
            pos += end - lo
        return out.reshape(shape)
