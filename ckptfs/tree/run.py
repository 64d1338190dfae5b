"""The virtual tree of a whole training run: every complete checkpoint of a model_dir as a folder, ``latest``, and a
README.txt, following the model_dir while training writes into it.

Root of a run mount::

    README.txt                  what the run holds now: its checkpoints, which one is latest, what is hidden and why
    latest -> checkpoint_3000   a relative symlink to the latest checkpoint's folder (``ckptfs.readers.run.scan``)
    checkpoint_1000/            one folder per complete checkpoint file, named after it (``checkpoint_<step>.mdl``):
    checkpoint_3000/            exactly the tree ``ckptfs mount <that file>`` shows (``tree/assemble.py``)

Live: a lookup rescans the model_dir when the last scan is older than ``poll`` seconds (one listing and one
``stat`` per checkpoint file; files are opened only when they are new or changed). A checkpoint appears once its
save completed, disappears when its file is deleted, and ``latest`` moves with them.

Trees are built lazily — a checkpoint's tree on the first access inside its folder (listing the root builds nothing)
— and at most ``keep`` trees that no open file uses are kept; the least recently used one is closed when another is
built. The run's trees read through one block cache of ``--cache-size``. ``open`` pins the tree an entry was looked
up in until ``release``: the handle serves that tree's bytes to the end, and the tree holds its checkpoint file
open, so a checkpoint deleted or replaced meanwhile still reads correctly. A handle never switches trees, so no file
ever mixes two checkpoints' bytes.

The kernel caches file pages per path, so two files are never served under one name at once: a checkpoint file
that replaces one whose generated files are still open is held back (README.txt says so) until they are closed,
then listed with new inode numbers and an mtime different from its predecessor's (so the kernel drops the old
pages).

Inode numbers: 1 is the root, 2 README.txt, 3 ``latest``; each checkpoint file (each identity of it) gets a number
``k`` and its tree's inode ``i`` becomes ``k << 32 | i`` (the folder itself is ``k << 32 | 1``). Checkpoint folders
report ``nlink`` 1 (their subdirectory count is unknown until built; ``find`` then does not rely on it).

A ``RunTree`` is a ``Tree`` (``tree/base.py``), served by the same frontends as a checkpoint's tree; the FUSE server
serves it with short cache timeouts (``RUN_CACHE_TIMEOUT``) so that the kernel sees the listing change.
"""
from __future__ import annotations

import errno
import gc
import itertools
import logging
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from ..errors import CheckpointError, CkptfsError
from ..views.options import MountOptions, s3_settings
from ..readers.run.scan import RunCheckpoint, RunListing, RunScanner
from ..storage.locate import locate
from ..storage.s3url import is_s3_url
from ..views.base import README_NAME, BytesFile
from .assemble import TreeBuilder, build_tree
from .base import (DIR_MODE, FILE_MODE, LINK_MODE, Attr, Handle, Tree, VirtualPathError, read_entry, readinto_entry,
                   split_path)
from .memory import RunParts, tree_cache
from .virtual import Entry, VirtualTree

log = logging.getLogger("ckptfs.run")

#: seconds the kernel may cache entries and attributes of a run mount (and the least time between two scans)
RUN_CACHE_TIMEOUT = 1.0
POLL_SECONDS = 1.0
#: trees kept built while no open file uses them
KEEP_TREES = 4
LATEST = "latest"
ROOT_INO, README_INO, LATEST_INO = 1, 2, 3
INO_SHIFT = 32


@dataclass(eq=False)
class Slot:
    """One checkpoint file as the mount serves it; a file that changes (new identity) gets a new Slot."""

    ckpt: RunCheckpoint
    number: int
    mtime_ns: int  # what its entries report (differs from the previous version's under the same name)
    tree: VirtualTree | None = None
    pins: int = 0  # open handles (and reads in progress) using ``tree``
    listed: bool = True  # False once the file left the model_dir (or changed)
    error: str | None = None  # why its tree could not be built (not retried for this identity)
    build_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def base(self) -> int:
        return self.number << INO_SHIFT


