"""A training run's ``model_dir``: the checkpoints it holds, which are complete, and which one is the latest.

Cerebras Model Zoo saves ``checkpoint_<step>.mdl`` into the model_dir (``checkpoint_<step>_<YYYYmmdd_HHMMSS>.mdl``
when that name is taken). A format 0.5 save writes ``<name>.<8 hex>.tmp``, sets the ``__SUCCESS__`` attribute last
and renames the file when the save completed; a failed save leaves the ``.tmp`` behind. Older formats were written in
place and carry no completion flag: such a file counts as complete once it opens as a Cerebras checkpoint.

Autoload order (what Model Zoo resumes from): by step, then by the timestamp suffix, a name without one first. The
latest checkpoint is the last one in that order among the complete ones — unless the model_dir has a ``latest``
pointer (a symlink, or a text file naming a checkpoint, as ``resolve_checkpoint`` reads it) naming a complete one.

``RunScanner(model_dir).scan()`` lists the top level of the model_dir (checkpoints in subfolders belong to another
run: mount that folder) through the storage layer's ``Folder``: a local directory, or a prefix of an S3 bucket. A
checkpoint name that is a symbolic link is served only when it leads, links resolved, to a file inside the model_dir
(or an ``--allow-external`` folder); one leading elsewhere is listed as not served, with the reason, as the
``latest`` pointer is confined (``resolve``). It opens each checkpoint file only to read its root attributes, without
HDF5 file locking (so a writer is never blocked), and remembers the answer until the file's version changes (size,
mtime, ctime or inode; an object's ETag), so that scanning a run of hundreds of checkpoints every second costs one
``stat`` per file — in a bucket, the listing alone.

In a bucket a checkpoint may also be a prefix in Cerebras' S3 layout (``checkpoint_<step>.mdl/``, ``cstorch.save``
to ``s3://``): it is complete once its ``__METADATA__`` object exists (written last). A scan costs the listing of the
model_dir (one request per 1,000 entries, with a delimiter: never the checkpoints' own objects) and a HEAD of
``<prefix>/__METADATA__`` for the new prefixes from the newest down to the first complete one (one, usually: the
older prefixes are saves finished before it, listed without a request). A complete one is remembered until its prefix
leaves the listing (``KeepNCheckpoints`` deletes its objects); an incomplete one is asked again at most every
``RECHECK_SECONDS``. Nothing else of a checkpoint is read until its folder is entered; its size is unknown until then
(``RunCheckpoint.size`` 0, ``sized`` False).
"""
from __future__ import annotations

import os
import re
import threading
import time
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Hashable

from ...errors import CheckpointError
from ...storage.base import Blob, Folder
from ...storage.local import open_if_regular
from ...storage.locate import folder_of
from ...storage.s3url import is_s3_url
from ckptfs.readers.cerebras.h5errors import open_problem
from ..hf import zipdir
from ...errors import one_line
from .resolve import CHECKPOINT_FILE, checkpoint_name

#: the temporary file of a save in progress (or of a failed one): ``<checkpoint name>.<8 hex>.tmp``
TEMPORARY_FILE = re.compile(r"^(?P<final>checkpoint_.+\.mdl)\.[0-9a-fA-F]{8}\.tmp$")

COMPLETE = "complete"
IN_PROGRESS = "temporary file of a save in progress (or of a failed save)"
LAYOUT_IN_PROGRESS = "no __METADATA__ yet: a save in progress to S3 (or a failed one)"
LAYOUT_COPIED = ("a checkpoint in Cerebras' S3 layout copied to disk: unreadable (each tensor's shape and dtype lived in "
                 "its object's S3 metadata, which the copy lost): mount it in the bucket")
#: the object a checkpoint in Cerebras' S3 layout writes last
LAYOUT_METADATA = "__METADATA__"
#: the status of a checkpoint prefix older than a complete one, not asked about (``RunScanner._layouts_now``)
PRESUMED = "complete (older than a complete checkpoint; its __METADATA__ is read when its folder is entered)"
#: seconds before a prefix without ``__METADATA__`` (a save in progress, or a failed one) is asked about again
RECHECK_SECONDS = 2.0


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
    sized: bool = True  # False: a checkpoint prefix in a bucket, whose objects are not listed (``size`` is 0)

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
    """``(complete, status)`` of one checkpoint file (a path, or a file object over a blob), from its root attributes
    only (HDF5 opened without locking); a legacy-mode checkpoint (a ``torch.save`` zip) from its zip end record."""
    import h5py
    import numpy as np

    from ..cerebras import h5store  # noqa: F401 - registers the LZ4 filter on import

    torch_zip = probe_torch_zip(path)
    if torch_zip is not None:
        return torch_zip
    try:
        f = h5py.File(path, "r", locking=False)
    except (OSError, ValueError) as e:
        return False, open_problem(e, "file")
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


