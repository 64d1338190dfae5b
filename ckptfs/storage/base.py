"""The storage interface: where a checkpoint's bytes live, as the layers above read them.

Two kinds of thing, each one declared here and implemented once per backend (``local.py``: files on a local disk):

* ``Blob`` — one object read by byte ranges: a checkpoint file, an external tensor file. It has an exact ``size``,
  a ``version`` taken when it was opened (compared with ``current_version()`` to see that it changed underneath), a
  ``name`` to show in messages (never a secret: no credentials, no signed query), and reads: ``read_into`` one
  range into a caller's buffer, ``read_spans`` several ranges into one scratch buffer, ``read_scattered`` the same
  for small ranges far apart, ``will_need`` to announce what comes next. Nothing here assumes a file descriptor:
  a backend keeps its own tricks (``O_DIRECT``, ``cachestat``, ranged GETs in parallel) behind these methods.
* ``Folder`` — a directory or an object prefix (a ``model_dir``): its entries listed with their size, mtime and
  version, each one stat'ed, opened as a ``Blob`` or read as a small text (a ``latest`` pointer).

A backend that waits for a device or the network on a read (a read straight from the disk, a GET) says so with
``count_waited_read()``: the read-ahead (``ckptfs.tensor.readahead``) runs a second worker while blocks wait
(``waited_reads``, the hook it is given). A read the backend knows was served from memory says so with
``count_memory_read()``: a reader's cursor whose blocks come from memory alone computes nothing ahead
(``memory_reads``; the decision is the cursor's, ``ckptfs.layouts.cursor``).

Adding a backend is one module in this package implementing both classes (docs/architecture.md, "Layers").
"""
from __future__ import annotations

import errno
import mmap
import os
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable


class ShortRead(Exception):
    """The blob ends inside span ``k`` of a ``read_spans``: only ``got`` of its bytes are there."""

    def __init__(self, k: int, got: int):
        super().__init__(f"span {k}: {got} bytes")
        self.k, self.got = k, got


_this_thread = threading.local()


def count_waited_read() -> None:
    """Count one read of the calling thread that waited for the device or network (not served from memory)."""
    _this_thread.waited = waited_reads() + 1


def waited_reads() -> int:
    """How many reads the calling thread made that waited for the device or network (``count_waited_read``)."""
    return getattr(_this_thread, "waited", 0)


def count_memory_read() -> None:
    """Count one read of the calling thread known to be served from memory (the kernel said every page was cached)."""
    _this_thread.memory = memory_reads() + 1


def memory_reads() -> int:
    """How many reads the calling thread made that were known to be served from memory (``count_memory_read``)."""
    return getattr(_this_thread, "memory", 0)


def page_aligned(n: int) -> mmap.mmap:
    """A scratch buffer for ``read_spans`` whose start is page-aligned (a span read straight from the disk needs one)."""
    return mmap.mmap(-1, max(n, 1))


#: a thread's scratch buffer larger than this is not kept for its next read
KEEP_SCRATCH_BYTES = 64 << 20
#: the threads whose scratch buffers are kept, the latest to come first (a FUSE server's, its decoding pool's and
#: read-ahead's are a few dozen): an older thread that reads again gets new ones
KEEP_SCRATCH_THREADS = 64


class _ThreadScratch:
    """Each thread's scratch buffers by name, keyed by the thread's native id: a thread that libfuse started has a
    Python thread state only while it runs a callback, so a ``threading.local`` would lose its buffers after every read
    it serves (docs/measurements.md, "S3: scratch buffers of the FUSE threads"). The buffers of the
    ``KEEP_SCRATCH_THREADS`` threads that came last are kept; a thread let go of keeps the buffer it holds until it
    drops it. A read takes no lock: only a thread's first read does, to add it."""

    def __init__(self):
        self._by_thread: dict = {}  # native thread id -> {name: buffer}, in the order the threads came
        self._lock = threading.Lock()

    def get(self, name: str, n: int) -> mmap.mmap:
        tid = threading.get_native_id()
        buffers = self._by_thread.get(tid)
        if buffers is None:
            with self._lock:
                buffers = self._by_thread.setdefault(tid, {})
                while len(self._by_thread) > KEEP_SCRATCH_THREADS:
                    del self._by_thread[next(iter(self._by_thread))]
        buf = buffers.get(name)  # only this thread touches its own buffers
        if buf is not None and len(buf) >= n:
            return buf
        buf = page_aligned(n)
        if n <= KEEP_SCRATCH_BYTES:
            buffers[name] = buf
        return buf


