"""Server-side read-ahead: while the FUSE loop copies one cache block out, a worker thread computes the next ones.

A pieced file (``ckptfs.layouts.pieces``) that serves a sequential read asks for the bytes after it that its reader's
cursor (``ckptfs.layouts.cursor``) wants prepared (at most ``BlockCache.read_ahead`` bytes, 0 = off; the FUSE server
turns it on): each tensor block under that range that is neither cached nor being computed is queued here and
computed by a background thread into the same cache, then reported to the cursor that queued it. Most of
that work releases the GIL (``preadv`` from the disk, numpy copies, LZ4 decoding through ctypes), so the disk, the
decoder and the FUSE loop's copies to the kernel overlap instead of taking turns. A reader that reaches a block
still being computed waits for it (``BlockCache.get_or_compute``) instead of computing it again.

The queue is bounded (``MAX_QUEUED`` blocks): read-ahead never builds a backlog larger than a few blocks, and a
failure is left for the reader that needs the block to report.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Hashable

from ..env import read_ahead_threads
from ..storage.base import memory_reads, waited_reads

#: blocks queued at most; further requests are dropped (the reader computes them itself; its cursor asks again)
MAX_QUEUED = 8


#: background threads computing blocks (``$CKPTFS_READ_AHEAD_THREADS``, default two): one waits for the storage
#: while the other places a block; the second runs only while blocks wait (docs/measurements.md, "Read-ahead threads")
WORKERS = read_ahead_threads()


class ReadAhead:
    """Background threads (``workers``) computing queued cache blocks, oldest request first. ``waited_reads()``
    counts the calling thread's reads that waited for the storage (the storage layer's hook): all workers run while
    the last block's reads waited, one while they came from memory. ``memory_reads()`` counts its reads known to be
    served from memory: each block is reported to the ``done`` its request came with (the reader's cursor:
    ``ReadCursor.block_computed``) as made of those alone or not; the cursor decides what to do with it."""

    def __init__(self, max_queued: int = MAX_QUEUED, workers: int = WORKERS,
                 waited_reads: Callable[[], int] = waited_reads, memory_reads: Callable[[], int] = memory_reads):
        self.max_queued = max_queued
        self.workers = max(1, workers)
        self._waited_reads = waited_reads
        self._memory_reads = memory_reads
        self._queue: deque = deque()
        self._queued: set = set()
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # workers wait here for a block they may take
        self._idle = threading.Condition(lock)  # ``wait_idle`` callers wait here
        self._threads: list = []
        self._busy = 0  # blocks taken off the queue and still being computed
        self._limit = self.workers  # blocks computed at once: all workers while the last block went to the disk

    def submit(self, cache, key: Hashable, compute: Callable[[], bytes],
               done: Callable[[bool], None] | None = None) -> bool:
        """Compute block ``key`` of ``cache`` in the background unless it is kept, computing, queued or lately
        consumed (``BlockCache.wanted``); ``done(from_memory_alone)`` is called once it is computed. False when the
        queue is full and the request was dropped (the reader computes the block itself)."""
        ident = (id(cache), key)
        if not cache.wanted(key):
            return True
        with self._cond:
            if ident in self._queued:
                return True
            if len(self._queue) >= self.max_queued:
                return False
            self._queued.add(ident)
            self._queue.append((ident, cache, key, compute, done))
            self._threads = [th for th in self._threads if th.is_alive()]
            if len(self._threads) < min(self.workers, len(self._queue) + self._busy):
                th = threading.Thread(target=self._run, name="ckptfs-readahead", daemon=True)
                th.start()
                self._threads.append(th)
            self._wake()
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue or self._busy >= self._limit:
                    self._cond.wait()
                ident, cache, key, compute, done = self._queue.popleft()
                self._busy += 1
            reads, from_memory = self._waited_reads(), self._memory_reads()
            try:
                cache.prefetch(key, compute)
            finally:
                waited = self._waited_reads() > reads
                if done is not None:
                    done(not waited and self._memory_reads() > from_memory)
                with self._cond:
                    self._limit = self.workers if waited else 1
                    self._queued.discard(ident)
                    self._busy -= 1
                    if self._queue:  # this worker takes the next block itself; another one only if two may run
                        self._wake(taking=1)
                    elif not self._busy:
                        self._idle.notify_all()

    def _wake(self, taking: int = 0) -> None:
        """Wake one waiting worker if a queued block is left for it once the caller took ``taking`` (called with the
        lock held). Waking every worker on every block (``notify_all``) cost a thread switch, and a GIL hand-off,
        per idle worker and block: ~2,000 needless switches per GB read from the page cache, where one worker
        computes at a time."""
        if len(self._queue) > taking and self._busy + taking < self._limit:
            self._cond.notify()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or being computed; False if ``timeout`` seconds passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._queue and not self._busy, timeout)


#: the process's read-ahead threads (started on first use), counting waits with the storage layer's counter
READ_AHEAD = ReadAhead(waited_reads=waited_reads, memory_reads=memory_reads)
