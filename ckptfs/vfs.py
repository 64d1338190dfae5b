"""The virtual tree: an immutable directory tree of virtual files, and ``build_tree`` that assembles it from the views.

``VirtualTree`` is what every frontend serves (FUSE, ``ckptfs export``, the Python API). It is built from a
``{relative_path: VFile}`` dict and never changes afterwards: inode numbers are assigned in sorted path order
(root is 1), every file's size is read once at construction (so it is exact and stable from the first
``getattr``), every entry's mtime is the checkpoint's mtime, files are mode 0444 and directories 0555.

``build_tree(ckpt_path, options)`` opens the checkpoint, creates the tree's own block cache (``options.cache_size``),
runs the builder of each registered view named in ``options.views`` (``ckptfs.views.registry``; a view whose
builder raises is *missing* with a reason, the others still mount), places each view's files in its folder and
writes a root ``README.txt`` saying what was mounted.

Test-only hook: when the environment variable ``CKPTFS_TEST_TREE=module:function`` is set, ``build_tree`` does not
open the checkpoint; it calls ``function(ckpt_path, options)``, which returns ``{view_name: ViewResult | Exception}``,
and assembles those exactly like real views. It exists so that the FUSE frontend can be tested end to end with
synthetic files (tests/fusehelp.py); nothing in ckptfs sets it.
"""
from __future__ import annotations

import errno
import importlib
import json
import logging
import os
import stat as stat_mod
import time
from array import array
from bisect import bisect_left
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from .cache import BlockCache
from .errors import CheckpointError, CkptfsError, TensorReadError
from .options import MountOptions, check_options
from .views.base import BytesFile, ViewContext, ViewResult, readinto_file

log = logging.getLogger("ckptfs.vfs")

FILE_MODE = stat_mod.S_IFREG | 0o444
DIR_MODE = stat_mod.S_IFDIR | 0o555
BLKSIZE = 1 << 20  # st_blksize: tells readers (cp, cat) to use 1 MiB reads
README_NAME = "README.txt"
TEST_TREE_ENV = "CKPTFS_TEST_TREE"


class VirtualPathError(CkptfsError):
    """A virtual path that does not exist, or is a directory where a file is needed (``errno`` says which)."""

    def __init__(self, path, problem: str, errno_: int):
        super().__init__(path, problem)
        self.errno = errno_


def split_path(path: str) -> tuple:
    """``"/a//b/"`` → ``("a", "b")``; ``""`` and ``"/"`` → ``()``. ``..`` is never resolved (it does not exist)."""
    return tuple(p for p in str(path).split("/") if p and p != ".")


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
        """The VFile, or None for a directory."""
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


def read_clipped(entry, offset: int, n: int) -> bytes:
    """Bytes ``[offset, offset+n)`` of the file of ``entry`` (its ``file``, ``size`` and ``path``), clipped at its
    end: exactly that many or an exception naming the path (built only then: this is every read's path)."""
    if offset < 0 or n < 0:
        raise VirtualPathError("/" + entry.path, f"invalid read of {n} bytes at offset {offset}", errno.EINVAL)
    want = max(0, min(n, entry.size - offset))
    if want == 0:
        return b""
    data = entry.file.read(offset, want)
    if not isinstance(data, bytes):
        data = bytes(data)
    if len(data) != want:
        raise TensorReadError("/" + entry.path, f"produced {len(data)} bytes for a read of {want} at offset {offset}")
    return data


def readinto_clipped(entry, offset: int, out: memoryview) -> int:
    """``read_clipped`` straight into ``out``; the count (exactly the clipped length or an exception)."""
    if offset < 0:
        raise VirtualPathError("/" + entry.path, f"invalid read at offset {offset}", errno.EINVAL)
    want = max(0, min(len(out), entry.size - offset))
    if want == 0:
        return 0
    got = readinto_file(entry.file, offset, out[:want])
    if got != want:
        raise TensorReadError("/" + entry.path, f"produced {got} bytes for a read of {want} at offset {offset}")
    return want