@dataclass(frozen=True, eq=False)
class RunEntry:
    """One node of the run tree. Inside a checkpoint folder it wraps the checkpoint tree's ``Entry`` (``inner``)
    and remembers that tree, so that everything done with it reads from the tree it was looked up in."""

    path: str  # "" for the root, "checkpoint_2000/config.json", ...
    ino: int
    kind: str  # "dir", "file" or "link"
    mtime_ns: int
    link: str | None = None  # a symlink's target
    file: Any = None  # a run-level file's VFile (README.txt)
    slot: Slot | None = None  # the checkpoint it belongs to
    tree: VirtualTree | None = None  # that checkpoint's tree (entries inside its folder)
    inner: Entry | None = None  # the tree's own entry
    names: Any = ()  # children: a tuple, or a callable giving them (a folder whose tree is built on demand)

    @property
    def is_dir(self) -> bool:
        return self.kind == "dir"

    @property
    def is_link(self) -> bool:
        return self.kind == "link"

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def children(self) -> tuple:
        return tuple(self.names() if callable(self.names) else self.names)

    @property
    def size(self) -> int:
        if self.inner is not None:
            return self.inner.size
        if self.file is not None:
            return self.file.size
        return len(self.link.encode()) if self.link is not None else 0


class RunTree(Tree):
    """The live tree of a model_dir (see the module docstring). Thread-safe."""

    def __init__(self, model_dir, options: MountOptions | None = None, *, keep: int = KEEP_TREES,
                 poll: float = POLL_SECONDS, build: Callable | None = None, build_tree: TreeBuilder = build_tree,
                 scanner: RunScanner | None = None):
        self.model_dir = model_dir if is_s3_url(model_dir) else Path(model_dir).absolute()
        self.options = options or MountOptions()
        self.keep = max(1, int(keep))
        self.poll = float(poll)
        self.cache = tree_cache(self.options.cache_size, model_dir)  # shared by the run's trees: bounds the run
        # the remote share, one pool per checkpoint tree built (equal shares): None for a local run
        self.parts = RunParts(self.options.cache_size) if is_s3_url(model_dir) else None
        self._build_tree = build_tree  # a checkpoint's tree, built with this run's cache (``_build_checkpoint``)
        self._build = build or self._build_checkpoint
        self._scanner = scanner or RunScanner(self.model_dir, allow_external=self.options.allow_external)
        self._lock = threading.RLock()
        self._scan_lock = threading.Lock()  # one scan at a time, applied in the order taken
        self._numbers = itertools.count(1)
        self._handles_ids = itertools.count(1)
        self._slots: dict = {}  # folder name -> Slot, the complete checkpoints listed now
        self._draining: dict = {}  # folder name -> Slot no longer listed whose files are still open
        self._held: list = []  # RunCheckpoints not listed until the previous version under their name is closed
        self._last_mtime: dict = {}  # folder name -> mtime_ns its entries last reported
        self._built: OrderedDict = OrderedDict()  # Slot -> None for every built tree, least recently used first
        self._handles: dict = {}  # file handle -> Handle (a RunEntry and its reader's cursor)
        self._listing = RunListing(self.model_dir, ())
        self._readme = BytesFile(b"")
        self._changed_ns = time.time_ns()
        self._scanned = float("-inf")
        self._scan_error: str | None = None
        self.refresh()

    # -- following the model_dir ----------------------------------------------------------------------------
    def refresh(self, force: bool = True) -> RunListing:
        """Rescan the model_dir (when ``force``, or when the last scan is older than ``poll`` seconds)."""
        with self._lock:
            now = time.monotonic()
            if not force and now - self._scanned < self.poll:
                return self._listing
            self._scanned = now
        with self._scan_lock:
            try:
                listing = self._scanner.scan()
            except CheckpointError as e:  # keep serving what was there (a transient error must not empty the mount)
                with self._lock:
                    if self._scan_error != str(e):
                        log.warning("%s (the listing stays as it was)", e)
                    self._scan_error = str(e)
                    return self._listing
            with self._lock:
                self._scan_error = None
                self._apply(listing)
                return listing

    @property
    def listing(self) -> RunListing:
        """The run as last scanned (``refresh`` scans again)."""
        return self._listing

    def _apply(self, listing: RunListing) -> None:
        slots, held = {}, []
        for c in listing.complete:
            slot = self._slots.get(c.name)
            if slot is not None and slot.ckpt.identity == c.identity:
                slots[c.name] = slot
                continue
            previous = self._draining.get(c.name) or slot
            if previous is not None and previous.pins > 0:
                # Another file under a name whose previous file is still open: the kernel caches pages per path, so
                # the two must not be served there at once; this one is listed once the other's files are closed.
                held.append(c)
                continue
            slots[c.name] = Slot(c, next(self._numbers), self._fresh_mtime(c))
        for name, old in self._slots.items():
            if slots.get(name) is not old:
                old.listed = False
                if old.pins == 0:
                    self._close_tree(old)
                else:
                    self._draining[name] = old
        self._slots, self._held, self._listing = slots, held, listing
        text = run_readme(listing, self.poll, held)
        if text != self._readme.data.decode():
            self._readme = BytesFile(text)
            self._changed_ns = time.time_ns()

    def _fresh_mtime(self, c: RunCheckpoint) -> int:
        """``c``'s mtime, moved by 1 ns if it equals what its name last reported (a copy that kept the old file's
        mtime): the kernel drops a file's cached pages when its mtime or size changes."""
        last = self._last_mtime.get(c.name)
        mtime = c.mtime_ns if c.mtime_ns != last else c.mtime_ns + 1
        self._last_mtime[c.name] = mtime
        return mtime

    def _latest(self) -> Slot | None:
        latest = self._listing.latest
        if latest is None:
            return None
        if latest.name in self._slots:
            return self._slots[latest.name]
        return next(reversed(self._slots.values()), None)  # the latest is held back: the last one listed

    # -- trees ----------------------------------------------------------------------------------------------
    def _tree_of(self, slot: Slot) -> VirtualTree:
        """The slot's tree, built on first use; marks it most recently used."""
        with self._lock:
            if slot.tree is not None:
                self._built.move_to_end(slot)
                return slot.tree
        with slot.build_lock:
            with self._lock:
                if slot.tree is not None:
                    self._built.move_to_end(slot)
                    return slot.tree
                if slot.error is not None:
                    raise VirtualPathError("/" + slot.ckpt.name, slot.error, errno.EIO)
            try:
                tree = self._build(slot.ckpt.path, self.options)
            except CkptfsError as e:
                log.error("%s (its folder %s/ fails with EIO)", e, slot.ckpt.name)
                slot.error = f"cannot be read: {e}"
                raise VirtualPathError("/" + slot.ckpt.name, slot.error, errno.EIO) from None
            with self._lock:
                slot.tree = tree
                self._built[slot] = None
                self._evict()
                return tree

    def _build_checkpoint(self, path, options: MountOptions) -> VirtualTree:
        if self.parts is None:
            return self._build_tree(path, options, cache=self.cache)
        try:
            return self._build_tree(path, options, cache=self.cache, parts=self.parts.pool())
        except BaseException:  # the builder closed the pool it was given
            self.parts.rebalance()
            raise

    def _evict(self) -> None:
        idle = [s for s in self._built if s.pins == 0]
        for s in idle[:max(0, len(idle) - self.keep)]:
            self._close_tree(s)

    def _close_tree(self, slot: Slot) -> None:
        tree, slot.tree = slot.tree, None
        self._built.pop(slot, None)
        if tree is not None:
            tree.close()
            if self.parts is not None:
                self.parts.rebalance()  # its pool's share goes back to the others
            del tree
            # what the tree's readers still hold (direct file handles on the checkpoint, which keep a deleted file's
            # disk space) is freed with them; they sit in reference cycles, so collect now rather than some time
            gc.collect()

    def _unpin(self, slot: Slot) -> None:
        with self._lock:
            slot.pins -= 1
            if slot.pins == 0:
                if slot.listed:
                    self._evict()
                else:
                    self._close_tree(slot)
                    if self._draining.get(slot.ckpt.name) is slot:
                        del self._draining[slot.ckpt.name]
                        self._scanned = float("-inf")  # a file held back under this name can be listed now

    @contextmanager
    def _using(self, e: RunEntry):
        """Keep ``e``'s tree open while it is used (an entry looked up before its tree was dropped is stale)."""
        if e.slot is None:
            yield
            return
        with self._lock:
            if e.slot.tree is not e.tree:
                raise VirtualPathError("/" + e.path, "stale: its checkpoint tree was released; look it up again",
                                       errno.ESTALE)
            e.slot.pins += 1
        try:
            yield
        finally:
            self._unpin(e.slot)

    @property
    def built_count(self) -> int:
        """How many checkpoint trees are built now."""
        return len(self._built)

    # -- lookups ----------------------------------------------------------------------------------------------
    def lookup(self, path: str) -> RunEntry:
        parts = split_path(path)
        self.refresh(force=False)
        with self._lock:
            if not parts:
                names = (README_NAME,) + ((LATEST,) if self._latest() else ()) + tuple(self._slots)  # autoload order
                return RunEntry("", ROOT_INO, "dir", self._changed_ns, names=names)
            head, rest = parts[0], parts[1:]
            if head == README_NAME and not rest:
                return RunEntry(README_NAME, README_INO, "file", self._changed_ns, file=self._readme)
            slot = self._slots.get(head)
            if head == LATEST:
                slot = self._latest()
                if slot is not None and not rest:
                    return RunEntry(LATEST, LATEST_INO, "link", self._changed_ns, link=slot.ckpt.name)
        if slot is None:
            raise VirtualPathError("/" + "/".join(parts), "no such file or directory", errno.ENOENT)
        if not rest:
            return RunEntry(slot.ckpt.name, slot.base | ROOT_INO, "dir", slot.mtime_ns, slot=slot,
                            names=lambda: self._tree_of(slot).listdir(""))
        tree = self._tree_of(slot)  # "latest/x" (the Python API; the kernel resolves the link itself) is followed
        try:
            inner = tree.lookup("/".join(rest))
        except VirtualPathError as e:
            raise VirtualPathError("/" + "/".join(parts), e.problem, e.errno) from None
        return RunEntry(f"{slot.ckpt.name}/{inner.path}", slot.base | inner.ino, "dir" if inner.is_dir else "file",
                        slot.mtime_ns, slot=slot, tree=tree, inner=inner, names=inner.children)

    def attr(self, path_or_entry) -> Attr:
        e = self.entry(path_or_entry)
        if e.inner is not None:
            a = e.tree.attr(e.inner)
            return Attr(e.ino, a.mode, a.nlink, a.size, e.mtime_ns)
        if e.is_link:
            return Attr(e.ino, LINK_MODE, 1, e.size, e.mtime_ns)
        if e.is_dir:
            nlink = 2 + len(self._slots) if e.ino == ROOT_INO else 1
            return Attr(e.ino, DIR_MODE, nlink, 0, e.mtime_ns)
        return Attr(e.ino, FILE_MODE, 1, e.size, e.mtime_ns)

    def readlink(self, path: str) -> str:
        e = self.lookup(path)
        if not e.is_link:
            raise VirtualPathError("/" + e.path, "not a symbolic link", errno.EINVAL)
        return e.link

    # -- data -------------------------------------------------------------------------------------------------
    def read(self, path_or_entry, offset: int, n: int, cursor=None) -> bytes:
        """Bytes ``[offset, offset+n)`` of a file, from the tree its entry was looked up in (``cursor``: the
        reader's stream, as ``Tree.read``)."""
        e = self.entry(path_or_entry)
        if e.inner is not None:
            with self._using(e):
                return e.tree.read(e.inner, offset, n, cursor)
        return read_entry(e, offset, n, cursor)

    def readinto(self, path_or_entry, offset: int, out: memoryview, cursor=None) -> int:
        """``read`` straight into ``out`` (the FUSE server's read); the count."""
        e = self.entry(path_or_entry)
        if e.inner is not None:
            with self._using(e):
                return e.tree.readinto(e.inner, offset, out, cursor)
        return readinto_entry(e, offset, out, cursor)

    def open(self, entry: RunEntry) -> int:
        """A file handle: until ``release`` it serves the tree ``entry`` was looked up in (kept open), with its
        reader's cursor."""
        if entry.is_dir or entry.is_link:
            raise VirtualPathError("/" + entry.path, "not a regular file", errno.EISDIR if entry.is_dir else errno.ELOOP)
        with self._lock:
            if entry.slot is not None:
                if entry.slot.tree is not entry.tree:
                    raise VirtualPathError("/" + entry.path, "stale: its checkpoint tree was released", errno.ESTALE)
                entry.slot.pins += 1
            fh = next(self._handles_ids)
            self._handles[fh] = Handle(entry)
            return fh

    def opened(self, entry: RunEntry) -> None:
        """What the checkpoint tree of ``entry`` does for a file just opened (``VirtualTree.opened``)."""
        if entry.inner is not None:
            entry.tree.opened(entry.inner)

    def handle(self, fh: int) -> Handle:
        with self._lock:
            h = self._handles.get(fh)
        if h is None:
            raise VirtualPathError(f"handle {fh}", "no such open file", errno.EBADF)
        return h

    def open_entry(self, path: str) -> RunEntry | None:
        """The entry an open handle serves at ``path`` (its checkpoint may have left the listing since), or None."""
        key = "/".join(split_path(path))
        with self._lock:
            return next((h.entry for h in self._handles.values() if h.entry.path == key), None)

    def release(self, fh: int) -> None:
        with self._lock:
            h = self._handles.pop(fh, None)
        if h is not None and h.entry.slot is not None:
            self._unpin(h.entry.slot)

    # -- the whole run ------------------------------------------------------------------------------------------
    def all_paths(self) -> list:
        """The root's entries (checkpoint folders are not built for this)."""
        return list(self.lookup("").children)

    @property
    def total_size(self) -> int:
        """The complete checkpoint files' total size (what ``statfs`` reports; the generated files are not sized)."""
        return sum(c.size for c in self._listing.complete)

    @property
    def file_count(self) -> int:
        return len(self._slots)

    @property
    def node_count(self) -> int:
        """The root and its entries (``statfs``'s ``f_files``)."""
        return len(self.all_paths()) + 1

    def close(self) -> None:
        with self._lock:
            slots = list(self._built)
            self._handles.clear()
            self._draining.clear()
            for s in slots:
                s.pins = 0
                self._close_tree(s)


