"""A training run's ``model_dir``: the checkpoints it holds, which are complete, and which one is the latest.

Cerebras Model Zoo saves ``checkpoint_<step>.mdl`` into the model_dir (``checkpoint_<step>_<YYYYmmdd_HHMMSS>.mdl``
when that name is taken). A format 0.5 save writes ``<name>.<8 hex>.tmp``, sets the ``__SUCCESS__`` attribute last
and renames the file when the save completed; a failed save leaves the ``.tmp`` behind. Older formats were written in
place and carry no completion flag: such a file counts as complete once it opens as a Cerebras checkpoint.

Autoload order (what Model Zoo resumes from): by step, then by the timestamp suffix, a name without one first. The
latest checkpoint is the last one in that order among the complete ones — unless the model_dir has a ``latest``
pointer (a symlink, or a text file naming a checkpoint, as ``resolve_checkpoint`` reads it) naming a complete one.

``RunScanner(model_dir).scan()`` lists the top level of the model_dir (checkpoints in subfolders belong to another
run: mount that folder). A checkpoint name that is a symbolic link is served only when it leads, links resolved, to
a file inside the model_dir (or an ``--allow-external`` folder); one leading elsewhere is listed as not served, with
the reason, as the ``latest`` pointer is confined (``resolve``). It opens each checkpoint file only to read its root attributes, without HDF5 file locking
(so a writer is never blocked), and remembers the answer until the file's size, mtime, ctime or inode change, so
that scanning a run of hundreds of checkpoints every second costs one ``stat`` per file.
"""
from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Hashable

import numpy as np

from ..errors import CheckpointError
from ..storage.base import Folder, FolderEntry
from ..storage.local import LocalFolder
from .h5store import one_line
from .resolve import CHECKPOINT_FILE, checkpoint_name

#: the temporary file of a save in progress (or of a failed one): ``<checkpoint name>.<8 hex>.tmp``
TEMPORARY_FILE = re.compile(r"^(?P<final>checkpoint_.+\.mdl)\.[0-9a-fA-F]{8}\.tmp$")

COMPLETE = "complete"
IN_PROGRESS = "temporary file of a save in progress (or of a failed save)"


@dataclass(frozen=True)
class RunCheckpoint:
    """One checkpoint file of a run, complete or not."""

    path: Path
    step: int | None  # None for a temporary file whose final name is not a step name
    stamp: datetime  # the timestamp suffix; datetime.min without one
    size: int
    mtime_ns: int
    complete: bool
    status: str  # COMPLETE, IN_PROGRESS, or why the file is not a usable checkpoint
    identity: Hashable = None  # the storage's version of the file (``FolderEntry.version``): changes with the file

    @property
    def name(self) -> str:
        """The folder it gets in a run mount: the file name without ``.mdl`` (``checkpoint_2000``)."""
        return self.path.name[:-4] if self.path.name.endswith(".mdl") else self.path.name

    @property
    def temporary(self) -> bool:
        return self.path.name.endswith(".tmp")

    def sort_key(self) -> tuple:
        return (self.step if self.step is not None else -1, self.stamp, self.temporary, self.path.name)


@dataclass(frozen=True)
class RunListing:
    """What a model_dir held at one scan."""

    model_dir: Path
    checkpoints: tuple  # every RunCheckpoint, complete or not, in autoload order
    latest: RunCheckpoint | None = None
    latest_reason: str = ""  # how ``latest`` was chosen
    pointer_problem: str | None = None  # why a ``latest`` pointer in the model_dir was not followed

    @property
    def complete(self) -> tuple:
        return tuple(c for c in self.checkpoints if c.complete)

    @property
    def incomplete(self) -> tuple:
        return tuple(c for c in self.checkpoints if not c.complete)


def parse_name(name: str):
    """``(step, stamp)`` of a checkpoint file name (``resolve.checkpoint_name``), ``(None, datetime.min)`` for the
    temporary file of a save whose final name is not a step name, or None if the name is neither."""
    tmp = TEMPORARY_FILE.match(name)
    final = tmp.group("final") if tmp else name
    if tmp and CHECKPOINT_FILE.match(final) is None:
        return None, datetime.min
    return checkpoint_name(final)


