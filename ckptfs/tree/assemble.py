"""The assembly of a mount's tree from a checkpoint's views: ``build_tree(ckpt_path, options)``.

It opens the checkpoint, creates the tree's own block cache (``options.cache_size``), runs the builder of each
registered view named in ``options.views`` (``ckptfs.views.registry``; a view whose builder raises is *missing* with
a reason, the others still mount), places each view's files in its folder and writes a root ``README.txt`` saying
what was mounted. ``views=`` replaces the registered builders by one function giving every view's result (a test's
synthetic files: tests/helpers/fuse.py); the checkpoint is then not opened.
"""
from __future__ import annotations

import json
import importlib
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable

from ..tensor.cache import BlockCache
from ..errors import CheckpointError, CkptfsError
from ..layouts.torchzip.crc_store import CrcStore
from ..views.options import MountOptions, check_options, content_options, s3_settings
from ..state.dirs import cache_dir
from ..storage.s3url import is_s3_url
from ..units import human_size
from ..views.base import README_NAME, BytesFile, ViewContext, ViewResult
from ..views.registry import default_names, folder_of, names, view, views_for
from .base import split_path
from .memory import tree_cache, tree_parts
from .virtual import VirtualTree

log = logging.getLogger("ckptfs.tree")

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
    format_name: str | None = None  # a format without a Cerebras format version (a TensorFlow kind's)


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


def outcome_from(name: str, result) -> ViewOutcome:
    """Normalise what a builder produced (a ``ViewResult`` or an exception) into a ``ViewOutcome``."""
    if isinstance(result, CkptfsError):
        return ViewOutcome(name, missing=str(result))
    if isinstance(result, BaseException):
        return ViewOutcome(name, missing=f"internal error: {type(result).__name__}: {result}")
    if not isinstance(result, ViewResult):
        return ViewOutcome(name, missing=f"internal error: builder returned {type(result).__name__}, not ViewResult")
    files = {}
    prefix = folder_of(name)
    for rel, vf in (result.files or {}).items():
        rel = "/".join(split_path(rel))
        files[rel if (not prefix or rel.startswith(prefix)) else prefix + rel] = vf
    try:  # validate the view alone, so that one broken view cannot stop the others
        VirtualTree(files)
    except CkptfsError as e:
        return ViewOutcome(name, missing=f"invalid file list: {e}", notes=list(result.notes or []))
    return ViewOutcome(name, files, result.missing, [str(n) for n in (result.notes or [])])


