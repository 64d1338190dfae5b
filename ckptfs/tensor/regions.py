"""Tensors that are byte regions of a blob, or constants: blob regions (``BlobRegionTensor``, over any ``Blob`` of
``ckptfs.storage``, a local file among them through ``RegionFile``), filled tensors (``FullTensor``), and the element
helpers they share."""
from __future__ import annotations

import errno
import itertools
import math
import os
import threading
from pathlib import Path
from typing import Callable

import numpy as np

from ckptfs.dtypes import BFLOAT16, DType
from ckptfs.errors import SourceChangedError, StorageError, TensorReadError, one_line
from ckptfs.guard.confine import Confinement, RefusedReference, open_regular_file
from ckptfs.storage.base import Blob, ShortRead, thread_scratch
from ckptfs.storage.local import LocalFile
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


def thread_region_scratch(n: int):
    """The calling thread's buffer for one region read (``storage.base.thread_scratch``): copied out before its next."""
    return thread_scratch("region", n)


#: a strided read fetches one span of the blob when it is at most this long, else splits the box
STRIDED_SPAN_BYTES = 8 << 20


def fill_strided(read, offset: int, stride: tuple, storage: np.dtype, box: Box, out: np.ndarray) -> None:
    """Fill ``out`` with the elements under ``box`` of a view of ``stride`` (in elements of ``storage``) whose
    first element is at byte ``offset``: each part is the span of bytes it reaches, ``read(offset, n)`` (exactly
    ``n`` bytes or an exception), when that span is at most ``STRIDED_SPAN_BYTES``; otherwise the box is split along
    its widest-strided dimension (a transposed matrix is read in column bands)."""
    item = storage.itemsize
    todo = [(box, out)]
    while todo:
        b, o = todo.pop()
        first = sum(a * s for (a, _), s in zip(b, stride))
        last = sum((e - 1) * s for (_, e), s in zip(b, stride))
        span = (last - first + 1) * item
        if span <= STRIDED_SPAN_BYTES or o.size == 1:
            src = np.frombuffer(read(offset + first * item, span), dtype=storage)
            o[...] = np.lib.stride_tricks.as_strided(src, shape=o.shape, strides=tuple(s * item for s in stride))
            continue
        # split the dimension that spreads the span most (among those longer than one)
        d = max((i for i, (a, e) in enumerate(b) if e - a > 1), key=lambda i: stride[i] * (b[i][1] - b[i][0]))
        a, e = b[d]
        mid = (a + e) // 2
        lo, hi = list(b), list(b)
        lo[d], hi[d] = (a, mid), (mid, e)
        sl_lo, sl_hi = [slice(None)] * len(b), [slice(None)] * len(b)
        sl_lo[d], sl_hi[d] = slice(0, mid - a), slice(mid - a, e - a)
        todo.append((tuple(lo), o[tuple(sl_lo)]))
        todo.append((tuple(hi), o[tuple(sl_hi)]))


class RegionFile(Blob):
    """A plain local file as a ``Blob`` opened on its first read (its reference confined, a regular file) and then
    kept open as one ``LocalFile`` shared by the tensors of the file: storage is the one door to its bytes, a read
    does not pay an open per block, and a model of many shards holds no descriptor for a shard never read.
    Opening raises ``RefusedReference``, ``FileNotFoundError`` or ``OSError``."""

    __slots__ = ("path", "name", "confinement", "_blob", "_lock", "_closed")

    def __init__(self, path: Path, confinement: Confinement | None = None):
        self.path = Path(path)
        self.name = str(self.path)
        self.confinement = confinement
        self._blob: LocalFile | None = None
        self._lock = threading.Lock()
        self._closed = False

    def blob(self) -> LocalFile:
        """The open file."""
        b = self._blob
        if b is None:
            with self._lock:
                if self._closed:  # as a closed LocalFile: a read after close fails, it does not open the file again
                    raise OSError(errno.EBADF, "read after close", str(self.path))
                if self._blob is None:
                    if not os.path.lexists(self.path):  # missing: not a reference to refuse
                        raise FileNotFoundError(errno.ENOENT, "not found", str(self.path))
                    if self.confinement is not None:
                        self.confinement.recheck(self.path)
                    self._blob = open_regular_file(self.path)
                b = self._blob
        return b

    @property
    def size(self) -> int:
        return self.blob().size

    @property
    def version(self):
        return self.blob().version

    def current_version(self):
        return self.blob().current_version()

    def read_into(self, view: memoryview, offset: int, need: int) -> tuple[int, bool]:
        return self.blob().read_into(view, offset, need)

    def read_spans(self, spans, scratch, hint: bool = True) -> tuple:
        return self.blob().read_spans(spans, scratch, hint)

    def read_scattered(self, spans, scratch, gap: int | None = None) -> tuple:
        return self.blob().read_scattered(spans, scratch, gap)

    def read_packed(self, spans, out, hint: bool = True) -> None:
        self.blob().read_packed(spans, out, hint)

    def will_need(self, offset: int, length: int | None = None) -> None:
        if self._blob is not None:
            self._blob.will_need(offset, length)

    def __reduce__(self):  # a copy opens the file again, on its own first read
        return RegionFile, (self.path, self.confinement)

    def close(self) -> None:
        with self._lock:
            b, self._blob, self._closed = self._blob, None, True
        if b is not None:
            b.close()


