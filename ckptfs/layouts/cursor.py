"""One reader's prefetch state: a ``ReadCursor`` per open file handle (a FUSE handle, a file ``ckptfs export``
copies), handed to ``PiecedFile.readinto(offset, out, cursor)``. Two readers of one file have two cursors and never
confuse each other's streams; a file, its storage and the tree's block cache keep no stream state. A read without a
cursor (a one-off read: ``tree.read``, ``explain``, a diff) prepares nothing.

The policy, decided in ``advance`` after each read ``[offset, end)``:

* **Stream.** A read within ``STREAM_SLACK`` of the reads in order so far continues the stream and widens it
  (libfuse's threads hand one stream's requests to several threads, which finish out of order); any other read
  starts a new stream, with both windows back to ``FIRST_WINDOW``.
* **Sequential.** Only a read of ``SEQUENTIAL_READ`` bytes or more, or of ``SEQUENTIAL_CONTINUATION`` or more
  starting exactly where the last one ended, prepares anything: a 4 KiB peek and the kernel's 16 KiB follow-up do
  not; a reader that goes on gets 32, 64, 128 KiB requests.
* **Window.** Two windows ahead of the stream's end: blocks computed ahead by the read-ahead threads (up to the
  tree's ``cache.read_ahead`` after the end) and bytes announced to the storage beyond those (up to
  ``cache.announce_ahead`` after the end, once the stream is ``read_ahead`` long; past the tensor being read only for
  a stream that went on from one tensor into the next, not a loader reading each tensor whole in its own order).
  The first starts at ``FIRST_WINDOW`` and doubles at every extension after the first, up to its cap; the second,
  which only a stream already ``read_ahead`` long reaches, starts whole (objects a few MB into a copy must be asked
  for before the reader gets there).
* **Backpressure.** A window is extended only once the reader has consumed some of what was prepared ahead of it,
  so a whole window stays ahead of a reader that goes on (extending at half, mountpoint-s3's rule, made a cold copy
  slower: docs/read-path.md): a reader that does not consume what was prepared (it rereads, or stays put) gets nothing
  more queued and no growth. Blocks the read-ahead queue refused (full: what was queued earlier is not computed
  yet) are not counted as prepared and stop the growth; the next read asks for them again.
* **From memory.** The read-ahead threads report each block they computed for this cursor (``block_computed``):
  after ``FROM_MEMORY_RUN`` blocks in a row read from memory alone, nothing is computed ahead (a thread computing
  ahead only takes turns with the reader for the GIL: docs/measurements.md, "Cache blocks of 2 MiB") until one of the
  reader's own reads waits for the storage.

Thread-safe: one handle may be read by several FUSE threads at once (a lock around ``advance``; the from-memory run
is a hint set without it).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

#: a read at least this large is part of a sequential stream (the kernel's read-ahead requests are 128 KiB to 1 MiB;
#: a 4 KiB peek is not)
SEQUENTIAL_READ = 128 << 10
#: a smaller read counts as sequential only when it starts where the previous one ended and is at least this large:
#: the kernel follows a 4 KiB peek with a 16 KiB read of the next bytes (its initial read-ahead), which must not
#: queue megabytes of decoding for a reader that only peeks
SEQUENTIAL_CONTINUATION = 64 << 10
#: a read within this distance of the stream (inside it, or at most this far before its start or after its end)
#: continues it: a mount of a checkpoint in object storage runs several libfuse threads, which finish the kernel's
#: requests of one stream out of order, one late by more than its neighbours when the machine is busy
STREAM_SLACK = 2 << 20
#: what a window holds when a stream starts (then doubled at each extension up to its cap): one cache block
FIRST_WINDOW = 1 << 20
#: blocks in a row the read-ahead computed from memory alone before the stream counts as served from memory (a cold
#: read meets short runs of pages the kernel read ahead of its own accord; a file in the page cache is one long run)
FROM_MEMORY_RUN = 8


@dataclass
class Window:
    """Bytes prepared ahead of a stream: up to file offset ``to``; ``size`` the window kept ahead of the reader (how
    far after the reader an extension reaches); ``extended``: whether anything was prepared yet."""

    to: int = 0
    size: int = FIRST_WINDOW
    extended: bool = False

    def extend(self, end: int, cap: int, skip: int = 0, limit: int | None = None,
               whole: bool = False) -> tuple | None:
        """``(a, b)``: the file bytes to prepare now for a reader at ``end`` — those from ``end + skip`` on not
        prepared yet, up to a window after ``end + skip`` and at most ``limit`` — or None while a whole window
        prepared earlier is still ahead (the reader consumed none of it). Each extension after the first doubles the window, up to ``cap``;
        ``whole``: the first one is the whole ``cap`` already."""
        base = end + skip
        size = cap if whole and not self.extended else min(self.size, cap)
        if self.to - base >= size:
            return None  # backpressure: nothing prepared was consumed yet
        if self.extended:
            size = min(size * 2, cap)
        a, b = max(self.to, base), base + size
        if limit is not None:
            b = min(b, limit)
        if b <= a:
            return None
        self.to, self.size, self.extended = b, size, True
        return a, b

    def refused(self, a: int) -> None:
        """The bytes from ``a`` on were not prepared after all (the read-ahead queue was full): asked again next time,
        and the window stops growing."""
        if a < self.to:
            self.to = a
            self.size = max(FIRST_WINDOW, self.size // 2)


@dataclass(frozen=True)
class Step:
    """What one read asks for: file bytes to compute ahead (``prepare``) and to announce to the storage
    (``announce``), each ``(a, b)`` or None."""

    prepare: tuple | None = None
    announce: tuple | None = None


NOTHING = Step()


class ReadCursor:
    """One open handle's stream (see the module docstring)."""

    __slots__ = ("start", "end", "last_end", "prepared", "announced", "memory_run", "_lock")

    def __init__(self):
        self.start = 0  # where the stream of reads in order began
        self.end = -1  # where it ends (-1: no read yet)
        self.last_end = -1  # where the last read ended
        self.prepared = Window()  # blocks computed ahead
        self.announced = Window()  # bytes announced to the storage
        self.memory_run = 0  # blocks in a row the read-ahead computed for this stream from memory alone
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"ReadCursor(stream [{self.start}, {self.end}), prepared to {self.prepared.to} "
                f"(window {self.prepared.size}), announced to {self.announced.to} (window {self.announced.size}), "
                f"{'from memory' if self.from_memory else 'from storage'})")

    @property
    def from_memory(self) -> bool:
        """The last ``FROM_MEMORY_RUN`` blocks computed ahead for this stream came from memory alone."""
        return self.memory_run >= FROM_MEMORY_RUN

    @from_memory.setter
    def from_memory(self, value: bool) -> None:
        self.memory_run = FROM_MEMORY_RUN if value else 0

    def block_computed(self, from_memory_alone: bool) -> None:
        """The read-ahead computed a block this cursor queued (``ckptfs.tensor.readahead``): one more in the run of
        blocks from memory, or the run ends."""
        self.memory_run = self.memory_run + 1 if from_memory_alone else 0

    def advance(self, offset: int, end: int, *, waited: bool, read_ahead: int, announce_ahead: int,
                announce_limit: Callable[[int, int], int] | None = None) -> Step:
        """The read ``[offset, end)`` was served (``waited``: one of its own storage reads waited for the device or
        network): what to prepare and announce after it. ``announce_limit(start, end)``: the file byte announcing
        stops at for the stream ``[start, end)`` — the end of its tensor unless it went on from one tensor into the
        next (asked only when announcing)."""
        with self._lock:
            last = self.last_end
            continues = self.end >= 0 and end >= self.start - STREAM_SLACK and offset <= self.end + STREAM_SLACK
            if continues:
                self.start, self.end = min(self.start, offset), max(self.end, end)
            else:  # a new stream: nothing prepared for it yet
                self.start, self.end = offset, end
                self.prepared, self.announced = Window(end), Window(end)
            self.last_end = end
            n = end - offset
            if not (n >= SEQUENTIAL_READ or (offset == last and n >= SEQUENTIAL_CONTINUATION)):
                return NOTHING
            if waited:
                self.memory_run = 0
            prepare = announce = None
            if read_ahead > 0 and not self.from_memory:
                prepare = self.prepared.extend(self.end, read_ahead)
            if announce_ahead > read_ahead and self.end - self.start >= read_ahead:
                limit = None if announce_limit is None else announce_limit(self.start, self.end)
                announce = self.announced.extend(self.end, announce_ahead - read_ahead, read_ahead, limit, whole=True)
            return Step(prepare, announce) if prepare or announce else NOTHING

    def refused(self, a: int) -> None:
        """The read-ahead queue refused the blocks from file byte ``a`` on (see ``Window.refused``)."""
        with self._lock:
            self.prepared.refused(a)
