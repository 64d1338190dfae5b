"""What a checkpoint argument is: the one place that decides it.

``classify(CKPT)`` looks at what the argument names — its spelling, its first bytes, the names in its folder, the
objects under an S3 prefix — and returns a ``SourceKind``: what it is (``kind``), what to open (``path``: the file,
the folder, the Hub snapshot, the ``S3Location``) and, when it is nothing ckptfs reads (``NOTHING``), ``reason``: one
line saying what was found and what would work. Every command asks this module (``mount``, ``info``, ``ls``,
``export``, ``diff``, ``convert-config``; the API), so a path means the same thing everywhere and a wrong one gets
the same line everywhere. Nothing here reads a tensor; a folder is read by its names only (bounded), a file by its
first 16 bytes, a bucket by one HEAD and one listing.

The recognisers run in this order; the first that answers wins (``RECOGNISERS``, one row each: a new kind of
source is a function and a row, placed where its checks belong):

*text* — before the file system, on the argument as given:

1. ``s3``: an ``s3://`` location, or a spelling naming one unambiguously (``S3://``, ``s3a://``, ``s3n://``, AWS's
   virtual-hosted and path-style https URLs: ``storage.s3url``): an HDF5 object (``S3_OBJECT``), a prefix in
   Cerebras' S3 layout (``S3_LAYOUT``: ``__METADATA__``), a run (``S3_RUN``: ``checkpoint_<step>.mdl`` objects or
   prefixes); ``RUN/latest`` and ``RUN/checkpoint_<step>`` in a bucket mean that checkpoint of the run;
2. ``url``: any other ``SCHEME://`` text: ``NOTHING``, saying what to give instead (an https URL of another host:
   ``s3://`` with ``--endpoint-url``);

*missing* — a path that does not exist:

3. ``hub id``: ``ORG/NAME``, a repository of the local Hugging Face Hub cache (``source.hub_cache``; a local
   folder of the same name wins, being found first) -> ``HF_FOLDER`` (its snapshot);
4. ``run member``: ``MODEL_DIR/latest``, ``MODEL_DIR/checkpoint_<step>`` (the names a run mount shows) ->
   ``HDF5_FILE`` (that checkpoint);
5. ``tf checkpoint``: a TF saver prefix (``model.ckpt-100`` beside its ``.index``) -> ``TF_CHECKPOINT``;

*file* — by its first bytes:

6. ``tf index``: a TF saver checkpoint's ``.index`` file -> ``TF_CHECKPOINT``;
7. ``hdf5``: the HDF5 signature ``\\x89HDF\\r\\n\\x1a\\n`` (at 0, 512, 1024…) -> ``HDF5_FILE`` (a Cerebras ``.mdl``, or
   a TF-era Cerebras H5 file: the HDF5 reader tells them apart by their root objects, ``tf_h5.is_tf_h5``);
8. ``run pointer``: a ``latest`` text file of a model_dir -> the checkpoint it names;
9. ``s3 layout copy``: a file of a Cerebras S3-layout checkpoint copied to disk -> ``NOTHING`` (see 12);
10. ``legacy torch``: a legacy-mode ``torch.save`` checkpoint (``is_legacy_torch``: zip ``PK\\x03\\x04``, or torch's
    formats before 1.6, which its reader refuses with the reason) -> ``LEGACY_TORCH``;

*folder* — by the names it holds:

11. ``hub cache``: a Hub repository folder (``models--ORG--NAME``) -> ``HF_FOLDER``; its ``snapshots/`` folder ->
    ``NOTHING`` (give one snapshot, or the repository);
12. ``s3 layout copy``: ``__METADATA__`` beside tensor files, or ``checkpoint_<step>.mdl/`` folders holding one
    (``aws s3 sync`` of a checkpoint or run in Cerebras' S3 layout) -> ``NOTHING``: each tensor's shape and dtype
    lived in its object's S3 metadata, which the copy lost;
13. ``run``: a model_dir holding a checkpoint file (``checkpoint_<step>[_<stamp>].mdl``), a save in progress
    (``.tmp``) or a ``latest`` pointer -> ``RUN``;
14. ``tf checkpoint``: a TF saver folder (a ``checkpoint`` state file) -> ``TF_CHECKPOINT`` (its latest);
15. ``hf``: ``config.json`` beside weights, or a multi-folder model -> ``HF_FOLDER``; ``config.json`` alone ->
    ``NOTHING``;
16. ``loose mdl``: ``.mdl`` files not named as a run's checkpoints -> ``NOTHING`` (give the file);
17. ``run markers``: a model_dir before its first checkpoint, known by Model Zoo's run files (``RUN_MARKERS``:
    params YAML, ``cerebras_logs/``, ``train/``, ``eval/``, run logs, TensorBoard events) -> ``RUN`` (empty: a
    mount shows ``latest: none`` until a checkpoint completes);

anything else is ``NOTHING``, naming what the folder holds.
"""
from __future__ import annotations

