"""``ckptfs info CKPT [--json] [--allow-partial]``: what a checkpoint is and holds, from metadata only (for a
model_dir: the run's checkpoints, ``commands/runinfo.py``, then its latest checkpoint's summary).

Format version, writing release, success flag, tensor count and bytes by dtype, other leaves,
top-level keys, detected model family and the catalog's warnings. No tensor data is read.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from ..errors import CkptfsError
from ..storage.s3url import is_s3_url
from ..units import human_size
from ..views import options as mount_options

if TYPE_CHECKING:  # the source layer (h5py, numpy) is imported when a command runs, not when the CLI is built
    from ..catalog.model import Checkpoint


def add_parser(subparsers):
    p = subparsers.add_parser(
        "info", help="summarise a Cerebras checkpoint (format, release, tensors, model family)",
        description="Summarise a Cerebras checkpoint from its metadata: format version, the release that wrote it, "
                    "whether the save completed, tensors and bytes by dtype, top-level keys and the model family.")
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint .mdl file, or a model_dir: its checkpoints (steps, sizes, "
                                                "completeness, latest) and the latest one's summary (--single: only "
                                                "that), or a Hugging Face model folder: its files, and the Cerebras "
                                                "checkpoint a mount of it serves")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    mount_options.add_arguments(p, only=("allow_partial", "allow_external", "single", "model", "added_tensors",
                                         "allow_unused_weights", "endpoint_url", "profile", "revision"))
    return p


@dataclass
class DtypeTotal:
    tensors: int = 0
    bytes: int = 0


@dataclass
class FamilyInfo:
    family: str | None
    model_name: str | None
    reason: str


@dataclass
class Summary:
    path: str
    format_version: float | None
    release: str | None
    success: bool
    tensors: int
    total_bytes: int
    by_dtype: dict  # dtype name -> DtypeTotal
    values: int
    opaque: int
    unreadable: dict  # flat key -> reason
    aliases: int
    top_level_keys: list
    root_kind: str
    family: FamilyInfo
    warnings: list = field(default_factory=list)
    loading: list = field(default_factory=list)  # how from_pretrained loads a mount of it (a mapped family only)
    notes: list = field(default_factory=list)  # where things came from (a params file fetched from a bucket)
    format_name: str | None = None  # a format without a Cerebras format version (a TF kind, a legacy torch.save zip)
    flat: bool = False  # a flat state keyed by TensorFlow variable names (a TF kind)


#: the family line of a checkpoint of TensorFlow variables
TF_FAMILY = "TensorFlow variable names: no model family mapping applies"


def detect(ckpt: Checkpoint) -> FamilyInfo:
    """The model family, from the mapping core if it is installed."""
    try:
        from ..mapping.detect import detect_family
    except ImportError:
        return FamilyInfo(None, None, "mapping core not available")
    config = None
    if is_s3_url(ckpt.path):  # its params are beside it in the bucket
        from ..readers.s3.params import params_for
        from ..state.dirs import cache_dir

        config = params_for(ckpt, cache_dir())
    try:
        d = detect_family(ckpt, config=config, model=None)
    except CkptfsError as e:
        return FamilyInfo(None, None, e.problem)
    return FamilyInfo(getattr(d, "family", None), getattr(d, "model_name", None), str(getattr(d, "reason", "") or ""))


def summarize(ckpt: Checkpoint, family: FamilyInfo | None = None) -> Summary:
    from ..catalog.model import Container, OpaqueLeaf, TensorLeaf, UnreadableLeaf, ValueLeaf

    if family is None and getattr(ckpt, "is_tf", False):
        family = FamilyInfo(None, None, TF_FAMILY)

    by_dtype: dict = {}
    seen: set = set()
    values = opaque = 0
    unreadable: dict = {}
    for key, leaf in ckpt.leaves.items():
        if key in ckpt.links or id(leaf) in seen:
            continue
        seen.add(id(leaf))
        if isinstance(leaf, TensorLeaf):
            t = by_dtype.setdefault(leaf.tensor.dtype.name, DtypeTotal())
            t.tensors += 1
            t.bytes += leaf.tensor.nbytes
        elif isinstance(leaf, ValueLeaf):
            values += 1
        elif isinstance(leaf, OpaqueLeaf):
            opaque += 1
        elif isinstance(leaf, UnreadableLeaf):
            unreadable[key] = leaf.reason
    root = ckpt.root
    if isinstance(root, Container):
        kind = root.kind
        top = [k if isinstance(k, (str, int, float, bool)) or k is None else str(k) for k in root.keys] \
            if root.keys is not None else list(range(len(root.children)))
    else:
        kind, top = "leaf", []
    return Summary(
        path=str(ckpt.path), format_version=ckpt.format_version, release=ckpt.release, success=ckpt.success,
        tensors=sum(t.tensors for t in by_dtype.values()), total_bytes=sum(t.bytes for t in by_dtype.values()),
        by_dtype=dict(sorted(by_dtype.items(), key=lambda kv: -kv[1].bytes)), values=values, opaque=opaque,
        unreadable=unreadable, aliases=len(ckpt.links), top_level_keys=top, root_kind=kind,
        family=family or detect(ckpt),
        warnings=list(ckpt.warnings), notes=list(getattr(ckpt, "notes", None) or []),
        format_name=getattr(ckpt, "format_name", None), flat=bool(getattr(ckpt, "is_tf", False)))


def with_loading(s: Summary) -> Summary:
    """``s`` with the ``from_pretrained`` calls a mount of it answers (when its family maps to Hugging Face)."""
    from ..views.hf.formats import loading_lines

    if s.family.family:
        s.loading = loading_lines()
    return s


def family_line(f: FamilyInfo) -> str:
    if not f.family:
        return f"unknown ({f.reason})" if f.reason else "unknown"
    name = f" ({f.model_name})" if f.model_name else ""
    why = f": {f.reason}" if f.reason else ""
    return f"{f.family}{name}{why}"


def _format(s: Summary) -> str:
    return s.format_name if s.format_version is None and s.format_name else f"{s.format_version:g}"


def format_text(s: Summary) -> str:
    lines = [f"checkpoint: {s.path}"]
    if s.flat:  # a TensorFlow kind: no format version, no __SUCCESS__ marker
        lines.append(f"format: {s.format_name}")
    else:
        lines += [f"format: {_format(s)} (written by release {s.release or 'unknown'})",
                  "complete: " + (("yes (__SUCCESS__ set)" if s.format_name is None else "yes") if s.success else
                                  "no (partial save; opened with --allow-partial)")]
    lines.append(f"family: {family_line(s.family)}")
    if s.flat:  # a flat state: one key per variable (``ckptfs ls`` lists them)
        lines.append(f"variables: {len(s.top_level_keys)} (a flat state keyed by TensorFlow variable names)")
    else:
        lines.append(f"top-level keys ({s.root_kind}): " + (", ".join(str(k) for k in s.top_level_keys) or "(none)"))
    lines += [f"tensors: {s.tensors} ({human_size(s.total_bytes, binary=True)}, {s.total_bytes} bytes)"]
    w = max((len(k) for k in s.by_dtype), default=0)
    for name, t in s.by_dtype.items():
        lines.append(f"  {name:<{w}}  {t.tensors:>6} tensors  {t.bytes:>14} bytes")
    lines.append(f"other leaves: {s.values} values, {s.opaque} opaque pickled objects, {len(s.unreadable)} unreadable; "
                 f"{s.aliases} aliases (links)")
    for key, reason in s.unreadable.items():
        lines.append(f"  unreadable {key}: {reason}")
    lines += s.notes
    for msg in s.warnings:
        lines.append(f"warning: {msg}")
    lines += [f"{'load (a mount of it):' if i == 0 else '':<22} {line}" for i, line in enumerate(s.loading)]
    return "\n".join(lines)


@dataclass
class HFSourceInfo:
    """The Hugging Face model a checkpoint is planned from."""

    path: str
    hub: str | None  # "org/name at revision …" for a Hub cache snapshot
    folders: dict  # folder ("" for one model) -> {"format", "files", "tensors", "bytes", "architectures"}
    notes: list


def hf_summary(hc) -> tuple:
    """``(HFSourceInfo, Summary)`` of an ``HFCheckpoint`` (``views.from_hf``): the source, and the checkpoint its
    mount serves, with the model the mapping chose as its family."""
    from ..mapping.hf_checkpoint import MDL_NAME

    m = hc.model
    folders = {f: {"format": c.format, "files": list(c.files), "tensors": len(c.tensors),
                   "bytes": sum(t.nbytes for t in c.tensors.values()),
                   "architectures": c.config.get("architectures")} for f, c in m.components.items()}
    hub = f"{m.hub.repo_id} at revision {m.hub.revision}" if m.hub else None
    s = summarize(hc.checkpoint, FamilyInfo(hc.plan.family, hc.plan.model_name, "from the Hugging Face config"))
    s.path = f"{MDL_NAME} (generated when read, by a mount or export of {m.path})"
    return HFSourceInfo(str(m.path), hub, folders, list(hc.notes)), s


def format_hf(src: HFSourceInfo, s: Summary) -> str:
    lines = [f"Hugging Face model: {src.path}"]
    if src.hub:
        lines.append(f"  Hub cache snapshot of {src.hub}")
    for f, d in src.folders.items():
        lines.append(f"  {(f + '/') if f else '(root)'}: {d['format']}, {d['tensors']} tensors "
                     f"({human_size(d['bytes'], binary=True)}) in {', '.join(d['files'])}; architectures {d['architectures']}")
    lines += ["", "served as a Cerebras checkpoint:", format_text(s)]
    lines += [f"note: {n}" for n in src.notes]
    return "\n".join(lines)


def run(args) -> int:
    from .runinfo import as_json, classify_argument, format_run, scan_run

    src = classify_argument(args)  # before the readers are imported: an S3 location's first request leaves sooner
    from ..readers import open_checkpoint

    where = src.path
    if src.is_hf:  # a Hugging Face model: its files, and the checkpoint a mount of it serves
        from ..mapping.hf_checkpoint import open_hf_checkpoint

        hc = open_hf_checkpoint(where, mount_options.from_args(args))
        src, s = hf_summary(hc)
        if args.json:
            print(json.dumps({"hugging_face": asdict(src), "checkpoint": asdict(s)}, indent=2, default=str))
        else:
            print(format_hf(src, s))
        return 0
    if src.is_run and not args.single:  # a model_dir: the run, then its latest checkpoint
        listing = scan_run(where, args.allow_external or ())
        s = None
        if listing.latest is not None:
            with open_checkpoint(listing.latest.path, allow_external=args.allow_external or ()) as ckpt:
                s = with_loading(summarize(ckpt))
        if args.json:
            print(json.dumps({"run": as_json(listing), "latest_checkpoint": asdict(s) if s else None}, indent=2,
                             default=str))
        else:
            print(format_run(listing) + ("\n\nlatest checkpoint:\n" + format_text(s) if s else ""))
        return 0
    with open_checkpoint(where, allow_partial=args.allow_partial,
                         allow_external=args.allow_external or ()) as ckpt:
        s = with_loading(summarize(ckpt))
    if args.json:
        print(json.dumps(asdict(s), indent=2, default=str))
    else:
        print(format_text(s))
    return 0
