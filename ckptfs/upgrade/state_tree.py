"""Editing a checkpoint's state tree (``Container`` nodes + catalog leaves) without touching the original.

``copy_tree`` copies the containers and shares the leaves, so an upgrade can rename, insert and
remove entries while the opened ``Checkpoint`` (used by the other views) stays as it was. Leaves
shared by several positions stay shared (ties and links survive); a changed value is a new leaf.
"""
from __future__ import annotations

import datetime
from typing import Any

import numpy as np

from ..catalog.model import Container, TensorLeaf, ValueLeaf

DICT_KINDS = ("dict", "OrderedDict", "defaultdict", "immutable_dict")


def copy_tree(node):
    if isinstance(node, Container):
        return Container(node.kind, None if node.keys is None else list(node.keys),
                         [copy_tree(c) for c in node.children], dict(node.extra))
    return node


def is_dict(node) -> bool:
    return isinstance(node, Container) and node.kind in DICT_KINDS and node.keys is not None


def is_seq(node) -> bool:
    return isinstance(node, Container) and node.keys is None


def has(node, key) -> bool:
    return is_dict(node) and key in node.keys


def get(node, key, default=None):
    if is_dict(node) and key in node.keys:
        return node.children[node.keys.index(key)]
    return default


def put(node: Container, key, child, *, after=None) -> None:
    """Set ``node[key] = child``: replaced in place, else inserted after ``after`` (or appended)."""
    if key in node.keys:
        node.children[node.keys.index(key)] = child
    elif after is not None and after in node.keys:
        i = node.keys.index(after) + 1
        node.keys.insert(i, key)
        node.children.insert(i, child)
    else:
        node.keys.append(key)
        node.children.append(child)


def pop(node: Container, key):
    i = node.keys.index(key)
    node.keys.pop(i)
    return node.children.pop(i)


def rename(node: Container, old, new) -> None:
    node.keys[node.keys.index(old)] = new


def is_none_leaf(node) -> bool:
    return isinstance(node, ValueLeaf) and node.value is None


def scalar_of(node):
    """Python value of a scalar leaf (a ValueLeaf, or a 1-element tensor); None if it is not one."""
    if isinstance(node, ValueLeaf) and not isinstance(node.value, str):
        return node.value
    if isinstance(node, TensorLeaf) and node.tensor.numel == 1:
        v = node.tensor.read_all().reshape(-1)[0]
        return v.item() if hasattr(v, "item") else v
    return None


def same_kind_scalar(old, value, key: str):
    """A new leaf holding ``value`` in the form of ``old`` (a Python int, or a 0-d tensor of its dtype)."""
    from ..tensor.base import ArrayTensor

    if isinstance(old, TensorLeaf):
        arr = np.array(value).astype(old.tensor.dtype.storage).reshape(old.tensor.shape)
        return TensorLeaf(key, ArrayTensor(arr, old.tensor.dtype))
    return ValueLeaf(key, value)


def from_python(value, key: str = "", notes: list | None = None):
    """A tree of Containers / ValueLeafs for YAML-like Python data (dict, list, tuple, scalars, str, None)."""
    if isinstance(value, dict):
        keys = list(value)
        return Container("dict", keys, [from_python(value[k], f"{key}.{k}" if key else str(k), notes) for k in keys])
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        return Container(kind, None, [from_python(v, f"{key}.{i}", notes) for i, v in enumerate(value)])
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return ValueLeaf(key, value)
    if notes is not None and not isinstance(value, (datetime.date, datetime.datetime)):
        notes.append(f"{key}: {type(value).__name__} value stored as its text")
    return ValueLeaf(key, str(value))


def to_python(node) -> Any:
    """YAML-like Python data of a tree of Containers / ValueLeafs (tensor leaves become None)."""
    if isinstance(node, Container):
        vals = [to_python(c) for c in node.children]
        if node.keys is not None:
            return dict(zip(node.keys, vals))
        return tuple(vals) if node.kind == "tuple" else vals
    if isinstance(node, ValueLeaf):
        return node.value
    return None