import fnmatch
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ckptfs.errors import CheckpointError
from ckptfs.storage.local import LocalFile
from ckptfs.storage.s3url import BadS3Url, S3Location, S3Settings, is_s3_url, parse_s3_url, url_problem

HDF5_FILE = "hdf5"  # a Cerebras checkpoint file (.mdl), local
HF_FOLDER = "hf"  # a Hugging Face model folder, Hub snapshot or repository (served as a Cerebras checkpoint)
RUN = "run"  # a local model_dir
S3_OBJECT = "s3 object"  # an HDF5 .mdl stored as one object
S3_LAYOUT = "s3 layout"  # a prefix in Cerebras' S3 layout
S3_RUN = "s3 run"  # a model_dir in a bucket
TF_CHECKPOINT = "tf checkpoint"  # a TF saver checkpoint: its prefix, its .index file or its folder
LEGACY_TORCH = "legacy torch"  # a legacy-mode torch.save checkpoint
NOTHING = "nothing"

#: names (shell patterns) in a model_dir that Model Zoo's trainer writes before the first checkpoint: such a folder
#: is a run that has not saved yet
RUN_MARKERS = ("params.yaml", "params*.yaml", "params*.yml", "train_params*.yaml", "cerebras_logs", "train", "eval",
               "latest_run.log", "run_*.log", "events.out.tfevents.*", "performance", "performance.json")
#: what a folder argument's listing reads at most (its names only)
MAX_ENTRIES = 10_000
#: the object a checkpoint in Cerebras' S3 layout writes last
LAYOUT_METADATA = "__METADATA__"

_WHAT_WORKS = ("give a checkpoint_<step>.mdl file, a model_dir holding one (or Model Zoo's run files), a Hugging "
               "Face model folder (config.json + model.safetensors), a Hub repository id (ORG/NAME) in the local "
               "cache, a TensorFlow saver checkpoint, a legacy torch.save checkpoint, or an s3:// location")
S3_COPY_REASON = ("a checkpoint in Cerebras' S3 layout copied to a file system ({what}): each tensor's shape and "
                  "dtype lived in its object's S3 metadata, which the copy lost, so neither ckptfs nor cstorch.load "
                  "can read it: mount it in the bucket (s3://BUCKET/…/checkpoint_<step>.mdl, with --endpoint-url "
                  "for a store other than AWS), or copy it with a tool that keeps each object's metadata")


@dataclass(frozen=True)
class SourceKind:
    """What a checkpoint argument is (see the module docstring)."""

    kind: str
    path: object  # what to open: a Path, an S3Location; None for NOTHING
    given: str  # the argument as given
    reason: str = ""  # NOTHING: what was found and what would work; else how it was recognised
    target: object = None  # S3 kinds: the ``s3open.S3Target`` (what the listing found), so that opening lists no more
    via: str = ""  # the recogniser that answered

    @property
    def found(self) -> bool:
        return self.kind != NOTHING

    @property
    def is_run(self) -> bool:
        return self.kind in (RUN, S3_RUN)

    @property
    def is_hf(self) -> bool:
        return self.kind == HF_FOLDER

    @property
    def in_bucket(self) -> bool:
        return self.kind in (S3_OBJECT, S3_LAYOUT, S3_RUN)

    def require(self) -> "SourceKind":
        """Itself, or ``CheckpointError`` (``<path>: <reason>``) when it is nothing ckptfs reads."""
        if not self.found:
            raise CheckpointError(self.given, self.reason)
        return self


