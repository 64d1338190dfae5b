"""A checkpoint's tree: an immutable directory tree of virtual files (``VirtualTree``, a ``Tree``).

It is built from a ``{relative_path: VirtualFile}`` dict and never changes afterwards: inode numbers are assigned in
sorted path order (root is 1), every file's size is read once at construction (so it is exact and stable from the
first ``getattr``), every entry's mtime is the checkpoint's mtime, files are mode 0444 and directories 0555.
``tree/assemble.py`` builds one from a checkpoint's views.
"""
from __future__ import annotations

import errno
import itertools
import logging
import threading
import time
from array import array
from bisect import bisect_left
from operator import itemgetter
from typing import Any, Iterable, Iterator, Mapping

from ..tensor.cache import BlockCache
from ..errors import CkptfsError
from ..layouts.file import VirtualFile
from .base import DIR_MODE, FILE_MODE, NAME_MAX, Attr, Handle, Tree, VirtualPathError, split_path

log = logging.getLogger("ckptfs.tree")


class Entry:
    """One node of a ``VirtualTree``: a directory (``file is None``) or a file (its size is the file's, fixed once
    known).

    The tree keeps its nodes in per-inode arrays (see ``VirtualTree``), not as objects: an ``Entry`` is made by
    each lookup and reads the node's fields from its tree. It holds the tree, the inode number and the path when
    the lookup already had it (else the path is built from the parents' names on first use). Two entries of the
    same node of the same tree are equal."""

    __slots__ = ("_tree", "ino", "_path")

    def __init__(self, tree: "VirtualTree", ino: int, path: str | None = None):
        self._tree = tree
        self.ino = ino
        self._path = path

    def __repr__(self) -> str:
        return f"Entry(path={self.path!r}, ino={self.ino}, {'dir' if self.file is None else 'file'})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Entry) and other._tree is self._tree and other.ino == self.ino

    def __hash__(self) -> int:
        return hash((id(self._tree), self.ino))

    @property
    def path(self) -> str:
        """``""`` for the root, else ``"a/b/c"``."""
        if self._path is None:
            self._path = self._tree._path_of(self.ino)
        return self._path

    @property
    def file(self):
        """The VirtualFile, or None for a directory."""
        return self._tree._files[self.ino]

    @property
    def children(self) -> tuple:
        """Sorted child names (``()`` for a file)."""
        return self._tree._children[self.ino]

    @property
    def nsubdirs(self) -> int:
        return self._tree._nsubdirs[self.ino]

    @property
    def is_dir(self) -> bool:
        return self._tree._files[self.ino] is None

    @property
    def size(self) -> int:
        return self._tree._size_of(self.ino)

    @property
    def name(self) -> str:
        return self._tree._names[self.ino]


