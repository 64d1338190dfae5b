"""A tensor of a TensorFlow saver checkpoint: a byte range of one ``.data-*`` shard, checked against its CRC-32C.

``TfShard`` is one data file: its path (confined to the checkpoint's folder when the catalog was read), the version
the catalog saw, and one ``LocalFile`` (``ckptfs.storage.local``) opened on first read, through which every read
goes (``read_spans``: only the ranges asked for, never the whole file). A read that finds the file changed fails.

``TfBundleTensor`` is ``[offset, offset + size)`` of a shard, C-order little-endian elements. Before its first
bytes are served, the whole range is read once in pieces of at most ``CRC_PIECE`` bytes and its CRC-32C compared
with the index entry's (TF stores it masked); a mismatch makes every read of the tensor fail (EIO in a mount), and
the outcome is remembered for this version of the shard. Then each read takes only the rows its box needs.
"""
from __future__ import annotations

import math
import threading
from pathlib import Path

import numpy as np

from ckptfs.dtypes import DType
from ckptfs.errors import SourceChangedError, TensorReadError
from ckptfs.guard.confine import Confinement, RefusedReference, regular_stat
from ckptfs.errors import one_line
from ckptfs.storage.base import thread_scratch
from ckptfs.tensor.regions import _shape_str, box_runs
from ckptfs.storage.base import ShortRead
from ckptfs.storage.local import FileIdentity, LocalFile
from ckptfs.tfbundle import crc32c, unmask
from ckptfs.tensor.base import Box, VirtualTensor, box_shape

def _scratch(n: int):
    """This thread's page-aligned buffer for the bytes of one read (copied out before the next read)."""
    return thread_scratch("tf-data", n)


#: the CRC-32C of a tensor is computed over pieces of at most this many bytes (the memory one check holds)
CRC_PIECE = 8 << 20


class TfShard:
    """One ``<prefix>.data-0000i-of-0000N`` file, opened on first read (one descriptor, shared by its tensors)."""

    def __init__(self, path: Path, identity: FileIdentity, checkpoint_path: Path, confinement: Confinement):
        self.path = path
        self.identity = identity
        self.checkpoint_path = checkpoint_path
        self.confinement = confinement
        self._file: LocalFile | None = None
        self._lock = threading.Lock()

    def file(self, key: str) -> LocalFile:
        f = self._file
        if f is not None:
            return f
        with self._lock:
            if self._file is None:
                try:
                    self.confinement.recheck(self.path)
                    regular_stat(self.path)
                    f = LocalFile(str(self.path))
                except RefusedReference as e:
                    raise TensorReadError(self.checkpoint_path, f"tensor {key}: {e.problem}") from None
                except OSError as e:
                    raise TensorReadError(self.checkpoint_path, f"tensor {key}: data file {self.path.name} cannot be "
                                                                f"opened ({e.strerror or e})") from None
                why = self.identity.difference(f.version)
                if why:
                    f.file.close()
                    raise SourceChangedError(self.checkpoint_path, f"tensor {key}: data file {self.path.name} changed "
                                                                   f"since the checkpoint was opened ({why})")
                self._file = f
        return self._file

    def read_spans(self, key: str, spans: list) -> tuple:
        """``(buffer, start of each span)`` of the byte ranges ``spans`` of this file; ``TensorReadError`` when it
        ends inside one or changed."""
        f = self.file(key)
        try:
            buf, starts = f.read_spans(spans, _scratch, hint=False)
            now = f.current_version()
        except ShortRead as e:
            raise TensorReadError(self.checkpoint_path, f"tensor {key}: data file {self.path.name} is truncated (it "
                                                        f"ends inside bytes [{spans[e.k][0]}, {spans[e.k][1]}))") from None
        except OSError as e:
            raise TensorReadError(self.checkpoint_path, f"tensor {key}: reading {self.path.name}: {one_line(e)}") from None
        why = self.identity.difference(now)
        if why:
            raise SourceChangedError(self.checkpoint_path, f"tensor {key}: data file {self.path.name} changed since "
                                                           f"the checkpoint was opened ({why}); remount to serve it")
        return buf, starts

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            f.file.close()


