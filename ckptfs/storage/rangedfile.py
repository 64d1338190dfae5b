"""A read-only Python file object over a ranged-read blob, for libraries that read through one (h5py's ``fileobj``
driver: HDF5 reads its superblock, object headers, B-tree nodes and heaps with it).

HDF5 reads its metadata in many small pieces (a few hundred bytes each, neighbouring ones often in turn), so small
reads are served from blocks of ``BLOCK_BYTES``, aligned, fetched whole and kept (the last ``MAX_BLOCKS``, least
recently used first out): opening a checkpoint costs a few requests, not one per object header. Reads of at least
``BLOCK_BYTES`` go to the blob as they are (a large attribute, a chunk read by HDF5 itself); the last one of at most
``LAST_BYTES`` is kept, so that reading the same bytes again at once (a check of where a chunk lies) costs no request.

Not safe for concurrent use (``seek`` then ``readinto``); h5py calls it under its own global lock.
"""
from __future__ import annotations

import io
import threading
from collections import OrderedDict

#: HDF5 metadata is fetched in aligned blocks of this size
BLOCK_BYTES = 64 << 10
#: blocks kept per file
MAX_BLOCKS = 128
#: the last large read is kept when it is at most this long
LAST_BYTES = 1 << 20


class RangedFile(io.RawIOBase):
    """``blob`` (``size``, ``read_into(view, offset, need)``) as a seekable, read-only raw file."""

    def __init__(self, blob):
        super().__init__()
        self.blob = blob
        self.size = int(blob.size)
        self._pos = 0
        self._blocks: OrderedDict = OrderedDict()  # block number -> bytes
        self._last: tuple = (0, b"")  # (offset, bytes) of the last large read
        self._lock = threading.Lock()
        self.name = getattr(blob, "name", "blob")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self.size + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise OSError(22, "negative seek position")
        self._pos = pos
        return pos

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")
        n = self.read_at(self._pos, view)
        self._pos += n
        return n

    def read_at(self, offset: int, view: memoryview) -> int:
        """Fill ``view`` from ``offset`` (fewer bytes only at the end of the blob): the count."""
        n = max(0, min(len(view), self.size - offset))
        if n == 0:
            return 0
        last_at, last = self._last
        if last_at <= offset and offset + n <= last_at + len(last):
            view[:n] = last[offset - last_at:offset - last_at + n]
            return n
        if n >= BLOCK_BYTES:
            got, _ = self.blob.read_into(view[:n], offset, n)
            if got <= LAST_BYTES:
                self._last = (offset, bytes(view[:got]))
            return got
        pos = 0
        while pos < n:
            blk = (offset + pos) // BLOCK_BYTES
            data = self._block(blk)
            lo = offset + pos - blk * BLOCK_BYTES
            take = min(n - pos, len(data) - lo)
            if take <= 0:
                break
            view[pos:pos + take] = data[lo:lo + take]
            pos += take
        return pos

    def _block(self, blk: int) -> bytes:
        with self._lock:
            data = self._blocks.get(blk)
            if data is not None:
                self._blocks.move_to_end(blk)
                return data
        lo = blk * BLOCK_BYTES
        buf = bytearray(min(BLOCK_BYTES, self.size - lo))
        self.blob.read_into(memoryview(buf), lo, len(buf))
        data = bytes(buf)
        with self._lock:
            self._blocks[blk] = data
            while len(self._blocks) > MAX_BLOCKS:
                self._blocks.popitem(last=False)
        return data

    def write(self, b):
        raise io.UnsupportedOperation("read-only")