class VirtualTree:
    """Immutable tree built from ``{relative_path: VFile}`` (plus optional empty directories ``dirs``).

    Its nodes are kept in arrays indexed by inode number, not as objects (a mount of 100,000 tensors has ~270,000
    nodes; this costs ~50 bytes each): the node's name (one string per distinct name: ``weight.npy`` is the same
    object in every layer), its parent's inode, its VFile (None for a directory) and its size (-1 until a
    deferred file is sized); for a directory its sorted child names (equal tuples shared: every layer's directories
    list the same names), their inodes (``_kids[_first_kid[ino]:]``, in name order) and its number of
    subdirectories. Paths are not stored: a lookup walks from the root, bisecting each directory's names
    (O(depth · log width)), and a node's path is its ancestors' names joined.
    """

    def __init__(self, files: Mapping[str, Any], *, dirs: Iterable[str] = (), mtime_ns: int | None = None,
                 closers: Iterable = (), cache: BlockCache | None = None):
        self.mtime_ns = int(time.time_ns() if mtime_ns is None else mtime_ns)
        self.cache = cache  # the block cache every file of this tree reads through (build_tree sizes it)
        self._closers = list(closers)
        self._warmers: list = []
        items = []  # (parts, VFile, size, raw path) of each file; (parts, None, 0, raw) of each declared directory
        same: dict = {}  # one string per distinct name: "weight.npy" is one object for every layer
        for raw, vf in files.items():
            parts = _checked_parts(raw, same)
            if not parts:
                raise CkptfsError(raw, "a file cannot be the root directory")
            deferred = getattr(vf, "deferred", False)
            size = 0 if deferred else getattr(vf, "size", None)  # deferred: sized on first use
            if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not callable(getattr(vf, "read", None)):
                raise CkptfsError(raw, f"not a virtual file (size={size!r})")
            items.append((parts, vf, -1 if deferred else size, raw))
        self._nfiles = len(items)
        items.extend((_checked_parts(d, same), None, 0, d) for d in dirs)
        items.sort(key=itemgetter(0))  # sorted paths: every directory before its entries, siblings by name
        self._place(items)
        self._recent_dirs: dict = {}  # normalised path -> inode of directories recently looked into (bounded)

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

    def listdir(self, path: str = "") -> list:
        e = self.lookup(path)
        if not e.is_dir:
            raise VirtualPathError("/" + e.path, "not a directory", errno.ENOTDIR)
        return list(e.children)

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

    # -- data -----------------------------------------------------------------------------------------
    def read(self, path_or_entry, offset: int, n: int) -> bytes:
        """Bytes ``[offset, offset+n)`` of a file, clipped at its end; exactly that many or an exception."""
        e = path_or_entry if isinstance(path_or_entry, Entry) else self.lookup(path_or_entry)
        if e.is_dir:
            raise VirtualPathError("/" + e.path, "is a directory", errno.EISDIR)
        return read_clipped(e, offset, n)

    def readinto(self, path_or_entry, offset: int, out: memoryview) -> int:
        """Fill ``out`` with bytes ``[offset, offset+len(out))`` of a file, clipped at its end; the count (exactly
        that many or an exception). The FUSE server's read: the bytes go straight into the request's buffer."""
        e = path_or_entry if isinstance(path_or_entry, Entry) else self.lookup(path_or_entry)
        if e.is_dir:
            raise VirtualPathError("/" + e.path, "is a directory", errno.EISDIR)
        return readinto_clipped(e, offset, out)

    def iter_blocks(self, path_or_entry, block: int = 8 << 20) -> Iterator[bytes]:
        """A whole file in order, ``block`` bytes at a time (bounded memory)."""
        e = path_or_entry if isinstance(path_or_entry, Entry) else self.lookup(path_or_entry)
        for off in range(0, e.size, block):
            yield self.read(e, off, block)

    # -- handles (the FUSE adapter's open/read/release; a run tree, ckptfs.runtree, pins a checkpoint per handle) --
    def open(self, entry: Entry) -> int:
        """A file handle for ``entry``: here its inode number (an immutable tree has nothing to keep alive)."""
        return entry.ino

    def entry_by_handle(self, fh: int) -> Entry:
        return self.entry_by_ino(fh)

    def release(self, fh: int) -> None:
        """Nothing to release (see ``open``)."""

    def readlink(self, path: str) -> str:
        """A checkpoint tree has no symbolic links."""
        raise VirtualPathError("/" + self.lookup(path).path, "not a symbolic link", errno.EINVAL)

    def warm(self) -> None:
        """Start building every deferred file in the background (the mount server does this before serving)."""
        for vf in self._files:
            if getattr(vf, "deferred", False):
                self._warmers.append(vf.start())

    def close(self) -> None:
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

#: longest name of one path component (bytes), as statfs announces
NAME_MAX = 255


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


# ---- assembling the views -------------------------------------------------------------------------


@dataclass
class SourceInfo:
    """What README.txt says about the mounted checkpoint."""

    path: Path
    format_version: Any = None
    release: str | None = None
    success: bool | None = None
    warnings: list = field(default_factory=list)
    resolved_from: Path | None = None  # the model_dir the checkpoint was resolved from (its latest checkpoint)


@dataclass
class ViewOutcome:
    """One view after its builder ran: its files (under ``<name>/``) or why it is missing."""

    name: str
    files: dict = field(default_factory=dict)
    missing: str | None = None
    notes: list = field(default_factory=list)

    @property
    def present(self) -> bool:
        return bool(self.files) or self.missing is None


