"""A read-only Python file object over a ranged-read blob, for libraries that read through one (h5py's ``fileobj``
driver: HDF5 reads its superblock, object headers, B-tree nodes and heaps with it).

HDF5 reads its metadata in many small pieces (a few hundred bytes each, neighbouring ones often in turn), so small
reads are served from blocks of ``BLOCK_BYTES``, aligned, fetched whole and kept (the last ``MAX_BLOCKS``, least
recently used first out): opening a checkpoint costs a few requests, not one per object header. Reads of at least
``BLOCK_BYTES`` go to the blob as they are (a large attribute, a chunk read by HDF5 itself); the last one of at most
``LAST_BYTES`` is kept, so that reading the same bytes again at once (a check of where a chunk lies) costs no request.

A caller that knows which metadata HDF5 will read next (``readers.cerebras.h5meta``: object headers, chunk index
nodes) fetches those ranges together ahead of it (``keep``: the blob's ``read_scattered``, concurrent requests); reads
inside one of them are then answered from memory, ``KEEP_BYTES`` of them at most, the oldest let go of first.

Not safe for concurrent use (``seek`` then ``readinto``); h5py calls it under its own global lock.
"""
from __future__ import annotations

import bisect
import io
import threading
from collections import OrderedDict

#: HDF5 metadata is fetched in aligned blocks of this size
BLOCK_BYTES = 64 << 10
#: blocks kept per file
MAX_BLOCKS = 128
#: the last large read is kept when it is at most this long
LAST_BYTES = 1 << 20
#: bytes of ranges fetched ahead (``keep``) held at once
KEEP_BYTES = 16 << 20
#: ranges fetched ahead less than this far apart are fetched as one (metadata is small; the bytes between two
#: chunk index nodes are data)
KEEP_GAP = 16 << 10


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
        self._kept: OrderedDict = OrderedDict()  # offset -> bytes fetched ahead (``keep``), oldest first
        self._kept_bytes = 0
        self._kept_at: list | None = []  # the kept offsets, sorted (None: to sort again)
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
        if self._kept and self._from_kept(offset, view[:n]):
            return n
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

    def keep(self, spans) -> list:
        """Fetch the ranges ``spans`` (``(offset, end)`` each) together (the blob's ``read_scattered``: concurrent
        requests, neighbours less than ``KEEP_GAP`` apart as one) and keep them for reads that fall inside one: each
        range's bytes (cut at the end of the blob; empty when outside it). A range held already costs no request."""
        asked = [(int(lo), min(int(hi), self.size)) for lo, hi in spans]
        out = [b""] * len(asked)
        missing = []
        for k, (lo, hi) in enumerate(asked):
            if 0 <= lo < hi:
                view = memoryview(bytearray(hi - lo))
                if self._from_kept(lo, view) or self._from_blocks(lo, view):
                    out[k] = bytes(view)
                else:
                    missing.append(k)
        if not missing:
            return out
        buf, starts = self.blob.read_scattered([asked[k] for k in missing], bytearray, KEEP_GAP)
        with self._lock:
            for k, at in zip(missing, starts):
                lo, hi = asked[k]
                data = out[k] = bytes(buf[at:at + hi - lo])
                old = self._kept.pop(lo, None)
                self._kept_bytes += len(data) - (len(old) if old is not None else 0)
                self._kept[lo] = data
                self._kept_at = None
            while self._kept_bytes > KEEP_BYTES and self._kept:
                self._kept_bytes -= len(self._kept.popitem(last=False)[1])
        return out

    def _from_blocks(self, offset: int, view: memoryview) -> bool:
        """Fill ``view`` from one block held, if one holds all of it."""
        blk = offset // BLOCK_BYTES
        if (offset + len(view) - 1) // BLOCK_BYTES != blk:
            return False
        with self._lock:
            data = self._blocks.get(blk)
        lo = offset - blk * BLOCK_BYTES
        if data is None or lo + len(view) > len(data):
            return False
        view[:] = data[lo:lo + len(view)]
        return True

    def _from_kept(self, offset: int, view: memoryview) -> bool:
        """Fill ``view`` from a range fetched ahead holding all of it, if one does."""
        with self._lock:
            if self._kept_at is None:
                self._kept_at = sorted(self._kept)
            i = bisect.bisect_right(self._kept_at, offset) - 1
            if i < 0:
                return False
            at = self._kept_at[i]
            data = self._kept[at]
            if offset + len(view) > at + len(data):
                return False
            view[:] = data[offset - at:offset - at + len(view)]
            return True

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