def run_readme(listing: RunListing, poll: float = POLL_SECONDS, held: list = ()) -> str:
    """The root README.txt of a run mount."""
    lines = ["ckptfs: a read-only view of a Cerebras training run; each checkpoint is a folder of files generated on "
             "read.", "", f"model_dir:   {listing.model_dir}"]
    latest = listing.latest
    lines.append(f"latest:      {latest.name} ({listing.latest_reason})" if latest else
                 f"latest:      none ({listing.latest_reason})")
    if listing.pointer_problem:
        lines.append(f"warning:     {listing.pointer_problem}; `latest` follows the autoload order instead")
    complete = [c for c in listing.complete if c not in held]
    lines += ["", f"checkpoints ({len(complete)} complete):"]
    width = max((len(c.name) for c in complete), default=0) + 1
    for c in complete:
        when = datetime.fromtimestamp(c.mtime_ns / 1e9).strftime("%Y-%m-%d %H:%M:%S") if c.mtime_ns else "-"
        size = f"{c.size:>16,} bytes" if c.sized else f"{'(objects not listed)':>22}"
        lines.append(f"  {c.name + '/':<{width}}  step {c.step:<10}  {size}  {when}")
    if listing.incomplete or held:
        lines += ["", "not shown:"]
        lines += [f"  {c.path.name}: {c.status}" for c in listing.incomplete]
        lines += [f"  {c.path.name}: replaces a file of the same name that is still open here; shown once that is "
                  "closed" for c in held]
    lines += ["",
              "Each folder holds what `ckptfs mount <its checkpoint file>` shows: the Hugging Face files at its root "
              "(from_pretrained works on the folder and on `latest`), cs/, torch/, tensors/ and its own README.txt.",
              f"The listing follows the model_dir while training writes (checked at most every {poll:g} s): a "
              "checkpoint appears once its save completed (" + ("its __METADATA__ object written, which cstorch "
                                                                "writes last; an .mdl object with __SUCCESS__ set"
                                                                if is_s3_url(listing.model_dir) else
                                                                "__SUCCESS__ set, renamed from its .tmp file") +
              ") and disappears when it is deleted; a file already open keeps serving the checkpoint it was opened "
              "on.",
              ""]
    return "\n".join(lines)


