"""Finding the checkpoint file a path means: a file is itself; a Model Zoo ``model_dir`` means its
latest checkpoint (Cerebras' autoload semantics).

In a directory, a ``latest`` pointer (a symlink, or a text file naming a checkpoint, relative to
the directory) wins. Otherwise every ``checkpoint_<step>.mdl`` / ``checkpoint_<step>_<time>.mdl``
in the directory or its subdirectories is a candidate and the highest step wins, then the later
timestamp suffix, then the newer file.

What a model_dir names is untrusted, as a checkpoint is (``confine``): the pointer is read with a size bound
(``MAX_POINTER_BYTES``) and followed once, to a checkpoint *file*; it and every candidate must lie, symbolic links
resolved, inside the model_dir (or an ``--allow-external`` folder). A pointer that names anything else is an error
saying so; a candidate file that leads elsewhere is not a candidate.
"""
from __future__ import annotations

import errno
import os
import re
import stat as stat_mod
from datetime import datetime
from pathlib import Path

from ...errors import CheckpointError
from ...guard.confine import Confinement, RefusedReference, open_regular_file
from ckptfs.readers.tf.locate import is_tf_source, resolve_tf_index

#: a ``latest`` pointer file is at most this long (it holds one name)
MAX_POINTER_BYTES = 4096

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


def model_dir_roots(d, allow_external=()) -> Confinement:
    """Where what a model_dir names may lead: the model_dir itself (subfolders included) and the ``allow_external``
    folders, as real paths."""
    return Confinement(os.path.realpath(Path(d).absolute()),
                       tuple(os.path.realpath(Path(p).absolute()) for p in allow_external or ()))


def _pointer_text(p: Path) -> str:
    """The name a ``latest`` pointer file holds: its first line, from at most ``MAX_POINTER_BYTES`` (a FIFO or a
    device is refused before it is read)."""
    try:
        blob = open_regular_file(p)
    except RefusedReference:
        raise CheckpointError(p, "the 'latest' pointer is not a regular file, a symlink or a directory") from None
    except OSError as e:
        raise CheckpointError(p, f"cannot read the 'latest' pointer ({e.strerror or e})") from None
    try:
        if blob.size > MAX_POINTER_BYTES:
            raise CheckpointError(p, f"the 'latest' pointer file holds {blob.size} bytes, more than a pointer's "
                                     f"{MAX_POINTER_BYTES}")
        data = blob.read(0, MAX_POINTER_BYTES)
    except OSError as e:
        raise CheckpointError(p, f"cannot read the 'latest' pointer ({e.strerror or e})") from None
    finally:
        blob.close()
    lines = data.decode("utf-8", "replace").strip().splitlines()
    if not lines or not lines[0].strip():
        raise CheckpointError(p, "the 'latest' pointer file is empty")
    return lines[0].strip()


def _latest_pointer(d: Path, allow_external=()) -> Path | None:
    """The checkpoint file the model_dir's ``latest`` pointer names (followed once: it must name a checkpoint file,
    not another pointer or folder), inside the model_dir or an ``allow_external`` folder; None without a pointer."""
    p = d / "latest"
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(p, f"cannot read the 'latest' pointer ({e.strerror or e})") from None
    if stat_mod.S_ISLNK(st.st_mode):
        target = d / os.readlink(p)
    elif stat_mod.S_ISDIR(st.st_mode):
        raise CheckpointError(p, "the 'latest' pointer is a directory, not a checkpoint file")
    else:
        name = _pointer_text(p)
        if "\0" in name:
            raise CheckpointError(p, "the 'latest' pointer holds a NUL byte")
        target = Path(name) if Path(name).is_absolute() else d / name
        if not os.path.lexists(target) and name.isdigit():
            target = d / f"checkpoint_{name}.mdl"
    real = os.path.realpath(target)
    if real == os.path.join(os.path.realpath(d), p.name):
        raise CheckpointError(p, "the 'latest' pointer names itself")
    roots = model_dir_roots(d, allow_external)
    if not roots.contains(real):
        hint = "" if roots.allowed else " (to allow a folder, give --allow-external DIR)"
        raise CheckpointError(p, f"the 'latest' pointer names {target}, which resolves to {real}, outside the "
                                 f"model_dir{hint}")
    try:
        kind = os.stat(real).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(p, f"the 'latest' pointer names {target}, a symbolic link loop") from None
        raise CheckpointError(p, f"the 'latest' pointer names {target}, which does not exist") from None
    if not stat_mod.S_ISREG(kind):
        raise CheckpointError(p, f"the 'latest' pointer names {target}, which is not a checkpoint file")
    return target


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0


def find_checkpoints(d: Path, allow_external=(), outside: list | None = None) -> list[Path]:
    """Every ``checkpoint_<step>[_<time>].mdl`` file under ``d`` that lies, symbolic links resolved, inside ``d`` (or
    an ``allow_external`` folder), oldest first (step, then timestamp suffix, then modification time, then path);
    each name is parsed once. Those leading elsewhere are added to ``outside`` when given."""
    roots = model_dir_roots(d, allow_external)
    found = []
    for p in d.rglob("checkpoint_*.mdl"):
        parsed = checkpoint_name(p.name)
        if parsed is None or not p.is_file():
            continue
        if roots.contains(os.path.realpath(p)):
            found.append((*parsed, _mtime(p), str(p), p))
        elif outside is not None:
            outside.append(p)
    return [key[-1] for key in sorted(found)]


def resolve_checkpoint(path, allow_external=()) -> Path:
    """The checkpoint file ``path`` designates; CheckpointError if there is none. A TensorFlow saver checkpoint (a
    folder with a ``checkpoint`` file, a prefix, an ``.index`` file: ``tf_locate``) designates its ``.index`` file."""
    p = Path(path)
    if is_tf_source(p):
        return resolve_tf_index(p)
    if p.is_dir():
        target = _latest_pointer(p, allow_external)
        if target is not None:
            return target
        outside: list = []
        found = find_checkpoints(p, allow_external, outside)
        if not found and outside:
            raise CheckpointError(p, f"its checkpoint files ({outside[0].name}…) are symbolic links leading outside "
                                     f"the model_dir: not followed (give --allow-external DIR to allow their folder)")
        if not found:
            raise CheckpointError(p, "is a directory with no checkpoint_<step>.mdl file (give a checkpoint file)")
        return found[-1]
    if not p.exists():
        if p.is_symlink():
            raise CheckpointError(p, "is a dangling symlink")
        raise CheckpointError(p, "no such file")
    return p