def view_dir(name: str) -> str:
    """Where a view's files go, as its registry record says: the hf view at the mount's root (so
    ``from_pretrained(mountpoint)`` works), every other view under ``<name>/``."""
    from .views.registry import view

    try:
        return view(name).folder
    except KeyError:
        return name + "/"


def outcome_from(name: str, result) -> ViewOutcome:
    """Normalise what a builder produced (a ``ViewResult`` or an exception) into a ``ViewOutcome``."""
    if isinstance(result, CkptfsError):
        return ViewOutcome(name, missing=str(result))
    if isinstance(result, BaseException):
        return ViewOutcome(name, missing=f"internal error: {type(result).__name__}: {result}")
    if not isinstance(result, ViewResult):
        return ViewOutcome(name, missing=f"internal error: builder returned {type(result).__name__}, not ViewResult")
    files = {}
    prefix = view_dir(name)
    for rel, vf in (result.files or {}).items():
        rel = "/".join(split_path(rel))
        files[rel if (not prefix or rel.startswith(prefix)) else prefix + rel] = vf
    try:  # validate the view alone, so that one broken view cannot stop the others
        VirtualTree(files)
    except CkptfsError as e:
        return ViewOutcome(name, missing=f"invalid file list: {e}", notes=list(result.notes or []))
    return ViewOutcome(name, files, result.missing, [str(n) for n in (result.notes or [])])


