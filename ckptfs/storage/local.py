"""The local-disk storage backend: a file read by byte ranges (``LocalFile``, a ``Blob``: from the page cache when
its pages are cached there, else straight from the disk) and a directory (``LocalFolder``, a ``Folder``).

A cold read through the page cache costs more CPU than the disk transfer itself: the kernel allocates and fills a
page per 4 KiB and copies it out again (docs/measurements.md, "Direct reads"), and the page cache ends up holding
the compressed source beside the decoded blocks and the kernel's copy of the mount's output. So
``LocalFile.read_into`` asks the kernel whether a range is cached (``cachestat``, Linux 6.5+; one system call,
which, unlike a non-blocking read, starts no read-ahead) and reads it

* with a plain ``preadv`` when every page of it is cached (a warm checkpoint costs what it did), or when ``O_DIRECT``
  cannot be used (no ``cachestat``, a file system that refuses ``O_DIRECT``, a read it rejects);
* otherwise, for a read of at least ``DIRECT_MIN_BYTES`` (a cache block's chunks, not a peek), with ``preadv`` on a
  second, ``O_DIRECT`` descriptor, over the range widened to whole ``ALIGN`` blocks, into a buffer aligned to them
  (``read_spans`` lays spans out so).

A range read directly stays out of the page cache, so the next mount reads it from the disk again (at the disk's
rate, with little CPU) instead of from memory; for checkpoints of many GB that is what the page cache could offer
anyway.

Direct reads are used on local disk file systems only (``DIRECT_FILE_SYSTEMS``, looked up in /proc/self/mountinfo):
on a network or FUSE file system the kernel's read-ahead over many requests in flight is what makes reads fast, and
tmpfs is memory already.

A direct read gets no kernel read-ahead (the caller's own read-ahead threads keep the disk busy), and ``will_need``
(``posix_fadvise(WILLNEED)``: ask the kernel to load the next bytes into the page cache) is for buffered reads only.
Both descriptors are read-only; the kernel writes dirty cached pages back before a direct read of them, so either
way the bytes are the file's. ``$CKPTFS_DIRECT_IO=0`` turns direct reads off.
"""
from __future__ import annotations

import ctypes
import errno
import os
import stat as stat_mod
from dataclasses import dataclass
from pathlib import Path

from ..env import direct_io_enabled
from .base import (Blob, Folder, FolderEntry, ShortRead, count_memory_read, count_waited_read, packed_room,
                   thread_scratch)

#: direct reads are widened and aligned to this (the largest logical block size of common disks; also the page size)
ALIGN = 4096
#: the kernel's page size, the unit ``cachestat`` counts in
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: bytes after a block read that ``will_need`` announces to the kernel
HINT_AHEAD = 8 << 20
#: a ``read_spans`` of at least this many bytes (a cache block's chunks, not a peek) that came through the page cache
#: tells the kernel that the ``HINT_AHEAD`` bytes of the file after it will be read soon (``will_need``): the
#: next chunks usually follow in the file (docs/measurements.md, "Announcing the next bytes"). Not after a read of
#: which any span came straight from the disk (its small spans, always buffered, say nothing about the page cache):
#: those bytes are not to be loaded into the page cache; nor after a read inside the range
#: announced last, whose pages are cached because it was announced: announcing on from there would turn a cold
#: read of the whole file into a buffered one (docs/measurements.md, "Announcing the next bytes").
HINT_AFTER_BYTES = 512 << 10
#: smaller reads (a peek, the chunks of a small tensor) always go through the page cache: a direct read would leave
#: them out of it, and such reads come back (every mount of a small checkpoint re-reads the same chunks)
DIRECT_MIN_BYTES = 512 << 10

#: file systems whose files are read directly when cold (local disks; ext4 is the one measured)
DIRECT_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs"})

#: ``cachestat``'s system call number, the same in the unified table of every architecture listed
_CACHESTAT_NR = 451
_CACHESTAT_MACHINES = frozenset({"x86_64", "aarch64", "arm64", "riscv64", "ppc64le", "s390x"})


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64), ("nr_writeback", ctypes.c_uint64),
                ("nr_evicted", ctypes.c_uint64), ("nr_recently_evicted", ctypes.c_uint64)]


