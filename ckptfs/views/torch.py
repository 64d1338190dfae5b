"""The torch view: the source state dict as ``torch.save`` files, generated lazily.

Files (relative to ``torch/``):

* ``<stem>.pt`` — the whole state (no release upgrade) as one ``TorchZipLayout``: tensors, dicts
  with their int keys, OrderedDicts, lists, tuples, sets, scalars, strings and None, loadable with
  ``torch.load(weights_only=True)``. A leaf appearing under several keys is one tensor object, so
  ties come back as shared storage. Pickled objects (never unpickled) and leaves ckptfs cannot
  produce are LEFT OUT (from dicts and sequences alike) and listed in notes. Containers torch's
  weights-only loader refuses become their plain equivalent (defaultdict → dict, namedtuple →
  tuple, deque → list) with a note; numpy-array leaves become tensors.
* ``model.pt`` — only the top-level ``model`` subtree, when there is one.

CRC mode follows ``options.zip_crc``; CRCs persist under ``ctx.identity`` (the checkpoint's realpath, size,
mtime_ns and inode plus the content-shaping options, see ``tree/assemble.py`` ``content_identity``) and the file name.
"""
from __future__ import annotations

from collections import OrderedDict

from ..errors import CkptfsError
from ..catalog.model import Container, OpaqueLeaf, TensorLeaf, UnreadableLeaf, ValueLeaf
from .base import ViewResult


class _Omit:
    """Marks a leaf left out of the output."""


OMIT = _Omit()

_PLAIN = {"defaultdict": "dict", "immutable_dict": "dict", "namedtuple": "tuple", "deque": "list",
          "immutable_list": "list"}


def to_object(node, notes: list, key: str = ""):
    """Plain Python of a state tree, ``VirtualTensor`` leaves (the same object wherever a leaf repeats)."""
    if isinstance(node, Container):
        keys = node.keys if node.keys is not None else list(range(len(node.children)))
        items = []
        for k, child in zip(keys, node.children):
            v = to_object(child, notes, f"{key}.{k}" if key else str(k))
            if v is not OMIT:
                items.append((k, v))
        kind = node.kind
        if kind in _PLAIN:
            notes.append(f"{key or '<root>'}: {kind} written as a {_PLAIN[kind]}")
            kind = _PLAIN[kind]
        if kind == "OrderedDict":
            return OrderedDict(items)
        if kind == "dict":
            return dict(items)
        vals = [v for _, v in items]
        if kind == "tuple":
            return tuple(vals)
        if kind == "set":
            return set(vals)
        if kind == "list":
            return vals
        raise CkptfsError(key or "<root>", f"container kind {kind!r} cannot be written to a torch file")
    if isinstance(node, TensorLeaf):
        if node.numpy:
            notes.append(f"{key}: numpy array written as a tensor")
        return node.tensor
    if isinstance(node, ValueLeaf):
        v = node.value
        if hasattr(v, "item") and not isinstance(v, (bool, int, float, str)):
            v = v.item()
        return v
    if isinstance(node, OpaqueLeaf):
        notes.append(f"{key}: left out ({node.reason}; {len(node.data)} bytes, see the cs view)")
        return OMIT
    if isinstance(node, UnreadableLeaf):
        notes.append(f"{key}: left out ({node.reason})")
        return OMIT
    raise CkptfsError(key, f"unknown leaf type {type(node).__name__}")


def build(ctx) -> ViewResult:
    from ..layouts.torchzip.layout import TorchZipLayout

    ckpt = ctx.checkpoint
    result = ViewResult()
    crc = getattr(ctx.options, "zip_crc", "exact")
    store = getattr(ctx, "crc_store", None)
    ident = getattr(ctx, "identity", None)  # set by tree/assemble.py (content_identity)

    def layout(obj, name: str):
        return TorchZipLayout(obj, name, crc=crc, crc_store=store,
                              identity=f"{ident}:torch/{name}.pt" if ident else None, cache=ctx.cache)

    obj = to_object(ckpt.root, result.notes)
    if obj is OMIT:
        result.missing = f"{ctx.stem}.pt: the checkpoint holds nothing a torch file can carry"
        return result
    result.files[f"{ctx.stem}.pt"] = layout(obj, ctx.stem)

    model = ckpt.subtree("model")
    if model is not None and ctx.stem != "model":
        mobj = to_object(model, [], "model")  # notes already recorded for the whole state
        if mobj is not OMIT:
            result.files["model.pt"] = layout(mobj, "model")
    elif model is not None:
        result.notes.append("model.pt not generated: the checkpoint's own file is model.pt")
    return result
