"""Legacy formats 0.1–0.4 (releases ≤ 1.7 … 2.4): hex dill ``__spec__``, URL-quoted dataset names,
per-dataset typing by ``__H5_TYPE__`` (0.3/0.4) or boolean flag attributes (0.1/0.2).

HDF5 hard-link aliases (one dataset under two names) and ``DeferredH5Tensor`` ``link_to_self``
become the same Leaf object. A spec key with no dataset reads as None, as cstorch does.
"""
from __future__ import annotations

import math
from urllib.parse import quote, unquote

import h5py
import numpy as np
from h5py import h5o

from ... import dtypes
from ...dtypes import BFLOAT16
from ...errors import CheckpointError, TensorReadError
from ...catalog.model import OpaqueLeaf, TensorLeaf, UnreadableLeaf, ValueLeaf
from ...guard.confine import RefusedReference
from .h5safe import H5Refused, dataset_info, open_object
from .h5store import ExternalFiles, H5Store
from ...errors import one_line
from .dill_spec import decode_dtype_pickle, decode_legacy_spec
from ...catalog.pytree import SpecError, build_tree, leaf_keys
from .format_v05 import ReadResult, check_collisions, resolve_links
from .serializers import Link
from ...tensor.regions import BlobRegionTensor, FullTensor, RegionFile
from .dataset_tensor import H5DatasetTensor
from ...catalog.validate import shape_problem


def _s(v) -> str:
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, np.ndarray) and v.shape == ():
        return _s(v[()])
    return str(v)


def _flag(attrs, name) -> bool:
    v = attrs.get(name)
    return bool(np.asarray(v).item()) if v is not None else False


def _object_address(d: h5py.Dataset) -> tuple:
    """Where dataset ``d`` lives (file number, object header address): the same for every name hard-linked to it."""
    info = h5o.get_info(d.id)
    return info.fileno, info.addr


def _bf16_bits_to_float(bits) -> float:
    u = np.array(bits).astype(np.uint16).astype(np.uint32) << 16
    return float(u.view(np.float32))