class _PageCacheProbe:
    """``cachestat(2)`` through libc's ``syscall``; ``works`` turns False for good once the kernel says it has none."""

    def __init__(self):
        self.works = False
        self._syscall = None
        if not hasattr(os, "uname") or os.uname().machine not in _CACHESTAT_MACHINES:
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.syscall
        except (OSError, AttributeError):
            return
        fn.restype = ctypes.c_long
        self._syscall, self._number, self.works = fn, _CACHESTAT_NR, True

    def cached(self, fd: int, offset: int, length: int) -> bool | None:
        """Whether every page of ``[offset, offset + length)`` of ``fd`` is in the page cache; None: cannot tell."""
        if not self.works:
            return None
        rng, st = _Range(offset, length), _Stat()
        if self._syscall(ctypes.c_long(self._number), ctypes.c_long(fd), ctypes.byref(rng), ctypes.byref(st),
                         ctypes.c_long(0)) != 0:
            if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):  # an older kernel, or a seccomp filter
                self.works = False
            return None
        pages = -(-(offset + length) // PAGE) - offset // PAGE
        return st.nr_cache >= pages


page_cache = _PageCacheProbe()


def file_system_type(st_dev: int, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The type of the file system mounted from device ``st_dev`` (None: not found, or no /proc)."""
    want = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                head, sep, tail = line.partition(" - ")
                fields = head.split()
                if sep and len(fields) > 2 and fields[2] == want and tail.split():
                    return tail.split()[0]
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class FileIdentity:
    """What a version of a file is: device, inode, size and the modification and change times (ns)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of_stat(cls, st: os.stat_result) -> "FileIdentity":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    @classmethod
    def of_path(cls, path) -> "FileIdentity":
        """The identity of the file at ``path`` now (``OSError`` if it cannot be stat'ed)."""
        return cls.of_stat(os.stat(path))

    def difference(self, other: "FileIdentity") -> str | None:
        """How ``other`` differs from this version, in words (None when it is the same version)."""
        if (self.dev, self.ino) != (other.dev, other.ino):
            return "replaced by another file (inode changed)"
        if self.size != other.size:
            return f"size changed from {self.size} to {other.size} bytes"
        if self.mtime_ns != other.mtime_ns or self.ctime_ns != other.ctime_ns:
            return "modified in place (mtime/ctime changed)"
        return None


class LocalFile(Blob):
    """Read-only descriptors on one local file (a buffered one and, when allowed, an ``O_DIRECT`` one)."""

    def __init__(self, path: str, fd: int | None = None):
        """``path`` opened for reading, or ``fd`` (a descriptor on it the caller opened under its own rules, such as
        a confined open: this object owns it from now on)."""
        self.name = os.fsdecode(path)
        self.file = open(path if fd is None else fd, "rb", buffering=0)  # noqa: SIM115 (lives as long as its readers)
        self.fd = self.file.fileno()
        self.direct_fd: int | None = None  # the O_DIRECT descriptor while direct reads are used
        self._owned_fd: int | None = None  # the O_DIRECT descriptor, closed with this object
        self._hinted = (0, 0)  # the file range last announced with ``will_need``
        self._fetched = (0, 0)  # consecutive announced ranges that were not all in the page cache when announced
        st = os.fstat(self.fd)
        self._version = FileIdentity.of_stat(st)
        if (direct_io_enabled() and hasattr(os, "O_DIRECT") and page_cache.cached(self.fd, 0, 1) is not None
                and file_system_type(st.st_dev) in DIRECT_FILE_SYSTEMS):
            try:
                self._owned_fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError:  # a file system without O_DIRECT (e.g. an old tmpfs)
                pass
            else:
                a, b = os.fstat(self.fd), os.fstat(self._owned_fd)
                if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):  # else the path was replaced in between
                    self.direct_fd = self._owned_fd

    @property
    def size(self) -> int:
        return self._version.size

    @property
    def version(self) -> FileIdentity:
        return self._version

    def current_version(self) -> FileIdentity:
        return FileIdentity.of_path(self.name)

    def read_spans(self, spans, scratch, hint: bool = True) -> tuple:
        """Read the file ranges ``spans`` (``(offset, end)`` each) into one buffer of ``scratch(size)`` (page-aligned):
        ``(buffer, position of each span's first byte)``. A span of at
        least ``DIRECT_MIN_BYTES`` gets a slot of whole ``ALIGN`` blocks (it may be read directly); smaller ones are
        packed, so the buffer outgrows the bytes read by at most ``2 * ALIGN`` per large span, whatever the spans.
        With ``hint``, a read of ``HINT_AFTER_BYTES`` or more through the page cache (no span of it read directly),
        and not inside the range announced last, announces the bytes after it (``will_need``). Raises ``ShortRead``
        when the file ends inside a span."""
        spans, slots, total = list(spans), [], 0
        for lo, end in spans:
            if end - lo >= DIRECT_MIN_BYTES:
                total = -(-total // ALIGN) * ALIGN
                a = lo - lo % ALIGN
                slots.append((total, a, -(-(end - a) // ALIGN) * ALIGN))
            else:
                slots.append((total, lo, end - lo))
            total += slots[-1][2]
        buf = scratch(total)
        mv, starts, from_disk = memoryview(buf), [], False
        for k, ((at, a, n), (lo, end)) in enumerate(zip(slots, spans)):
            got, direct = self.read_into(mv[at:at + n], a, end - a)
            if got < end - a:
                raise ShortRead(k, max(0, got - (lo - a)))
            from_disk |= direct
            starts.append(at + lo - a)
        if hint and not from_disk and sum(end - lo for lo, end in spans) >= HINT_AFTER_BYTES:  # all buffered
            first, last = min(lo for lo, _ in spans), max(end for _, end in spans)
            if not self._hinted[0] <= first < last <= self._hinted[1]:  # cached of its own accord, not as announced
                self.will_need(last)
        return buf, starts

    def read_packed(self, spans, out: memoryview, hint: bool = True) -> None:
        """``Blob.read_packed``: a span read directly (``read_into``: large, its pages not cached) goes through an
        aligned buffer of the thread's and is copied in; every other span is read through the page cache straight
        into ``out`` (a copy of each block less: docs/measurements.md, "Region reads: a mapping per block"). The
        bytes after are announced as ``read_spans`` does."""
        spans, out, packed = packed_room(spans, out)
        from_disk = False
        for k, ((lo, end), pos) in enumerate(zip(spans, packed)):
            n = end - lo
            cached = page_cache.cached(self.fd, lo, n) if self.direct_fd is not None and n >= DIRECT_MIN_BYTES else None
            if cached is False:
                buf, at = self.read_spans([(lo, end)], lambda size: thread_scratch("packed", size), hint=False)
                out[pos:pos + n] = memoryview(buf)[at[0]:at[0] + n]
                from_disk = True
            else:
                if cached and not self._fetched[0] <= lo < self._fetched[1]:  # as ``read_into`` counts it
                    count_memory_read()
                got = 0
                while got < n:  # a buffered read returns fewer bytes only at the end of the file
                    step = os.preadv(self.fd, [out[pos + got:pos + n]], lo + got)
                    if step <= 0:
                        raise ShortRead(k, got)
                    got += step
        if hint and not from_disk and len(out) >= HINT_AFTER_BYTES:
            first, last = min(lo for lo, _ in spans), max(end for _, end in spans)
            if not self._hinted[0] <= first < last <= self._hinted[1]:
                self.will_need(last)

    def read_into(self, view: memoryview, offset: int, need: int) -> tuple[int, bool]:
        """Read the file from ``offset`` into ``view``: ``(bytes read, whether directly)``; fewer than ``need`` only
        at the end of the file. ``offset`` and the view's address and length must be ``ALIGN``-aligned (a direct read
        fills the whole view, up to the end of the file); a buffered read reads ``need`` bytes."""
        dfd = self.direct_fd
        cached = page_cache.cached(self.fd, offset, need) if dfd is not None and need >= DIRECT_MIN_BYTES else None
        if cached is False:
            try:
                got = os.preadv(dfd, [view], offset)
                count_waited_read()
                return got, True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._no_direct()  # alignment this device does not take: buffered from now on
        elif cached and not self._fetched[0] <= offset < self._fetched[1]:  # cached before, not as announced
            count_memory_read()
        return os.preadv(self.fd, [view[:need]], offset), False

    def _no_direct(self) -> None:
        """Stop reading directly. The descriptor stays open until the file is dropped: another thread may be inside
        a read of it, and a closed number could be reused by an unrelated open file."""
        self.direct_fd = None

    def read_scattered(self, spans, scratch, gap: int | None = None) -> tuple:
        """``read_spans`` for small ranges far apart (a peek's rows in each chunk of a row of chunks): every range is
        announced to the kernel first, so that the disk reads them together instead of one after the other
        (docs/measurements.md, "Scattered reads")."""
        spans = list(spans)
        if len(spans) > 1:
            for lo, end in spans:
                hint_will_need(self.fd, lo, end - lo)
        return self.read_spans(spans, scratch, hint=False)

    def will_need(self, offset: int, length: int | None = None, announced: bool = True) -> None:
        """Announce ``[offset, offset + length)`` (None: ``HINT_AHEAD``) to the kernel, minus what the last announcement
        covered.

        The kernel walks its page cache over the whole range on every call (docs/measurements.md, "Announcing the
        next bytes"), so consecutive blocks announce only the new part, and only once at least half a window is new.
        Best effort:
        readers racing on ``_hinted`` at worst announce a range twice."""
        lo, hi = self._hinted
        window = HINT_AHEAD if length is None else length
        end = offset + window
        if lo <= offset <= hi:  # continues the announced range
            if end - hi < window // 2:
                return
            start = hi
        else:
            start = lo = offset
        self._hinted = (lo, end)
        if self.direct_fd is not None and not page_cache.cached(self.fd, start, end - start):
            a, b = self._fetched  # pages cached from now on are there because they were announced
            self._fetched = (a if a <= start <= b else start, end)
        hint_will_need(self.fd, start, end - start)

    def close(self) -> None:
        f = getattr(self, "file", None)
        if f is not None:
            f.close()
            self.fd = -1  # a read after close fails (EBADF) instead of reading a file that reuses the number
        owned, self._owned_fd, self.direct_fd = getattr(self, "_owned_fd", None), None, None
        if owned is not None:
            os.close(owned)

    __del__ = close


def open_if_regular(path) -> LocalFile | None:
    """The file at ``path`` (links followed) as a ``LocalFile`` when it is a regular file; None when it is anything
    else (a FIFO is not waited on: the open does not block); ``OSError`` when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block the open
    try:
        regular = stat_mod.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        return None
    return LocalFile(path, fd=fd)  # owns the descriptor from here


def hint_will_need(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start reading ``[offset, offset + length)`` of ``fd`` into its page cache (best effort)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        try:
            advise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass


def within(real: str, roots) -> bool:
    """Whether the real path ``real`` is one of the real folders ``roots`` or inside one."""
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def _entry(name: str, st: os.stat_result) -> FolderEntry:
    return FolderEntry(name, stat_mod.S_ISREG(st.st_mode), st.st_size, st.st_mtime_ns, FileIdentity.of_stat(st))


class LocalFolder(Folder):
    """A local directory: entries listed with ``scandir`` and stat'ed through links, opened as ``LocalFile``s.

    What the directory names is untrusted: an entry that is a symbolic link leading (links resolved) outside the
    directory and the ``allowed`` folders is listed with the reason it is ``refused``, never as the file it names."""

    def __init__(self, path, allowed=()):
        self.path = Path(path)
        self.name = str(self.path)
        self.roots = (os.path.realpath(self.path),) + tuple(os.path.realpath(a) for a in allowed)

    def _refused(self, de_path: str) -> str | None:
        real = os.path.realpath(de_path)
        if within(real, self.roots):
            return None
        hint = "" if len(self.roots) > 1 else f" (give --allow-external {os.path.dirname(real)} to serve it)"
        return f"a symbolic link to {real}, outside {self.path}: not served{hint}"

    def _entry_of(self, name: str, st: os.stat_result, link: bool) -> FolderEntry:
        entry = _entry(name, st)
        why = self._refused(str(self.path / name)) if link else None
        return entry if why is None else FolderEntry(name, False, st.st_size, st.st_mtime_ns, entry.version, why)

    def entries(self, match=None) -> list:
        out = []
        with os.scandir(self.path) as it:
            for de in it:
                if match is not None and not match(de.name):
                    continue
                try:
                    st = de.stat()  # follows links: a checkpoint may be a link to its file
                except OSError:
                    continue  # deleted since listed, or a dangling link
                out.append(self._entry_of(de.name, st, de.is_symlink()))
        return out

    def stat(self, name: str) -> FolderEntry | None:
        try:
            return self._entry_of(name, os.stat(self.path / name), os.path.islink(self.path / name))
        except OSError:
            return None

    def open(self, name: str) -> LocalFile:
        return LocalFile(str(self.path / name))

    def read_text(self, name: str, limit: int = 1 << 16) -> str:
        """A regular file's text (links followed); ``OSError`` for anything else (a FIFO is refused, not waited on)."""
        path = self.path / name
        blob = open_if_regular(path)
        if blob is None:
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        try:
            return blob.read(0, limit).decode("utf-8", "replace")
        finally:
            blob.close()

    def folder(self, name: str) -> "LocalFolder":
        return LocalFolder(self.path / name)
