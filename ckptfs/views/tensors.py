"""The tensors view: every source tensor as ``tensors/<key with "." as "/">.npy``, to browse with ``ls`` and open
with ``np.load(path, mmap_mode="r")``.

Path rules: the flattened key's dots become directories (``model.lm_head.weight`` →
``tensors/model/lm_head/weight.npy``). A ``/`` inside a key (a key component containing a slash) is written
``%2F`` and a ``%`` is written ``%25``, so every key maps to one path and back. Aliases (tied tensors) appear under
each of their keys. bfloat16 / float8 tensors are raw bits: ``weight.bf16.npy`` (see ckptfs.layouts.npy).
When a key is a prefix of another key (``a.b`` and ``a.b.c``), the file wins the name ``a/b`` and the deeper key is
placed under ``a/b@/c`` — rare, and listed in README.txt.
"""
from __future__ import annotations

from ..layouts.npy import NpyLayout, npy_suffix
from .base import ViewResult


def key_to_parts(key: str) -> list[str]:
    return [p.replace("%", "%25").replace("/", "%2F") for p in key.split(".")]


def build(ctx) -> ViewResult:
    files: dict = {}
    notes: list[str] = []
    leaves = ctx.checkpoint.tensors()
    dirs: set[str] = set()
    planned = []
    for key, leaf in leaves.items():
        parts = key_to_parts(key)
        planned.append((key, leaf, parts))
        for i in range(1, len(parts)):
            dirs.add("/".join(parts[:i]))
    for key, leaf, parts in planned:
        # a file cannot also be a directory: move a file whose path is a directory elsewhere
        base = "/".join(parts)
        if base in dirs:
            base = base + "@"
            notes.append(f"tensors: key {key!r} is also a prefix of other keys; served as {base}{npy_suffix(leaf.tensor.dtype)}")
        files["tensors/" + base + npy_suffix(leaf.tensor.dtype)] = NpyLayout(leaf.tensor, name=key)
    if not files:
        return ViewResult(missing="the checkpoint holds no tensors")
    return ViewResult(files=files, notes=notes)
