"""Which TensorFlow saver checkpoint a path means, as TensorFlow would pick it, confined to its folder.

A TF checkpoint is a prefix (``…/model.ckpt-100``) naming ``<prefix>.index`` and ``<prefix>.data-0000i-of-0000N``.
A path designates one when it is

* the prefix itself (no file of that name; ``<prefix>.index`` exists),
* the ``.index`` file (its footer ends in the LevelDB table magic number),
* a folder holding a ``checkpoint`` file (the text ``CheckpointState`` a Saver or ``tf.train.Checkpoint`` writes
  beside its files): its ``model_checkpoint_path`` is the latest checkpoint, relative to the folder (an absolute one
  is taken as it is), exactly as ``tf.train.latest_checkpoint`` picks it.

What a folder's ``checkpoint`` file names is untrusted: it is read with a size bound, and a prefix resolving
(symbolic links followed) outside the folder is refused in one line. ``resolve_tf_index`` gives the ``.index`` file,
``CheckpointError`` for anything it cannot use; ``is_tf_source`` only looks (no error).
"""
from __future__ import annotations

import os
import re
import stat as stat_mod
from pathlib import Path

from ckptfs.errors import CheckpointError
from ckptfs.guard.confine import non_regular_kind
from ...storage.local import open_if_regular

#: the name of the state file TF writes beside its checkpoints
STATE_FILE = "checkpoint"
#: the ``checkpoint`` file is read up to this size (it lists the kept checkpoints' prefixes)
MAX_STATE_BYTES = 1 << 20
#: the LevelDB table magic number every ``.index`` file ends with (little-endian)
TABLE_MAGIC = (0xDB4775248B80FB57).to_bytes(8, "little")
INDEX_SUFFIX = ".index"

_FIELD = re.compile(r'^\s*model_checkpoint_path\s*:\s*"((?:[^"\\]|\\.)*)"\s*$')
_ESCAPES = {"n": b"\n", "r": b"\r", "t": b"\t", '"': b'"', "'": b"'", "\\": b"\\", "a": b"\a", "b": b"\b",
            "f": b"\f", "v": b"\v", "?": b"?"}


def unescape(text: str) -> bytes:
    """The bytes of a protobuf text-format string's contents (C escapes: ``\\n``, ``\\"``, octal, ``\\xHH``)."""
    out, i = bytearray(), 0
    while i < len(text):
        ch = text[i]
        if ch != "\\":
            out += ch.encode("utf-8", "surrogateescape")
            i += 1
            continue
        nxt = text[i + 1:i + 2]
        if nxt in _ESCAPES:
            out += _ESCAPES[nxt]
            i += 2
        elif nxt == "x":
            m = re.match(r"[0-9a-fA-F]{1,2}", text[i + 2:])
            if not m:
                raise ValueError("bad \\x escape")
            out.append(int(m.group(0), 16))
            i += 2 + len(m.group(0))
        elif nxt.isdigit():
            m = re.match(r"[0-7]{1,3}", text[i + 1:])
            if not m:
                raise ValueError("bad octal escape")
            out.append(int(m.group(0), 8) & 0xFF)
            i += 1 + len(m.group(0))
        else:
            raise ValueError(f"bad escape \\{nxt}")
    return bytes(out)


def _regular(path: Path) -> bool:
    try:
        return stat_mod.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def is_index_file(path: Path) -> bool:
    """Whether ``path`` is a regular ``*.index`` file ending in the table magic number."""
    if not str(path).endswith(INDEX_SUFFIX) or not _regular(path):
        return False
    try:
        blob = open_if_regular(path)
    except OSError:
        return False
    if blob is None:
        return False
    try:
        return blob.size >= 48 and blob.read(blob.size - 8, 8) == TABLE_MAGIC
    except OSError:
        return False
    finally:
        blob.close()


def _state_file(folder: Path) -> Path | None:
    """The folder's ``checkpoint`` file when it is a regular file (a symbolic link to one counts), else None."""
    p = folder / STATE_FILE
    return p if _regular(p) else None


