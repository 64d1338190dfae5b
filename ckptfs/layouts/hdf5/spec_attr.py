"""How cstorch 2.10 names and describes a state tree: flat keys, ``__spec__`` JSON, per-key metadata JSON.

Pure functions over a tree of ``ckptfs.catalog.model.Container`` nodes whose leaves are any other
objects. They reproduce, byte for byte, what ``cstorch.save`` writes:

* ``flat_items(root)``: the flattened keys of ``cstorch.utils.nest.recurse_spec``: dict keys → ``str(key)``,
  sequences → indices, a subtree without leaves contributes nothing, and the defaultdict quirk (children named ``str(factory)``, ``str(keys)``, the rest dropped).
* ``treespec_dumps(root)``: torch pytree protocol-1 JSON (``torch.utils._pytree.treespec_dumps``).
* ``spec_attr(root)``: the global ``__spec__`` = ``json.dumps([skeleton, treespec], indent=4)``,
  skeleton ``null`` when the structure is not JSON-able (a set, a deque, odd keys).
* ``key_metadata_attr(key, md)``: one ``<key>.__metadata__`` attribute (indent=4).
"""
from __future__ import annotations

import json
from typing import Any, Iterator

from ...catalog.model import Container

LEAF_SPEC = {"type": None, "context": None, "children_spec": []}

_TYPE_NAMES = {
    "dict": "builtins.dict",
    "OrderedDict": "collections.OrderedDict",
    "defaultdict": "collections.defaultdict",
    "list": "builtins.list",
    "tuple": "builtins.tuple",
    "set": "builtins.set",
    "namedtuple": "collections.namedtuple",
    "deque": "collections.deque",
    "immutable_dict": "torch.fx.immutable_collections.immutable_dict",
    "immutable_list": "torch.fx.immutable_collections.immutable_list",
}
_KEYED = {"dict", "OrderedDict", "defaultdict", "immutable_dict"}


def is_container(node) -> bool:
    return isinstance(node, Container)


def count_leaves(node) -> int:
    if not is_container(node):
        return 1
    return sum(count_leaves(c) for c in node.children)


def defaultdict_factory(c: Container) -> tuple:
    """(module, name) of a defaultdict's factory from ``Container.extra`` (None, None when unset)."""
    ex = c.extra or {}
    mod, name = ex.get("default_factory_module"), ex.get("default_factory_name")
    if name is None:
        f = ex.get("default_factory", ex.get("factory"))
        if isinstance(f, str) and f:
            mod, _, name = f.rpartition(".")
            mod = mod or "builtins"
    return mod, name


def _factory_str(c: Container) -> str:
    mod, name = defaultdict_factory(c)
    if name is None:
        return "None"
    return f"<class '{name}'>" if mod in (None, "builtins") else f"<class '{mod}.{name}'>"


def child_names(c: Container) -> list:
    """Name of each child as ``recurse_spec`` derives it; ``None`` for children cstorch drops."""
    n = len(c.children)
    if c.kind == "defaultdict":
        names = [_factory_str(c), str(list(c.keys or []))][:n]
        return names + [None] * (n - len(names))
    if c.kind in _KEYED and c.keys:
        return [str(k) for k in c.keys]
    return [str(i) for i in range(n)]


def flat_items(root, prefix: tuple = ()) -> Iterator[tuple]:
    """``(flat_key, leaf)`` for every leaf in spec order (a leaf object may appear several times)."""
    if not is_container(root):
        yield ".".join(prefix), root
        return
    for name, child in zip(child_names(root), root.children):
        if count_leaves(child) == 0:
            continue
        if name is None:
            continue
        yield from flat_items(child, prefix + (name,))


def dropped_children(root, prefix: tuple = ()) -> list:
    """Flat key prefixes of subtrees that cstorch's key derivation drops (multi-key defaultdicts)."""
    out = []
    if is_container(root):
        for i, (name, child) in enumerate(zip(child_names(root), root.children)):
            if name is None and count_leaves(child):
                out.append(".".join(prefix + (f"<child {i}>",)))
            elif name is not None:
                out.extend(dropped_children(child, prefix + (name,)))
    return out


# -- treespec (torch pytree protocol 1) ------------------------------------------------------------
def _context(c: Container):
    if c.kind in ("dict", "OrderedDict", "immutable_dict"):
        return json.dumps(list(c.keys or []))
    if c.kind == "defaultdict":
        mod, name = defaultdict_factory(c)
        return {"default_factory_module": mod, "default_factory_name": name, "dict_context": list(c.keys or [])}
    if c.kind == "namedtuple":
        ex = c.extra or {}
        return ex.get("name") or ex.get("typename") or ex.get("serialized_type_name") or "NestedObject"
    if c.kind == "deque":
        return json.dumps((c.extra or {}).get("maxlen"))
    return "null"


def spec_node(node) -> dict:
    if not is_container(node):
        return dict(LEAF_SPEC)
    try:
        tname = _TYPE_NAMES[node.kind]
    except KeyError:
        raise ValueError(f"container kind {node.kind!r} has no cstorch pytree type") from None
    return {"type": tname, "context": _context(node), "children_spec": [spec_node(c) for c in node.children]}


def treespec_dumps(root) -> str:
    return json.dumps([1, spec_node(root)])


# -- skeleton and attributes -----------------------------------------------------------------------
class _Unjsonable:
    """Stands for a set/deque: makes ``json.dumps`` fail, as it does for cstorch."""


def _skeleton(node):
    if not is_container(node):
        return "*"
    kids = [_skeleton(c) for c in node.children]
    if node.kind in _KEYED:
        return dict(zip(node.keys or [], kids))
    if node.kind in ("set", "deque"):
        return _Unjsonable()
    return kids


def spec_attr(root) -> str:
    """The global ``__spec__`` attribute text."""
    spec = treespec_dumps(root)
    try:
        return json.dumps([_skeleton(root), spec], indent=4)
    except (TypeError, ValueError):
        return json.dumps([None, spec], indent=4)


def leaf_treespec(key: str) -> str:
    return json.dumps([1, {"type": "builtins.dict", "context": json.dumps([key]), "children_spec": [dict(LEAF_SPEC)]}])


def key_metadata_attr(key: str, md: dict) -> str:
    """``<key>.__metadata__`` text for a simple (non-nested) leaf with metadata ``md``."""
    obj: dict[str, Any] = {
        "__spec__": [{key: "*"}, leaf_treespec(key)],
        "__objects__": [key],
        key + ".__metadata__": md,
    }
    return json.dumps(obj, indent=4)
