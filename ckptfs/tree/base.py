"""The tree interface: what every frontend serves (the FUSE adapter, ``ckptfs export``, the Python API), declared once.

A ``Tree`` is a read-only directory tree of virtual files (``ckptfs.layouts.file``). Two implement it: a
checkpoint's immutable ``VirtualTree`` (``tree/virtual.py``) and a training run's live ``RunTree`` (``tree/run.py``);
a new kind of tree (a bucket of runs…) implements the abstract methods below and every frontend serves it.

An entry (``TreeEntry``) is what ``lookup`` returns: a file, a directory or a symbolic link, with a path, an inode
number and a size. Handles (``open``/``handle``/``release``) let a tree keep what an open file reads from alive until
it is closed (a run pins the checkpoint a file was opened in); each open handle owns its reader's ``ReadCursor``
(``ckptfs.layouts.cursor``: what its stream prepares ahead), which reads through the handle pass down. Reads go
through ``read_entry`` and ``readinto_entry`` below, which refuse a directory or link and a negative offset, then
hand the file to ``virtual_file.fill`` — the one place a request is clipped to the file and its count checked.
"""
from __future__ import annotations

import errno
import os
import stat as stat_mod
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterator, Protocol

from ..errors import CkptfsError
from ..layouts.cursor import ReadCursor
from ..layouts.file import fill

FILE_MODE = stat_mod.S_IFREG | 0o444
DIR_MODE = stat_mod.S_IFDIR | 0o555
LINK_MODE = stat_mod.S_IFLNK | 0o777
BLKSIZE = 1 << 20  # st_blksize: tells readers (cp, cat) to use 1 MiB reads
#: longest name of one path component (bytes), as statfs announces
NAME_MAX = 255


class VirtualPathError(CkptfsError):
    """A virtual path that does not exist, or is a directory where a file is needed (``errno`` says which)."""

    def __init__(self, path, problem: str, errno_: int):
        super().__init__(path, problem)
        self.errno = errno_


def split_path(path: str) -> tuple:
    """``"/a//b/"`` → ``("a", "b")``; ``""`` and ``"/"`` → ``()``. ``..`` is never resolved (it does not exist)."""
    return tuple(p for p in str(path).split("/") if p and p != ".")


@dataclass(frozen=True)
class Attr:
    """``stat``-like attributes of an entry."""

    ino: int
    mode: int
    nlink: int
    size: int
    mtime_ns: int
    blksize: int = BLKSIZE

    @property
    def blocks(self) -> int:  # 512-byte units, as st_blocks
        return (self.size + 511) // 512


class TreeEntry(Protocol):
    """One node of a tree, as ``lookup`` returns it."""

    path: str  # "" for the root, else "a/b/c"
    ino: int
    file: object  # the VirtualFile of a file, else None

    @property
    def is_dir(self) -> bool: ...

    @property
    def name(self) -> str: ...

    @property
    def size(self) -> int: ...

    @property
    def children(self) -> tuple: ...


def _check_file(e: TreeEntry) -> None:
    if e.file is None:
        is_dir = e.is_dir
        raise VirtualPathError("/" + e.path, "is a directory" if is_dir else "is a symbolic link",
                               errno.EISDIR if is_dir else errno.EINVAL)


def readinto_entry(e: TreeEntry, offset: int, out: memoryview, cursor: ReadCursor | None = None) -> int:
    """Fill ``out`` from byte ``offset`` of the file of entry ``e``, clipped at its end; the count (exactly the
    clipped length, or an exception naming the path). ``cursor``: the reader's (its handle's), None for a one-off
    read (nothing prepared ahead)."""
    _check_file(e)
    if offset < 0:
        raise VirtualPathError("/" + e.path, f"invalid read at offset {offset}", errno.EINVAL)
    return fill(e.file, offset, out, "/" + e.path, e.size, cursor)


def read_entry(e: TreeEntry, offset: int, n: int, cursor: ReadCursor | None = None) -> bytes:
    """Bytes ``[offset, offset + n)`` of the file of entry ``e``, clipped at its end."""
    _check_file(e)
    if offset < 0 or n < 0:
        raise VirtualPathError("/" + e.path, f"invalid read of {n} bytes at offset {offset}", errno.EINVAL)
    buf = bytearray(max(0, min(n, e.size - offset)))
    fill(e.file, offset, memoryview(buf), "/" + e.path, e.size, cursor)
    return bytes(buf)


@dataclass
class Handle:
    """An open file: the entry it serves and the cursor of the stream read through it (one per handle: two
    readers of one file never share one)."""

    entry: TreeEntry
    cursor: ReadCursor = field(default_factory=ReadCursor)


