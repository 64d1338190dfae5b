"""Finding the checkpoint file a path means: a file is itself; a Model Zoo ``model_dir`` means its
latest checkpoint (Cerebras' autoload semantics).

In a directory, a ``latest`` pointer (a symlink, or a text file naming a checkpoint, relative to
the directory) wins. Otherwise every ``checkpoint_<step>.mdl`` / ``checkpoint_<step>_<time>.mdl``
in the directory or its subdirectories is a candidate and the highest step wins, then the later
timestamp suffix, then the newer file.
"""
from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

from ..errors import CheckpointError

#: ``checkpoint_<step>.mdl`` or ``checkpoint_<step>_<stamp>.mdl`` (stamp: Model Zoo's ``%Y%m%d_%H%M%S``, or the
#: unix time that older tools appended)
CHECKPOINT_FILE = re.compile(r"^checkpoint_(?P<step>\d+)(?:_(?P<stamp>\d{8}_\d{6}|\d+))?\.mdl$")


def checkpoint_name(name: str):
    """``(step, stamp)`` of a checkpoint file name (stamp ``datetime.min`` when it has none), or None if the name
    is not a checkpoint's; a timestamp that is not a valid date makes the name not a checkpoint's, as in Model Zoo."""
    m = CHECKPOINT_FILE.match(name)
    if m is None:
        return None
    stamp = m.group("stamp")
    if stamp is None:
        return int(m.group("step")), datetime.min
    try:
        when = (datetime.strptime(stamp, "%Y%m%d_%H%M%S") if "_" in stamp
                else datetime.fromtimestamp(int(stamp)))
    except (ValueError, OverflowError, OSError):
        return None
    return int(m.group("step")), when


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


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0


def find_checkpoints(d: Path) -> list[Path]:
    """Every ``checkpoint_<step>[_<time>].mdl`` file under ``d``, oldest first (step, then timestamp suffix, then
    modification time, then path); each name is parsed once."""
    found = []
    for p in d.rglob("checkpoint_*.mdl"):
        parsed = checkpoint_name(p.name)
        if parsed is not None and p.is_file():
            found.append((*parsed, _mtime(p), str(p), p))
    return [key[-1] for key in sorted(found)]


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
