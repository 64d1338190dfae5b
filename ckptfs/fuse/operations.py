"""The thin FUSE adapter: mfusepy operations serving a ``Tree`` (``ckptfs/tree/base.py``) read-only, in page-cache
mode.

All the logic (paths, sizes, inodes, bytes) lives in the tree; this module only translates FUSE calls and
errors. Choices (docs/measurements.md, "FUSE server"): libfuse 3 loaded explicitly, no ``direct_io``
(mmap must work), ``kernel_cache`` and long attr/entry timeouts (the tree is immutable), ``st_blksize`` 1 MiB,
one loop thread for a local checkpoint and libfuse's multi-threaded loop for one in object storage (``loop_threads``: a
read waiting for the endpoint must not hold up the other files), reads filled straight into libfuse's reply buffer
(``ReadIntoFUSE``), glibc malloc thresholds pinned, a 2 MiB read-ahead when allowed. A failing read logs one line naming
the file and the problem (once per file) and returns EIO; every write-ish operation returns EROFS.

mfusepy is imported lazily (``load_mfusepy``) because it raises at import time when libfuse is missing.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import sys
import threading
from ctypes.util import find_library

from .. import env
from ..errors import CkptfsError, SourceChangedError
from ..tree.base import BLKSIZE, NAME_MAX, Tree, TreeEntry, VirtualPathError
from ..tree.memory import announce_window

log = logging.getLogger("ckptfs.fuse")

#: kernel cache lifetimes in seconds for a checkpoint tree, which never changes while mounted
CACHE_TIMEOUT = 86400
#: the kernel's read-ahead on a mounted file (``max_readahead`` at init, and the mount's bdi ``read_ahead_kb`` when we
#: may write it): requests stay 1 MiB (libfuse's largest), but a page fault of a memory-mapped file reads this much
#: around it (docs/measurements.md, "Kernel read-ahead on the mount")
READ_AHEAD_KB = 2048
#: bytes after a sequential read the server prepares in its read-ahead thread (``ckptfs.tensor.readahead``)
SERVER_READ_AHEAD = 4 << 20
#: bytes after a sequential read whose storage is asked to fetch ahead (an S3 object's parts; without it a cp from S3
#: waited for each tensor's first part: docs/measurements.md, "S3: fetching across objects")
SERVER_ANNOUNCE_AHEAD = 64 << 20
#: libfuse 3 ``fuse_readdir_flags`` / ``fuse_fill_dir_flags`` bits
_FUSE_READDIR_PLUS = 1
_FUSE_FILL_DIR_PLUS = 2
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


class FuseUnavailableError(CkptfsError):
    """libfuse or mfusepy cannot be loaded; the message says what to install."""


#: the message of a libfuse that cannot be loaded ({}: why)
_NO_LIBFUSE = ("cannot load libfuse ({}): install fuse3 (Debian/Ubuntu: apt install fuse3; Fedora: dnf install fuse3) "
               "and make /dev/fuse usable")


#: sonames of libfuse 3 (3.17 moved to .so.4), tried with a plain dlopen before asking ``ldconfig``
LIBFUSE3_SONAMES = ("libfuse3.so.4", "libfuse3.so.3")


def libfuse3_path() -> str | None:
    """What to load libfuse 3 by: a soname the dynamic linker opens as it is (one ``dlopen``, no subprocess), else
    ``ctypes.util.find_library("fuse3")`` (which runs ``ldconfig -p``: ~10 ms warm, more on a cold disk), else None."""
    for name in LIBFUSE3_SONAMES:
        try:
            ctypes.CDLL(name)
        except OSError:
            continue
        return name
    return find_library("fuse3")


def check_fuse() -> None:
    """Raise ``FuseUnavailableError`` if mfusepy or libfuse is missing, without importing mfusepy (the mount
    command's early check; the server imports it and reports anything else through its status pipe)."""
    from importlib.util import find_spec

    if find_spec("mfusepy") is None:
        raise FuseUnavailableError(None, "mfusepy is not installed: pip install 'mfusepy~=3.1'")
    if not (env.fuse_library_chosen() or libfuse3_path() or find_library("fuse")):
        raise FuseUnavailableError(None, _NO_LIBFUSE.format("libfuse not found"))


def load_mfusepy():
    """Import mfusepy, preferring libfuse 3 (``FUSE_LIBRARY_PATH`` set to it when it is installed, unless the user
    chose a library with ``FUSE_LIBRARY_PATH`` or ``FUSE_LIBRARY_NAME``)."""
    if "mfusepy" in sys.modules:
        return sys.modules["mfusepy"]
    if not env.fuse_library_chosen():
        path = libfuse3_path()
        if path:
            env.choose_fuse_library(path)
    try:
        import mfusepy
    except OSError as e:
        raise FuseUnavailableError(None, _NO_LIBFUSE.format(e)) from e
    except ImportError as e:
        raise FuseUnavailableError(None, f"mfusepy is not installed ({e}): pip install 'mfusepy~=3.1'") from e
    return mfusepy


def pin_malloc(one_arena: bool = False) -> bool:
    """Stop glibc from trimming/refaulting the heap on every 1 MiB reply; ``one_arena``: the threads started from now
    on allocate from the arenas there are instead of one more each (libfuse's loop threads, whose freed blocks
    another thread's arena would not reuse: docs/measurements.md, "S3: scratch buffers of the FUSE threads"). Best
    effort; False if not glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # 32 MiB is the largest mmap threshold glibc accepts on 64-bit; trimming only above 512 MiB of free heap
    ok = mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1
    if one_arena:
        ok = mallopt(_M_ARENA_MAX, 1) == 1 and ok
    return (mallopt(_M_TRIM_THRESHOLD, 512 << 20) == 1) and ok


def trim_memory() -> bool:
    """Give the memory freed while the tree was built back to the system (``malloc_trim``; with the trim threshold
    ``pin_malloc`` sets, glibc would otherwise keep it for good). Best effort; False if not glibc."""
    import gc

    gc.collect()
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def _erofs(*_args, **_kw):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS))


def _oserror(code: int) -> OSError:
    return OSError(code, os.strerror(code))  # what mfusepy's FuseOSError is; any errno > 0 reaches the caller


class CkptfsOperations:
    """mfusepy ``Operations`` over a ``Tree``. Every public attribute is a FUSE op: private state is ``_x``."""

    use_ns = True  # times are int nanoseconds (read by mfusepy, not an operation)

    def __init__(self, tree: Tree, mount_target: str | None = None, *, uid: int | None = None,
                 gid: int | None = None):
        self._tree = tree
        self._mount_target = mount_target  # see mount_target(); never stat'ed from inside a callback
        self._uid = os.getuid() if uid is None else uid
        self._gid = os.getgid() if gid is None else gid
        self._failed: set = set()
        self._lock = threading.Lock()

    # -- helpers ------------------------------------------------------------------------------------
    def _entry(self, path: str) -> TreeEntry:
        try:
            return self._tree.lookup(path)
        except VirtualPathError as e:
            raise _oserror(e.errno) from None

    def _stat(self, e: TreeEntry) -> dict:
        a = self._tree.attr(e)
        return {"st_mode": a.mode, "st_ino": a.ino, "st_nlink": a.nlink, "st_size": a.size,
                "st_uid": self._uid, "st_gid": self._gid, "st_blksize": a.blksize, "st_blocks": a.blocks,
                "st_mtime": a.mtime_ns, "st_ctime": a.mtime_ns, "st_atime": a.mtime_ns}

    def _report(self, e: TreeEntry, err: BaseException) -> None:
        """Log the first failure of each file as one line; later ones only at debug level. A source that changed
        under the mount is said once for the whole mount (every file reading it then fails the same way)."""
        path = "/" + e.path
        msg = " ".join(str(err).split()) or type(err).__name__
        if not isinstance(err, CkptfsError):
            msg = f"{type(err).__name__}: {msg}"
        changed = isinstance(err, SourceChangedError)
        with self._lock:
            first = (err.path if changed else path) not in self._failed
            self._failed.add(err.path if changed else path)
        if first and changed:
            log.error("source changed: %s (reads that need its data return EIO until remounted)", msg)
        elif first:
            log.error("read error in %s: %s (reads of this file return EIO)", path, msg)
        log.debug("read error in %s", path, exc_info=err)

    # -- read-only operations ---------------------------------------------------------------------------
    def getattr(self, path, fh=None):
        if fh:  # an open file: what its handle serves (its path may be gone from a live tree)
            try:
                return self._stat(self._tree.entry_by_handle(fh))
            except VirtualPathError:
                pass
        try:
            return self._stat(self._entry(path))
        except OSError:  # fstat() comes without a handle: a file still open here keeps its attributes
            e = self._tree.open_entry(path)
            if e is None:
                raise
            return self._stat(e)

    def readdir(self, path, fh):
        return [name if attrs is None else (name, attrs, 0) for _, name, attrs in self.readdir_plus(path, fh)]

    def readdir_plus(self, path, fh, start: int = 0) -> list:
        """``(position, name, stat)`` of ``path``'s entries after position ``start`` (positions count from 1:
        ``.``, ``..``, then the children in order; ``..`` has no stat: libfuse fills it). Not a FUSE operation
        name: ``ReadIntoFUSE.readdir_fuse_3`` calls it for READDIRPLUS, ``readdir`` for plain READDIR."""
        e = self._entry(path)
        if not e.is_dir:
            raise _oserror(errno.ENOTDIR)
        out = [(1, ".", self._stat(e)), (2, "..", None)][start:]
        try:
            children = e.children  # a folder built on demand (a run's checkpoint) may fail: its errno, not EINVAL
        except VirtualPathError as err:
            raise _oserror(err.errno) from None
        for pos in range(max(start, 2) + 1, len(children) + 3):
            name = children[pos - 3]
            try:
                c = self._tree.lookup(f"{e.path}/{name}")
            except VirtualPathError:  # gone since listed (a live tree)
                continue
            out.append((pos, name, self._stat(c)))
        return out

    def access(self, path, amode):
        self._entry(path)
        if amode & os.W_OK:
            raise _oserror(errno.EROFS)
        return 0

    def open(self, path, flags):
        e = self._entry(path)
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise _oserror(errno.EROFS)
        if e.is_dir:
            raise _oserror(errno.EISDIR)
        try:
            fh = self._tree.open(e)  # the handle keeps reading what it was opened on until release
        except VirtualPathError as err:
            raise _oserror(err.errno) from None
        try:
            self._tree.opened(e)  # a tree in object storage fetches the file's tensors ahead
        except Exception as err:  # a hint: the file's reads say what is wrong, if anything
            log.debug("announcing %s failed: %s", path, err)
        return fh

    def read(self, path, size, offset, fh):
        return self._serve(path, fh, lambda e, cursor: self._tree.read(e, offset, size, cursor))

    def readinto(self, path, out, offset, fh) -> int:
        """``read`` into libfuse's reply buffer ``out`` (``ReadIntoFUSE.read``; not a FUSE operation name)."""
        return self._serve(path, fh, lambda e, cursor: self._tree.readinto(e, offset, out, cursor))

    def _serve(self, path, fh, reader):
        """``reader(entry, cursor)`` for the open handle ``fh`` and its cursor (or ``path``, without one); any failure
        is EIO for this read only."""
        try:
            if fh:
                h = self._tree.handle(fh)
                e, cursor = h.entry, h.cursor
            else:
                e, cursor = self._tree.lookup(path), None
        except VirtualPathError:
            raise _oserror(errno.EBADF) from None
        try:
            return reader(e, cursor)
        except Exception as err:  # never wrong bytes
            self._report(e, err)
            raise _oserror(errno.EIO) from None

    def release(self, path, fh):
        self._tree.release(fh)
        return 0

    def readlink(self, path):
        try:
            return self._tree.readlink(path)
        except VirtualPathError as e:
            raise _oserror(e.errno) from None

    def statfs(self, path):
        frsize = 4096
        return {"f_bsize": BLKSIZE, "f_frsize": frsize, "f_blocks": -(-self._tree.total_size // frsize),
                "f_bfree": 0, "f_bavail": 0, "f_files": self._tree.node_count, "f_ffree": 0,
                "f_favail": 0, "f_namemax": NAME_MAX}

    def init_with_config(self, conn, config):
        """Ask for ``READ_AHEAD_KB`` of read-ahead (libfuse 3 then sends 1 MiB requests); best effort, never raises."""
        try:
            if conn is not None and hasattr(conn, "max_readahead"):
                conn.max_readahead = READ_AHEAD_KB << 10
            if self._mount_target:
                raise_read_ahead(self._mount_target)
            log.info("serving %s", self._mount_target)
        except Exception:
            log.debug("could not raise read-ahead", exc_info=True)

    # -- everything that would modify the tree ------------------------------------------------------
    write = create = mkdir = mknod = unlink = rmdir = rename = truncate = _erofs
    chmod = chown = symlink = link = setxattr = removexattr = utimens = fallocate = _erofs


def unescape_mount_path(s: str) -> str:
    """Undo the octal escapes (``\\040`` for a space) of paths in /proc/mounts and /proc/self/mountinfo."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def mount_target(mountpoint) -> str:
    """The path /proc/self/mountinfo lists for ``mountpoint``, computed without touching the mount point itself
    (its parent is resolved; resolving the mount point would send a request to our own, maybe busy, server)."""
    p = os.path.abspath(str(mountpoint))
    return os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))


def mount_device(target: str) -> str | None:
    """``major:minor`` of the filesystem mounted at ``target`` (a ``mount_target`` path; reads only /proc)."""
    dev = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 4 and unescape_mount_path(parts[4]) == target:
                    dev = parts[2]
    except OSError:
        return None
    return dev


def raise_read_ahead(target: str) -> bool:
    """Set the bdi read-ahead of the mount at ``target`` (a ``mount_target`` path) to ``READ_AHEAD_KB`` when we may
    (root).

    Safe inside the server's own callbacks: it reads /proc and writes /sys only. True if done."""
    dev = mount_device(target)
    if not dev:
        return False
    ra = f"/sys/class/bdi/{dev}/read_ahead_kb"
    if not os.access(ra, os.W_OK):
        return False
    with open(ra, "w") as f:
        f.write(str(READ_AHEAD_KB))
    log.debug("read-ahead of %s set to %d KiB", target, READ_AHEAD_KB)
    return True


def fuse_class(fuse):
    """mfusepy's ``FUSE`` with a ``read`` that fills libfuse's reply buffer in place: the operations'
    ``readinto(path, out, offset, fh)`` writes the bytes straight into it (no ``bytes`` object, no second copy)."""

    class ReadIntoFUSE(fuse.FUSE):
        def readdir_fuse_3(self, path, buf, filler, offset, fip, flags):
            """READDIRPLUS: hand libfuse each entry's whole stat with ``FUSE_FILL_DIR_PLUS`` and its position
            (libfuse 3.14 sends the kernel the attributes only for entries filled with a non-zero offset), so the
            kernel caches the entries and their attributes from the listing instead of sending one LOOKUP per
            entry. A listing larger than the reply continues at ``offset``, the position of the last entry sent."""
            if not flags & _FUSE_READDIR_PLUS:
                return super().readdir_fuse_3(path, buf, filler, offset, fip, flags)
            name = None if path is None else path.decode(self.encoding, self.errors)
            st = fuse.c_stat()
            for pos, entry, attrs in self.operations.readdir_plus(name, fip.contents.fh, offset):
                if attrs is None:
                    full = filler(buf, entry.encode(self.encoding, self.errors), None, pos, 0)
                else:
                    ctypes.memset(ctypes.byref(st), 0, ctypes.sizeof(st))
                    fuse.set_st_attrs(st, attrs, use_ns=self.use_ns)
                    full = filler(buf, entry.encode(self.encoding, self.errors), st, pos, _FUSE_FILL_DIR_PLUS)
                if full != 0:
                    break
            return 0

        def read(self, path, buf, size, offset, fip):
            if size <= 0:
                return 0
            out = memoryview((ctypes.c_char * size).from_address(ctypes.addressof(buf.contents))).cast("B")
            name = None if path is None else path.decode(self.encoding, self.errors)
            return self.operations.readinto(name, out, offset, fip.contents.fh)

    return ReadIntoFUSE


def loop_threads(tree: Tree, chosen: bool | None = None) -> bool:
    """Whether the server runs libfuse's multi-threaded loop for ``tree``: ``chosen`` when the user chose
    (``$CKPTFS_FUSE_THREADS``), else when the tree's tensors are in object storage (``cache.remote``).

    With one loop thread every request waits for the one before it: a read waiting for a silent endpoint (up to the
    client's timeouts) held up ``README.txt``, ``stat``, ``ls`` and every other file of the mount. In the
    multi-threaded loop a read that waits holds one worker thread and libfuse starts another for the next request
    (up to its ``max_threads``, 10), so the requests that need no remote bytes answer at once (docs/read-path.md,
    "Slow reads do not stall the mount"). A local checkpoint keeps one loop thread: its reads wait for the disk only,
    and on 2 cores the multi-threaded loop serves them 10–25% slower (docs/measurements.md, "FUSE server" and "S3:
    scratch buffers of the FUSE threads")."""
    if chosen is not None:
        return chosen
    cache = tree.cache
    return bool(cache is not None and cache.remote)


def serve(tree: Tree, mountpoint, *, fsname: str = "ckptfs", allow_other: bool = False,
          cache_timeout: float = CACHE_TIMEOUT, threads: bool | None = None) -> None:
    """Mount ``tree`` at ``mountpoint`` and serve until unmounted or signalled (SIGTERM/SIGINT/SIGHUP).

    ``cache_timeout``: how long the kernel may cache entries, attributes and failed lookups (short for a tree that
    changes: a run, ``tree/run.py``). ``threads``: libfuse's multi-threaded loop (default: ``loop_threads``, on for a
    tree in object storage, off for a local one unless ``$CKPTFS_FUSE_THREADS`` says otherwise). Returns normally on a
    clean unmount; raises ``CkptfsError`` if the mount itself fails. A tree whose tensors are in object storage
    (``cache.remote``) has a read running through a file announce the objects ahead (``SERVER_ANNOUNCE_AHEAD``; a local
    file's storage announces its own next bytes, so local trees skip that work on every read). The caller has set
    malloc up before building the tree (``pin_malloc``, which must come before any thread starts).
    """
    fuse = load_mfusepy()
    if threads is None:
        threads = loop_threads(tree, env.fuse_threads())
    cache = tree.cache
    if cache is not None:  # the kernel's page cache keeps what was read: blocks read whole are not kept twice
        cache.streaming = True
        cache.read_ahead = SERVER_READ_AHEAD
        cache.announce_ahead = announce_window(tree, SERVER_ANNOUNCE_AHEAD)
    mountpoint = os.path.abspath(str(mountpoint))
    ops = CkptfsOperations(tree, mount_target(mountpoint))
    opts = dict(foreground=True, nothreads=not threads, ro=True, default_permissions=True, kernel_cache=True,
                attr_timeout=cache_timeout, entry_timeout=cache_timeout, negative_timeout=cache_timeout,
                use_ino=True, fsname=fsname.replace(",", "_"), subtype="ckptfs")
    if allow_other:
        opts["allow_other"] = True
    try:
        fuse_class(fuse)(ops, mountpoint, **opts)
    except RuntimeError as e:
        code = e.args[0] if e.args else None
        if code == 8:  # libfuse 3: the loop ended because of a signal; the mount is already gone
            log.debug("FUSE loop ended by a signal")
            return
        raise CkptfsError(mountpoint, f"FUSE mount failed (libfuse error {code}; see the messages above)") from e
