"""torch pytree specs as plain nodes: parse protocol-1 JSON, name leaves like cstorch, rebuild containers.

A ``SpecNode`` is what both format families decode their ``__spec__`` into (0.5: JSON text; legacy:
a restricted-unpickled TreeSpec, see ``legacy_spec``). ``leaf_keys`` reproduces
``cstorch.utils.nest.recurse_spec`` exactly (quirks included: a defaultdict's children are named
``str(factory)`` and ``str(keys)``), and ``build_tree`` turns the spec plus the leaves, taken in the
same order, into ``Container`` nodes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterator

from .model import Container, Leaf, Node

#: torch serialized type name -> Container.kind
KINDS = {
    "builtins.dict": "dict",
    "collections.OrderedDict": "OrderedDict",
    "collections.defaultdict": "defaultdict",
    "builtins.list": "list",
    "builtins.tuple": "tuple",
    "builtins.set": "set",
    "collections.deque": "deque",
    "collections.namedtuple": "namedtuple",
    "torch.fx.immutable_collections.immutable_dict": "dict",
    "torch.fx.immutable_collections.immutable_list": "list",
}
_DICT_KINDS = ("dict", "OrderedDict")


class SpecError(ValueError):
    """The spec cannot be decoded or does not follow the pytree rules (callers add the file path)."""


@dataclass(frozen=True)
class DefaultDictContext:
    factory_module: str
    factory_name: str
    keys: list

    def factory_str(self) -> str:
        """``str(default_factory)`` as cstorch's key naming sees it, e.g. ``<class 'list'>``."""
        if self.factory_module == "builtins":
            return f"<class '{self.factory_name}'>"
        return f"<class '{self.factory_module}.{self.factory_name}'>"


@dataclass(frozen=True)
class NamedTupleType:
    name: str
    fields: tuple | None = None


@dataclass(eq=False)
class SpecNode:
    kind: str | None  # Container.kind, None for a leaf
    context: Any = None  # dict kinds: list of keys; defaultdict: DefaultDictContext; deque: maxlen; namedtuple: NamedTupleType
    children: list = field(default_factory=list)
    type_name: str | None = None  # the torch serialized type name, for messages

    @property
    def is_leaf(self) -> bool:
        return self.kind is None

    def num_leaves(self) -> int:
        n = getattr(self, "_n", None)
        if n is None:
            n = 1 if self.is_leaf else sum(c.num_leaves() for c in self.children)
            self._n = n
        return n


# -- protocol-1 JSON -------------------------------------------------------------------------------
def parse_treespec(text: str) -> SpecNode:
    """``torch.utils._pytree.treespec_dumps`` output (``[1, node]``) -> SpecNode."""
    try:
        data = json.loads(text)
    except (TypeError, ValueError) as e:
        raise SpecError(f"pytree spec is not valid JSON ({e})") from None
    if not (isinstance(data, list) and len(data) == 2):
        raise SpecError("pytree spec is not a [protocol, node] pair")
    if data[0] != 1:
        raise SpecError(f"unsupported pytree spec protocol {data[0]!r} (only protocol 1 is known)")
    return _json_node(data[1])


def _json_node(d) -> SpecNode:
    if not isinstance(d, dict):
        raise SpecError("pytree spec node is not a JSON object")
    t = d.get("type")
    children = [_json_node(c) for c in d.get("children_spec") or []]
    if t is None:
        if children:
            raise SpecError("pytree leaf with children")
        return SpecNode(None)
    kind = KINDS.get(t)
    if kind is None:
        raise SpecError(f"unsupported container type {t!r} in pytree spec")
    ctx = d.get("context")
    if kind in _DICT_KINDS:
        keys = json.loads(ctx) if isinstance(ctx, str) else ctx
        if not isinstance(keys, list) or len(keys) != len(children):
            raise SpecError(f"{t} node: context does not list one key per child")
        context = keys
    elif kind == "defaultdict":
        if not isinstance(ctx, dict):
            ctx = json.loads(ctx) if isinstance(ctx, str) else None
        if not isinstance(ctx, dict) or "dict_context" not in ctx:
            raise SpecError("defaultdict node without a dict_context")
        context = DefaultDictContext(str(ctx.get("default_factory_module")), str(ctx.get("default_factory_name")),
                                     list(ctx["dict_context"]))
        if len(context.keys) != len(children):
            raise SpecError("defaultdict node: context does not list one key per child")
    elif kind == "deque":
        context = json.loads(ctx) if isinstance(ctx, str) else ctx
    elif kind == "namedtuple":
        context = NamedTupleType(str(ctx))
    else:
        context = None
    return SpecNode(kind, context, children, t)


