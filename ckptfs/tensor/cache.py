"""A bounded, thread-safe LRU cache of byte blocks (``bytes`` or read-only byte ``memoryview``s): the only place
tensor data is kept in memory.

Each mounted tree owns one (``VirtualTree.cache``, sized by ``--cache-size``) and hands it to every file it
serves; nothing here is process-wide except ``NO_CACHE``, which keeps nothing (reads outside any tree).

Concurrent readers (the FUSE server's worker threads, the read-ahead) that miss the same block compute it once:
the first computes, the others wait for its result (or its exception). ``peek`` and ``prefetch`` serve the
read-ahead: whether a block is kept, and computing one only if nobody has it or is computing it. A ``streaming``
cache (the FUSE server's) drops blocks that were read whole (``taken``).
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable, Hashable

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 256 << 20

#: what keeping one block costs beyond its bytes (the value object, its key, the LRU entry): charged against the
#: bound, so that a cache of many tiny blocks (a checkpoint of 100,000 small tensors) stays within --cache-size too
BLOCK_OVERHEAD = 512

#: how many blocks a streaming cache remembers as read whole and dropped (``taken``): the read-ahead skips them, since
#: the kernel's page cache holds their bytes (a loader that jumps back before a region it read would otherwise have
#: the read-ahead decode that region again for nobody). ~100 bytes each.
REMEMBER_CONSUMED = 8192

def _cost(val) -> int:
    return len(val) + BLOCK_OVERHEAD


class _Pending:
    """A block being computed by one thread; others wait on ``done``."""

    __slots__ = ("done", "value", "error")

    def __init__(self):
        self.done = threading.Event()
        self.value = None
        self.error: BaseException | None = None


class BlockCache:
    """LRU of ``bytes`` values bounded by total size (each block charged ``BLOCK_OVERHEAD`` on top of its bytes);
    values larger than the bound are not kept."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES):
        self.max_bytes = int(max_bytes)
        self._data: "OrderedDict[Hashable, bytes]" = OrderedDict()
        self._pending: dict = {}
        self._taken: dict = {}  # key -> bytes of that block readers have copied out so far
        self._consumed: "OrderedDict[Hashable, None]" = OrderedDict()  # blocks read whole and dropped, newest last
        # the FUSE server's cache (the kernel's page cache keeps what was read): a block is dropped once all its bytes
        # were read (``taken``), and a small read of a block not kept decodes only its own chunks
        # (``VirtualTensor.read_into``) instead of the whole block
        self.streaming = False
        # the most a sequential reader's cursor prepares after its reads (``ckptfs.layouts.cursor``, computed by
        # ``ckptfs.tensor.readahead``), and the most whose storage it asks to fetch ahead (``VirtualTensor.will_need``)
        self.read_ahead = 0
        self.announce_ahead = 0
        self.remote = False  # the tree's tensors are in object storage (``tree.memory.tree_cache``)
        self._size = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def size(self) -> int:
        return self._size

    def peek(self, key: Hashable) -> bool:
        """True when ``key`` is kept or being computed (no LRU update, no counting)."""
        with self._lock:
            return key in self._data or key in self._pending

    def wanted(self, key: Hashable) -> bool:
        """Whether the read-ahead should compute ``key``: not kept, not being computed, and not lately read whole
        and dropped by a streaming cache (``taken``; the kernel's page cache has those bytes)."""
        with self._lock:
            return not (key in self._data or key in self._pending or key in self._consumed)

    def get_or_compute(self, key: Hashable, compute: Callable[[], bytes]) -> bytes:
        with self._lock:
            val = self._data.get(key)
            if val is not None:
                self._data.move_to_end(key)
                self.hits += 1
                return val
            self.misses += 1
            pend = self._pending.get(key)
            mine = pend is None
            if mine:
                pend = self._pending[key] = _Pending()
        if not mine:  # another thread computes this block: wait for it
            pend.done.wait()
            if pend.error is not None:
                raise pend.error
            return pend.value
        try:
            val = compute()
        except BaseException as e:
            pend.error = e
            with self._lock:
                self._pending.pop(key, None)
            pend.done.set()
            raise
        pend.value = val
        self.put(key, val, _pending=pend)
        pend.done.set()
        return val

    def prefetch(self, key: Hashable, compute: Callable[[], bytes]) -> None:
        """Compute and keep ``key`` unless it is kept, being computed or lately consumed (``wanted``; errors are
        left for the real read)."""
        if self.max_bytes <= 0 or not self.wanted(key):
            return
        try:
            self.get_or_compute(key, compute)
        except Exception as e:  # noqa: BLE001 - a guess ahead: the reader that needs the block reports the error
            log.debug("prefetch of block %r failed: %s", key, e)

    def taken(self, key: Hashable, nbytes: int) -> None:
        """A reader copied ``nbytes`` of block ``key`` out. With ``streaming`` (the FUSE server's cache), a block
        is dropped once every byte of it has been taken: behind FUSE the kernel's page cache keeps what was read,
        a sequential reader (cp, a loader) does not come back, and the freed memory is reused for the next block
        instead of fresh pages (faulting new pages in costs more than the copy itself: ~1.5 GB/s here). A reader
        that does come back (another file holding the same tensor) recomputes the block."""
        if not self.streaming:
            return
        with self._lock:
            val = self._data.get(key)
            if val is None:
                return
            got = self._taken.get(key, 0) + nbytes
            if got < len(val):
                self._taken[key] = got
                return
            del self._data[key]
            self._taken.pop(key, None)
            self._size -= _cost(val)
            self._consumed[key] = None
            if len(self._consumed) > REMEMBER_CONSUMED:
                self._consumed.popitem(last=False)

    def put(self, key: Hashable, val: bytes, _pending: _Pending | None = None) -> None:
        with self._lock:
            if _pending is not None and self._pending.get(key) is _pending:
                del self._pending[key]
            if _cost(val) > self.max_bytes:
                return
            old = self._data.pop(key, None)
            if old is not None:
                self._size -= _cost(old)
            self._taken.pop(key, None)
            self._data[key] = val
            self._size += _cost(val)
            while self._size > self.max_bytes and self._data:
                k, v = self._data.popitem(last=False)
                self._taken.pop(k, None)
                self._size -= _cost(v)

    @contextmanager
    def sequential(self, read_ahead: int = 0):
        """While inside: serve readers going through files once, in order, as the FUSE server does for the kernel and
        an export does for its files — blocks dropped once read whole, so their memory serves the next instead of the
        cache filling up to its bound with blocks nobody reads again, each in fresh memory faulted in
        (docs/measurements.md, "Export: blocks read once"; a tensor in two files is read again a whole file later,
        when an LRU would have let it go anyway for any checkpoint larger than the cache); and the ``read_ahead``
        bytes after each read prepared by the read-ahead threads (the next blocks decode, and their chunks come from
        the disk, while the reader writes this one). The previous settings are restored after."""
        saved = self.streaming, self.read_ahead
        self.streaming, self.read_ahead = True, max(self.read_ahead, int(read_ahead))
        try:
            yield self
        finally:
            self.streaming, self.read_ahead = saved

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._taken.clear()
            self._consumed.clear()
            self._size = 0


#: keeps nothing: what a read without a tree's cache goes through
NO_CACHE = BlockCache(0)
