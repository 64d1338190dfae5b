"""The cs view: the checkpoint upgraded to the current Cerebras release (2.10) as a lazily generated ``.mdl``.

Files (relative to ``cs/``):

* ``<stem>.mdl`` — a format-0.5 checkpoint (``ckptfs.layouts.hdf5.layout``) holding the complete source
  state (model, optimizer, schedulers, global_step, dataloader, ``__metadata__``…) with the release
  rules of ``ckptfs.upgrade`` applied. Tensors keep their dtype and their data is read from the
  source only when those bytes are read; constant-fill tensors stay metadata-only
  (DeferredFullTensor); pickled objects are copied as the same ``__BYTES__`` dataset, never
  unpickled; a leaf that appears under several keys is written once and linked, as cstorch does.
  Leaves ckptfs cannot produce (e.g. TorchScript graph tensors) are left out and listed in notes.
* ``<stem>.yaml`` — the params upgraded the same way, when params were found (else a note).
"""
from __future__ import annotations

import yaml

from ..errors import CkptfsError
from ..layouts.hdf5.layout import Hdf5Layout
from ..layouts.hdf5.entries import BytesEntry, FullEntry, NoneEntry, ScalarEntry, StringEntry, TensorEntry
from ..catalog.model import Container, OpaqueLeaf, TensorLeaf, UnreadableLeaf, ValueLeaf
from ..upgrade import upgrade_checkpoint
from .base import BytesFile, DeferredFile, ViewResult

try:  # the source's constant-fill tensor (DeferredFullTensor); absent in older trees
    from ..tensor.regions import FullTensor
except ImportError:  # pragma: no cover
    FullTensor = ()


class _Omit:
    """Marks a leaf left out of the output."""


OMIT = _Omit()


def _entry(leaf, key: str, memo: dict, notes: list):
    if isinstance(leaf, TensorLeaf):
        t = leaf.tensor
        if id(t) in memo:
            return memo[id(t)]
        if isinstance(t, FullTensor):
            fill = t.fill.item() if hasattr(t.fill, "item") else t.fill
            e = FullEntry(t.shape, t.dtype, fill)
        else:
            e = TensorEntry(t, numpy=bool(leaf.numpy))
        memo[id(t)] = e
        return e
    if isinstance(leaf, ValueLeaf):
        v = leaf.value
        if hasattr(v, "item") and not isinstance(v, (bool, int, float, str)):
            v = v.item()
        if v is None:
            return NoneEntry()
        if isinstance(v, str):
            return StringEntry(v)
        if isinstance(v, (bool, int, float)):
            return ScalarEntry(v)
        notes.append(f"{key}: {type(v).__name__} value written as its text")
        return StringEntry(str(v))
    if isinstance(leaf, OpaqueLeaf):
        return BytesEntry(leaf.data)
    if isinstance(leaf, UnreadableLeaf):
        notes.append(f"{key}: left out ({leaf.reason})")
        return OMIT
    raise TypeError(f"{key}: unknown leaf type {type(leaf).__name__}")


def to_entries(node, notes: list, memo: dict | None = None, key: str = ""):
    """The layout tree of a state tree: same containers, leaves as hdf5 layout entries (or OMIT)."""
    memo = {} if memo is None else memo
    if isinstance(node, Container):
        keys = node.keys if node.keys is not None else list(range(len(node.children)))
        out_keys, out_children = [], []
        for k, child in zip(keys, node.children):
            ck = f"{key}.{k}" if key else str(k)
            e = to_entries(child, notes, memo, ck)
            if e is OMIT:
                continue
            out_keys.append(k)
            out_children.append(e)
        kind = node.kind
        if kind == "defaultdict" and len(out_children) > 1:
            notes.append(f"{key or '<root>'}: defaultdict with several keys written as a dict "
                         f"(cstorch's key naming would lose entries)")
            kind = "dict"
        return Container(kind, out_keys if node.keys is not None else None, out_children, dict(node.extra))
    if id(node) not in memo:
        memo[id(node)] = _entry(node, key, memo, notes)
    return memo[id(node)]


def _plain(obj):
    """YAML-safe copy (tuples → lists)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def params_yaml(params: dict) -> str:
    return yaml.safe_dump(_plain(params), indent=4, sort_keys=False, allow_unicode=True)


#: keys the upgraded file can hold: one ``<key>.__metadata__`` root attribute each plus four more, in a root group
#: whose attribute creation order is tracked (HDF5 numbers them with a 16-bit index: at most 65,535)
MAX_KEYS = 65_535 - 4


def count_keys(node) -> int:
    """Flat keys of a layout tree (``to_entries``): one per leaf."""
    if isinstance(node, Container):
        return sum(count_keys(c) for c in node.children)
    return 1


def too_many_keys(stem: str, n: int) -> str:
    return (f"{stem}.mdl not generated: the checkpoint has {n:,} keys, more than the {MAX_KEYS:,} an upgraded "
            f"checkpoint can hold here (one root attribute per key; HDF5 numbers a group's attributes with a "
            f"16-bit index)")


def build(ctx) -> ViewResult:
    ckpt = ctx.checkpoint
    result = ViewResult()
    if len(ckpt.leaves) > MAX_KEYS:  # said before anything is built (an HDF5 error on first stat was EINVAL)
        return ViewResult(missing=too_many_keys(ctx.stem, len(ckpt.leaves)))
    up = upgrade_checkpoint(ckpt, ctx.options)
    result.notes.extend(up.notes)
    if not ckpt.success:
        result.notes.append("source is a partially written checkpoint: the upgraded file holds what could be read")

    if up.params is not None:
        result.files[f"{ctx.stem}.yaml"] = BytesFile(params_yaml(up.params))
        result.notes.append(f"{ctx.stem}.yaml from {up.params_doc.origin}")
    else:
        result.notes.append(f"{ctx.stem}.yaml not generated (no params; use --config)")

    mdl, missing = mdl_file(up.root, ctx.stem, ctx.ckpt_path, ctx.cache, ctx.fork_builds, result.notes)
    if mdl is None:
        result.missing = missing
    else:
        result.files[f"{ctx.stem}.mdl"] = mdl
    return result


def mdl_file(root, stem: str, path, cache, fork_builds: bool, notes: list) -> tuple:
    """``(the .mdl file of state tree root, None)`` — a ``DeferredFile`` sized on first use — or ``(None, why)``
    when the tree cannot be written (nothing ckptfs can write, too many keys, a layout error). Appends the layout's
    notes to ``notes``. ``fork_builds``: the mount server, whose skeleton builds in a forked process."""
    entries = to_entries(root, notes)
    if entries is OMIT:
        return None, f"{stem}.mdl: the checkpoint holds nothing ckptfs can write"
    if count_keys(entries) > MAX_KEYS:
        return None, too_many_keys(stem, count_keys(entries))
    try:
        lay = Hdf5Layout(entries, path=path, cache=cache)
    except CkptfsError as e:
        return None, f"{stem}.mdl: {e.problem}"
    notes.extend(lay.notes)
    if fork_builds:  # the mount server: the skeleton builds on the other CPU while the other views are built
        lay.fork_build()

    def skeleton():
        lay.size  # lays the HDF5 skeleton out: O(keys) h5py work, ~0.25 s of CPU for a 70B model's 724 tensors
        return lay

    # Sized on first use; the mount server warms it in a background thread (VirtualTree.warm) so that the mount
    # answers at once and the first stat of the file only waits for what is left of the build.
    return DeferredFile(skeleton), None