class Tree(ABC):
    """A read-only tree of virtual files (see the module docstring). Thread-safe."""

    #: the block cache its files read through (a FUSE server turns it to streaming); None: no cache of its own
    cache = None

    @abstractmethod
    def lookup(self, path: str) -> TreeEntry:
        """The entry at ``path`` (``VirtualPathError`` ENOENT when there is none)."""

    @abstractmethod
    def attr(self, path_or_entry) -> Attr:
        """``stat`` of an entry."""

    @abstractmethod
    def readlink(self, path: str) -> str:
        """A symbolic link's target (``VirtualPathError`` EINVAL for anything else)."""

    @abstractmethod
    def open(self, entry: TreeEntry) -> int:
        """A handle serving ``entry``'s file until ``release`` (what it reads from is kept alive meanwhile)."""

    def opened(self, entry: TreeEntry) -> None:
        """``entry`` was just opened by a reader (the FUSE server's ``open``): a tree whose tensors are in object
        storage announces the file's tensor bytes to their storage (``VirtualTree.opened``). Nothing by default."""

    @abstractmethod
    def handle(self, fh: int) -> Handle:
        """The open handle ``fh`` (``VirtualPathError`` EBADF when it is not open)."""

    def entry_by_handle(self, fh: int) -> TreeEntry:
        """The entry an open handle serves (``VirtualPathError`` when it is not open)."""
        return self.handle(fh).entry

    @abstractmethod
    def release(self, fh: int) -> None:
        """Close a handle."""

    def open_entry(self, path: str) -> TreeEntry | None:
        """The entry an open handle serves at ``path`` when ``path`` itself is gone from the tree (a live tree's
        checkpoint left its listing): ``fstat`` asks by path. None when there is none (a static tree loses none)."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release what the tree holds (checkpoint files, background builds); reads afterwards may fail."""

    @property
    @abstractmethod
    def total_size(self) -> int:
        """Bytes ``statfs`` reports."""

    @property
    @abstractmethod
    def node_count(self) -> int:
        """Nodes ``statfs`` reports (``f_files``), the root included."""

    @property
    @abstractmethod
    def file_count(self) -> int:
        """What the mount's log line counts (files, or checkpoints of a run)."""

    def warm(self) -> None:
        """Start building what is expensive in the background (the mount server calls it before serving)."""

    def entry(self, path_or_entry) -> TreeEntry:
        """``path_or_entry`` looked up when it is a path."""
        return self.lookup(path_or_entry) if isinstance(path_or_entry, (str, os.PathLike)) else path_or_entry

    def listdir(self, path: str = "") -> list:
        """A directory's entries' names, in order."""
        e = self.lookup(path)
        if not e.is_dir:
            raise VirtualPathError("/" + e.path, "not a directory", errno.ENOTDIR)
        return list(e.children)

    def read(self, path_or_entry, offset: int, n: int, cursor: ReadCursor | None = None) -> bytes:
        """Bytes ``[offset, offset + n)`` of a file, clipped at its end; exactly that many or an exception.
        ``cursor``: the reader's stream (an open handle's, a copied file's), None for a one-off read."""
        return read_entry(self.entry(path_or_entry), offset, n, cursor)

    def readinto(self, path_or_entry, offset: int, out: memoryview, cursor: ReadCursor | None = None) -> int:
        """Fill ``out`` with bytes ``[offset, offset + len(out))`` of a file, clipped at its end; the count. The FUSE
        server's read: the bytes go straight into the request's buffer."""
        return readinto_entry(self.entry(path_or_entry), offset, out, cursor)

    def iter_blocks(self, path_or_entry, block: int = 8 << 20) -> Iterator[bytes]:
        """A whole file in order, ``block`` bytes at a time (bounded memory), one stream (its own cursor)."""
        e = self.entry(path_or_entry)
        cursor = ReadCursor()
        for off in range(0, e.size, block):
            yield self.read(e, off, block, cursor)

    def walk(self, path: str = "", *, dirs: bool = False) -> Iterator[str]:
        """The path of every file under ``path`` (and of every directory, with ``dirs``), depth first in name
        order; links are not followed."""
        def visit(e):
            for name in e.children:
                c = self.lookup(f"{e.path}/{name}" if e.path else name)
                if c.is_dir:
                    if dirs:
                        yield c.path
                    yield from visit(c)
                elif c.file is not None:
                    yield c.path

        return visit(self.lookup(path))

    def __contains__(self, path) -> bool:
        try:
            self.lookup(path)
        except VirtualPathError:
            return False
        return True
