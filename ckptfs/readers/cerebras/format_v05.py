"""Format 0.5 (cstorch 2.5 → 2.10): JSON ``__spec__`` + one ``<key>.__metadata__`` JSON per key.

Keys come from the top-level pytree spec (cstorch naming); each key's metadata has its own inner
spec whose sub-keys name the serialized objects, nested ones (``NestedObject``: ``.0`` payload,
``.1`` outer serializer metadata) included. Links resolve to the same Leaf object. A partial file
(no ``__SUCCESS__``) is salvaged, on request, from the datasets' own attributes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from ...errors import CheckpointError
from ...catalog.model import Leaf, Node, TensorLeaf, UnreadableLeaf
from .graph_ir import identity_output_index
from .h5safe import H5Refused, open_object
from .h5store import ExternalFiles, H5Store, read_text_attr
from ...errors import one_line
from ...catalog.pytree import SpecError, SpecNode, build_tree, child_names, leaf_keys, parse_treespec, real_keys
from .serializers import LeafFactory, Link, Unresolved, attrs_to_metadata, tensor_dtype, tensor_shape
from ...catalog.validate import shape_problem

#: keys whose metadata attributes are read together before their datasets are opened (``_metadata_texts``)
METADATA_BATCH = 1000


@dataclass
class ReadResult:
    """What a format reader hands back to ``open_checkpoint``."""

    root: Node
    leaves: dict
    links: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)


@dataclass
class _RawMeta:  # a NestedObject metadata slot (a sub-key not listed in __objects__)
    md: dict


def check_collisions(path, keys: list[tuple[str, tuple]]) -> None:
    """CheckpointError if two leaves flatten to the same key (e.g. ``{1: …, "1": …}``)."""
    seen: dict[str, tuple] = {}
    for k, p in keys:
        if k in seen:
            raise CheckpointError(path, f"keys {_fmt_path(seen[k])} and {_fmt_path(p)} both flatten to {k!r}, "
                                        f"so one overwrote the other (cstorch cannot load it either)")
        seen[k] = p


def _fmt_path(p: tuple) -> str:
    return "root" + "".join(f"[{k!r}]" for k in p)


def parse_top_spec(path, text) -> SpecNode:
    try:
        outer = json.loads(text)
        if not (isinstance(outer, list) and len(outer) == 2 and isinstance(outer[1], str)):
            raise SpecError("__spec__ is not a [skeleton, treespec] pair")
        return parse_treespec(outer[1])
    except SpecError as e:
        raise CheckpointError(path, f"bad __spec__: {e}") from None
    except ValueError as e:
        raise CheckpointError(path, f"__spec__ is not valid JSON ({one_line(e)})") from None


class V05Reader:
    def __init__(self, f, store: H5Store, externals: ExternalFiles, path, *, partial: bool):
        self.f = f
        self.path = path
        self.partial = partial
        self.warnings: list = []
        self.factory = LeafFactory(store, externals, self.warnings)

    def read(self, spec_text: str) -> ReadResult:
        """The catalog, from the ``__spec__`` text (read once by ``open_checkpoint``) and each key's metadata."""
        spec = parse_top_spec(self.path, spec_text)
        try:
            keys = leaf_keys(spec)
        except SpecError as e:
            raise CheckpointError(self.path, f"bad __spec__: {e}") from None
        check_collisions(self.path, keys)
        values: dict = {}
        salvaged = lost = 0
        for k, text in self._metadata_texts(keys):
            if text is None:
                if not self.partial:
                    raise CheckpointError(self.path, f"metadata attribute of key {k!r} is missing")
                v = self._salvage(k)
                if isinstance(v, UnreadableLeaf):
                    lost += 1
                else:
                    salvaged += 1
            else:
                v = self._key_value(k, text)
            values[k] = v
        leaves, links = resolve_links(values)
        if self.partial:
            self.warnings.insert(0, f"partial checkpoint (no __SUCCESS__): {salvaged} of {len(keys)} leaves salvaged "
                                    f"from dataset attributes; {lost} lost (metadata-only leaves such as scalars, "
                                    f"strings, None, links and fill tensors, and tensors never written)")
        root = build_tree(spec, iter(list(leaves.values())))
        return ReadResult(root, leaves, links, self.warnings)

    def _metadata_texts(self, keys: list):
        """``(key, its metadata JSON text or None when absent)`` in key order. The attributes are read
        ``METADATA_BATCH`` keys at a time, before those keys' datasets are opened: HDF5 spends about a quarter
        less time when it does not alternate between the root's attribute index and dataset headers key by key."""
        for start in range(0, len(keys), METADATA_BATCH):
            batch = [k for k, _ in keys[start:start + METADATA_BATCH]]
            texts = []
            for k in batch:
                try:
                    texts.append(read_text_attr(self.f, k + ".__metadata__"))
                except KeyError:
                    texts.append(None)
            yield from zip(batch, texts)

    # -- one top-level key ---------------------------------------------------------------------------
    def _key_value(self, k: str, text: str):
        try:
            md = json.loads(text)
            inner = parse_treespec(md["__spec__"][1])
            objects = set(md.get("__objects__") or [])
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise CheckpointError(self.path, f"metadata of key {k!r} is malformed ({one_line(e)})") from None
        if inner.kind not in ("dict", "OrderedDict") or inner.context != [k]:
            raise CheckpointError(self.path, f"metadata of key {k!r}: inner spec is not rooted at {{{k!r}: …}}")
        try:
            v = self._deser(inner.children[0], k, k, md, objects)
        except SpecError as e:
            raise CheckpointError(self.path, f"metadata of key {k!r}: {e}") from None
        return self._finish(k, v)

    def _finish(self, k: str, v):
        if isinstance(v, (Leaf, Link)):
            if isinstance(v, Leaf):
                v.key = k
            return v
        if isinstance(v, Unresolved):
            return UnreadableLeaf(k, v.reason)
        return UnreadableLeaf(k, "serialized structure ckptfs does not recognise")

    def _deser(self, node: SpecNode, sk: str, k: str, md: dict, objects: set):
        if node.is_leaf:
            m = md.get(sk + ".__metadata__")
            if m is None:
                raise SpecError(f"no metadata for serialized object {sk!r}")
            if sk in objects:
                return self.factory.from_metadata(k, sk, m)
            return _RawMeta(m)
        kids = node.children
        if node.kind == "namedtuple" and node.context.name == "NestedObject" and len(kids) == 2:
            obj = self._deser(kids[0], sk + ".0", k, md, objects)
            meta = self._deser(kids[1], sk + ".1", k, md, objects)
            return self._nested(k, obj, meta.md if isinstance(meta, _RawMeta) else {})
        vals = [self._deser(c, f"{sk}.{n}", k, md, objects) for n, c in zip(child_names(node), kids)]
        if node.kind in ("dict", "OrderedDict", "defaultdict"):
            return dict(zip(real_keys(node), vals))
        return vals

    def _nested(self, k: str, obj, meta: dict):
        """Apply a NestedObject's outer serializer to its already-deserialized payload."""
        t = meta.get("__TYPE__")
        if t == "DeferredGraphTensor":
            return self._graph(k, obj, meta)
        if t in ("TorchTensorSerializer", "DeferredTorchTensor"):
            try:
                shape, dt = tensor_shape(meta), tensor_dtype(meta)
            except (KeyError, ValueError, TypeError):
                shape = dt = None
            why = shape_problem(shape, dt.itemsize) if shape is not None else None
            if why:
                return UnreadableLeaf(k, f"bad tensor metadata: {why}", dtype=dt.name)
            if isinstance(obj, Unresolved):
                if shape is None:
                    return UnreadableLeaf(k, obj.reason)
                return TensorLeaf(k, obj.make(shape, dt))
            if isinstance(obj, TensorLeaf):
                if shape is not None and (obj.tensor.shape != shape or obj.tensor.dtype != dt):
                    return UnreadableLeaf(k, f"nested tensor is {list(obj.tensor.shape)} {obj.tensor.dtype.name} but "
                                             f"its serializer says {list(shape)} {dt.name}")
                return TensorLeaf(k, obj.tensor, numpy=obj.numpy)
            if isinstance(obj, UnreadableLeaf):
                if shape is not None:
                    obj.shape, obj.dtype = shape, obj.dtype or dt.name
                return obj
            if isinstance(obj, Link):
                return obj
            return UnreadableLeaf(k, f"nested {t} payload ckptfs does not recognise")
        return UnreadableLeaf(k, f"nested serializer {t!r} is not supported")

    def _graph(self, k: str, obj, meta: dict):
        args = obj.get("args") if isinstance(obj, dict) else None
        ir = meta.get("jit_graph") or ""
        shape = meta.get("shape")
        dt = meta.get("dtype")
        if isinstance(args, list):
            i = identity_output_index(ir, len(args))
            if i is not None and isinstance(args[i], TensorLeaf):
                t = args[i].tensor
                if (shape is None or list(t.shape) == list(shape)) and (dt is None or t.dtype.torch_name == dt or t.dtype.name == dt):
                    return TensorLeaf(k, t)
        n = len(args) if isinstance(args, list) else 0
        name = dt[len("torch."):] if isinstance(dt, str) and dt.startswith("torch.") else dt
        return UnreadableLeaf(k, f"TorchScript graph tensor (DeferredGraphTensor, {n} argument(s)): ckptfs does not "
                                 f"execute TorchScript", shape=tuple(shape) if isinstance(shape, list) else None,
                              dtype=name if isinstance(name, str) else None)

    # -- partial files ----------------------------------------------------------------------------------
    def _salvage(self, k: str):
        try:
            d = open_object(self.f, k)
        except (OSError, ValueError, H5Refused):
            d = None
        if d is not None and hasattr(d, "attrs"):
            md = attrs_to_metadata(d.attrs)
            if md.get("__NUMPY__") or md.get("__BYTES__"):
                leaf = self.factory.from_metadata(k, k, md)
                if isinstance(leaf, Leaf):
                    return leaf
        return UnreadableLeaf(k, "lost: partial checkpoint keeps no metadata for this leaf")


def resolve_links(values: dict) -> tuple[dict, dict]:
    """Replace every Link by the very Leaf object of its target: (leaves, alias -> target)."""
    leaves: dict = {}
    links: dict = {}
    for k, v in values.items():
        if isinstance(v, Link):
            links[k] = v.target
            target, seen = values.get(v.target), {k}
            while isinstance(target, Link) and target.target not in seen:  # cstorch never chains; be lenient
                seen.add(target.target)
                target = values.get(target.target)
            if isinstance(target, Leaf):
                leaves[k] = target
            else:
                why = "is missing" if target is None else "is a link cycle"
                leaves[k] = UnreadableLeaf(k, f"link target {v.target!r} {why}")
        else:
            leaves[k] = v
    return leaves, links