def run_builder(view, ctx: ViewContext, build: Callable | None = None) -> ViewOutcome:
    """Run a registered view's builder (``ckptfs.views.registry.View``: its module's ``build``, imported here, or
    ``build``); failures make the view missing."""
    name = view.name
    try:
        result = (build or importlib.import_module(view.module).build)(ctx)
    except CkptfsError as e:
        log.debug("view %s failed", name, exc_info=True)
        result = e
    except Exception as e:  # a bug in one view must not take the others down
        log.warning("view %s: internal error: %s: %s", name, type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
        result = e
    return outcome_from(name, result)


def _run_view(name: str, ctx: ViewContext) -> ViewOutcome:
    try:
        return run_builder(view(name), ctx)
    except KeyError:
        return ViewOutcome(name, missing=f"unknown view (known: {', '.join(names())})")


def family_of(outcomes: list) -> str | None:
    """The model family as the hf view says it: ``model_type`` (and architecture) of its config.json."""
    for o in outcomes:
        vf = o.files.get(folder_of(o.name) + "config.json") if o.name == "hf" else None
        if vf is None or vf.size > (1 << 20):
            continue
        try:
            cfg = json.loads(vf.read(0, vf.size))
        except (CkptfsError, ValueError) as e:  # the config could not be made or is not JSON: no family named
            log.debug("view %s: no family from its config.json: %s", o.name, e)
            return None
        fam = cfg.get("model_type")
        archs = cfg.get("architectures") or []
        if fam and archs:
            return f"{fam} ({', '.join(map(str, archs))})"
        return fam or (", ".join(map(str, archs)) or None)
    return None


def _publishing(outcomes: list) -> list:
    """README.txt's lines on what to publish, when the hf view serves the repository folder (``views/hf_dir.py``)."""
    from ..views.hf.arrange import HUB_FOLDER, publishing_lines  # here: the mount command starts without it (yaml…)

    paths = [p for o in outcomes if o.present for p in o.files]
    if not any(p.startswith(HUB_FOLDER + "/") for p in paths):
        return []
    return publishing_lines(paths, [folder_of(o.name) for o in outcomes if o.present and folder_of(o.name)])


def _loading(outcomes: list) -> list:
    """README.txt's ``load:`` lines, when the hf view serves a format in a sub-folder of its own (``bin/``): which
    ``from_pretrained`` call reads which files (``use_safetensors=False`` on the root finds no ``.bin``)."""
    from ..views.hf import formats as hf_formats

    paths = {p for o in outcomes if o.present for p in o.files}
    sub = [f for f in hf_formats.FORMATS if f.folder]
    if not sub or not any(p.startswith(sub[0].folder + "/") and sub[0].is_shard(p.rsplit("/", 1)[-1]) for p in paths):
        return []
    return [f"{'load:' if i == 0 else '':<16}{line}" for i, line in enumerate(hf_formats.loading_lines())]


def readme_text(info: SourceInfo, outcomes: list) -> str:
    """The root README.txt: what was mounted, which views are present, why any is missing, and all notes."""
    lines = ["ckptfs: a read-only view of a Cerebras checkpoint; every file is generated on read.", ""]
    lines.append(f"checkpoint:     {info.path}")
    if info.format_name:
        lines.append(f"format:         {info.format_name}")
    elif info.format_version is not None:
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
    lines += _publishing(outcomes)
    lines += _loading(outcomes)
    lines += ["", "views:"]
    for o in outcomes:
        if o.present:
            ready = [f for f in o.files.values() if not getattr(f, "deferred", False)]
            status = f"{len(o.files)} file{'' if len(o.files) == 1 else 's'}"
            if ready:  # a file served at several paths (hub/ mirrors the model) counts once, as export stores it
                status += f", {human_size(sum(f.size for f in {id(f): f for f in ready}.values()))}"
            if len(ready) < len(o.files):
                status += f" ({len(o.files) - len(ready)} sized on first access)"
            if o.missing:
                status += f"; partly missing: {o.missing}"
        else:
            status = f"missing: {o.missing}"
        lines.append(f"  {(folder_of(o.name) or '(root)'):<10} {o.name + ':':<8} {status}")
    notes = [(o.name, n) for o in outcomes for n in o.notes] + [("checkpoint", w) for w in info.warnings]
    if notes:
        lines += ["", "notes:"]
        lines += [f"  {n}" if n.startswith(who + ":") else f"  {who}: {n}" for who, n in notes]
    return "\n".join(lines) + "\n"


def assemble_tree(info: SourceInfo, outcomes: list, *, mtime_ns: int | None = None, closers: Iterable = (),
                  cache: BlockCache | None = None, identity: str | None = None, background: Iterable = ()) -> VirtualTree:
    """The mount's tree: each present view under ``<name>/`` plus the root README.txt; ``identity`` is what its
    content is computed from (``content_identity``; None: unknown), to which the files laid over it are added."""
    files: dict = {}
    dirs = []
    for o in outcomes:
        if o.present:
            files.update(o.files)
            if folder_of(o.name):
                dirs.append(folder_of(o.name).rstrip("/"))
    files[README_NAME] = BytesFile(readme_text(info, outcomes))
    tree = VirtualTree(files, dirs=dirs, mtime_ns=mtime_ns, closers=closers, cache=cache, background=background)
    tree.identity = tree_identity(identity, files)
    return tree


# ---- building from a checkpoint ---------------------------------------------------------------------


def classify_source(ckpt_path, options: MountOptions, required: bool = True):
    """What ``ckpt_path`` is (``source.kind``), with the mount options' S3 settings and ``--revision``; a
    ``CheckpointError`` (one line: what was found, what would work) when it is nothing ckptfs reads (unless not
    ``required``: then its ``NOTHING`` kind)."""
    from ..readers.kind import SourceKind, classify

    if isinstance(ckpt_path, SourceKind):
        src = ckpt_path
    else:
        src = classify(ckpt_path, settings=s3_settings(options), revision=getattr(options, "revision", None),
                       allow_external=options.allow_external)
    return src.require() if required else src


def open_source(ckpt_path, options: MountOptions, parts=None):
    """Resolve a checkpoint path (a .mdl or a model_dir, local or ``s3://``; or its ``SourceKind``) and open it:
    ``(resolved_path, checkpoint, options)``. For a checkpoint in S3 without ``--config``, the options name the
    params file found beside it in the bucket, fetched into the cache folder (``source.s3params``); its objects read
    through ``parts`` (the tree's pool; None: the checkpoint's own)."""
    from ..readers import open_checkpoint, resolve_checkpoint  # h5py: not imported before a tree is built

    src = classify_source(ckpt_path, options)
    if src.in_bucket:
        from ..readers.s3.open import open_s3_checkpoint

        ckpt = open_s3_checkpoint(src.target, allow_partial=options.allow_partial, parts=parts)
        if options.config is None:
            options = _with_s3_params(ckpt, options)
        return ckpt.path, ckpt, options
    if src.kind not in OPENED_KINDS:
        raise CheckpointError(src.given, f"is {src.reason or src.kind}, which ckptfs cannot open as a checkpoint")
    resolve = src.is_run or src.kind == "tf checkpoint"  # a run: its latest checkpoint; a TF checkpoint: its .index
    path = Path(resolve_checkpoint(src.path, options.allow_external)) if resolve else Path(src.path)
    return path, open_checkpoint(path, allow_partial=options.allow_partial,
                                 allow_external=options.allow_external), options


#: the kinds ``open_source`` opens as a checkpoint (a local run: its latest checkpoint)
OPENED_KINDS = ("hdf5", "run", "tf checkpoint", "legacy torch")  # source.kind's names (importing it would import
# the readers: a mount's start does not)


def _with_s3_params(ckpt, options: MountOptions) -> MountOptions:
    """``options`` naming the local copy of the params file beside the S3 checkpoint ``ckpt`` (unchanged when there
    is none)."""
    from ..readers.s3.params import params_for

    local = params_for(ckpt, cache_dir())
    return options if local is None else replace(options, config=local)


def _file_identity(path) -> str | None:
    """A file's real path and full identity (device, inode, size, mtime, ctime): any write to it changes this, even
    one that restores its size and mtime (ctime cannot be set from user space)."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    return f"{real}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def content_identity(path, options: MountOptions, version: str | None = None) -> str | None:
    """Names what the generated files are computed from: the checkpoint file (or, for a checkpoint in S3, its
    location and stored ``version``), the params YAML files a local one may be converted with (when no ``--config``
    names one), and every option declared as changing content (``ckptfs.views.options``: params YAML, model, trainer
    index…) that is not at its default; a file counts by its full identity (``_file_identity``). Keys persisted
    caches (zip CRCs); None if the checkpoint cannot be stat'ed."""
    from ..mapping.params.find import candidate_files

    ident = f"{path}@{version}" if version is not None else _file_identity(path)
    if ident is None:
        return None
    parts = [ident]
    if options.config is None and version is None:
        parts += [f"params={_file_identity(p) or p}" for p in candidate_files(Path(path))]
    for opt, value in content_options(options):
        values = value if opt.repeat else (value,)
        text = ",".join((_file_identity(v) or str(v)) if opt.kind.path else opt.kind.text(v) for v in values)
        parts.append(f"{opt.name}={text}")
    return "|".join(parts)


def tree_identity(identity: str | None, files: dict) -> str | None:
    """``identity`` (``content_identity``) and the identity of every file laid over the tree from disk (overlay
    and tokenizer files, which also decide config.json's token ids): what an export record keys finished files on."""
    if identity is None:
        return None
    stamps = sorted(f"{p}={f.stamp}" for p, f in files.items() if getattr(f, "stamp", None) is not None)
    return "|".join([identity, *stamps])


#: views that start a build in a forked process when ``build_tree(fork_builds=True)``
FORKING_VIEWS = ("cs",)


#: what builds a tree: ``build_tree`` below, or a caller's own with its arguments (``ckptfs.cli.main(build_tree=…)``)
TreeBuilder = Callable[..., VirtualTree]


def build_tree(ckpt_path, options: MountOptions | None = None, *, cache: BlockCache | None = None, parts=None,
               fork_builds: bool = False, views: Callable[[Path, MountOptions], dict] | None = None) -> VirtualTree:
    """Open the checkpoint and assemble every requested view into one ``VirtualTree``.

    ``cache``: the block cache its files read through (default: its own, of ``options.cache_size``; the trees of a
    run mount share one, ``tree/run.py``). ``parts``: the pool its objects in object storage read their parts through
    (``storage.s3object.PartPool``; default: its own, of the remote share of ``options.cache_size``, ``tree.memory``),
    closed with the tree, or when the build fails. Raises ``CheckpointError`` if the checkpoint cannot be opened; a
    failing view only makes that view missing. ``fork_builds``: views may start expensive layouts in forked
    processes (``ViewContext.fork_builds``): only for a caller that has no other thread, the mount server.
    ``views``: instead of opening the checkpoint, ``views(path, options)`` gives ``{view name: ViewResult or the
    exception its builder raised}``, assembled exactly like the registered views' (synthetic files in tests).
    """
    options = options or MountOptions()
    check_options(options)
    if cache is None:
        cache = tree_cache(options.cache_size, ckpt_path)  # this tree's own: never shared with, or replaced by, another
    if parts is None:
        parts = tree_parts(options.cache_size, ckpt_path)  # likewise (None for a local checkpoint)
    try:
        tree = _build(ckpt_path, options, cache, parts, fork_builds, views)
    except BaseException:
        if parts is not None:
            parts.close()
        raise
    if parts is not None:
        tree.parts = parts
        tree.add_closer(parts.close)  # after the checkpoint's own closers: nothing reads through it then
    return tree


def _build(ckpt_path, options: MountOptions, cache: BlockCache, parts, fork_builds: bool, views) -> VirtualTree:
    if views is not None:
        path = Path(ckpt_path).absolute()
        results = views(path, options)
        outcomes = [outcome_from(n, results.get(n, CkptfsError(None, "not given by the views function")))
                    for n in options.views]
        info = SourceInfo(path)
        closers: list = []
        background: list = []
        identity = None
        mtime_ns = None
    elif (src := classify_source(ckpt_path, options)).is_hf:  # a Hugging Face model: served as a Cerebras checkpoint
        from .hf_source import build_hf_tree

        return build_hf_tree(src.path, options, cache=cache, fork_builds=fork_builds)
    else:
        path, ckpt, options = open_source(src, options, parts)
        path = path.absolute()
        identity = content_identity(path, options, ckpt.version)
        ctx = ViewContext(checkpoint=ckpt, ckpt_path=path, stem=path.stem, options=options,
                          crc_store=CrcStore(), identity=identity, cache=cache, parts=parts, fork_builds=fork_builds)
        # the views this kind of checkpoint gets (a TensorFlow one: no hf view, the h5 view…), those it cannot have
        # missing with the reason
        explicit = set(options.views) != set(default_names())  # --views given
        chosen = views_for(getattr(ckpt, "kind", "cerebras"), options.views if explicit else names(), explicit)
        wanted = [n for n, why in chosen if why is None]
        # a view that forks a build (cs) goes first, so that the build overlaps the others'; outcomes keep their order
        first = [n for n in wanted if fork_builds and n in FORKING_VIEWS]
        built = {n: _run_view(n, ctx) for n in first + [n for n in wanted if n not in first]}
        built.update({n: ViewOutcome(n, missing=why) for n, why in chosen if why is not None})
        outcomes = [built[n] for n, _ in chosen]
        given = ckpt_path if is_s3_url(ckpt_path) else Path(ckpt_path).absolute()
        # a run's latest (or named) checkpoint; a TensorFlow checkpoint's folder: the latest its checkpoint file names
        resolved = src.is_run or " of the run in " in src.reason or (src.kind == "tf checkpoint" and given.is_dir())
        resolved_from = given if resolved and str(given).rstrip("/") != str(path) else None
        info = SourceInfo(path, getattr(ckpt, "format_version", None), getattr(ckpt, "release", None),
                          getattr(ckpt, "success", None),
                          [str(w) for w in [*getattr(ckpt, "notes", ()), *(getattr(ckpt, "warnings", None) or [])]],
                          resolved_from, getattr(ckpt, "format_name", None))
        closers = [ckpt.close] if callable(getattr(ckpt, "close", None)) else []
        background = [ckpt.warm] if getattr(ckpt, "_warmers", None) else []
        mtime_ns = ckpt.mtime_ns  # a checkpoint in S3: its objects' time; a local file: its stat below
    if mtime_ns is None and not is_s3_url(path):
        try:
            mtime_ns = path.stat().st_mtime_ns
        except OSError:
            mtime_ns = None
    return assemble_tree(info, outcomes, mtime_ns=mtime_ns, closers=closers, cache=cache, identity=identity,
                         background=background)