@dataclass
class Probe:
    """One argument being classified, with what the recognisers have read of it (each read once)."""

    given: str
    path: object  # a Path, or an S3Location
    settings: S3Settings
    revision: str | None = None
    allow_external: tuple = ()
    _head: bytes | None = None
    _size: int = 0
    _names: list | None = None
    _file: LocalFile | None = None  # the file, opened by the first read (a regular file: the "file" stage)
    read_error: str | None = None

    def read(self, offset: int, n: int) -> bytes:
        """``n`` bytes of the file from ``offset`` (fewer at its end), through the storage layer; ``OSError``."""
        if self._file is None:
            self._file = LocalFile(self.path)
        return self._file.read(offset, n)

    def close(self) -> None:
        """Close the file the reads opened."""
        f, self._file = self._file, None
        if f is not None:
            f.close()

    def head(self) -> bytes:
        """The file's first 16 bytes."""
        if self._head is None:
            try:
                self._head = self.read(0, 16)
                self._size = self._file.size
            except OSError as e:
                self._head, self.read_error = b"", e.strerror or str(e)
        return self._head

    def signature_at(self, offset: int) -> bool:
        """Whether the HDF5 signature is at ``offset`` of the file."""
        from ckptfs.readers.cerebras.h5store import HDF5_SIGNATURE

        try:
            return self.read(offset, 8) == HDF5_SIGNATURE
        except OSError:
            return False

    @property
    def size(self) -> int:
        self.head()
        return self._size

    def names(self) -> list:
        """The folder's entry names (at most ``MAX_ENTRIES``), sorted."""
        if self._names is None:
            out = []
            try:
                with os.scandir(self.path) as it:
                    for e in it:
                        out.append(e.name)
                        if len(out) >= MAX_ENTRIES:
                            break
            except OSError:
                pass
            self._names = sorted(out)
        return self._names

    def kind(self, kind: str, path=None, reason: str = "", target=None) -> SourceKind:
        return SourceKind(kind, self.path if path is None and kind != NOTHING else path, self.given, reason, target)

    def nothing(self, reason: str) -> SourceKind:
        return SourceKind(NOTHING, None, self.given, reason)


@dataclass(frozen=True)
class Recogniser:
    """One row of the table: ``check(probe)`` -> a ``SourceKind``, or None when it is not this kind."""

    name: str
    stage: str  # "text", "missing", "file" or "folder"
    check: Callable[[Probe], SourceKind | None]
    handled: bool = True  # False: a placeholder that answers nothing yet


# ---- text --------------------------------------------------------------------------------------------------------

def _s3(p: Probe) -> SourceKind | None:
    if not is_s3_url(p.path):
        return None
    from ckptfs.readers.s3.target import LAYOUT, OBJECT, RUN as S3RUN, classify as s3_classify

    try:
        loc = p.path if isinstance(p.path, S3Location) else parse_s3_url(str(p.path), p.settings)
    except BadS3Url as e:
        return p.nothing(str(e))
    p.path = loc
    kinds = {OBJECT: S3_OBJECT, LAYOUT: S3_LAYOUT, S3RUN: S3_RUN}
    if loc.name == "latest" and loc.key:
        return _s3_member(p, loc)
    try:
        target = s3_classify(loc)
    except CheckpointError as e:
        if _is_member_name(loc.name) and "/" in loc.key:  # a name a run mount shows: the run says what it holds
            member = _s3_member(p, loc)
            if member.found or "the run in" in member.reason:
                return member
        return SourceKind(NOTHING, None, e.path or p.given, e.problem)  # the path the endpoint's answer concerns
    return SourceKind(kinds[target.kind], target.location, p.given, target=target)


