"""How ``ckptfs ls MODEL_DIR`` and ``ckptfs info MODEL_DIR`` show a training run: every checkpoint file with its
step, size, time, completeness, and which one is the latest (``ckptfs.source.rundir``). Not a command itself."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from ..errors import CheckpointError
from ..storage.s3url import is_s3_url
from ..source.rundir import RunListing, RunScanner
from ..units import human_size


@dataclass
class RunRow:
    file: str
    folder: str | None  # its folder in a run mount (complete checkpoints only)
    step: int | None
    timestamp: str | None  # the file name's timestamp suffix
    size: int | None
    modified: str
    complete: bool
    status: str
    latest: bool


def checkpoint_argument(args):
    """The command's CKPT as a local path or an ``s3://`` location (with ``--endpoint-url``, ``--profile``)."""
    from ..storage.locate import locate
    from ..storage.s3url import S3Settings

    return locate(args.ckpt, S3Settings(getattr(args, "endpoint_url", None), getattr(args, "profile", None)))


def is_run_argument(path, single: bool = False) -> bool:
    """A directory (or an S3 prefix holding checkpoints) given without ``--single`` means the whole run (a Hugging
    Face model folder never does)."""
    if single:
        return False
    if is_s3_url(path):
        from ..source.s3open import RUN, classify

        return classify(path).kind == RUN
    from ..source.hf_layout import is_hf_folder
    from ckptfs.source.tf_locate import is_tf_source

    return Path(path).is_dir() and not is_hf_folder(path) and not is_tf_source(path)


def is_hf_source(path) -> bool:
    """A Hugging Face model folder (or Hub cache snapshot): ``info`` and ``ls`` show the checkpoint it mounts as."""
    if is_s3_url(path):
        return False
    from ..source.hf_layout import is_hf_folder

    return is_hf_folder(path)


def scan_run(path, allow_external=()) -> RunListing:
    """The run in ``path``; a ``CheckpointError`` if the directory holds no checkpoint file at all."""
    listing = RunScanner(path, allow_external=allow_external).scan()
    if not listing.checkpoints:
        raise CheckpointError(listing.model_dir, "is a directory with no checkpoint_<step>.mdl file (not a model_dir)")
    return listing


def rows(listing: RunListing) -> list:
    out = []
    for c in listing.checkpoints:
        out.append(RunRow(
            file=c.path.name, folder=c.name if c.complete else None, step=c.step,
            timestamp=None if c.stamp == datetime.min else c.stamp.isoformat(sep=" "),
            size=c.size if c.sized else None,  # None: a checkpoint prefix in a bucket (its objects are not listed)
            modified=datetime.fromtimestamp(c.mtime_ns / 1e9).strftime("%Y-%m-%d %H:%M:%S"), complete=c.complete,
            status=c.status, latest=listing.latest is not None and c.path == listing.latest.path))
    return out


def as_json(listing: RunListing) -> dict:
    latest = listing.latest
    return {"model_dir": str(listing.model_dir), "latest": latest.name if latest else None,
            "latest_file": latest.path.name if latest else None, "latest_reason": listing.latest_reason,
            "pointer_problem": listing.pointer_problem, "complete": len(listing.complete),
            "incomplete": len(listing.incomplete), "checkpoints": [asdict(r) for r in rows(listing)]}


def format_run(listing: RunListing) -> str:
    """The run as a table."""
    latest = listing.latest
    lines = [f"model_dir: {listing.model_dir}",
             f"latest: {latest.name} ({listing.latest_reason})" if latest else f"latest: none ({listing.latest_reason})"]
    if listing.pointer_problem:
        lines.append(f"warning: {listing.pointer_problem}")
    table = rows(listing)
    if table:
        wf = max(len(r.file) for r in table)
        lines.append(f"{'STEP':>10}  {'SIZE':>10}  {'MODIFIED':<19}  {'FILE':<{wf}}  STATUS")
        for r in table:
            step = "?" if r.step is None else str(r.step)
            status = r.status + ("  <- latest" if r.latest else "")
            size = "-" if r.size is None else human_size(r.size, binary=True)  # a prefix's objects are not listed
            lines.append(f"{step:>10}  {size:>10}  {r.modified:<19}  {r.file:<{wf}}  {status}")
    lines.append(f"{len(listing.complete)} complete checkpoint(s), {len(listing.incomplete)} not complete "
                 f"(a run mount shows only complete ones)")
    return "\n".join(lines)
