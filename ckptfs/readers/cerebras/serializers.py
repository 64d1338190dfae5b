"""One serialized object's metadata (format 0.5, ``__TYPE__`` = a cstorch serializer) -> a Leaf.

No tensor data is read here: tensors become lazy ``H5DatasetTensor``/``FullTensor``/
``SafetensorsTensor`` objects. Only small things are read at catalog time: a pickled object's bytes
(kept opaque, never unpickled), a referenced safetensors file's header, and every dataset's header, checked
against the metadata (``validate``: shape, element size; ``h5safe``: no external link, virtual dataset or
external raw storage). A tensor that fails a check, or whose reference leads outside the allowed folders
(``confine``), becomes an ``UnreadableLeaf`` saying why; the rest of the checkpoint is unaffected.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ... import dtypes
from ...dtypes import BFLOAT16, DType
from ...errors import TensorReadError
from ...catalog.model import OpaqueLeaf, TensorLeaf, UnreadableLeaf, ValueLeaf
from ...guard.confine import RefusedReference
from .h5safe import H5Refused, dataset_header, open_dataset
from .h5store import ExternalFiles, H5Store
from ...errors import one_line
from ...tensor.regions import FullTensor
from .dataset_tensor import H5DatasetTensor
from ..safetensors_tensor import SafetensorsTensor
from ...catalog.validate import dataset_problem, shape_problem

#: RtFxProto element types (``rtfx_dtypes``) -> dtype name
RTFX_DTYPES = {1: "bool", 3: "int16", 4: "int32", 5: "int64", 6: "uint8", 7: "uint16", 8: "uint32", 9: "uint64",
               10: "float16", 11: "float32", 12: "float64", 15: "bfloat16"}


@dataclass
class Link:
    """A LinkedObject: the value is the one stored under top-level key ``target``."""

    target: str


@dataclass
class Unresolved:
    """An external tensor whose shape/dtype are not known yet (target missing): ``make(shape, dtype)``
    builds it once an enclosing serializer supplies them; otherwise it is unreadable for ``reason``."""

    reason: str
    make: Callable[[tuple, DType], object]


def tensor_dtype(md: dict) -> DType:
    """The torch dtype of TorchTensorSerializer-style metadata (``dtypes`` or ``rtfx_dtypes``)."""
    names = md.get("dtypes") or md.get("dtype")
    name = names[0] if isinstance(names, list) and names else names
    if isinstance(name, str):
        return dtypes.by_name(name)
    rt = md.get("rtfx_dtypes")
    if isinstance(rt, list) and rt and rt[0] in RTFX_DTYPES:
        return dtypes.BY_NAME[RTFX_DTYPES[rt[0]]]
    raise KeyError("metadata names no dtype")


def tensor_shape(md: dict) -> tuple:
    shapes = md.get("shapes")
    if isinstance(shapes, list) and shapes and isinstance(shapes[0], list):
        return tuple(int(n) for n in shapes[0])
    shape = md.get("shape")
    if isinstance(shape, list):
        return tuple(int(n) for n in shape)
    raise KeyError("metadata names no shape")


def attrs_to_metadata(attrs) -> dict:
    """A dataset's HDF5 attributes (which duplicate its leaf metadata) as JSON-like metadata."""
    out = {}
    for k, v in attrs.items():
        if k == "__BYTES__":
            out[k] = True
            continue
        if isinstance(v, np.ndarray):
            v = v.tolist()
        elif isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, bytes):
            v = v.decode("utf-8", "replace")
        if isinstance(v, list):
            v = [x.decode("utf-8", "replace") if isinstance(x, bytes) else x for x in v]
        out[k] = v
    return out