def _s3_member(p: Probe, loc: S3Location) -> SourceKind:
    """``RUN/latest`` or ``RUN/checkpoint_<step>`` of a run in a bucket: that checkpoint."""
    from ckptfs.readers.run.scan import RunScanner
    from ckptfs.readers.s3.target import RUN as S3RUN, classify as s3_classify

    try:
        run = s3_classify(loc.parent)
        if run.kind != S3RUN:
            return p.nothing(f"no such object or prefix, and {loc.parent} is not a run (a prefix holding "
                             "checkpoint_<step>.mdl)")
        chosen = _member(RunScanner(run.location).scan(), loc.name, loc.parent)
        target = s3_classify(chosen)
    except CheckpointError as e:
        return SourceKind(NOTHING, None, p.given, e.problem)
    kinds = {"object": S3_OBJECT, "layout": S3_LAYOUT}
    return SourceKind(kinds.get(target.kind, S3_RUN), target.location, p.given, f"{loc.name} of the run in {loc.parent}",
                      target)


def _url(p: Probe) -> SourceKind | None:
    problem = url_problem(p.given)
    return p.nothing(problem) if problem else None


# ---- missing paths -------------------------------------------------------------------------------------------------

def _hub_id(p: Probe) -> SourceKind | None:
    from ckptfs.readers.hf.hub_cache import looks_like_repo_id, resolve_repo_id

    if not looks_like_repo_id(p.given):
        return None
    try:
        snap = resolve_repo_id(p.given, p.revision)
    except CheckpointError as e:
        return SourceKind(NOTHING, None, e.path, e.problem)
    inner = classify_local(Probe(str(snap), snap, p.settings, None, p.allow_external))
    if not inner.found:
        return SourceKind(NOTHING, None, p.given, f"its Hub cache snapshot {snap}: {inner.reason}")
    return SourceKind(HF_FOLDER, snap, p.given, f"Hub repository {p.given} in the local cache")


def _is_member_name(name: str) -> bool:
    from ckptfs.readers.run.resolve import CHECKPOINT_FILE

    return name == "latest" or CHECKPOINT_FILE.match(name + ".mdl") is not None


def _member(listing, name: str, run) -> object:
    """The checkpoint ``name`` (``latest``, ``checkpoint_<step>`` or its file name) of a scanned run."""
    if name == "latest":
        if listing.latest is None:
            raise CheckpointError(run / name, f"the run in {run} has no complete checkpoint "
                                              f"({listing.latest_reason})")
        return listing.latest.path
    for c in listing.complete:
        if name in (c.name, c.path.name):
            return c.path
    names = ", ".join(c.name for c in listing.complete) or "none"
    raise CheckpointError(run / name, f"no such file, nor a checkpoint of the run in {run} (its complete "
                                      f"checkpoints: {names}; latest)")


def _run_member(p: Probe) -> SourceKind | None:
    path = Path(p.path)
    if not _is_member_name(path.name) or not path.parent.is_dir():
        return None
    parent = classify_local(Probe(str(path.parent), path.parent, p.settings, None, p.allow_external))
    if parent.kind != RUN:
        return None
    from ckptfs.readers.run.scan import RunScanner

    try:
        chosen = _member(RunScanner(path.parent, allow_external=p.allow_external).scan(), path.name, path.parent)
    except CheckpointError as e:
        return SourceKind(NOTHING, None, p.given, e.problem)
    return SourceKind(HDF5_FILE, Path(chosen), p.given, f"{path.name} of the run in {path.parent}")


def _tf_checkpoint_prefix(p: Probe) -> SourceKind | None:
    """A TF saver checkpoint prefix (``model.ckpt-100`` beside ``model.ckpt-100.index``)."""
    from ckptfs.readers.tf.locate import is_tf_source

    return p.kind(TF_CHECKPOINT, reason="a TensorFlow saver checkpoint (its prefix)") if is_tf_source(p.path) else None


