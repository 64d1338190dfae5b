"""A catalog as plain Python objects with torch tensors (what ``cstorch.load`` would give).

Reads every tensor in full, so it is for tests, small checkpoints and the Python API, not for the
filesystem. Ties stay ties: one Leaf object becomes one tensor object wherever it appears.
Pickled objects come back as ``Opaque(bytes)`` (never unpickled) and leaves ckptfs cannot produce
as ``Unreadable(reason)``.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

from .model import Checkpoint, Container, Leaf, OpaqueLeaf, TensorLeaf, UnreadableLeaf, ValueLeaf


@dataclass(frozen=True)
class Opaque:
    """A pickled Python object of the checkpoint, as its raw pickle bytes."""

    data: bytes
    reason: str = "pickled Python object (not unpickled for safety)"


@dataclass(frozen=True)
class Unreadable:
    """A leaf ckptfs cannot produce; ``reason`` says why."""

    reason: str


_FACTORIES = {"builtins.list": list, "builtins.dict": dict, "builtins.set": set, "builtins.int": int,
              "builtins.float": float, "builtins.str": str, "builtins.tuple": tuple}


def require_torch():
    """The ``torch`` module; ``ModuleNotFoundError`` in one line saying how to install it when it is missing (only
    ``ckptfs.load`` needs it)."""
    try:
        import torch
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        raise ModuleNotFoundError("ckptfs.load needs PyTorch, which is not installed here: pip install "
                                  "'ckptfs[torch]' (or any torch>=2.1); mounts and exports work without it",
                                  name="torch") from None
    return torch


def tensor_to_torch(leaf: TensorLeaf):
    """One tensor leaf read in full: a torch tensor (bf16 as torch.bfloat16) or, for numpy leaves, an ndarray."""
    torch = require_torch()

    arr = np.array(leaf.tensor.read_all(), copy=True)
    dt = leaf.tensor.dtype
    if leaf.numpy:
        return arr.view(np.int16) if dt.name == "bfloat16" else arr  # cstorch gives bf16 numpy arrays as int16 bits
    if not dt.npy_native:
        signed = {1: np.int8, 2: np.int16}[arr.dtype.itemsize]
        return torch.from_numpy(arr.view(signed)).view(getattr(torch, dt.name))
    return torch.from_numpy(arr)


def leaf_to_python(leaf: Leaf, memo: dict | None = None):
    memo = {} if memo is None else memo
    got = memo.get(id(leaf))
    if got is not None:
        return got[0]
    if isinstance(leaf, TensorLeaf):
        v = tensor_to_torch(leaf)
    elif isinstance(leaf, ValueLeaf):
        v = leaf.value
    elif isinstance(leaf, OpaqueLeaf):
        v = Opaque(leaf.data, leaf.reason)
    elif isinstance(leaf, UnreadableLeaf):
        v = Unreadable(leaf.reason)
    else:
        raise TypeError(f"unknown leaf type {type(leaf).__name__}")
    memo[id(leaf)] = (v, leaf)  # keep the leaf alive so id() stays unique
    return v


def node_to_python(node, memo: dict | None = None):
    memo = {} if memo is None else memo
    if not isinstance(node, Container):
        return leaf_to_python(node, memo)
    vals = [node_to_python(c, memo) for c in node.children]
    kind = node.kind
    if kind == "dict":
        return dict(zip(node.keys, vals))
    if kind == "OrderedDict":
        return collections.OrderedDict(zip(node.keys, vals))
    if kind == "defaultdict":
        factory = _FACTORIES.get(node.extra.get("default_factory"))
        return collections.defaultdict(factory, zip(node.keys, vals))
    if kind == "list":
        return vals
    if kind == "tuple":
        return tuple(vals)
    if kind == "set":
        return set(vals)
    if kind == "deque":
        return collections.deque(vals, maxlen=node.extra.get("maxlen"))
    if kind == "namedtuple":
        fields = node.extra.get("fields") or [f"field{i}" for i in range(len(vals))]
        cls = collections.namedtuple(node.extra.get("name") or "NamedTuple", fields, rename=True)
        return cls(*vals)
    raise TypeError(f"unknown container kind {kind!r}")


def to_torch(checkpoint: Checkpoint):
    """The whole checkpoint as nested Python objects with torch tensors."""
    return node_to_python(checkpoint.root, {})
