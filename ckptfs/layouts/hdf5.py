"""A format-0.5 Cerebras checkpoint (``.mdl``), served lazily: HDF5 metadata built once, tensor bytes on read.

Given a state tree (``Container`` nodes, leaves are the entry dataclasses below) the layout builds a
*metadata-only* HDF5 skeleton with h5py, exactly as cerebras-pytorch 2.10 lays out a checkpoint
(global ``__spec__``/``__version__`` 0.5/``__cstorch_version__``/per-key ``<key>.__metadata__``
JSON/``__SUCCESS__``, dataset attributes ``__NUMPY__``, ``__TORCH__``, ``__TYPE__``, ``shapes``,
``dtypes``, ``rtfx_dtypes``, ``compressed``; bf16 stored as int16 bits, bool as the HDF5 enum over
int8, keys with ``/`` become groups, bytes objects as null-dataspace datasets with ``__BYTES__``).

The trade: cstorch writes every non-0-d dataset chunked with the LZ4 filter (32004). Here every
tensor dataset is CONTIGUOUS, allocated early, unfiltered and never filled, so its data is one
byte range at a fixed offset (``dset.id.get_offset()``): the file is planned as pieces
(``ckptfs.layouts.pieces``) — metadata segments, zero gaps, and each tensor's bytes at its offset. cstorch's loader reads any h5py dataset, so the file loads the same; we give
up LZ4 to gain laziness and O(#keys) memory. The skeleton is written through h5py's file-object
driver into an in-memory sparse buffer, so the never-written data regions cost nothing.
One more difference from cstorch: the root group tracks creation order (HDF5 1.8 object header with
indexed attributes), because cstorch's compact root attributes make a build O(#keys²). Readers
see the same attributes and datasets. The file's bytes are a pure function of the tree and never change.
"""
from __future__ import annotations

import bisect
import io
import threading
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from ..cache import BlockCache
from ..dtypes import DType
from ..errors import CheckpointError
from ..tensor import VirtualTensor
from . import hdf5_spec
from .pieces import Literal, PiecedFile, TensorBytes, Zeros

FORMAT_VERSION = 0.5
CSTORCH_VERSION = "2.10.0"

#: RtFxProto ElementType codes written by cstorch 2.10 (cerebras-h5-format §2.5)
RTFX_CODES = {"bool": 1, "int16": 3, "int32": 4, "int64": 5, "uint8": 6, "uint16": 7, "uint32": 8,
              "uint64": 9, "float16": 10, "float32": 11, "float64": 12, "bfloat16": 15}


# -- entries (the leaves of the tree handed to the layout) -----------------------------------------
@dataclass(eq=False)
class TensorEntry:
    """A tensor with data: a dataset (TorchTensorSerializer, or NumpyArraySerializer if ``numpy``)."""

    tensor: VirtualTensor
    numpy: bool = False


@dataclass(eq=False)
class FullEntry:
    """A constant-fill tensor (DeferredFullTensor): metadata only; ``fill_value`` None = uninitialized."""

    shape: tuple
    dtype: DType
    fill_value: Any = None


@dataclass(eq=False)
class ScalarEntry:
    value: Any  # bool | int | float


@dataclass(eq=False)
class StringEntry:
    value: str


@dataclass(eq=False)
class NoneEntry:
    pass


@dataclass(eq=False)
class BytesEntry:
    """An opaque pickled object, carried as its bytes (ObjectSerializer ``__BYTES__``)."""

    data: bytes


@dataclass(eq=False)
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


