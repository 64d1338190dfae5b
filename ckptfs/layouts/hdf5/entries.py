"""The entries of a format-0.5 Cerebras checkpoint (the leaves of the tree an ``Hdf5Layout`` lays out), the metadata
cstorch 2.10 writes for each, and the flat keys they resolve to (repeated objects becoming links).

bf16 is stored as int16 bits and bool as the HDF5 enum over int8 (``h5_storage_dtype``); ``RTFX_CODES`` are the
element types cstorch records for its tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...dtypes import DType
from ...errors import CheckpointError
from ...tensor.base import VirtualTensor
from . import spec_attr as hdf5_spec

#: RtFxProto ElementType codes written by cstorch 2.10 (cerebras-h5-format §2.5)
RTFX_CODES = {"bool": 1, "int16": 3, "int32": 4, "int64": 5, "uint8": 6, "uint16": 7, "uint32": 8,
              "uint64": 9, "float16": 10, "float32": 11, "float64": 12, "bfloat16": 15}


@dataclass(eq=False, slots=True)
class TensorEntry:
    """A tensor with data: a dataset (TorchTensorSerializer, or NumpyArraySerializer if ``numpy``)."""

    tensor: VirtualTensor
    numpy: bool = False


@dataclass(eq=False, slots=True)
class FullEntry:
    """A constant-fill tensor (DeferredFullTensor): metadata only; ``fill_value`` None = uninitialized."""

    shape: tuple
    dtype: DType
    fill_value: Any = None


@dataclass(eq=False, slots=True)
class ScalarEntry:
    value: Any  # bool | int | float


@dataclass(eq=False, slots=True)
class StringEntry:
    value: str


@dataclass(eq=False, slots=True)
class NoneEntry:
    pass


@dataclass(eq=False, slots=True)
class BytesEntry:
    """An opaque pickled object, carried as its bytes (ObjectSerializer ``__BYTES__``)."""

    data: bytes


@dataclass(eq=False, slots=True)
class LinkEntry:
    """A LinkedObject to another flat key. The layout also emits one for any repeated leaf object."""

    target: str


ENTRY_TYPES = (TensorEntry, FullEntry, ScalarEntry, StringEntry, NoneEntry, BytesEntry, LinkEntry)


def h5_storage_dtype(dtype: DType) -> np.dtype:
    """numpy dtype of the HDF5 dataset: bf16 → int16 bits, bool → numpy bool (HDF5 enum over int8)."""
    if dtype.name == "bfloat16":
        return np.dtype("<i2")
    if dtype.name == "bool":
        return np.dtype(np.bool_)
    return dtype.storage


def entry_metadata(entry) -> dict:
    """The leaf metadata dict cstorch writes for ``entry`` (key order as cstorch emits it)."""
    if isinstance(entry, TensorEntry):
        t = entry.tensor
        if entry.numpy:
            return {"is_bfloat16": t.dtype.name == "bfloat16", "__TYPE__": "NumpyArraySerializer",
                    "__NUMPY__": True, "compressed": False}
        md = {"__TORCH__": True, "shapes": [list(t.shape)], "dtypes": [t.dtype.torch_name]}
        if t.dtype.name in RTFX_CODES:
            md["rtfx_dtypes"] = [RTFX_CODES[t.dtype.name]]
        md.update({"__TYPE__": "TorchTensorSerializer", "__NUMPY__": True, "compressed": False})
        return md
    if isinstance(entry, FullEntry):
        return {"shape": [int(n) for n in entry.shape], "dtype": entry.dtype.torch_name,
                "fill_value": entry.fill_value, "__TYPE__": "DeferredFullTensor", "__NONE__": True}
    if isinstance(entry, ScalarEntry):
        return {"scalar_value": entry.value, "__TYPE__": "ScalarSerializer", "__NONE__": True}
    if isinstance(entry, StringEntry):
        return {"string_value": entry.value, "__TYPE__": "StringSerializer", "__NONE__": True}
    if isinstance(entry, NoneEntry):
        return {"__TYPE__": "NoneSerializer", "__NONE__": True}
    if isinstance(entry, BytesEntry):
        return {"__TYPE__": "ObjectSerializer", "__BYTES__": True, "compressed": False}
    if isinstance(entry, LinkEntry):
        return {"key": entry.target, "__LINKED__": True, "__TYPE__": "LinkedObject", "__NONE__": True}
    raise TypeError(f"not an hdf5 layout entry: {type(entry).__name__}")


def resolve_entries(root, path=None) -> list:
    """``[(flat_key, entry)]`` in spec order; repeated leaf objects become ``LinkEntry`` to the first key.

    Raises CheckpointError for keys that collide, links to unknown keys, and subtrees cstorch's key
    derivation would drop (multi-key defaultdicts).
    """
    dropped = hdf5_spec.dropped_children(root)
    if dropped:
        raise CheckpointError(path, f"cstorch key derivation would drop {', '.join(dropped)} (multi-key defaultdict)")
    first: dict[int, str] = {}
    out, seen = [], {}
    for key, leaf in hdf5_spec.flat_items(root):
        if not isinstance(leaf, ENTRY_TYPES):
            raise TypeError(f"{key}: not an hdf5 layout entry: {type(leaf).__name__}")
        if key in seen:
            raise CheckpointError(path, f"two entries flatten to the same key {key!r}")
        if id(leaf) in first and not isinstance(leaf, LinkEntry):
            entry = LinkEntry(first[id(leaf)])
        else:
            first.setdefault(id(leaf), key)
            entry = leaf
        seen[key] = entry
        out.append((key, entry))
    # explicit links: point at the key that holds the value, never at another link
    for i, (key, entry) in enumerate(out):
        if isinstance(entry, LinkEntry):
            target, hops = entry.target, 0
            while isinstance(seen.get(target), LinkEntry) and hops < len(out):
                target, hops = seen[target].target, hops + 1
            if target not in seen or isinstance(seen[target], LinkEntry) or target == key:
                raise CheckpointError(path, f"{key}: link to missing key {entry.target!r}")
            if target != entry.target:
                out[i] = (key, LinkEntry(target))
    return out