def run_builder(view, ctx: ViewContext) -> ViewOutcome:
    """Run a registered view's builder (``ckptfs.views.registry.View``); failures make the view missing."""
    name, build = view.name, view.build
    try:
        result = build(ctx)
    except CkptfsError as e:
        log.debug("view %s failed", name, exc_info=True)
        result = e
    except Exception as e:  # a bug in one view must not take the others down
        log.warning("view %s: internal error: %s: %s", name, type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
        result = e
    return outcome_from(name, result)


def _run_view(name: str, ctx: ViewContext) -> ViewOutcome:
    from .views.registry import names, view

    try:
        return run_builder(view(name), ctx)
    except KeyError:
        return ViewOutcome(name, missing=f"unknown view (known: {', '.join(names())})")


def family_of(outcomes: list) -> str | None:
    """The model family as the hf view says it: ``model_type`` (and architecture) of its config.json."""
    for o in outcomes:
        vf = o.files.get(view_dir(o.name) + "config.json") if o.name == "hf" else None
        if vf is None or vf.size > (1 << 20):
            continue
        try:
            cfg = json.loads(vf.read(0, vf.size))
        except Exception:
            return None
        fam = cfg.get("model_type")
        archs = cfg.get("architectures") or []
        if fam and archs:
            return f"{fam} ({', '.join(map(str, archs))})"
        return fam or (", ".join(map(str, archs)) or None)
    return None


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def readme_text(info: SourceInfo, outcomes: list) -> str:
    """The root README.txt: what was mounted, which views are present, why any is missing, and all notes."""
    lines = ["ckptfs: a read-only view of a Cerebras checkpoint; every file is generated on read.", ""]
    lines.append(f"checkpoint:     {info.path}")
    if info.format_version is not None:
        lines.append(f"format version: {info.format_version}")
    if info.release:
        lines.append(f"release:        {info.release}")
    fam = family_of(outcomes)
    if fam:
        lines.append(f"family:         {fam}")
    if info.success is False:
        lines.append("complete:       no (no __SUCCESS__ marker; mounted with --allow-partial)")
    if info.resolved_from is not None:
        lines.append(f"resolved from:  {info.resolved_from} (its latest checkpoint when mounted; this mount keeps "
                     "serving that one: remount to see a newer checkpoint)")
    lines += ["", "views:"]
    for o in outcomes:
        if o.present:
            ready = [f for f in o.files.values() if not getattr(f, "deferred", False)]
            status = f"{len(o.files)} file{'' if len(o.files) == 1 else 's'}"
            if ready:
                status += f", {_human(sum(f.size for f in ready))}"
            if len(ready) < len(o.files):
                status += f" ({len(o.files) - len(ready)} sized on first access)"
            if o.missing:
                status += f"; partly missing: {o.missing}"
        else:
            status = f"missing: {o.missing}"
        lines.append(f"  {(view_dir(o.name) or '(root)'):<10} {o.name + ':':<8} {status}")
    notes = [(o.name, n) for o in outcomes for n in o.notes] + [("checkpoint", w) for w in info.warnings]
    if notes:
        lines += ["", "notes:"]
        lines += [f"  {n}" if n.startswith(who + ":") else f"  {who}: {n}" for who, n in notes]
    return "\n".join(lines) + "\n"


def assemble_tree(info: SourceInfo, outcomes: list, *, mtime_ns: int | None = None, closers: Iterable = (),
                  cache: BlockCache | None = None) -> VirtualTree:
    """The mount's tree: each present view under ``<name>/`` plus the root README.txt."""
    files: dict = {}
    dirs = []
    for o in outcomes:
        if o.present:
            files.update(o.files)
            if view_dir(o.name):
                dirs.append(view_dir(o.name).rstrip("/"))
    files[README_NAME] = BytesFile(readme_text(info, outcomes))
    return VirtualTree(files, dirs=dirs, mtime_ns=mtime_ns, closers=closers, cache=cache)


# ---- building from a checkpoint ---------------------------------------------------------------------


def open_source(ckpt_path, options: MountOptions):
    """Resolve a checkpoint path (a .mdl or a model_dir) and open it: ``(resolved_path, checkpoint)``."""
    path = Path(ckpt_path)
    if not path.exists():
        raise CheckpointError(path, "no such file or directory")
    from .source import open_checkpoint, resolve_checkpoint

    path = Path(resolve_checkpoint(path))
    return path, open_checkpoint(path, allow_partial=options.allow_partial, allow_external=options.allow_external)


def _file_identity(path) -> str | None:
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    return f"{real}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def content_identity(path, options: MountOptions) -> str | None:
    """Names what the generated files are computed from: the checkpoint file and every option declared as changing
    content (``ckptfs.options``: params YAML, model, trainer index…) that is not at its default; a path option
    counts by its file's identity. Keys persisted caches (zip CRCs); None if the checkpoint cannot be stat'ed."""
    from .options import content_options

    ident = _file_identity(path)
    if ident is None:
        return None
    parts = [ident]
    for opt, value in content_options(options):
        values = value if opt.repeat else (value,)
        text = ",".join((_file_identity(v) or str(v)) if opt.kind.path else opt.kind.text(v) for v in values)
        parts.append(f"{opt.name}={text}")
    return "|".join(parts)


def _crc_store():
    try:
        from .layouts.crc import CrcStore
    except ImportError:
        return None
    return CrcStore()


def _load_test_factory(spec: str):
    mod, _, func = spec.partition(":")
    if not mod or not func:
        raise CkptfsError(None, f"{TEST_TREE_ENV} must be module:function, not {spec!r}")
    return getattr(importlib.import_module(mod), func)


#: views that start a build in a forked process when ``build_tree(fork_builds=True)``
FORKING_VIEWS = ("cs",)


def build_tree(ckpt_path, options: MountOptions | None = None, *, cache: BlockCache | None = None,
               fork_builds: bool = False) -> VirtualTree:
    """Open the checkpoint and assemble every requested view into one ``VirtualTree``.

    ``cache``: the block cache its files read through (default: its own, of ``options.cache_size``; the trees of a
    run mount share one, ``ckptfs.runtree``). Raises ``CheckpointError`` if the checkpoint cannot be opened; a
    failing view only makes that view missing. ``fork_builds``: views may start expensive layouts in forked
    processes (``ViewContext.fork_builds``): only for a caller that has no other thread, the mount server.
    """
    options = options or MountOptions()
    check_options(options)
    if cache is None:
        cache = BlockCache(options.cache_size)  # this tree's own: never shared with, or replaced by, another tree
    spec = os.environ.get(TEST_TREE_ENV)
    if spec:  # test-only: synthetic views (see module docstring)
        path = Path(ckpt_path).absolute()
        results = _load_test_factory(spec)(path, options)
        outcomes = [outcome_from(n, results.get(n, CkptfsError(None, "not given by the test tree")))
                    for n in options.views]
        info = SourceInfo(path)
        closers: list = []
    else:
        path, ckpt = open_source(ckpt_path, options)
        path = path.absolute()
        ctx = ViewContext(checkpoint=ckpt, ckpt_path=path, stem=path.stem, options=options,
                          crc_store=_crc_store(), identity=content_identity(path, options), cache=cache,
                          fork_builds=fork_builds)
        # a view that forks a build (cs) goes first, so that the build overlaps the others'; outcomes keep their order
        first = [n for n in options.views if fork_builds and n in FORKING_VIEWS]
        built = {n: _run_view(n, ctx) for n in first + [n for n in options.views if n not in first]}
        outcomes = [built[n] for n in options.views]
        info = SourceInfo(path, getattr(ckpt, "format_version", None), getattr(ckpt, "release", None),
                          getattr(ckpt, "success", None), [str(w) for w in getattr(ckpt, "warnings", []) or []],
                          Path(ckpt_path).absolute() if Path(ckpt_path).is_dir() else None)
        closers = [ckpt.close] if callable(getattr(ckpt, "close", None)) else []
    try:
        mtime_ns = path.stat().st_mtime_ns
    except OSError:
        mtime_ns = None
    return assemble_tree(info, outcomes, mtime_ns=mtime_ns, closers=closers, cache=cache)
