"""A tensor stored as raw little-endian elements at a byte offset of a ``Blob`` (``ckptfs.storage``): a storage
member of a ``torch.save`` zip read through the storage layer.

``BlobRegionTensor`` reads a box as the byte ranges under it: the C-order runs of a contiguous view in one
``read_spans``, a strided view (``stride`` in elements) through ``torch_bin.fill_strided``. After every read the
blob must still be the version it was opened as (``Blob.current_version``): bytes never mix two versions of a file
rewritten in place (a blob whose every read names its version, an object in S3, needs no such check:
``verify=False``).
"""
from __future__ import annotations

import numpy as np

from ..dtypes import DType
from ..errors import SourceChangedError, StorageError, TensorReadError
from ..storage.base import Blob, ShortRead
from ..tensor.base import Box, VirtualTensor, box_shape
from .cerebras.lz4chunks.pool import scratch
from ..tensor.regions import box_runs
from .hf.torch_bin import fill_strided


class BlobRegionTensor(VirtualTensor):
    """Elements of ``dtype`` at byte ``offset`` of ``blob``; ``stride`` None for a C-contiguous view."""

    __slots__ = ("blob", "offset", "stride", "key", "checkpoint_path", "what", "verify")

    def __init__(self, blob: Blob, offset: int, shape, dtype: DType, key: str, checkpoint_path, *,
                 stride: tuple | None = None, what: str = "storage", verify: bool = True):
        super().__init__(shape, dtype)
        self.blob = blob
        self.offset = int(offset)
        self.stride = None if stride is None else tuple(int(s) for s in stride)
        self.key = key
        self.checkpoint_path = checkpoint_path
        self.what = what
        self.verify = verify  # False: every read of the blob names its version itself (an S3 object's ETag)

    def describe(self) -> str:
        where = f"{self.what} @{self.offset}" + ("" if self.stride is None else f" stride {list(self.stride)}")
        return f"{where} [{', '.join(map(str, self.shape))}] {self.dtype.name}"

    def _fail(self, problem: str) -> TensorReadError:
        return TensorReadError(self.checkpoint_path, f"tensor {self.key}: {' '.join(str(problem).split())}")

    def read(self, box: Box) -> np.ndarray:
        shape = box_shape(box)
        st = self.dtype.storage
        out = np.empty(shape, dtype=st)
        if out.size == 0:
            return out
        try:
            if self.stride is None:
                self._read_runs(box, out)
            else:
                fill_strided(self._read_exact, self.offset, self.stride, st, box, out)
            if self.verify:
                self._check_version()
        except (SourceChangedError, TensorReadError):
            raise
        except ShortRead:
            raise self._fail(f"the file ends inside its {self.what} (truncated)") from None
        except StorageError as e:
            raise self._fail(e.problem) from None
        except OSError as e:
            raise self._fail(e.strerror or e) from e
        return out

    def _read_runs(self, box: Box, out: np.ndarray) -> None:
        item = self.dtype.itemsize
        spans = [(self.offset + start * item, self.offset + (start + n) * item)
                 for start, n in box_runs(self.shape, box)]
        buf, at = self.blob.read_spans(spans, lambda n: scratch("blob_region", n))
        src, dst, pos = memoryview(buf), memoryview(out.reshape(-1).view(np.uint8)), 0
        for (lo, end), a in zip(spans, at):
            dst[pos:pos + end - lo] = src[a:a + end - lo]
            pos += end - lo

    def _read_exact(self, offset: int, n: int) -> bytes:
        buf, at = self.blob.read_spans([(offset, offset + n)], lambda size: scratch("blob_region", size))
        return bytes(memoryview(buf)[at[0]:at[0] + n])

    def _check_version(self) -> None:
        opened = self.blob.version
        try:
            now = self.blob.current_version()
        except OSError:
            now = None
        if now != opened:
            why = "removed" if now is None else (opened.difference(now) if hasattr(opened, "difference") else
                                                 "another version")
            raise SourceChangedError(self.checkpoint_path, f"tensor {self.key}: the checkpoint changed since it was "
                                                           f"opened ({why}); remount to serve the new version")