class BlobRegionTensor(VirtualTensor):
    """Raw little-endian elements of ``dtype`` at byte ``offset`` of ``blob``: C-order when ``stride`` is None, else
    a view of ``stride`` (in elements). A box is read as the byte ranges under it: the C-order runs in one
    ``read_spans``, a strided view through ``fill_strided``.

    The blob is any ``Blob``: a member of an open checkpoint (a legacy ``torch.save`` zip, local or in S3), or a
    plain file opened on first read (``RegionFile``: pass one to the tensors of one file to share it). Bytes never mix
    two versions: the blob must be the version ``identity`` names (the catalog's; None: the one opened), and after
    every read still be it (``current_version``). A blob whose every read names its version itself (an S3 object's
    ETag) needs no such check: ``verify=False``. ``referenced_as``: how the checkpoint named the file (messages)."""

    __slots__ = ("blob", "offset", "stride", "key", "checkpoint_path", "what", "identity", "verify",
                 "referenced_as", "scratch")

    def __init__(self, blob: Blob, offset: int, shape, dtype: DType, key: str, checkpoint_path, *,
                 stride: tuple | None = None, what: str = "file", identity=None, verify: bool = True,
                 referenced_as: str | None = None, scratch: Callable[[int], object] = thread_region_scratch):
        super().__init__(shape, dtype)
        self.blob = blob
        self.offset = int(offset)
        self.stride = None if stride is None else tuple(int(s) for s in stride)
        self.key = key
        self.checkpoint_path = checkpoint_path  # a Path, or an S3 location
        self.what = what
        self.identity = identity
        self.verify = verify  # False: every read of the blob names its version itself (an S3 object's ETag)
        self.referenced_as = referenced_as
        self.scratch = scratch  # the buffer a read's bytes land in before they are copied out (before the next read)

    @property
    def path(self) -> Path:
        """The file the blob is (for a ``RegionFile``; else its name as a path)."""
        return getattr(self.blob, "path", None) or Path(self.blob.name)

    @property
    def file_name(self) -> str:
        """The last part of the blob's name (a file's name, an object's key's)."""
        return self.blob.name.rstrip("/").rsplit("/", 1)[-1]

    def describe(self) -> str:
        where = f"{self.what} {self.file_name} @{self.offset}"
        if self.stride is not None:
            where += f" stride {list(self.stride)}"
        return f"{where} {_shape_str(self.shape)} {self.dtype.name}"

    def _fail(self, problem) -> TensorReadError:
        return TensorReadError(self.checkpoint_path, f"tensor {self.key}: {one_line(problem)}")

    def _missing(self) -> TensorReadError:
        ref = f" (referenced as {self.referenced_as!r})" if self.referenced_as else ""
        return self._fail(f"{self.what} {self.blob.name} not found{ref}")

    def _changed(self, now) -> None:
        """``SourceChangedError`` when ``now`` (None: gone) is not the version expected."""
        expected = self.identity if self.identity is not None else self.blob.version
        if now != expected:
            why = "removed" if now is None else (expected.difference(now) if hasattr(expected, "difference") else
                                                 "another version")
            raise SourceChangedError(self.checkpoint_path, f"tensor {self.key}: {self.what} {self.blob.name} changed "
                                                           f"since it was opened ({why}); remount to serve the new "
                                                           "version")

    def data_offset(self) -> int:
        """Absolute offset of the first element in the blob."""
        return self.offset

    def read(self, box: Box) -> np.ndarray:
        shape = box_shape(box)
        st = self.dtype.storage
        out = np.empty(shape, dtype=st)
        if out.size == 0:
            return out
        try:
            if self.verify:
                self._changed(self.blob.version)  # the version opened (a file opened now: the catalog's)
            base = self.data_offset()
            if self.stride is None:
                self._read_runs(base, box, out)
            else:
                fill_strided(self._read_exact, base, self.stride, st, box, out)
            if self.verify:
                try:
                    now = self.blob.current_version()
                except OSError:
                    now = None
                self._changed(now)
        except (SourceChangedError, TensorReadError):
            raise
        except RefusedReference as e:
            raise self._fail(f"external reference refused: {e.problem}") from None
        except FileNotFoundError:
            raise self._missing() from None
        except ShortRead:
            raise self._fail(f"{self.what} {self.file_name} is truncated") from None
        except StorageError as e:
            raise self._fail(e.problem) from None
        except OSError as e:
            raise self._fail(e.strerror or e) from e
        return out

    def _read_runs(self, base: int, box: Box, out: np.ndarray) -> None:
        item = self.dtype.itemsize
        spans = [(base + start * item, base + (start + n) * item) for start, n in box_runs(self.shape, box)]
        self.blob.read_packed(spans, memoryview(out.reshape(-1).view(np.uint8)))  # may announce what follows

    def _read_exact(self, offset: int, n: int) -> bytes:
        buf, at = self.blob.read_spans([(offset, offset + n)], self.scratch, hint=False)
        return bytes(memoryview(buf)[at[0]:at[0] + n])