def is_run(path, options: MountOptions | None = None) -> bool:
    """Whether ``path`` is mounted as a whole run: a model_dir, local or in a bucket (``source.kind``), unless
    ``--single`` was given; a ``CheckpointError`` when it is nothing ckptfs reads."""
    from .assemble import classify_source

    src = classify_source(path, options or MountOptions())
    return src.is_run and not getattr(options, "single", False)


def check_run(model_dir, options: MountOptions | None = None) -> RunScanner:
    """A ``CheckpointError`` if ``model_dir`` cannot be followed as a run (it may hold no checkpoint yet); else the
    scanner that found so (``open_run(..., scanner=…)`` then scans again without probing anything twice)."""
    options = options or MountOptions()
    scanner = RunScanner(locate(model_dir, s3_settings(options)), allow_external=options.allow_external)
    scanner.scan()
    return scanner


def open_run(model_dir, options: MountOptions | None = None, **kw) -> RunTree:
    """The run tree of ``model_dir``, a local directory or an S3 prefix (``kw``: ``keep``, ``poll``, ``build``,
    ``build_tree``, ``scanner`` of ``RunTree``)."""
    from .assemble import classify_source

    src = classify_source(model_dir, options or MountOptions())
    if not src.is_run:
        what = "a checkpoint file, not a directory" if src.kind == "hdf5" else (src.reason or src.kind)
        raise CheckpointError(src.given, f"not a run (a model_dir holding checkpoint_<step>.mdl or Model Zoo's run "
                                         f"files): {what}")
    return RunTree(src.path, options, **kw)
