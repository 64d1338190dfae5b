"""The tensors view: every source tensor as ``tensors/<key with "." as "/">.npy``, to browse with ``ls`` and open
with ``np.load(path, mmap_mode="r")``.

Path rules: the flattened key's dots become directories (``model.lm_head.weight`` →
``tensors/model/lm_head/weight.npy``); in a TensorFlow checkpoint's flat state the variable name's slashes do
(``bert/encoder/layer_0/output/dense/kernel`` → ``tensors/bert/encoder/layer_0/output/dense/kernel.npy``). Each component is escaped on its own: ``%`` is written ``%25``, ``/``
``%2F``, NUL ``%00`` (and a lone surrogate its UTF-8 bytes), a component ``.`` or ``..`` is written ``%2E`` /
``%2E%2E`` and an empty one (``a..b``) a lone ``%``, so that every component is a valid file name. A component
longer than 255 bytes (the limit ``statfs`` announces) keeps its first bytes and ends in ``~`` plus 12 hex digits
of its SHA-256. Aliases (tied tensors) appear under each of their keys. bfloat16 / float8 tensors are raw bits:
``weight.bf16.npy`` (see ckptfs.layouts.npy). When a key is a prefix of another key (``a.b`` and ``a.b.c``), the
deeper key keeps ``a/b/c`` and the file of ``a.b`` is named ``a/b@.npy``.

Keys that still end up with the same path (``a.b`` and ``a..b`` only differ by an empty component; a shortened
name) are told apart deterministically: in the checkpoint's key order the first keeps the path, each later one
gets ``~2``, ``~3``… before the suffix. Every such move is a README.txt note naming the key and its file, so every
tensor stays reachable.
"""
from __future__ import annotations

import hashlib

from ..layouts.npy import NpyLayout, npy_suffix
from .base import ViewResult

#: longest file name (bytes) a component may have: the NAME_MAX that statfs announces
NAME_MAX = 255
_SPECIAL = {"": "%", ".": "%2E", "..": "%2E%2E"}


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def escape_component(part: str) -> str:
    """One key component as a file-name component (no ``/``, no NUL, not ``.``/``..``/empty), before shortening."""
    if part in _SPECIAL:
        return _SPECIAL[part]
    out = []
    for ch in part:
        if ch == "%":
            out.append("%25")
        elif ch == "/":
            out.append("%2F")
        elif ch == "\0":
            out.append("%00")
        elif 0xD800 <= ord(ch) <= 0xDFFF:
            out.append("".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass")))
        else:
            out.append(ch)
    return "".join(out)


def shorten(name: str, original: str, room: int = NAME_MAX) -> str:
    """``name`` if it fits in ``room`` bytes, else its longest prefix (whole characters, no cut ``%XX`` escape)
    followed by ``~`` and 12 hex digits of the SHA-256 of ``original``."""
    if _nbytes(name) <= room:
        return name
    tag = "~" + hashlib.sha256(original.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    keep = room - len(tag)
    out, used, i = [], 0, 0
    while i < len(name):
        tok = name[i:i + 3] if name[i] == "%" else name[i]
        n = _nbytes(tok)
        if used + n > keep:
            break
        out.append(tok)
        used += n
        i += len(tok)
    return "".join(out) + tag


def key_to_parts(key: str, suffix: str = "", sep: str = ".") -> list[str]:
    """The path components of ``key`` split at ``sep`` (the last one sized to leave room for ``suffix``)."""
    raw = key.split(sep)
    parts = [shorten(escape_component(p), p) for p in raw[:-1]]
    parts.append(shorten(escape_component(raw[-1]), raw[-1], NAME_MAX - _nbytes(suffix) - 1))  # 1: the "@" rule
    return parts


def _with_counter(path: str, suffix: str, n: int) -> str:
    """``a/b`` + ``.npy`` with counter 2 → ``a/b~2`` (shortened further if the name would exceed NAME_MAX)."""
    head, _, last = path.rpartition("/")
    tag = f"~{n}"
    room = NAME_MAX - _nbytes(suffix) - _nbytes(tag)
    last = last if _nbytes(last) <= room else shorten(last, last, room)
    return (head + "/" if head else "") + last + tag


def plan_paths(keys: list, sep: str = ".") -> tuple[dict, list]:
    """``{key: path under tensors/}`` for ``[(key, suffix)]`` in the checkpoint's order (the key's ``sep`` becoming
    folders), and README notes for every key not served at its plain path. Pure: the same keys always give the same
    paths."""
    planned = []
    dirs: set = set()
    for key, suffix in keys:
        parts = key_to_parts(key, suffix, sep)
        planned.append((key, suffix, parts))
        for i in range(1, len(parts)):
            dirs.add("/".join(parts[:i]))
    paths: dict = {}
    taken: set = set()
    notes: list = []
    for key, suffix, parts in planned:
        base = "/".join(parts)
        why = None
        if base in dirs:
            base += "@"
            why = "is also a prefix of other keys"
        path = base + suffix
        n = 1
        while path in taken:
            n += 1
            path = _with_counter(base, suffix, n) + suffix
            why = "has the same file name as an earlier key once escaped"
        taken.add(path)
        paths[key] = path
        if why:
            notes.append(f"tensors: key {key!r} {why}; served as {path}")
        elif base != key.replace(sep, "/"):
            notes.append(f"tensors: key {key!r} is served as {path} (escaped)")
    return paths, notes


def build(ctx) -> ViewResult:
    leaves = ctx.checkpoint.tensors()
    sep = "/" if getattr(ctx.checkpoint, "is_tf", False) else "."  # TF variable names: their scopes become folders
    paths, notes = plan_paths([(key, npy_suffix(leaf.tensor.dtype)) for key, leaf in leaves.items()], sep)
    files = {"tensors/" + paths[key]: NpyLayout(leaf.tensor, name=key, cache=ctx.cache)
             for key, leaf in leaves.items()}
    if not files:
        return ViewResult(missing="the checkpoint holds no tensors")
    return ViewResult(files=files, notes=notes)
