"""Decode the hex dill-pickled ``__spec__`` of legacy (0.1–0.4) checkpoints without torch or dill.

The pickle is metadata written by the framework: a torch ``TreeSpec``. A restricted
``pickle.Unpickler`` admits only the handful of globals such a spec names (TreeSpec/LeafSpec,
dill's ``_load_type`` for builtin container types, OrderedDict/defaultdict/deque, dill's namedtuple
factory, the 1.x TensorScalarDict) and maps each to an inert stub. Every other global is refused,
so decoding can never import or run anything. Also decodes the dill-pickled ``torch.<dtype>`` of
legacy file-backed tensors the same way.
"""
from __future__ import annotations

import io
import pickle

from ... import dtypes
from ...dtypes import DType
from ...catalog.pytree import KINDS, DefaultDictContext, NamedTupleType, SpecError, SpecNode


class _TypeRef:
    """Stands in for a container type named by the pickle (``builtins.dict``, a namedtuple class…)."""

    def __init__(self, qualname: str, name: str | None = None, fields: tuple | None = None):
        self.qualname = qualname
        self.name = name
        self.fields = fields

    def __repr__(self):
        return f"<class '{self.qualname}'>"


class _SpecStub:
    """Stands in for torch.utils._pytree.TreeSpec / LeafSpec: keeps the pickled state, nothing else."""

    leaf = False

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slots state)
            d, slots = state
            state = {**(d or {}), **(slots or {})}
        if not isinstance(state, dict):
            raise pickle.UnpicklingError("TreeSpec state is not a dict")
        self.__dict__.update(state)


class _LeafStub(_SpecStub):
    leaf = True


_BUILTIN_TYPE_NAMES = {  # dill _load_type names -> builtins type
    "dict": "dict", "DictType": "dict", "list": "list", "ListType": "list", "tuple": "tuple",
    "TupleType": "tuple", "set": "set", "SetType": "set",
}


def _load_type(name):
    qual = _BUILTIN_TYPE_NAMES.get(name)
    if qual is None:
        raise pickle.UnpicklingError(f"dill type {name!r} is not a pytree container type")
    return _TypeRef("builtins." + qual)


def _create_namedtuple(name, fieldnames, modulename=None, defaults=None):
    return _TypeRef("collections.namedtuple", str(name), tuple(str(f) for f in fieldnames))


_ADMITTED = {
    ("torch.utils._pytree", "TreeSpec"): _SpecStub,
    ("torch.utils._pytree", "LeafSpec"): _LeafStub,
    ("dill._dill", "_load_type"): _load_type,
    ("dill._dill", "_create_namedtuple"): _create_namedtuple,
    ("collections", "OrderedDict"): _TypeRef("collections.OrderedDict"),
    ("collections", "defaultdict"): _TypeRef("collections.defaultdict"),
    ("collections", "deque"): _TypeRef("collections.deque"),
    ("cerebras_pytorch.utils.tensor_scalar_dict", "TensorScalarDict"): _TypeRef("builtins.dict"),
    ("cerebras.pytorch.utils.tensor_scalar_dict", "TensorScalarDict"): _TypeRef("builtins.dict"),
}


class RefusedGlobal(SpecError, pickle.UnpicklingError):
    """The pickle names a global outside the admitted pytree spec classes."""


class SpecUnpickler(pickle.Unpickler):
    """Admits only the pytree spec globals above; refuses every other global."""

    def find_class(self, module, name):
        obj = _ADMITTED.get((module, name))
        if obj is None:
            raise RefusedGlobal(f"it names {module}.{name}, which ckptfs refuses to load "
                                f"(only pytree spec classes are admitted)")
        return obj

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("legacy spec uses persistent ids")


class _DtypeUnpickler(pickle.Unpickler):
    """Admits only ``torch.<dtype name>`` globals and returns the matching DType."""

    def find_class(self, module, name):
        if module == "torch" and name in dtypes.BY_NAME:
            return dtypes.BY_NAME[name]
        raise pickle.UnpicklingError(f"dtype pickle names {module}.{name}, not a torch dtype")


def decode_legacy_spec(hex_text: str) -> SpecNode:
    """Hex of ``dill.dumps(treespec)`` -> SpecNode; SpecError with a one-line reason otherwise."""
    try:
        raw = bytes.fromhex(hex_text.strip())
    except (ValueError, AttributeError):
        raise SpecError("legacy __spec__ is not a hex string") from None
    if not raw:
        raise SpecError("legacy __spec__ is empty")
    try:
        stub = SpecUnpickler(io.BytesIO(raw)).load()
    except SpecError:
        raise
    except Exception as e:  # UnpicklingError, EOFError, TypeError from malformed opcodes…
        raise SpecError(f"cannot decode legacy __spec__: {e}") from None
    return _to_node(stub)


def decode_dtype_pickle(hex_text: str) -> DType:
    """Hex of a dill-pickled ``torch.<dtype>`` -> DType."""
    try:
        obj = _DtypeUnpickler(io.BytesIO(bytes.fromhex(str(hex_text)))).load()
    except Exception as e:
        raise SpecError(f"cannot decode pickled dtype: {e}") from None
    if not isinstance(obj, DType):
        raise SpecError("pickled dtype is not a torch dtype")
    return obj


def _to_node(stub) -> SpecNode:
    if not isinstance(stub, _SpecStub):
        raise SpecError("legacy __spec__ is not a pytree TreeSpec")
    st = stub.__dict__
    t = st.get("type")
    children = st.get("children_specs") or []
    if stub.leaf or t is None:
        return SpecNode(None)
    kids = [_to_node(c) for c in children]
    if not isinstance(t, _TypeRef):
        raise SpecError(f"legacy spec node type {t!r} is not a container type")
    ctx = st.get("context")
    if t.qualname == "collections.namedtuple":
        return SpecNode("namedtuple", NamedTupleType(t.name, t.fields), kids, t.qualname)
    kind = KINDS.get(t.qualname)
    if kind is None:
        raise SpecError(f"unsupported container type {t.qualname!r} in legacy spec")
    if kind in ("dict", "OrderedDict"):
        keys = list(ctx or [])
        if len(keys) != len(kids):
            raise SpecError(f"{t.qualname} node: context does not list one key per child")
        return SpecNode(kind, keys, kids, t.qualname)
    if kind == "defaultdict":
        try:
            factory, keys = ctx
        except (TypeError, ValueError):
            raise SpecError("defaultdict node without [factory, keys] context") from None
        mod, _, name = (factory.qualname if isinstance(factory, _TypeRef) else "builtins.None").rpartition(".")
        return SpecNode(kind, DefaultDictContext(mod, name, list(keys)), kids, t.qualname)
    if kind == "deque":
        return SpecNode(kind, ctx if isinstance(ctx, int) else None, kids, t.qualname)
    return SpecNode(kind, None, kids, t.qualname)
