"""The files h5py writes an HDF5 skeleton into (through its file-object driver): an unlinked temporary file
(``ScratchBuffer``, sparse: the tensors' regions are never written) or, when none can be made, memory
(``SparseBuffer``). Both tell afterwards which ranges HDF5 wrote (its metadata) and read any range back."""
from __future__ import annotations

import bisect
import io
import logging
import os
import tempfile

log = logging.getLogger(__name__)


class SkeletonBuffer(io.RawIOBase):
    """What h5py's file-object driver needs (a seekable binary file) plus what the layout needs after the build:
    ``eof``, ``spans()`` (the merged byte ranges written, i.e. the HDF5 metadata) and ``read_at(offset, out)``
    (unwritten bytes read as zeros). Subclasses keep the bytes: ``_put``, ``read_at``, ``_cut``."""

    def __init__(self):
        super().__init__()
        self._pos = 0
        self.eof = 0

    def readable(self):
        return True

    def writable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=0):
        base = {0: 0, 1: self._pos, 2: self.eof}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self):
        return self._pos

    def write(self, b):
        n = len(memoryview(b).cast("B"))
        if n:
            self._put(self._pos, b)
            self._pos += n
            self.eof = max(self.eof, self._pos)
        return n

    def readinto(self, b):
        n = len(b)  # past the end reads as zeros too
        self.read_at(self._pos, memoryview(b).cast("B"))
        self._pos += n
        return n

    def truncate(self, size=None):
        size = self._pos if size is None else int(size)
        self._cut(size)
        self.eof = size
        return size

    def finish(self) -> list:
        """Ends writing: returns ``spans()`` and drops what only writing needed."""
        return self.spans()


class ScratchBuffer(SkeletonBuffer):
    """The skeleton written into ``scratch``, an unlinked temporary file (sparse: the tensors' regions are never
    written), so that its metadata stays on disk and out of the server's memory; the written ranges are tracked
    (merged, two int lists) to tell metadata from free space. Reads use ``os.pread``: safe from several threads."""

    def __init__(self, scratch):
        super().__init__()
        self.scratch = scratch  # kept open: the layout reads from it for as long as it lives
        self._fd = scratch.fileno()
        self._starts: list[int] = []
        self._ends: list[int] = []
        self.error: OSError | None = None  # a write that failed (a full disk): the layout builds in memory instead

    def _put(self, offset: int, data) -> None:
        mv = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(mv):
                done += os.pwrite(self._fd, mv[done:], offset + done)
        except OSError as e:
            self.error = e
            raise
        lo, hi = offset, offset + len(mv)
        i = bisect.bisect_left(self._ends, lo)  # first range ending at or after lo: touches or overlaps
        j = bisect.bisect_right(self._starts, hi)  # ranges from j on start after hi
        if i < j:
            lo, hi = min(lo, self._starts[i]), max(hi, self._ends[j - 1])
        self._starts[i:j] = [lo]
        self._ends[i:j] = [hi]

    def read_at(self, offset: int, out: memoryview) -> None:
        pos, end = offset, offset + len(out)
        while pos < end:
            data = os.pread(self._fd, end - pos, pos)
            if not data:  # beyond the file's end: zeros
                out[pos - offset:] = bytes(end - pos)
                break
            out[pos - offset:pos - offset + len(data)] = data
            pos += len(data)

    def _cut(self, size: int) -> None:
        try:
            os.ftruncate(self._fd, size)
        except OSError as e:
            self.error = e
            raise
        i = bisect.bisect_left(self._starts, size)
        del self._starts[i:], self._ends[i:]
        if self._ends and self._ends[-1] > size:
            self._ends[-1] = size

    def spans(self) -> list:
        return list(zip(self._starts, self._ends))

    def finish(self) -> list:
        spans = self.spans()
        self._starts, self._ends = [], []
        return spans


class SparseBuffer(SkeletonBuffer):
    """The skeleton kept in memory (when no temporary file can be made): only written ranges are kept, merged,
    each with its bytes."""

    def __init__(self):
        super().__init__()
        self._starts: list[int] = []
        self._data: list[bytearray] = []

    def _put(self, lo: int, b) -> None:
        b = bytes(b)
        hi = lo + len(b)
        i = bisect.bisect_right(self._starts, lo) - 1
        if i >= 0 and self._starts[i] + len(self._data[i]) >= lo:
            start, buf = self._starts[i], self._data[i]
        else:
            i += 1
            start, buf = lo, bytearray()
            self._starts.insert(i, start)
            self._data.insert(i, buf)
        if len(buf) < hi - start:
            buf.extend(b"\0" * (hi - start - len(buf)))
        buf[lo - start:hi - start] = b
        # swallow following segments that now touch or overlap
        while i + 1 < len(self._starts) and self._starts[i + 1] <= start + len(buf):
            ns, nb = self._starts.pop(i + 1), self._data.pop(i + 1)
            tail = ns + len(nb) - (start + len(buf))
            if tail > 0:
                buf.extend(nb[len(nb) - tail:])

    def read_at(self, offset: int, out: memoryview) -> None:
        n = len(out)
        out[:] = bytes(n)
        lo, hi = offset, offset + n
        i = max(0, bisect.bisect_right(self._starts, lo) - 1)
        while i < len(self._starts) and self._starts[i] < hi:
            s, d = self._starts[i], self._data[i]
            a, z = max(lo, s), min(hi, s + len(d))
            if a < z:
                out[a - lo:z - lo] = d[a - s:z - s]
            i += 1

    def _cut(self, size: int) -> None:
        i = bisect.bisect_left(self._starts, size)
        del self._starts[i:], self._data[i:]
        if self._starts and self._starts[-1] + len(self._data[-1]) > size:
            del self._data[-1][size - self._starts[-1]:]

    def spans(self) -> list:
        return [(s, s + len(d)) for s, d in zip(self._starts, self._data)]


def new_buffer() -> SkeletonBuffer:
    """A ``ScratchBuffer`` on an unlinked temporary file in the temporary directory (``$TMPDIR``), or a
    ``SparseBuffer`` in memory when no temporary file can be made there."""
    try:
        return ScratchBuffer(tempfile.TemporaryFile(prefix="ckptfs-hdf5-"))
    except OSError as e:
        log.warning("no temporary file for the HDF5 skeleton (%s): kept in memory", e)
        return SparseBuffer()