# ---- files ---------------------------------------------------------------------------------------------------------

def _tf_index(p: Probe) -> SourceKind | None:
    """A TF saver checkpoint's ``.index`` file (a LevelDB-style table ending in its magic number)."""
    from ckptfs.readers.tf.locate import is_index_file

    return p.kind(TF_CHECKPOINT, reason="a TensorFlow saver checkpoint (its .index file)") \
        if is_index_file(Path(p.path)) else None


def _hdf5(p: Probe) -> SourceKind | None:
    from ckptfs.readers.cerebras.h5store import what_bytes_are

    head = p.head()
    if p.read_error:
        return None
    if what_bytes_are(head, p.size, p.signature_at) is None:
        return p.kind(HDF5_FILE)
    return None


def _run_pointer(p: Probe) -> SourceKind | None:
    path = Path(p.path)
    if path.name != "latest" or p.size > 4096:
        return None
    return _run_member(p)


def _s3_copy_file(p: Probe) -> SourceKind | None:
    path = Path(p.path)
    if path.name == LAYOUT_METADATA or os.path.lexists(path.parent / LAYOUT_METADATA):
        return p.nothing(S3_COPY_REASON.format(what=f"{path.name} is one of its files, in {path.parent}"))
    return None


def _legacy_torch(p: Probe) -> SourceKind | None:
    """A legacy-mode ``torch.save`` checkpoint (``is_legacy_torch`` of its first bytes: the zip format, or torch's
    formats before 1.6, which its reader refuses with the reason)."""
    from ckptfs.readers.legacy_torch.reader import HEAD_BYTES, is_legacy_torch

    try:
        head = p.read(0, HEAD_BYTES)
    except OSError:
        return None
    return p.kind(LEGACY_TORCH, reason="a torch.save file (legacy mode)") if is_legacy_torch(head) else None


def _unknown_file(p: Probe) -> SourceKind:
    from ckptfs.readers.cerebras.h5store import what_bytes_are

    if p.head() == b"" and p.read_error:
        return p.nothing(f"cannot be read ({p.read_error})")
    why = what_bytes_are(p.head(), p.size, p.signature_at) or "not a Cerebras checkpoint"
    if "safetensors" in why or "zip" in why:
        why += " (a Hugging Face weight file: give the model folder that holds it with its config.json)"
    return p.nothing(why)


# ---- folders -------------------------------------------------------------------------------------------------------

def _hub_cache(p: Probe) -> SourceKind | None:
    from ckptfs.readers.hf.hub_cache import snapshot_of_repo

    path = Path(p.path).absolute()
    if path.name == "snapshots" and path.parent.name.startswith("models--"):
        snaps = [n for n in p.names() if os.path.isdir(path / n)]
        example = path / (snaps[0] if snaps else "<commit>")
        return p.nothing(f"the snapshots/ folder of a Hub cache repository ({len(snaps)} snapshot(s)): give one "
                         f"snapshot ({example}), the repository folder {path.parent}, or its id "
                         f"{path.parent.name[len('models--'):].replace('--', '/')}")
    if not (path.name.startswith("models--") and (path / "snapshots").is_dir()):
        return None
    if p.revision is not None:
        try:
            snap = snapshot_of_repo(path, p.revision)
        except CheckpointError as e:
            return SourceKind(NOTHING, None, e.path, e.problem)
        return SourceKind(HF_FOLDER, snap, p.given, f"Hub cache repository at revision {p.revision}")
    return p.kind(HF_FOLDER, reason="Hub cache repository")


def _checkpoint_entries(p: Probe) -> tuple:
    """``(files, layout folders)``: the folder's checkpoint files (or saves in progress, or a ``latest`` pointer)
    and its ``checkpoint_<step>.mdl/`` folders holding ``__METADATA__``."""
    from ckptfs.readers.run.scan import parse_name

    files, layouts = [], []
    for n in p.names():
        if n != "latest" and parse_name(n) is None:
            continue
        full = Path(p.path) / n
        if os.path.isdir(full):
            if os.path.lexists(full / LAYOUT_METADATA):
                layouts.append(n)
        elif os.path.lexists(full):
            files.append(n)
    return files, layouts