# -- key naming (cstorch recurse_spec) ---------------------------------------------------------------
def child_names(node: SpecNode) -> list[str]:
    """Names cstorch gives the children of ``node``; may be shorter than the children (zip semantics)."""
    n = len(node.children)
    kind, ctx = node.kind, node.context
    if kind == "namedtuple":
        return [str(i) for i in range(n)]
    if kind in _DICT_KINDS:
        return [_key_str(k) for k in ctx] if ctx else [str(i) for i in range(n)]
    if kind == "defaultdict":  # deserialized context is [factory, keys]: zip names only two children
        return [ctx.factory_str(), _key_str(list(ctx.keys))][:n]
    if kind == "deque" and ctx:
        raise SpecError("deque with maxlen: cstorch cannot name its children")
    return [str(i) for i in range(n)]


def _key_str(k) -> str:
    return str(k)  # int 0 -> "0", True -> "True", 1.5 -> "1.5", list -> "['a']"


def leaf_keys(spec: SpecNode, prefix: str = "") -> list[tuple[str, tuple]]:
    """Every leaf as ``(flat key, path of real container keys/indices)``, in flatten order."""
    out: list[tuple[str, tuple]] = []
    _walk_keys(spec, prefix, (), out)
    return out


def _walk_keys(node: SpecNode, prefix: str, path: tuple, out: list) -> None:
    if node.num_leaves() == 0:
        return
    if node.is_leaf:
        out.append((prefix, path))
        return
    names = child_names(node)
    if len(names) < len(node.children) and any(c.num_leaves() for c in node.children[len(names):]):
        raise SpecError(f"{node.type_name} with {len(node.children)} entries: cstorch names only the first "
                        f"{len(names)}, the others were not saved")
    real = real_keys(node)
    for name, key, child in zip(names, real, node.children):
        _walk_keys(child, f"{prefix}.{name}" if prefix else name, path + (key,), out)


def real_keys(node: SpecNode) -> list:
    """The container's own keys (dict keys, or indices for sequences)."""
    if node.kind in _DICT_KINDS:
        return list(node.context)
    if node.kind == "defaultdict":
        return list(node.context.keys)
    return list(range(len(node.children)))


# -- rebuilding the nesting --------------------------------------------------------------------------
def build_tree(spec: SpecNode, leaves: Iterator[Leaf]) -> Node:
    """Rebuild the containers of ``spec``, taking one leaf from ``leaves`` per leaf position, in order."""
    if spec.is_leaf:
        return next(leaves)
    children = [build_tree(c, leaves) for c in spec.children]
    return Container(spec.kind, _container_keys(spec), children, _extra(spec))


def _container_keys(spec: SpecNode):
    if spec.kind in _DICT_KINDS:
        return list(spec.context)
    if spec.kind == "defaultdict":
        return list(spec.context.keys)
    return None


def _extra(spec: SpecNode) -> dict:
    if spec.kind == "defaultdict":
        return {"default_factory": f"{spec.context.factory_module}.{spec.context.factory_name}"}
    if spec.kind == "deque":
        return {"maxlen": spec.context}
    if spec.kind == "namedtuple":
        return {"name": spec.context.name, "fields": spec.context.fields}
    if spec.type_name and spec.type_name.startswith("torch.fx.immutable_collections."):
        return {"immutable": True}
    return {}