def is_tf_source(path) -> bool:
    """Whether ``path`` (local) designates a TF saver checkpoint: a folder with a ``checkpoint`` file, an ``.index``
    file, or a prefix whose ``.index`` file exists. Nothing is validated beyond that (``resolve_tf_index`` does)."""
    if path is None or "://" in str(path):
        return False
    p = Path(path)
    try:
        if p.is_dir():
            return _state_file(p) is not None
        if p.exists():
            return is_index_file(p)
        return is_index_file(Path(str(p) + INDEX_SUFFIX))
    except OSError:
        return False


def latest_prefix(folder: Path) -> str:
    """The ``model_checkpoint_path`` of the folder's ``checkpoint`` file (its text, unresolved)."""
    p = folder / STATE_FILE
    try:
        blob = open_if_regular(p)
        if blob is None:
            kind = non_regular_kind(os.stat(p)) or "something else"
            raise CheckpointError(p, f"the TensorFlow 'checkpoint' file is {kind}, not a regular file")
        try:
            if blob.size > MAX_STATE_BYTES:
                raise CheckpointError(p, f"the TensorFlow 'checkpoint' file holds {blob.size:,} bytes, more than "
                                         f"the {MAX_STATE_BYTES:,} a list of checkpoint prefixes needs")
            data = blob.read(0, MAX_STATE_BYTES)
        finally:
            blob.close()
    except OSError as e:
        raise CheckpointError(p, f"cannot read the TensorFlow 'checkpoint' file ({e.strerror or e})") from None
    for line in data.decode("utf-8", "surrogateescape").splitlines():
        m = _FIELD.match(line)
        if m is None:
            continue
        try:
            name = unescape(m.group(1)).decode("utf-8", "surrogateescape")
        except ValueError as e:
            raise CheckpointError(p, f"model_checkpoint_path is not a valid text-format string ({e})") from None
        if not name or "\0" in name:
            raise CheckpointError(p, "model_checkpoint_path is empty or holds a NUL byte")
        return name
    raise CheckpointError(p, "the TensorFlow 'checkpoint' file names no model_checkpoint_path (give the checkpoint "
                             "prefix, e.g. DIR/model.ckpt-100, or its .index file)")


def _confined_prefix(folder: Path, name: str) -> Path:
    """``folder/name`` (or ``name`` when absolute) as a prefix whose ``.index`` resolves inside ``folder``."""
    state = folder / STATE_FILE
    cand = Path(name) if Path(name).is_absolute() else folder / name
    root = os.path.realpath(folder.absolute())
    real = os.path.realpath(str(cand) + INDEX_SUFFIX)
    if os.path.commonpath([root, real]) != root:
        raise CheckpointError(state, f"model_checkpoint_path {name!r} resolves to {real}, outside the checkpoint's "
                                     f"folder {root}: refused (give the checkpoint prefix itself to read it)")
    return cand


def resolve_tf_index(path) -> Path:
    """The ``.index`` file of the TF checkpoint ``path`` designates (see the module docstring); ``CheckpointError``
    naming the path when there is none or it would lead outside its folder."""
    p = Path(path)
    if p.is_dir():
        if _state_file(p) is None:
            raise CheckpointError(p, "is a directory without a TensorFlow 'checkpoint' file")
        prefix = _confined_prefix(p, latest_prefix(p))
        index = Path(str(prefix) + INDEX_SUFFIX)
        if not is_index_file(index):
            raise CheckpointError(p / STATE_FILE, f"model_checkpoint_path names {prefix}, but {index.name} is missing "
                                                  "or not a TensorFlow index file")
        return index
    if p.exists():
        if not is_index_file(p):
            raise CheckpointError(p, "is not a TensorFlow checkpoint .index file (no table magic number at its end)")
        return p
    index = Path(str(p) + INDEX_SUFFIX)
    if not is_index_file(index):
        raise CheckpointError(p, "no such file, and no TensorFlow checkpoint with this prefix (no .index file)")
    return index


def prefix_of(index: Path) -> Path:
    """The checkpoint prefix of an ``.index`` file."""
    return Path(str(index)[:-len(INDEX_SUFFIX)])