def _s3_copy_folder(p: Probe) -> SourceKind | None:
    names = p.names()
    if LAYOUT_METADATA in names:
        return p.nothing(S3_COPY_REASON.format(what=f"{LAYOUT_METADATA} and {len(names) - 1} tensor file(s)"))
    files, layouts = _checkpoint_entries(p)
    if layouts and not [f for f in files if f != "latest"]:
        return p.nothing(S3_COPY_REASON.format(what=f"{', '.join(layouts[:3])}{'…' if len(layouts) > 3 else ''}: "
                                                    f"folders holding {LAYOUT_METADATA}, not .mdl files"))
    return None


def _run(p: Probe) -> SourceKind | None:
    files, _ = _checkpoint_entries(p)
    return p.kind(RUN, reason="a model_dir holding checkpoints") if files else None


def _tf_checkpoint_folder(p: Probe) -> SourceKind | None:
    """A TF saver checkpoint folder (a ``checkpoint`` state file naming the latest prefix)."""
    from ckptfs.readers.tf.locate import is_tf_source

    return p.kind(TF_CHECKPOINT, reason="a folder of TensorFlow saver checkpoints (its checkpoint file)") \
        if is_tf_source(p.path) else None


def _hf(p: Probe) -> SourceKind | None:
    from ckptfs.readers.hf.names import (BIN_INDEX, BIN_SINGLE, CONFIG, SAFE_INDEX, SAFE_SINGLE, UNREAD_WEIGHTS,
        component_folders)

    path = Path(p.path)
    names = set(p.names())
    if component_folders(path):
        return p.kind(HF_FOLDER, reason="a multi-folder Hugging Face model")
    if CONFIG not in names:
        return None
    weights = (SAFE_SINGLE, SAFE_INDEX, BIN_SINGLE, BIN_INDEX) + UNREAD_WEIGHTS
    if any(n in names for n in weights) or any(n.startswith(("model-0", "pytorch_model-0")) for n in names):
        return p.kind(HF_FOLDER, reason="a Hugging Face model folder")
    return p.nothing(f"a Hugging Face config without weights ({CONFIG}, no {SAFE_SINGLE}, {SAFE_INDEX}, "
                     f"{BIN_SINGLE} or {BIN_INDEX}): download the weights too, or give the folder that holds them")


def _loose_mdl(p: Probe) -> SourceKind | None:
    mdl = [n for n in p.names() if n.endswith(".mdl") and os.path.isfile(Path(p.path) / n)]
    if not mdl:
        return None
    return p.nothing(f"a folder holding {', '.join(mdl[:3])}, not named as a run's checkpoints "
                     f"(checkpoint_<step>.mdl): give the file itself ({Path(p.path) / mdl[0]})")


def _run_markers(p: Probe) -> SourceKind | None:
    found = [n for n in p.names() if any(fnmatch.fnmatchcase(n, m) for m in RUN_MARKERS)]
    if found:
        return p.kind(RUN, reason=f"a model_dir before its first checkpoint ({', '.join(found[:3])})")
    return None


def _unknown_folder(p: Probe) -> SourceKind:
    names = p.names()
    if not names:
        return p.nothing(f"an empty folder, not a checkpoint: {_WHAT_WORKS}")
    shown = ", ".join(names[:4]) + ("…" if len(names) > 4 else "")
    nested = _nested_run(p)
    if nested:
        return p.nothing(f"a folder with no checkpoint of its own (it holds {shown}); {nested}/ holds "
                         f"checkpoint_<step>.mdl files: give that folder")
    return p.nothing(f"a folder with no checkpoint, Model Zoo run files or Hugging Face model (it holds "
                     f"{len(names)} entr{'y' if len(names) == 1 else 'ies'}: {shown}): {_WHAT_WORKS}")