# -- the in-memory sparse file h5py writes the skeleton into ----------------------------------------
class SparseBuffer(io.RawIOBase):
    """A seekable binary file keeping only written ranges (merged); unwritten bytes read as zeros."""

    def __init__(self):
        super().__init__()
        self._starts: list[int] = []
        self._data: list[bytearray] = []
        self._pos = 0
        self.eof = 0

    def readable(self):
        return True

    def writable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=0):
        base = {0: 0, 1: self._pos, 2: self.eof}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self):
        return self._pos

    def truncate(self, size=None):
        size = self._pos if size is None else int(size)
        i = bisect.bisect_left(self._starts, size)
        del self._starts[i:], self._data[i:]
        if self._starts and self._starts[-1] + len(self._data[-1]) > size:
            del self._data[-1][size - self._starts[-1]:]
        self.eof = size
        return size

    def write(self, b):
        b = bytes(b)
        if not b:
            return 0
        lo, hi = self._pos, self._pos + len(b)
        i = bisect.bisect_right(self._starts, lo) - 1
        if i >= 0 and self._starts[i] + len(self._data[i]) >= lo:
            start, buf = self._starts[i], self._data[i]
        else:
            i += 1
            start, buf = lo, bytearray()
            self._starts.insert(i, start)
            self._data.insert(i, buf)
        if len(buf) < hi - start:
            buf.extend(b"\0" * (hi - start - len(buf)))
        buf[lo - start:hi - start] = b
        # swallow following segments that now touch or overlap
        while i + 1 < len(self._starts) and self._starts[i + 1] <= start + len(buf):
            ns, nb = self._starts.pop(i + 1), self._data.pop(i + 1)
            tail = ns + len(nb) - (start + len(buf))
            if tail > 0:
                buf.extend(nb[len(nb) - tail:])
        self._pos = hi
        self.eof = max(self.eof, hi)
        return len(b)

    def readinto(self, b):
        n = len(b)  # past the end reads as zeros too
        mv = memoryview(b)
        mv[:n] = b"\0" * n
        lo, hi = self._pos, self._pos + n
        i = max(0, bisect.bisect_right(self._starts, lo) - 1)
        while i < len(self._starts) and self._starts[i] < hi:
            s, d = self._starts[i], self._data[i]
            a, z = max(lo, s), min(hi, s + len(d))
            if a < z:
                mv[a - lo:z - lo] = d[a - s:z - s]
            i += 1
        self._pos += n
        return n

    def segments(self) -> list:
        return [(s, bytes(d)) for s, d in zip(self._starts, self._data)]


# -- skeleton building ------------------------------------------------------------------------------
def _dcpl(track_attr_order: bool = False):
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    dcpl.set_obj_track_times(False)
    if track_attr_order:
        dcpl.set_attr_creation_order(h5py.h5p.CRT_ORDER_TRACKED | h5py.h5p.CRT_ORDER_INDEXED)
    return dcpl


def _lcpl():
    lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
    lcpl.set_create_intermediate_group(True)
    lcpl.set_char_encoding(h5py.h5t.CSET_UTF8)
    return lcpl


def _tensor_attrs(dset, entry: TensorEntry, md: dict) -> None:
    a = dset.attrs
    t = entry.tensor
    a["__NUMPY__"] = np.bool_(True)
    if entry.numpy:
        a["__TYPE__"] = md["__TYPE__"]
        a["compressed"] = np.bool_(False)
        a["is_bfloat16"] = np.bool_(md["is_bfloat16"])
        return
    a["__TORCH__"] = np.bool_(True)
    a["__TYPE__"] = md["__TYPE__"]
    a["compressed"] = np.bool_(False)
    a["dtypes"] = np.array(md["dtypes"], dtype=h5py.string_dtype())
    if "rtfx_dtypes" in md:
        a["rtfx_dtypes"] = np.array(md["rtfx_dtypes"], dtype=np.int64)
    a["shapes"] = np.array([list(t.shape)], dtype=np.int64) if t.ndim else np.zeros((1, 0), np.float64)


def build_skeleton(items: list, *, cstorch_version: str, format_version: float, spec_text: str):
    """Write the HDF5 metadata; returns ``(segments, regions, size)``.

    ``segments``: ``[(offset, bytes)]`` metadata written by HDF5; ``regions``: ``[(offset, tensor)]``
    data ranges left for the tensors; ``size``: the file size.
    """
    buf = SparseBuffer()
    regions = []
    lcpl = _lcpl()
    # track_order: the root group gets a v2 object header with indexed (dense) attribute storage; with the
    # compact v1 storage cstorch uses, adding n root attributes costs O(n^2) (130 s for 12,000 keys)
    with h5py.File(buf, "w", track_order=True) as f:
        f.attrs["__spec__"] = spec_text
        f.attrs["__version__"] = np.float64(format_version)
        f.attrs["__cstorch_version__"] = cstorch_version
        for key, entry in items:
            if isinstance(entry, TensorEntry):
                t = entry.tensor
                space = h5py.h5s.create_simple(t.shape) if t.ndim else h5py.h5s.create(h5py.h5s.SCALAR)
                tid = h5py.h5t.py_create(h5_storage_dtype(t.dtype), logical=True)
                dsid = h5py.h5d.create(f.id, key.encode(), tid, space, dcpl=_dcpl(), lcpl=lcpl)
                _tensor_attrs(h5py.Dataset(dsid), entry, entry_metadata(entry))
                off = dsid.get_offset()
                if t.nbytes:
                    if off is None or dsid.get_storage_size() != t.nbytes:
                        raise RuntimeError(f"{key}: HDF5 did not allocate {t.nbytes} contiguous bytes")
                    regions.append((off, t))
            elif isinstance(entry, BytesEntry):
                space = h5py.h5s.create(h5py.h5s.NULL)
                dsid = h5py.h5d.create(f.id, key.encode(), h5py.h5t.IEEE_F32LE, space,
                                       dcpl=_dcpl(track_attr_order=True), lcpl=lcpl)
                a = h5py.Dataset(dsid).attrs
                a["__TYPE__"] = "ObjectSerializer"
                a["compressed"] = np.bool_(False)
                a["__BYTES__"] = np.frombuffer(entry.data, dtype="V1")
        for key, entry in items:
            f.attrs[key + ".__metadata__"] = hdf5_spec.key_metadata_attr(key, entry_metadata(entry))
        f.attrs["__SUCCESS__"] = np.bool_(True)
    segments = buf.segments()
    size = buf.eof
    _check_disjoint(segments, regions, size)
    return segments, regions, size


