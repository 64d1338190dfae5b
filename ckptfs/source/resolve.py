"""Finding the checkpoint file a path means: a file is itself; a Model Zoo ``model_dir`` means its
latest checkpoint (Cerebras' autoload semantics).

In a directory, a ``latest`` pointer (a symlink, or a text file naming a checkpoint, relative to
the directory) wins. Otherwise every ``checkpoint_<step>.mdl`` / ``checkpoint_<step>_<time>.mdl``
in the directory or its subdirectories is a candidate and the highest step wins, then the later
timestamp suffix, then the newer file.
"""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import CheckpointError

CHECKPOINT_NAME = re.compile(r"^checkpoint_(\d+)(?:_(\d+))?\.mdl$")


def _latest_pointer(d: Path) -> Path | None:
    p = d / "latest"
    if not (p.is_symlink() or p.exists()):
        return None
    if p.is_symlink() or p.is_dir():
        target = p.resolve()
    elif not p.is_file():  # a FIFO would block the read below
        raise CheckpointError(p, "the 'latest' pointer is not a regular file, a symlink or a directory")
    else:
        try:
            text = p.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        except OSError as e:
            raise CheckpointError(p, f"cannot read the 'latest' pointer ({e.strerror or e})") from None
        if not text or not text[0].strip():
            raise CheckpointError(p, "the 'latest' pointer file is empty")
        name = text[0].strip()
        target = Path(name) if Path(name).is_absolute() else d / name
        if not target.exists() and name.isdigit():
            target = d / f"checkpoint_{name}.mdl"
    if not target.exists():
        raise CheckpointError(p, f"the 'latest' pointer names {target}, which does not exist")
    return target


def checkpoint_sort_key(p: Path):
    m = CHECKPOINT_NAME.match(p.name)
    step, stamp = int(m.group(1)), int(m.group(2) or 0)
    try:
        mtime = p.stat().st_mtime
    except OSError:
        mtime = 0.0
    return step, stamp, mtime, str(p)


def find_checkpoints(d: Path) -> list[Path]:
    """Every ``checkpoint_<step>[_<time>].mdl`` file under ``d``, oldest first."""
    found = [p for p in d.rglob("checkpoint_*.mdl") if CHECKPOINT_NAME.match(p.name) and p.is_file()]
    return sorted(found, key=checkpoint_sort_key)


def resolve_checkpoint(path) -> Path:
    """The checkpoint file ``path`` designates; CheckpointError if there is none."""
    p = Path(path)
    if p.is_dir():
        target = _latest_pointer(p)
        if target is not None:
            return resolve_checkpoint(target) if target.is_dir() and target != p else target
        found = find_checkpoints(p)
        if not found:
            raise CheckpointError(p, "is a directory with no checkpoint_<step>.mdl file (give a checkpoint file)")
        return found[-1]
    if not p.exists():
        if p.is_symlink():
            raise CheckpointError(p, "is a dangling symlink")
        raise CheckpointError(p, "no such file")
    return p