_scratch = _ThreadScratch()


def _after_fork() -> None:
    """A forked child has none of the parent's threads (and a lock one of them held would stay held): fresh buffers."""
    global _scratch
    _scratch = _ThreadScratch()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def thread_scratch(name: str, n: int) -> mmap.mmap:
    """The calling thread's page-aligned scratch buffer ``name`` of at least ``n`` bytes, kept for its next read (up
    to ``KEEP_SCRATCH_BYTES``): a fresh mapping for every read pays its page faults every time (docs/measurements.md,
    "Region reads: a mapping per block"). Its bytes are the caller's only until the thread's next use of ``name``."""
    return _scratch.get(name, n)


def packed_room(spans: Iterable, out) -> tuple:
    """``(spans as int pairs, out as bytes, where each span starts in out)`` for ``Blob.read_packed``; ``ValueError``
    unless ``out`` holds exactly the spans' bytes."""
    spans = [(int(lo), int(end)) for lo, end in spans]
    out = memoryview(out).cast("B")
    packed, total = [], 0
    for lo, end in spans:
        packed.append(total)
        total += end - lo
    if len(out) != total:
        raise ValueError(f"{len(out)} bytes of room for {total} bytes of spans")
    return spans, out, packed


class Blob(ABC):
    """One stored object read by byte ranges (see the module docstring). Thread-safe: readers share one."""

    #: what messages call it: a path, ``s3://bucket/key`` — never a credential
    name: str

    @property
    @abstractmethod
    def size(self) -> int:
        """Its size in bytes when it was opened."""

    @property
    @abstractmethod
    def version(self) -> Hashable:
        """What identifies the version that was opened (equal to ``current_version()`` while it is unchanged)."""

    @abstractmethod
    def current_version(self) -> Hashable:
        """The version stored now (``OSError`` when it is gone or cannot be asked)."""

    @abstractmethod
    def read_into(self, view: memoryview, offset: int, need: int) -> tuple[int, bool]:
        """Read ``need`` bytes from ``offset`` into ``view``: ``(bytes read, whether the read waited for the
        device)``; fewer than ``need`` only at the end of the blob. ``view`` may be longer than ``need`` (a backend
        may fill it whole, up to the end of the blob)."""

    def read_spans(self, spans: Iterable, scratch: Callable[[int], object], hint: bool = True) -> tuple:
        """Read the ranges ``spans`` (``(offset, end)`` each) into one buffer of ``scratch(size)``: ``(buffer,
        position of each span's first byte in it)``. Raises ``ShortRead`` when
        the blob ends inside a span. ``hint``: the backend may announce the bytes after the spans (``will_need``).
        This default packs the spans and reads them one by one; a backend lays them out as its reads need."""
        spans = list(spans)
        total = sum(end - lo for lo, end in spans)
        buf = scratch(total)
        mv, starts, at = memoryview(buf), [], 0
        for k, (lo, end) in enumerate(spans):
            got, _ = self.read_into(mv[at:at + end - lo], lo, end - lo)
            if got < end - lo:
                raise ShortRead(k, got)
            starts.append(at)
            at += end - lo
        return buf, starts

    def read_packed(self, spans: Iterable, out: memoryview, hint: bool = True) -> None:
        """Read the ranges ``spans`` end to end into ``out`` (exactly their total size): a tensor's rows straight into
        the block that holds them. Raises ``ShortRead`` when the blob ends inside a span. This default reads through
        ``read_spans`` into ``out`` itself when the backend packs the spans (no copy), else copies each span in; a
        backend whose reads need buffers of their own (a direct read's alignment) reads the others straight in."""
        spans, out, packed = packed_room(spans, out)
        total = len(out)
        buf, starts = self.read_spans(spans, lambda n: out if n == total else thread_scratch("packed", n), hint)
        if buf is out:
            if starts == packed:
                return
            buf = bytes(out)  # laid out in another order: moved within ``out`` it would overwrite what it moves
        src = memoryview(buf).cast("B")
        for (lo, end), a, b in zip(spans, starts, packed):
            out[b:b + end - lo] = src[a:a + end - lo]

    def read(self, offset: int, n: int) -> bytes:
        """``n`` bytes from ``offset`` as ``bytes``, fewer only at the end of the blob (for metadata: headers, a zip
        directory); ``OSError`` when the blob ends before its size says."""
        n = max(0, min(n, self.size - offset))
        if n == 0:
            return b""
        try:
            buf, starts = self.read_spans([(offset, offset + n)], page_aligned, hint=False)
        except ShortRead as e:
            raise OSError(errno.EIO, f"{self.name} ends {n - e.got} bytes early") from None
        return bytes(memoryview(buf)[starts[0]:starts[0] + n])

    def read_scattered(self, spans: Iterable, scratch: Callable[[int], object], gap: int | None = None) -> tuple:
        """``read_spans`` for small ranges far apart (a peek's rows in each chunk of a row of chunks, HDF5 metadata
        fetched ahead): a backend may issue them together rather than one after the other. ``gap``: ranges at least
        this far apart are not read as one (None: the backend's own choice)."""
        return self.read_spans(spans, scratch, hint=False)

    def will_need(self, offset: int, length: int | None = None, announced: bool = True) -> None:
        """Announce that the ``length`` bytes from ``offset`` on (None: as many as the backend reads ahead by itself)
        will be read soon: a backend may start fetching them. Never waits. ``announced=False``: they continue what a
        reader's stream is reading in this blob (a backend holding back announcements after some were not read
        fetches these all the same)."""

    def close(self) -> None:
        """Release what the blob holds (descriptors, connections); reads after ``close`` fail."""