def probe_torch_zip(path) -> tuple | None:
    """``(complete, status)`` of a legacy-mode checkpoint file (``legacy_torch.is_legacy_torch``): complete once its
    zip end record is there (torch.save writes it last); None for any other file. ``path``: a path, or a
    ``RangedFile`` over a blob (whose blob is read)."""
    try:
        if not isinstance(path, (str, os.PathLike)):
            return _probe_torch(path.blob)
        blob = open_if_regular(path)
        if blob is None:
            return None
        with closing(blob):
            return _probe_torch(blob)
    except OSError as e:
        return False, f"cannot be read ({one_line(e)})"


def _probe_torch(blob: Blob) -> tuple | None:
    from ..legacy_torch.reader import HEAD_BYTES, ZIP_MAGIC, is_legacy_torch

    head = blob.read(0, HEAD_BYTES)
    if not is_legacy_torch(head):
        return None
    if not head.startswith(ZIP_MAGIC):
        return False, "torch's format before torch 1.6: not read (re-save it with torch>=1.6)"
    size = blob.size
    n = min(zipdir.TAIL_SIZE, size)
    try:
        zipdir.locate_directory(blob.read(size - n, n), size)
    except zipdir.ZipFormatError as e:
        return False, f"partial torch.save zip ({e})"
    return True, COMPLETE


class RunScanner:
    """Scans one model_dir (a local path or an ``S3Location``, listed through ``folder``, by default the storage
    layer's folder of it); remembers each file's probe until the file changes (thread-safe)."""

    def __init__(self, model_dir, folder: Folder | None = None, allow_external=()):
        self.model_dir = model_dir if is_s3_url(model_dir) else Path(model_dir).absolute()
        self.allow_external = tuple(allow_external or ())
        self.folder = folder if folder is not None else folder_of(self.model_dir, self.allow_external)
        self.in_bucket = is_s3_url(self.model_dir)  # a checkpoint may then be a prefix (Cerebras' S3 layout)
        self._probes: dict = {}  # identity -> (complete, status)
        self._layouts: dict = {}  # prefix name -> RunCheckpoint of a complete S3-layout checkpoint
        self._pending: dict = {}  # prefix name -> (monotonic time of its last probe, RunCheckpoint): no __METADATA__
        self._lock = threading.Lock()

    def scan(self) -> RunListing:
        """The model_dir's checkpoints now. ``CheckpointError`` if the model_dir itself cannot be listed."""
        found = []
        try:
            entries = self.folder.entries(match=lambda name: parse_name(name) is not None or name == "latest")
        except OSError as e:
            raise CheckpointError(self.model_dir, f"cannot list the model_dir ({e.strerror or e})") from None
        prefixes = []
        for e in entries:
            parsed = parse_name(e.name)
            if parsed is None:
                continue
            if e.refused is not None:  # a link out of the model_dir: listed as not served, with the reason
                found.append(RunCheckpoint(self.model_dir / e.name, *parsed, e.size, e.mtime_ns, False, e.refused,
                                           e.version))
            elif e.is_file:  # links followed: a checkpoint may be a link to the file
                found.append(self._checkpoint(e, parsed))
            elif self.in_bucket and not e.name.endswith(".tmp"):
                prefixes.append((e.name, parsed))
            elif not self.in_bucket and os.path.lexists(self.model_dir / e.name / LAYOUT_METADATA):
                found.append(RunCheckpoint(self.model_dir / e.name, *parsed, 0, e.mtime_ns, False, LAYOUT_COPIED,
                                           ("copied layout", e.name)))
        found += self._layouts_now(prefixes)
        found.sort(key=RunCheckpoint.sort_key)
        with self._lock:
            keep = {c.identity for c in found}
            self._probes = {k: v for k, v in self._probes.items() if k in keep}
            names = {c.path.name for c in found}
            self._layouts = {k: v for k, v in self._layouts.items() if k in names}
            self._pending = {k: v for k, v in self._pending.items() if k in names}
        pointer = any(e.name == "latest" and e.is_file for e in entries)
        latest, reason, problem = choose_latest(self.model_dir, found, self.folder if pointer else None,
                                                self.allow_external)
        return RunListing(self.model_dir, tuple(found), latest, reason, problem)

    def _checkpoint(self, e, parsed: tuple) -> RunCheckpoint:
        step, stamp = parsed
        identity = e.version
        if e.name.endswith(".tmp"):
            complete, status = False, IN_PROGRESS
        else:
            with self._lock:
                known = self._probes.get(identity)
            if known is None:
                known = self._probe(e.name)
                with self._lock:
                    self._probes[identity] = known
            complete, status = known
        return RunCheckpoint(self.model_dir / e.name, step, stamp, e.size, e.mtime_ns, complete, status, identity)

    def _probe(self, name: str) -> tuple:
        if not self.in_bucket:
            return probe(self.model_dir / name)
        from ...storage.rangedfile import RangedFile

        try:
            blob = self.folder.open(name)
        except OSError as e:
            return False, f"cannot be opened ({e})"
        return probe(RangedFile(blob))

    def _layouts_now(self, prefixes: list) -> list:
        """The checkpoints of the prefixes ``[(name, (step, stamp))]`` listed now. From the newest down (autoload
        order), each prefix not known yet is asked about (``_layout``: one HEAD; an incomplete one again once
        ``RECHECK_SECONDS`` passed) until one is complete: the prefixes older than that one are saves that Cerebras
        finished before starting it, listed as complete without a request (a failed one among them fails when its
        folder is entered, with the reason)."""
        now = time.monotonic()
        order = sorted(prefixes, key=lambda p: (p[1][0] if p[1][0] is not None else -1, p[1][1], p[0]), reverse=True)
        out = []
        settled = False  # a complete checkpoint newer than the prefixes still to place was found
        for name, parsed in order:
            with self._lock:
                known = self._layouts.get(name)
                pending = self._pending.get(name)
            if known is not None:
                out.append(known)
                settled = True
            elif settled:
                c = RunCheckpoint(self.model_dir / name, *parsed, 0, 0, True, PRESUMED, ("layout", name), sized=False)
                with self._lock:
                    self._layouts[name] = c
                out.append(c)
            elif pending is not None and now - pending[0] < RECHECK_SECONDS:
                out.append(pending[1])
            else:
                c = self._layout(name, parsed)
                out.append(c)
                settled = c.complete
        return out

    def _layout(self, name: str, parsed: tuple) -> RunCheckpoint:
        """A prefix of the bucket holding a checkpoint in Cerebras' S3 layout, complete once ``__METADATA__`` is:
        one HEAD of that object (none of the checkpoint's other objects is listed or read)."""
        step, stamp = parsed
        path = self.model_dir / name
        try:
            meta = self.folder.folder(name).stat(LAYOUT_METADATA)
        except OSError as err:
            c = RunCheckpoint(path, step, stamp, 0, 0, False, f"cannot be read ({err})", ("layout", name), sized=False)
            with self._lock:
                self._pending[name] = (time.monotonic(), c)
            return c
        if meta is None:
            c = RunCheckpoint(path, step, stamp, 0, 0, False, LAYOUT_IN_PROGRESS, ("layout", name), sized=False)
            with self._lock:
                self._pending[name] = (time.monotonic(), c)
            return c
        c = RunCheckpoint(path, step, stamp, 0, meta.mtime_ns, True, COMPLETE, ("layout", name, meta.version),
                          sized=False)
        with self._lock:
            self._layouts[name] = c
            self._pending.pop(name, None)
        return c