def probe(path) -> tuple:
    """``(complete, status)`` of one checkpoint file, from its root attributes only (HDF5 opened without locking)."""
    import h5py  # the LZ4 filter is registered: this module imports .h5store, which registers it on import

    try:
        f = h5py.File(path, "r", locking=False)
    except (OSError, ValueError) as e:
        return False, f"cannot be opened as an HDF5 file ({one_line(e)})"
    try:
        attrs = f.attrs
        if "__spec__" not in attrs:
            return False, "not a Cerebras checkpoint (no __spec__ attribute)"
        version = float(np.asarray(attrs["__version__"]).item()) if "__version__" in attrs else 0.1
        if version >= 0.5 and not ("__SUCCESS__" in attrs and bool(np.asarray(attrs["__SUCCESS__"]).item())):
            return False, "partial: no __SUCCESS__ flag (the save has not finished, or failed)"
        return True, COMPLETE
    except (OSError, ValueError, TypeError, KeyError) as e:
        return False, f"unreadable root attributes ({one_line(e)})"
    finally:
        f.close()


class RunScanner:
    """Scans one model_dir (a storage ``Folder``: a local directory unless ``folder`` says otherwise); remembers each
    file's probe until the file changes (thread-safe)."""

    def __init__(self, model_dir, folder: Folder | None = None, allow_external=()):
        self.model_dir = Path(model_dir).absolute()
        self.allow_external = tuple(allow_external or ())
        self.folder = folder if folder is not None else LocalFolder(self.model_dir, self.allow_external)
        self._probes: dict = {}  # identity -> (complete, status)
        self._lock = threading.Lock()

    def scan(self) -> RunListing:
        """The model_dir's checkpoints now. ``CheckpointError`` if the model_dir itself cannot be listed."""
        found = []
        try:
            entries = self.folder.entries(match=lambda name: parse_name(name) is not None)
        except OSError as e:
            raise CheckpointError(self.model_dir, f"cannot list the model_dir ({e.strerror or e})") from None
        for entry in entries:
            if entry.refused is not None:  # a link out of the model_dir: listed as not served, with the reason
                found.append(RunCheckpoint(self.model_dir / entry.name, *parse_name(entry.name), entry.size,
                                           entry.mtime_ns, False, entry.refused, entry.version))
            elif entry.is_file:  # links followed: a checkpoint may be a link to the file
                found.append(self._checkpoint(self.model_dir / entry.name, parse_name(entry.name), entry))
        found.sort(key=RunCheckpoint.sort_key)
        with self._lock:
            keep = {c.identity for c in found}
            self._probes = {k: v for k, v in self._probes.items() if k in keep}
        latest, reason, problem = choose_latest(self.model_dir, found, self.allow_external)
        return RunListing(self.model_dir, tuple(found), latest, reason, problem)

    def _checkpoint(self, path: Path, parsed: tuple, entry: FolderEntry) -> RunCheckpoint:
        step, stamp = parsed
        identity = entry.version
        if path.name.endswith(".tmp"):
            complete, status = False, IN_PROGRESS
        else:
            with self._lock:
                known = self._probes.get(identity)
            if known is None:
                known = probe(path)
                with self._lock:
                    self._probes[identity] = known
            complete, status = known
        return RunCheckpoint(path, step, stamp, entry.size, entry.mtime_ns, complete, status, identity)


def choose_latest(model_dir: Path, checkpoints: list, allow_external=()) -> tuple:
    """``(latest, reason, pointer_problem)``: the ``latest`` pointer's checkpoint if it names a complete one,
    else the last complete checkpoint in autoload order."""
    from .resolve import _latest_pointer

    complete = [c for c in checkpoints if c.complete]
    problem = None
    try:
        target = _latest_pointer(model_dir, allow_external)
    except CheckpointError as e:
        target, problem = None, e.problem
    if target is not None:
        real = os.path.realpath(target)
        named = [c for c in complete if os.path.realpath(c.path) == real]
        if named:
            return named[-1], f"named by the 'latest' pointer in {model_dir}", None
        problem = f"the 'latest' pointer names {target}, which is not a complete checkpoint of this run"
    if complete:
        return complete[-1], "highest step (then newest timestamp), as Cerebras' autoload picks it", problem
    return None, "no complete checkpoint yet", problem