@dataclass(frozen=True)
class FolderEntry:
    """One entry of a ``Folder``, as one listing saw it."""

    name: str
    is_file: bool  # a regular file (a link is followed); False for a directory or anything else
    size: int = 0
    mtime_ns: int = 0
    version: Hashable = None  # changes whenever the entry's content does (as ``Blob.version``)
    refused: str | None = None  # why it is not served although it exists (a link leading out of the folder)


class Folder(ABC):
    """A directory or an object prefix whose entries can be listed, stat'ed, opened and read (see the module
    docstring)."""

    #: what messages call it (never a credential)
    name: str

    @abstractmethod
    def entries(self, match: Callable[[str], bool] | None = None) -> list:
        """``FolderEntry`` of every entry directly in the folder whose name ``match`` accepts (all without
        ``match``; a backend may stat only those); ``OSError`` when the folder cannot be listed."""

    @abstractmethod
    def stat(self, name: str) -> FolderEntry | None:
        """The entry called ``name`` now (links followed), or None when there is none."""

    @abstractmethod
    def open(self, name: str) -> Blob:
        """The entry called ``name`` as a ``Blob`` (``OSError`` when it cannot be opened)."""

    @abstractmethod
    def read_text(self, name: str, limit: int = 1 << 16) -> str:
        """The entry ``name`` as UTF-8 text (undecodable bytes replaced), at most ``limit`` bytes of it."""

    @abstractmethod
    def folder(self, name: str) -> "Folder":
        """The sub-folder ``name`` (which need not exist: listing it then fails)."""