def choose_latest(model_dir, checkpoints: list, folder=None, allow_external=()) -> tuple:
    """``(latest, reason, pointer_problem)``: the ``latest`` pointer's checkpoint if it names a complete one,
    else the last complete checkpoint in autoload order. In a bucket, ``folder`` is given when the listing holds a
    ``latest`` object (read then)."""
    from .resolve import _latest_pointer

    complete = [c for c in checkpoints if c.complete]
    problem = None
    if is_s3_url(model_dir):
        return _latest_in_bucket(model_dir, complete, folder)
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


def _latest_in_bucket(model_dir, complete: list, folder) -> tuple:
    """``choose_latest`` for a model_dir in a bucket: a ``latest`` object naming a checkpoint of the run (its name,
    with or without ``.mdl``, or its step) wins if that checkpoint is complete."""
    problem = None
    if folder is not None:
        try:
            text = folder.read_text("latest", 4096).strip().splitlines()
        except OSError as e:
            text, problem = [], f"cannot read the 'latest' object ({e})"
        name = text[0].strip().rstrip("/").rsplit("/", 1)[-1] if text else ""
        wanted = {name, f"{name}.mdl", f"checkpoint_{name}.mdl"} if name else set()
        named = [c for c in complete if c.path.name in wanted]
        if named:
            return named[-1], f"named by the 'latest' object in {model_dir}", None
        if problem is None:
            problem = f"the 'latest' object names {name!r}, which is not a complete checkpoint of this run"
    if complete:
        return complete[-1], "highest step (then newest timestamp), as Cerebras' autoload picks it", problem
    return None, "no complete checkpoint yet", problem