class LegacyReader:
    def __init__(self, f: h5py.File, store: H5Store, externals: ExternalFiles, path, version: float):
        self.f = f
        self.store = store
        self.externals = externals
        self.path = path
        self.version = version
        self.warnings: list = []

    def read(self, spec_text: str) -> ReadResult:
        """The catalog, from the hex ``__spec__`` text (read once by ``open_checkpoint``) and the datasets."""
        try:
            spec = decode_legacy_spec(spec_text)
            keys = leaf_keys(spec)
        except SpecError as e:
            raise CheckpointError(self.path, f"bad legacy __spec__: {e}") from None
        check_collisions(self.path, keys)
        spec_keys = {k for k, _ in keys}
        first_name_of: dict = {}  # (file number, object address) -> first key naming it (hard links)
        values: dict = {}
        missing = []
        for k, _ in keys:
            name = quote(k, safe="")
            name = k if name == k else name  # most keys need no quoting: the tensor keeps one string, not two
            d, problem = self._get(name)
            if d is None:
                if problem:
                    values[k] = UnreadableLeaf(k, problem)
                else:
                    missing.append(k)
                    values[k] = ValueLeaf(k, None)
                continue
            where = _object_address(d)  # not the object itself: that would keep every dataset open
            if where in first_name_of:
                values[k] = Link(first_name_of[where])
                continue
            first_name_of[where] = k
            values[k] = self._leaf(k, name, d, spec_keys)
        if missing:
            shown = ", ".join(missing[:5]) + (" …" if len(missing) > 5 else "")
            self.warnings.append(f"{len(missing)} key(s) have no dataset and read as None (as cstorch does): {shown}")
        leaves, links = resolve_links(values)
        root = build_tree(spec, iter(list(leaves.values())))
        return ReadResult(root, leaves, links, self.warnings)

    def _get(self, name: str, f: h5py.File | None = None):
        """(dataset, None), (None, None) if absent, or (None, problem) for a dangling link, a group, or a dataset
        reached through or stored in another file (``h5safe``: no name is resolved by HDF5 across files)."""
        f = self.f if f is None else f
        try:
            d = open_object(f, name)
            if d is None:
                first = next((p for p in name.split("/") if p), "")
                if first and "/" not in name.strip("/") and f.id.links.exists(first.encode("utf-8", "surrogateescape")):
                    return None, f"dangling HDF5 link {name!r}"
                return None, None
            if not isinstance(d, h5py.Dataset):
                return None, f"{name!r} is an HDF5 group, not a dataset"
            dataset_info(d, name)
        except H5Refused as e:
            self.warnings.append(f"{name}: {e.problem}")
            return None, e.problem
        except (KeyError, OSError, ValueError, UnicodeError) as e:
            return None, f"dataset {name!r} cannot be opened ({one_line(e)})"
        return d, None

    # -- one dataset -----------------------------------------------------------------------------------
    def _leaf(self, k: str, name: str, d: h5py.Dataset, spec_keys: set):
        a = d.attrs
        h5type = _s(a["__H5_TYPE__"]) if "__H5_TYPE__" in a else None
        try:
            if h5type is None:
                return self._flag_leaf(k, name, d)
            bf16 = _flag(a, "is_bfloat16")
            if h5type in ("TorchTensorH5Type", "StoredTensorH5Type"):
                return self._tensor(k, name, d, bf16)
            if h5type == "NumpyArrayH5Type":  # 0.3 and older: a torch tensor; 0.4: a numpy array
                return self._tensor(k, name, d, bf16, numpy=self.version >= 0.4)
            if h5type == "ScalarH5Type":
                return self._scalar(k, name, d)
            if h5type == "StringH5Type":
                return ValueLeaf(k, _s(a["string_value"]))
            if h5type == "NoneH5Type":
                return ValueLeaf(k, None)
            if h5type in ("ObjectH5Type", "ApplianceInfoH5Type"):
                return OpaqueLeaf(k, bytes.fromhex(_s(a["object_value"])))
            if h5type in ("DeferredFullTensor", "FullTensorH5Type"):
                return self._full(k, d, bf16)
            if h5type == "DeferredGraphTensor":
                shape = tuple(int(n) for n in a["shape"]) if "shape" in a else None
                return UnreadableLeaf(k, "TorchScript graph tensor (DeferredGraphTensor): ckptfs does not execute "
                                         "TorchScript", shape=shape)
            if h5type == "DeferredH5Tensor":
                return self._deferred_h5(k, d, spec_keys)
            if h5type in ("DeferredFileTensor", "StoredApplianceTensorH5Type"):
                return self._file_tensor(k, d)
        except (KeyError, ValueError, TypeError, SpecError, OSError) as e:
            return UnreadableLeaf(k, f"{h5type or 'legacy'} dataset {name!r} is malformed ({one_line(e)})")
        return UnreadableLeaf(k, f"unknown legacy __H5_TYPE__ {h5type!r}")

    def _flag_leaf(self, k: str, name: str, d: h5py.Dataset):
        a = d.attrs
        if "filepath" in a:
            return self._file_tensor(k, d)
        bf16 = _flag(a, "is_bfloat16")
        if _flag(a, "is_constructible"):
            return self._full(k, d, bf16)
        if _flag(a, "is_none"):
            return ValueLeaf(k, None)
        if _flag(a, "is_string"):
            return ValueLeaf(k, _s(a["string_val"]))
        if _flag(a, "is_scalar"):
            v = self._scalar(k, name, d, raw=True)
            if isinstance(v, UnreadableLeaf):
                return v
            return ValueLeaf(k, _bf16_bits_to_float(v) if bf16 else v.item())
        return self._tensor(k, name, d, bf16)

    def _scalar(self, k: str, name: str, d: h5py.Dataset, raw: bool = False):
        """A scalar dataset's value (its array when ``raw``); a "scalar" holding more than one element is refused
        before it is read."""
        if d.shape is None or math.prod(d.shape) != 1:
            return UnreadableLeaf(k, f"scalar dataset {name!r} has shape {d.shape}, not one element")
        v = np.asarray(d[()])
        return v if raw else ValueLeaf(k, v.item())

    def _dtype(self, d: h5py.Dataset, bf16: bool):
        return BFLOAT16 if bf16 else dtypes.from_numpy(d.dtype)

    def _tensor(self, k: str, name: str, d: h5py.Dataset, bf16: bool, numpy: bool = False, store: H5Store | None = None):
        if d.shape is None:
            return UnreadableLeaf(k, f"dataset {name!r} holds no data (null dataspace)")
        why = shape_problem(tuple(d.shape), d.dtype.itemsize)
        if why:
            return UnreadableLeaf(k, f"bad tensor: {why}")
        t = H5DatasetTensor(store or self.store, name, k, d.shape, self._dtype(d, bf16))
        return TensorLeaf(k, t, numpy=numpy)

    def _full(self, k: str, d: h5py.Dataset, bf16: bool):
        a = d.attrs
        shape = tuple(int(n) for n in np.asarray(a["shape"]).reshape(-1))
        fill = a.get("fill_value")
        fill = None if fill is None else np.asarray(fill).item()
        dt = self._dtype(d, bf16)
        why = shape_problem(shape, dt.itemsize)
        if why:
            return UnreadableLeaf(k, f"bad tensor metadata: {why}", dtype=dt.name)
        return TensorLeaf(k, FullTensor(shape, dt, fill))

    def _deferred_h5(self, k: str, d: h5py.Dataset, spec_keys: set):
        a = d.attrs
        target = _s(a["key"])
        if _flag(a, "link_to_self"):
            if unquote(target) in spec_keys and unquote(target) != k:
                return Link(unquote(target))
            d2, problem = self._get(target)
            if d2 is None:
                return UnreadableLeaf(k, problem or f"link_to_self target {target!r} is missing")
            return self._tensor(k, target, d2, _flag(d2.attrs, "is_bfloat16"))
        ref = _s(a["filepath"])
        try:
            store = self.externals.h5(ref)
        except RefusedReference as e:
            return self._refused(k, e)
        if not store.path.exists():
            self.warnings.append(f"{k}: external file {store.path} not found (referenced as {ref!r})")
            return UnreadableLeaf(k, f"external file {store.path} not found (referenced as {ref!r})")
        try:
            f2 = store.file(f"tensor {k}")
        except TensorReadError as e:
            return UnreadableLeaf(k, e.problem)
        d2, problem = self._get(target, f2)
        if d2 is None:
            return UnreadableLeaf(k, problem or f"external file {store.path.name} has no dataset {target!r}")
        return self._tensor(k, target, d2, _flag(d2.attrs, "is_bfloat16"), store=store)

    def _refused(self, k: str, e: RefusedReference) -> UnreadableLeaf:
        reason = f"external reference refused: {e.problem}"
        self.warnings.append(f"{k}: {reason}")
        return UnreadableLeaf(k, reason)

    def _file_tensor(self, k: str, d: h5py.Dataset):
        a = d.attrs
        ref = _s(a["filepath"])
        shape = tuple(int(n) for n in np.asarray(a["shape"]).reshape(-1))
        dt = decode_dtype_pickle(_s(a["dtype"]))
        why = shape_problem(shape, dt.itemsize)
        if why:
            return UnreadableLeaf(k, f"bad tensor metadata: {why}", dtype=dt.name)
        try:
            path = self.externals.resolve(ref)
        except RefusedReference as e:
            return self._refused(k, e)
        ident = self.externals.identity(path)
        if ident is None:
            self.warnings.append(f"{k}: external tensor file {path} not found (referenced as {ref!r})")
        elif ident.size < math.prod(shape) * dt.itemsize:
            return UnreadableLeaf(k, f"external tensor file {path} holds {ident.size} bytes but shape {list(shape)} "
                                     f"{dt.name} needs {math.prod(shape) * dt.itemsize}", shape=shape, dtype=dt.name)
        return TensorLeaf(k, BlobRegionTensor(RegionFile(path, self.externals.confinement), 0, shape, dt, k, self.path,
                                              referenced_as=ref, what="external tensor file", identity=ident))