def _nested_run(p: Probe) -> str | None:
    """A sub-folder (one level down, the first 50 looked at) holding checkpoint files."""
    from ckptfs.readers.run.resolve import checkpoint_name

    subs = [n for n in p.names() if os.path.isdir(Path(p.path) / n)][:50]
    for s in subs:
        try:
            with os.scandir(Path(p.path) / s) as it:
                if any(checkpoint_name(e.name) is not None for e in it):
                    return s
        except OSError:
            continue
    return None


#: the table, in the order of the module docstring
RECOGNISERS: list = [
    Recogniser("s3", "text", _s3),
    Recogniser("url", "text", _url),
    Recogniser("hub id", "missing", _hub_id),
    Recogniser("run member", "missing", _run_member),
    Recogniser("tf checkpoint", "missing", _tf_checkpoint_prefix),
    Recogniser("tf index", "file", _tf_index),
    Recogniser("hdf5", "file", _hdf5),
    Recogniser("run pointer", "file", _run_pointer),
    Recogniser("s3 layout copy", "file", _s3_copy_file),
    Recogniser("legacy torch", "file", _legacy_torch),
    Recogniser("hub cache", "folder", _hub_cache),
    Recogniser("s3 layout copy", "folder", _s3_copy_folder),
    Recogniser("run", "folder", _run),
    Recogniser("tf checkpoint", "folder", _tf_checkpoint_folder),
    Recogniser("hf", "folder", _hf),
    Recogniser("loose mdl", "folder", _loose_mdl),
    Recogniser("run markers", "folder", _run_markers),
]


def _first(stage: str, p: Probe) -> SourceKind | None:
    for r in RECOGNISERS:
        if r.stage == stage:
            found = r.check(p)
            if found is not None:
                return found if found.via else SourceKind(found.kind, found.path, found.given, found.reason,
                                                          found.target, r.name)
    return None


def classify(location, *, settings: S3Settings | None = None, revision: str | None = None,
             allow_external=()) -> SourceKind:
    """What ``location`` (a text, a ``Path`` or an ``S3Location``) is: see the module docstring. Never raises for
    a wrong argument: its ``SourceKind`` is ``NOTHING`` with the reason (``require()`` raises it)."""
    given = str(location)
    path = location if isinstance(location, S3Location) else (location if is_s3_url(location) else None)
    p = Probe(given, path if path is not None else Path(os.fspath(location)), settings or S3Settings(), revision,
              tuple(allow_external or ()))
    if path is not None or isinstance(location, str):
        found = _first("text", p)
        if found is not None:
            return found
    return classify_local(p)


def classify_local(p: Probe) -> SourceKind:
    """``classify`` of a local path (the *missing*, *file* and *folder* stages)."""
    path = Path(p.path)
    try:
        st = os.stat(path)
    except OSError as e:
        found = _first("missing", p)
        if found is not None:
            return found
        if os.path.islink(path):
            return p.nothing("a dangling symbolic link")
        return p.nothing("no such file or directory" if isinstance(e, FileNotFoundError)
                         else f"cannot be read ({e.strerror or e})")
    if stat.S_ISREG(st.st_mode):
        try:
            return _first("file", p) or _unknown_file(p)
        finally:
            p.close()
    if stat.S_ISDIR(st.st_mode):
        return _first("folder", p) or _unknown_folder(p)
    from ckptfs.guard.confine import non_regular_kind

    what = non_regular_kind(st) or "neither a regular file nor a folder"
    return p.nothing(f"{what}, not a checkpoint file: not opened ({_WHAT_WORKS})")


def is_hf_folder(path) -> bool:
    """Whether ``path`` is served as a Hugging Face model (a model folder, a multi-folder model, a Hub cache
    repository or snapshot) rather than a Model Zoo ``model_dir``: ``source.kind`` decides (a folder holding
    checkpoint files is a run, whatever else it holds)."""
    return classify(path).is_hf