class LeafFactory:
    """Builds Leaves of one checkpoint from serializer metadata."""

    def __init__(self, store: H5Store, externals: ExternalFiles, warnings: list):
        self.store = store
        self.externals = externals
        self.warnings = warnings
        self._safetensors_headers: dict = {}  # path -> header (or the error reading it), read once per catalog

    @property
    def checkpoint_path(self) -> Path:
        return self.store.checkpoint_path

    def from_metadata(self, key: str, name: str, md: dict, store: H5Store | None = None):
        """Leaf (or Link / Unresolved) for the object stored as dataset ``name`` with metadata ``md``."""
        store = store or self.store
        if not isinstance(md, dict):
            return UnreadableLeaf(key, "metadata is not a JSON object")
        t = md.get("__TYPE__")
        try:
            if t == "LinkedObject":
                return Link(str(md["key"]))
            if t == "ScalarSerializer":
                return ValueLeaf(key, md.get("scalar_value"))
            if t == "StringSerializer":
                return ValueLeaf(key, md.get("string_value"))
            if t == "NoneSerializer":
                return ValueLeaf(key, None)
            if t in ("DeferredFullTensor", "FullTensor"):
                shape, dt = tensor_shape(md), tensor_dtype(md)
                why = shape_problem(shape, dt.itemsize)
                if why:
                    return UnreadableLeaf(key, f"bad tensor metadata: {why}", dtype=dt.name)
                return TensorLeaf(key, FullTensor(shape, dt, md.get("fill_value")))
            if t == "DeferredSafeTensor":
                return self._safetensor(key, md)
            if t in ("DeferredNumpyArray", "DeferredObject"):
                return self._external_object(key, md)
            if md.get("__RTFX__"):
                return UnreadableLeaf(key, "raw RtFx object written by an S3 weight host (not in this file)")
            if md.get("__NUMPY__"):
                if t == "NumpyArraySerializer" or not md.get("__TORCH__"):
                    return self._numpy(key, name, md, store)
                return self._h5_tensor(key, name, store, tensor_shape(md), tensor_dtype(md))
            if md.get("__BYTES__") or t == "ObjectSerializer":
                return self._opaque(key, name, store)
        except (KeyError, TypeError, ValueError) as e:
            return UnreadableLeaf(key, f"{t or 'object'} metadata is malformed ({one_line(e)})")
        return UnreadableLeaf(key, f"unknown serializer {t!r}")

    # -- kinds needing the file at catalog time --------------------------------------------------------
    def _dataset(self, name: str, store: H5Store, key: str):
        """``(dataset, DatasetInfo)``; ``TensorReadError`` when it is missing, refused or its file cannot be opened."""
        f = store.file(f"tensor {key}")
        try:
            d, info = open_dataset(f, name)
        except H5Refused as e:
            raise TensorReadError(self.checkpoint_path, f"tensor {key}: {e.problem}") from None
        if d is None:
            raise TensorReadError(self.checkpoint_path, f"tensor {key}: dataset {name!r} is missing")
        return d, info

    def _h5_tensor(self, key: str, name: str, store: H5Store, shape: tuple, dt: DType):
        """A torch tensor stored as dataset ``name``, its metadata checked against the dataset's header. When an
        external file cannot be opened now, the tensor stays lazy and its reads say why."""
        why = shape_problem(shape, dt.itemsize)
        if why:
            return UnreadableLeaf(key, f"bad tensor metadata: {why}", dtype=dt.name)
        own = store is self.store
        if not own and store.identity is None:
            return TensorLeaf(key, H5DatasetTensor(store, name, key, shape, dt))  # missing now: reads say so
        try:
            info = dataset_header(store.file(f"tensor {key}"), name)
        except H5Refused as e:
            self.warnings.append(f"{key}: {e.problem}")
            return UnreadableLeaf(key, e.problem, shape=shape, dtype=dt.name)
        except TensorReadError as e:
            if own:
                return UnreadableLeaf(key, e.problem, shape=shape, dtype=dt.name)
            return TensorLeaf(key, H5DatasetTensor(store, name, key, shape, dt))
        if info is None:
            return UnreadableLeaf(key, f"dataset {name!r} is missing", shape=shape, dtype=dt.name)
        why = dataset_problem(info, shape, dt.itemsize, name)
        if why:
            return UnreadableLeaf(key, f"metadata disagrees with the data: {why}", shape=shape, dtype=dt.name)
        return TensorLeaf(key, H5DatasetTensor(store, name, key, shape, dt, chunks=info.chunks))

    def _numpy(self, key: str, name: str, md: dict, store: H5Store):
        try:
            d, info = self._dataset(name, store, key)
            shape = tuple(info.shape or ())
            dt = BFLOAT16 if md.get("is_bfloat16") else dtypes.from_numpy(d.dtype)
        except TensorReadError as e:
            return UnreadableLeaf(key, e.problem)
        except KeyError as e:
            return UnreadableLeaf(key, f"numpy array of unsupported element type ({one_line(e)})")
        if info.shape is None:
            return UnreadableLeaf(key, f"dataset {name!r} holds no data (null dataspace)")
        why = shape_problem(shape, dt.itemsize) or dataset_problem(info, shape, dt.itemsize, name)
        if why:
            return UnreadableLeaf(key, f"bad numpy array: {why}")
        return TensorLeaf(key, H5DatasetTensor(store, name, key, shape, dt), numpy=True)

    def _opaque(self, key: str, name: str, store: H5Store):
        try:
            d, _ = self._dataset(name, store, key)
            if "__BYTES__" in d.attrs:
                data = np.asarray(d.attrs["__BYTES__"]).tobytes()
            elif "object_value" in d.attrs:
                data = bytes.fromhex(str(d.attrs["object_value"]))
            else:
                return UnreadableLeaf(key, "pickled object without its __BYTES__ attribute")
        except TensorReadError as e:
            return UnreadableLeaf(key, e.problem)
        except (OSError, ValueError) as e:
            return UnreadableLeaf(key, f"pickled object bytes cannot be read ({one_line(e)})")
        return OpaqueLeaf(key, data)

    # -- references to other files ---------------------------------------------------------------------
    def _refused(self, key: str, e: RefusedReference) -> UnreadableLeaf:
        reason = f"external reference refused: {e.problem}"
        self.warnings.append(f"{key}: {reason}")
        return UnreadableLeaf(key, reason)

    def _safetensor(self, key: str, md: dict):
        ref = str(md["path"])
        name = str(md["key"])
        try:
            path = self.externals.resolve(ref)
        except RefusedReference as e:
            return self._refused(key, e)
        ckpt = self.checkpoint_path
        ident = self.externals.identity(path)

        def make(shape, dt, offset=-1):
            return SafetensorsTensor(path, name, shape, dt, key, ckpt, referenced_as=ref, identity=ident,
                                     confinement=self.externals.confinement, offset=offset)

        if ident is None:
            self.warnings.append(f"{key}: external safetensors file {path} not found (referenced as {ref!r})")
            return Unresolved(f"external safetensors file {path} not found (referenced as {ref!r})", make)
        try:
            entry = self._safetensors_header(path).get(name)
        except RefusedReference as e:
            return self._refused(key, e)
        except (OSError, ValueError) as e:
            return Unresolved(f"external safetensors file {path.name}: {one_line(e)}", make)
        if entry is None:
            return Unresolved(f"external safetensors file {path.name} has no tensor {name!r}", make)
        return TensorLeaf(key, make(entry.shape, entry.dtype, entry.offset))  # the header is not read again

    def _safetensors_header(self, path: Path) -> dict:
        """The header of a referenced .safetensors file, read once for all the keys that refer to it (the same
        exception again when it could not be read)."""
        from ..safetensors_ref import read_safetensors_file_header

        got = self._safetensors_headers.get(path)
        if got is None:
            try:
                got = read_safetensors_file_header(path)
            except (RefusedReference, OSError, ValueError) as e:
                got = e
            self._safetensors_headers[path] = got
        if isinstance(got, Exception):
            raise got.with_traceback(None)  # a fresh traceback each time, not one growing per key
        return got

    def _external_object(self, key: str, md: dict):
        ref = str(md["path"])
        try:
            store = self.externals.h5(ref)
        except RefusedReference as e:
            return self._refused(key, e)
        inner = md.get("metadata")
        if not store.path.exists():
            self.warnings.append(f"{key}: external file {store.path} not found (referenced as {ref!r})")
        if isinstance(inner, dict) and inner:
            leaf = self.from_metadata(key, str(md["key"]), inner, store)
            if isinstance(leaf, UnreadableLeaf) and not store.path.exists():
                name = str(md["key"])
                return Unresolved(leaf.reason, lambda shape, dt: H5DatasetTensor(store, name, key, shape, dt))
            return leaf
        # no stored metadata: the target dataset's own attributes describe it
        name = str(md["key"])
        try:
            d, _ = self._dataset(name, store, key)
            inner = attrs_to_metadata(d.attrs)
        except TensorReadError as e:
            if "refused" in e.problem:
                return UnreadableLeaf(key, e.problem.removeprefix(f"tensor {key}: "))
            return Unresolved(e.problem, lambda shape, dt: H5DatasetTensor(store, name, key, shape, dt))
        return self.from_metadata(key, name, inner, store)