def _check_disjoint(segments, regions, size):
    spans = sorted([(o, o + len(d), "m") for o, d in segments] + [(o, o + t.nbytes, "d") for o, t in regions])
    for (a0, a1, ak), (b0, b1, bk) in zip(spans, spans[1:]):
        if b0 < a1 and "d" in (ak, bk):
            raise RuntimeError(f"HDF5 wrote metadata into a data region at {b0}")
    if spans and spans[-1][1] > size:
        raise RuntimeError("data region beyond end of file")


def plan_pieces(segments, regions, size: int, names: dict | None = None) -> list:
    """The file as pieces: metadata ``segments`` [(offset, bytes)] and tensor ``regions`` [(offset, tensor)] in
    offset order, the gaps between them zeros."""
    names = names or {}
    spans = sorted([(o, Literal(d, "HDF5 metadata")) for o, d in segments]
                   + [(o, TensorBytes(t, names.get(id(t), t.describe()))) for o, t in regions], key=lambda x: x[0])
    pieces, pos = [], 0
    for off, piece in spans:
        if off > pos:
            pieces.append(Zeros(off - pos, "HDF5 free space"))
        pieces.append(piece)
        pos = off + piece.size
    if size > pos:
        pieces.append(Zeros(size - pos, "HDF5 free space"))
    return pieces


class Hdf5Layout(PiecedFile):
    """The bytes of a lazily generated format-0.5 ``.mdl``: ``size`` and ``read(offset, n)``.

    ``root``: a ``Container`` tree whose leaves are entries (``TensorEntry`` … ``LinkEntry``); the same
    entry object under two keys is written once and linked, like cstorch does for repeated objects.
    The skeleton is built (the file planned) on first use of ``size`` or ``read``.
    """

    def __init__(self, root, *, cstorch_version: str = CSTORCH_VERSION, format_version: float = FORMAT_VERSION,
                 cache: BlockCache | None = None, path=None):
        self.root = root
        self.path = path
        self.cstorch_version = cstorch_version
        self.format_version = format_version
        self.items = resolve_entries(root, path)
        self.notes = [f"{k}: dtype {e.tensor.dtype.name} has no RtFx code; cstorch 2.10 cannot write it"
                      for k, e in self.items if isinstance(e, TensorEntry) and not e.numpy
                      and e.tensor.dtype.name not in RTFX_CODES]
        super().__init__(name=str(path) if path is not None else "HDF5 file", cache=cache, plan=self._plan_file)

    def _plan_file(self) -> list:
        try:
            segments, regions, size = build_skeleton(
                self.items, cstorch_version=self.cstorch_version, format_version=self.format_version,
                spec_text=hdf5_spec.spec_attr(self.root))
        except (ValueError, KeyError, OSError) as e:
            raise CheckpointError(self.path, f"cannot lay out the HDF5 file: {e}") from e
        names = {id(e.tensor): k for k, e in reversed(self.items) if isinstance(e, TensorEntry)}
        return plan_pieces(segments, regions, size, names)

    @property
    def metadata_bytes(self) -> int:
        """Bytes of HDF5 metadata held in memory (no tensor data)."""
        return sum(p.size for p in self.plan().pieces if isinstance(p, Literal))
