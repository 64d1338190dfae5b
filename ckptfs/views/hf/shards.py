"""Shard planning, shard file names and the HF ``*.index.json`` text, as Hugging Face writes them.

``plan_shards`` is the greedy split of ``huggingface_hub.split_torch_state_dict_into_shards`` (used by
``save_pretrained``): tensors in the given order; a new shard starts when ``current + tensor > max``;
a tensor larger than ``max`` gets a shard of its own, appended at once (so it comes *before* the
shard still being filled, as in the hub); no shard is empty (no tensors → no shards). Names bound to
the same ``VirtualTensor`` object are one storage: counted once, and the later names are appended to
the first name's shard (safetensors cannot hold two names on one storage, so a safetensors caller
passes distinct objects; the torch zip layout can).

Index policy for views: when there is one shard, the weights file keeps the plain name
(``model.safetensors`` / ``pytorch_model.bin``) *and* the index is still provided (mapping every name
to that file). transformers loads the plain file first and ignores the index; tools that only read
indexes still work. ``index_json`` accepts one shard for that reason.
"""
from __future__ import annotations

import json
from typing import Sequence

from ...tensor.base import VirtualTensor
from ...units import parse_size

Named = tuple[str, VirtualTensor]


def plan_shards(named: Sequence[Named], max_shard_size: int | str) -> list[list[Named]]:
    """Split ``named`` into shards of at most ``max_shard_size`` bytes (except oversized single tensors)."""
    limit = parse_size(max_shard_size)
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"tensor name {dup!r} appears twice")
    shards: list[list[Named]] = []
    current: list[Named] = []
    current_size = 0
    home: dict[int, list[Named]] = {}  # id(tensor) -> shard holding its first name
    later: dict[int, list[Named]] = {}  # id(tensor) -> further names of the same tensor, in order
    for name, t in named:
        key = id(t)
        if key in later:
            later[key].append((name, t))
            continue
        later[key] = []
        size = t.nbytes
        if size > limit:
            shards.append([(name, t)])
            home[key] = shards[-1]
            continue
        if current_size + size > limit:
            shards.append(current)
            current, current_size = [], 0
        current.append((name, t))
        current_size += size
        home[key] = current
    if current:
        shards.append(current)
    for key, extra in later.items():
        home[key].extend(extra)
    return shards


def _dotted(ext: str) -> str:
    return ext if ext.startswith(".") else "." + ext


def shard_filenames(stem: str, ext: str, n: int) -> list[str]:
    """``["model.safetensors"]`` for one shard, else ``model-00001-of-00003.safetensors`` …"""
    ext = _dotted(ext)
    if n < 0:
        raise ValueError(f"negative shard count {n}")
    if n == 1:
        return [f"{stem}{ext}"]
    return [f"{stem}-{i:05d}-of-{n:05d}{ext}" for i in range(1, n + 1)]


def index_filename(stem: str, ext: str) -> str:
    """``model.safetensors.index.json`` / ``pytorch_model.bin.index.json``."""
    return f"{stem}{_dotted(ext)}.index.json"


def total_size(named: Sequence[Named]) -> int:
    """Sum of tensor bytes, each distinct tensor object counted once (HF ``metadata.total_size``)."""
    seen: dict[int, int] = {}
    for _, t in named:
        seen.setdefault(id(t), t.nbytes)
    return sum(seen.values())


def index_json(shards: Sequence[Sequence[Named]], filenames: Sequence[str], *,
               total_parameters: int | None = None) -> bytes:
    """The index file: ``json.dumps({"metadata": {...}, "weight_map": {...}}, indent=2, sort_keys=True) + "\\n"``.

    ``total_parameters`` (written by transformers 5.x for safetensors) is included only when given.
    """
    if len(shards) != len(filenames):
        raise ValueError(f"{len(shards)} shards but {len(filenames)} file names")
    weight_map: dict[str, str] = {}
    for shard, fname in zip(shards, filenames):
        for name, _ in shard:
            if name in weight_map:
                raise ValueError(f"tensor name {name!r} appears in two shards")
            weight_map[name] = fname
    metadata = {"total_size": total_size([nt for shard in shards for nt in shard])}
    if total_parameters is not None:
        metadata["total_parameters"] = int(total_parameters)
    return (json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n").encode()