class VirtualTree(Tree):
    """Immutable tree built from ``{relative_path: VirtualFile}`` (plus optional empty directories ``dirs``).

    Its nodes are kept in arrays indexed by inode number, not as objects (a mount of 100,000 tensors has ~270,000
    nodes; this costs ~50 bytes each): the node's name (one string per distinct name: ``weight.npy`` is the same
    object in every layer), its parent's inode, its VirtualFile (None for a directory) and its size (-1 until a
    deferred file is sized); for a directory its sorted child names (equal tuples shared: every layer's directories
    list the same names), their inodes (``_kids[_first_kid[ino]:]``, in name order) and its number of
    subdirectories. Paths are not stored: a lookup walks from the root, bisecting each directory's names
    (O(depth · log width)), and a node's path is its ancestors' names joined.
    """

    def __init__(self, files: Mapping[str, Any], *, dirs: Iterable[str] = (), mtime_ns: int | None = None,
                 closers: Iterable = (), cache: BlockCache | None = None, background: Iterable = ()):
        self.mtime_ns = int(time.time_ns() if mtime_ns is None else mtime_ns)
        self.cache = cache  # the block cache every file of this tree reads through (build_tree sizes it)
        self.parts = None  # its pool of parts fetched from object storage (``build_tree`` sets it; None: local)
        self.identity: str | None = None  # what the content is computed from (``tree_identity``), None: unknown
        self._closers = list(closers)
        self._warmers: list = []
        self._background = list(background)  # ``work(stopped)`` started by ``warm``, told to stop by ``close``
        self._stopped = threading.Event()
        items = []  # (parts, file, size, raw path) of each file; (parts, None, 0, raw) of each declared directory
        same: dict = {}  # one string per distinct name: "weight.npy" is one object for every layer
        for raw, vf in files.items():
            parts = _checked_parts(raw, same)
            if not parts:
                raise CkptfsError(raw, "a file cannot be the root directory")
            if not isinstance(vf, VirtualFile):
                raise CkptfsError(raw, f"not a virtual file ({type(vf).__name__})")
            deferred = vf.deferred
            size = 0 if deferred else vf.size  # deferred: sized on first use
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise CkptfsError(raw, f"not a virtual file (size={size!r})")
            items.append((parts, vf, -1 if deferred else size, raw))
        self._nfiles = len(items)
        items.extend((_checked_parts(d, same), None, 0, d) for d in dirs)
        items.sort(key=itemgetter(0))  # sorted paths: every directory before its entries, siblings by name
        self._place(items)
        self._recent_dirs: dict = {}  # normalised path -> inode of directories recently looked into (bounded)
        self._announced: dict = {}  # inodes of the files ``opened`` announced, oldest first (bounded)
        self._handles: dict = {}  # file handle -> Handle (its entry and reader's cursor), until released
        self._handle_ids = itertools.count(1)

    def _place(self, items: list) -> None:
        """Number the nodes of the sorted ``items`` (and the directories they imply) in path order and fill the
        arrays; refuses a path listed twice or both a file and a directory."""
        names: list = [None, ""]  # index 0 unused; 1 is the root
        parents = array("i", [0, 0])
        vfiles: list = [None, None]
        sizes = array("q", [0, 0])
        kids_of: list = [None, []]  # while placing: each directory's child inodes, in name order (None for a file)
        open_names: list = []  # the directory the previous item went into: its names from the root...
        open_inos: list = [1]  # ...and the inodes of the root and of each of those names
        prev = None  # the previous item's parts when it was a file
        for parts, vf, size, raw in items:
            if prev is not None and parts[:len(prev)] == prev:  # sorted: a file's path and its extensions are next
                if len(parts) == len(prev) and vf is not None:
                    raise CkptfsError(raw, "listed twice")
                raise CkptfsError("/".join(prev), "is both a file and a directory")
            k, last = 0, min(len(open_names), len(parts))
            while k < last and open_names[k] == parts[k]:
                k += 1
            if k == len(parts):  # the directory the previous item went into (sorted: never one of its ancestors)
                if vf is not None:
                    raise CkptfsError(raw, "is both a file and a directory")
                continue  # a declared directory that already exists
            del open_names[k:], open_inos[k + 1:]
            for depth in range(k, len(parts)):
                is_dir = vf is None or depth < len(parts) - 1
                ino = len(names)
                names.append(parts[depth])
                parents.append(open_inos[-1])
                vfiles.append(None if is_dir else vf)
                sizes.append(0 if is_dir else size)
                kids_of.append([] if is_dir else None)
                kids_of[open_inos[-1]].append(ino)
                if is_dir:
                    open_names.append(parts[depth])
                    open_inos.append(ino)
            prev = None if vf is None else parts
        n = len(names)
        children: list = [()] * n
        first_kid = array("i", bytes(4 * n))
        nsubdirs = array("i", bytes(4 * n))
        kids = array("i")
        shared: dict = {}  # equal child-name tuples: one object
        for ino, mine in enumerate(kids_of):
            if mine is None:
                continue
            first_kid[ino] = len(kids)
            kids.extend(mine)
            kid_names = tuple([names[c] for c in mine])
            children[ino] = shared.setdefault(kid_names, kid_names)
            nsubdirs[ino] = sum(1 for c in mine if vfiles[c] is None)
        self._names, self._parents, self._files, self._sizes = names, parents, vfiles, sizes
        self._children, self._first_kid, self._kids, self._nsubdirs = children, first_kid, kids, nsubdirs

    # -- nodes (by inode number) ---------------------------------------------------------------------------
    def _find(self, path) -> tuple:
        """``(inode, normalised path)`` of ``path``; inode 0 when there is no such node. The last directories found
        are remembered (``RECENT_DIRS``), so that finding an entry of one of them is a single bisection."""
        key = (path if type(path) is str else str(path)).strip("/")
        parts = key.split("/")
        if "" in parts or "." in parts:
            parts = [p for p in parts if p and p != "."]
            key = "/".join(parts)
            if not parts:
                return 1, key
        recent = self._recent_dirs
        name = parts[-1]
        if len(parts) == 1:
            parent = 1
        else:
            parent = recent.get(key[:-len(name) - 1])
            if parent is None:
                parent = self._walk(1, parts[:-1])
        listed = self._children[parent]
        i = bisect_left(listed, name)
        if i == len(listed) or listed[i] != name:
            return 0, key
        ino = self._kids[self._first_kid[parent] + i]
        if self._files[ino] is None:
            if len(recent) >= RECENT_DIRS:
                recent.clear()
            recent[key] = ino
        return ino, key

    def _walk(self, ino: int, names: list) -> int:
        """The node reached from directory ``ino`` through ``names`` (0 if none): a bisection per directory."""
        children, first_kid, kids = self._children, self._first_kid, self._kids
        for name in names:
            listed = children[ino]
            i = bisect_left(listed, name)
            if i == len(listed) or listed[i] != name:
                return 0
            ino = kids[first_kid[ino] + i]
        return ino

    def _path_of(self, ino: int) -> str:
        names, parents = self._names, self._parents
        out = []
        while ino > 1:
            out.append(names[ino])
            ino = parents[ino]
        return "/".join(reversed(out))

    def _size_of(self, ino: int) -> int:
        size = self._sizes[ino]
        if size < 0:  # a deferred file, sized here on first use and fixed from then on
            size = self._sizes[ino] = self._files[ino].size
        return size

    def _all_paths(self) -> list:
        """The path of every node by inode (index 0 unused, 1 the root's ``""``): each is its parent's plus a name."""
        names, parents = self._names, self._parents
        paths = ["", ""]
        for ino in range(2, len(names)):
            head = paths[parents[ino]]
            paths.append(head + "/" + names[ino] if head else names[ino])
        return paths

    # -- lookups -----------------------------------------------------------------------------------
    def lookup(self, path: str) -> Entry:
        ino, key = self._find(path)
        if not ino:
            raise VirtualPathError("/" + key, "no such file or directory", errno.ENOENT)
        return Entry(self, ino, key)

    def entry_by_ino(self, ino: int) -> Entry:
        if 0 < ino < len(self._names):
            return Entry(self, ino)
        raise VirtualPathError(f"inode {ino}", "no such inode", errno.ENOENT)

    def attr(self, path_or_entry) -> Attr:
        if isinstance(path_or_entry, Entry):
            ino = path_or_entry.ino
        else:
            ino, key = self._find(path_or_entry)
            if not ino:
                raise VirtualPathError("/" + key, "no such file or directory", errno.ENOENT)
        if self._files[ino] is None:
            return Attr(ino, DIR_MODE, 2 + self._nsubdirs[ino], 0, self.mtime_ns)
        return Attr(ino, FILE_MODE, 1, self._size_of(ino), self.mtime_ns)

    def file_paths(self) -> list:
        """Every file's path, in inode (sorted) order."""
        vfiles = self._files
        return [p for ino, p in enumerate(self._all_paths()) if vfiles[ino] is not None]

    def all_paths(self) -> list:
        """Every file's and directory's path except the root's, in inode order."""
        return self._all_paths()[2:]

    def walk(self, path: str = "", *, dirs: bool = False) -> Iterator[str]:
        if split_path(path):
            return super().walk(path, dirs=dirs)
        return iter(self.all_paths() if dirs else self.file_paths())  # the whole tree: in inode (path) order

    @property
    def file_count(self) -> int:
        return self._nfiles

    @property
    def node_count(self) -> int:
        """Files and directories, the root included (``statfs``'s ``f_files``; no path is built for it)."""
        return len(self._names) - 1

    @property
    def total_size(self) -> int:
        sizes = self._sizes
        if -1 in sizes:  # deferred files not sized yet
            for ino in range(len(sizes)):
                self._size_of(ino)
        return sum(sizes)

    def __contains__(self, path) -> bool:
        return self._find(path)[0] != 0

    # -- handles (the FUSE adapter's open/read/release; a run tree, tree/run.py, pins a checkpoint per handle) --
    def open(self, entry: Entry) -> int:
        """A file handle for ``entry``, owning its reader's cursor until ``release`` (an immutable tree has nothing
        else to keep alive). Dict operations are atomic: FUSE threads open and release concurrently."""
        fh = next(self._handle_ids)
        self._handles[fh] = Handle(entry)
        return fh

    def opened(self, entry: Entry) -> None:
        """Announce the whole file's tensor bytes to their storage, in the file's order, when the tree's tensors are
        in object storage (``cache.remote``): a loader memory-maps the file and reads its tensors in the model's
        order, by page faults, so the parts are fetched ahead, concurrently across objects, and kept until read,
        within the ahead budget of the parts (what does not fit is asked for when read). Once per file (the last
        ``ANNOUNCED_FILES`` remembered): opened again, its pages are in the kernel's cache, or its parts were read
        and let go, and announcing them again would fetch them again. A local tree announces nothing (its storage
        reads ahead by itself)."""
        cache = self.cache
        will_need = getattr(entry.file, "will_need", None)  # a generated file (``PiecedFile``)
        if cache is None or not cache.remote or will_need is None or entry.ino in self._announced:
            return
        announced = self._announced  # a race announces a file twice at worst (harmless: parts are not asked twice)
        announced[entry.ino] = None
        while len(announced) > ANNOUNCED_FILES:
            try:
                del announced[next(iter(announced))]
            except (KeyError, StopIteration, RuntimeError):  # emptied or changed by a concurrent open
                break
        will_need(0, entry.size)

    def handle(self, fh: int) -> Handle:
        h = self._handles.get(fh)
        if h is None:
            raise VirtualPathError(f"handle {fh}", "no such open file", errno.EBADF)
        return h

    def release(self, fh: int) -> None:
        """Drop the handle and its cursor."""
        self._handles.pop(fh, None)

    def readlink(self, path: str) -> str:
        """A checkpoint tree has no symbolic links."""
        raise VirtualPathError("/" + self.lookup(path).path, "not a symbolic link", errno.EINVAL)

    def warm(self) -> None:
        """Start building every deferred file in the background (the mount server does this before serving), and
        the sources' background work (``Checkpoint.warm``)."""
        for vf in self._files:
            if vf is not None and vf.deferred:
                self._warmers.append(vf.start())
        for work in self._background:
            th = threading.Thread(target=work, args=(self._stopped,), name="ckptfs-warm", daemon=True)
            th.start()
            self._warmers.append(th)

    def add_closer(self, close) -> None:
        """Call ``close()`` when the tree closes, after the closers it was made with."""
        self._closers.append(close)

    def close(self) -> None:
        self._stopped.set()
        for th in self._warmers:  # never close sources under a build still running
            th.join()
        self._warmers = []
        for c in self._closers:
            try:
                c()
            except Exception:  # closing is best effort
                log.debug("close failed", exc_info=True)
        self._closers = []


#: how many directories a tree remembers the inode of (a lookup in one of them is a single bisection: ``ls -lR``
#: and FUSE's path-based calls look up the entries of one directory after another)
RECENT_DIRS = 1024
#: how many files a tree remembers it announced when opened (``VirtualTree.opened``)
ANNOUNCED_FILES = 4096


def _checked_parts(path, same: dict | None = None) -> tuple:
    """The components of a path given to a tree, checked; with ``same``, each component is the one string kept in
    ``same`` for its text (a tree keeps one string per distinct name)."""
    raw = str(path)
    parts = tuple(p for p in raw.split("/") if p)
    for p in parts:
        if p in (".", "..") or "\0" in p:
            raise CkptfsError(raw, "invalid path component")
        if len(p.encode("utf-8", "surrogateescape")) > NAME_MAX:
            raise CkptfsError(raw, f"path component longer than {NAME_MAX} bytes")
    return parts if same is None else tuple([same.setdefault(p, p) for p in parts])