class TfBundleTensor(VirtualTensor):
    """Bytes ``[offset, offset + nbytes)`` of ``shard``, checked once against ``masked_crc`` (see the module
    docstring)."""

    __slots__ = ("shard", "offset", "key", "masked_crc", "_checked")

    def __init__(self, shard: TfShard, offset: int, shape, dtype: DType, key: str, masked_crc: int):
        super().__init__(shape, dtype)
        self.shard = shard
        self.offset = int(offset)
        self.key = key
        self.masked_crc = int(masked_crc)
        self._checked: str | None = None  # "ok", or the problem found

    def describe(self) -> str:
        return f"{self.shard.path.name} @{self.offset} {_shape_str(self.shape)} {self.dtype.name}"

    def data_offset(self) -> int:
        return self.offset

    def check_crc(self) -> None:
        """Compare the CRC-32C of the tensor's bytes with its index entry's, once; ``TensorReadError`` on mismatch."""
        if self._checked is None:
            crc, pos, end = 0, self.offset, self.offset + self.nbytes
            while pos < end:
                n = min(CRC_PIECE, end - pos)
                buf, starts = self.shard.read_spans(self.key, [(pos, pos + n)])
                crc = crc32c(memoryview(buf)[starts[0]:starts[0] + n], crc)
                pos += n
            want = unmask(self.masked_crc)
            self._checked = "ok" if crc == want else (f"CRC-32C mismatch in {self.shard.path.name} at bytes "
                                                      f"[{self.offset}, {end}): the data is {crc:#010x}, the index "
                                                      f"says {want:#010x}")
        if self._checked != "ok":
            raise TensorReadError(self.shard.checkpoint_path, f"tensor {self.key}: {self._checked}")

    def read(self, box: Box) -> np.ndarray:
        self.check_crc()
        shape = box_shape(box)
        st = self.dtype.storage
        out = np.empty(math.prod(shape), dtype=st)
        runs = box_runs(self.shape, box)
        if not runs:
            return out.reshape(shape)
        item = st.itemsize
        spans = [(self.offset + start * item, self.offset + (start + n) * item) for start, n in runs]
        buf, starts = self.shard.read_spans(self.key, spans)
        dst, pos, src = memoryview(out.view(np.uint8)), 0, memoryview(buf)
        for (lo, end), at in zip(spans, starts):
            dst[pos:pos + end - lo] = src[at:at + end - lo]
            pos += end - lo
        return out.reshape(shape)


class TfSlicedTensor(VirtualTensor):
    """A variable saved as slices (TF's ``MaxShardSizePolicy`` splits a large one across shards; a TF1 partitioned
    variable): ``parts`` are ``(box of the whole tensor, TfBundleTensor of that box's shape)``, tiling it exactly
    (``tiling_problem``). A read asks each part only for its share of the box."""

    __slots__ = ("parts", "key")

    def __init__(self, shape, dtype: DType, key: str, parts: list):
        super().__init__(shape, dtype)
        self.parts = parts
        self.key = key

    def describe(self) -> str:
        return f"{len(self.parts)} saved slices {_shape_str(self.shape)} {self.dtype.name}"

    def read(self, box: Box) -> np.ndarray:
        out = np.empty(box_shape(box), dtype=self.dtype.storage)
        for extent, part in self.parts:
            inter = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, extent))
            if any(lo >= hi for lo, hi in inter):
                continue
            sub = part.read(tuple((lo - c, hi - c) for (lo, hi), (c, _) in zip(inter, extent)))
            out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, box))] = sub
        return out


def tiling_problem(shape: tuple, boxes: list) -> str | None:
    """Why the slices ``boxes`` (``((start, stop), …)`` each) do not tile a tensor of ``shape`` exactly, or None."""
    total = 0
    for b in boxes:
        if len(b) != len(shape) or any(not 0 <= lo < hi <= n for (lo, hi), n in zip(b, shape)):
            return f"slice {list(b)} does not lie inside shape {list(shape)}"
        total += math.prod(hi - lo for lo, hi in b)
    if total != math.prod(shape):
        return f"its {len(boxes)} slices hold {total} elements, the shape {math.prod(shape)}"
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b)):
                return f"slices {list(a)} and {list(b)} overlap"
    return None
