"""A format-0.5 Cerebras checkpoint (``.mdl``), served lazily: HDF5 metadata built once, tensor bytes on read.

Given a state tree (``Container`` nodes, leaves are the entry dataclasses below) the layout builds a
*metadata-only* HDF5 skeleton with h5py, exactly as cerebras-pytorch 2.10 lays out a checkpoint
(global ``__spec__``/``__version__`` 0.5/``__cstorch_version__``/per-key ``<key>.__metadata__``
JSON/``__SUCCESS__``, dataset attributes ``__NUMPY__``, ``__TORCH__``, ``__TYPE__``, ``shapes``,
``dtypes``, ``rtfx_dtypes``, ``compressed``; bf16 stored as int16 bits, bool as the HDF5 enum over
int8, keys with ``/`` become groups, bytes objects as null-dataspace datasets with ``__BYTES__``).

The trade: cstorch writes every non-0-d dataset chunked with the LZ4 filter (32004). Here every
tensor dataset is CONTIGUOUS, allocated early, unfiltered and never filled, so its data is one
byte range at a fixed offset (``dset.id.get_offset()``). cstorch's loader reads any h5py dataset, so the file
loads the same; we give up LZ4 to gain laziness and O(#keys) memory. The skeleton is written through h5py's
file-object driver into an unlinked temporary file (``ScratchBuffer``; in memory, ``SparseBuffer``, when none can
be made), sparse: the never-written data regions cost nothing, and the metadata (~2 KB per key, mostly the
``__metadata__`` JSON) stays out of the server's memory. The file is served by one piece (``_Body``) holding
arrays: each tensor's region and the ranges HDF5 wrote; the bytes outside the tensors are read back from the
temporary file, and the tensors' bytes through the block cache.
One more difference from cstorch: the root group tracks creation order (HDF5 1.8 object header with
indexed attributes), because cstorch's compact root attributes make a build O(#keys²). Readers
see the same attributes and datasets. The file's bytes are a pure function of the tree and never change.
"""
from __future__ import annotations

import bisect
import io
import json
import logging
import os
import signal
import tempfile
import threading
import weakref
from array import array
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np
from h5py._hl.base import array_for_new_object

from ..cache import BlockCache
from ..dtypes import DType
from ..errors import CheckpointError, TensorReadError
from ..source.h5store import release_hdf5_free_lists
from ..virtual_tensor import VirtualTensor
from . import hdf5_spec
from .pieces import PiecedFile, TensorBytes

log = logging.getLogger(__name__)

FORMAT_VERSION = 0.5
CSTORCH_VERSION = "2.10.0"

#: RtFxProto ElementType codes written by cstorch 2.10 (cerebras-h5-format §2.5)
RTFX_CODES = {"bool": 1, "int16": 3, "int32": 4, "int64": 5, "uint8": 6, "uint16": 7, "uint32": 8,
              "uint64": 9, "float16": 10, "float32": 11, "float64": 12, "bfloat16": 15}


# -- entries (the leaves of the tree handed to the layout) -----------------------------------------
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


# -- the files h5py writes the skeleton into --------------------------------------------------------
class _SkeletonBuffer(io.RawIOBase):
    """What h5py's file-object driver needs (a seekable binary file) plus what the layout needs after the build:
    ``eof``, ``spans()`` (the merged byte ranges written, i.e. the HDF5 metadata) and ``read_at(offset, out)``
    (unwritten bytes read as zeros). Subclasses keep the bytes: ``_put``, ``read_at``, ``_cut``."""

    def __init__(self):
        super().__init__()
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

    def write(self, b):
        n = len(memoryview(b).cast("B"))
        if n:
            self._put(self._pos, b)
            self._pos += n
            self.eof = max(self.eof, self._pos)
        return n

    def readinto(self, b):
        n = len(b)  # past the end reads as zeros too
        self.read_at(self._pos, memoryview(b).cast("B"))
        self._pos += n
        return n

    def truncate(self, size=None):
        size = self._pos if size is None else int(size)
        self._cut(size)
        self.eof = size
        return size

    def finish(self) -> list:
        """Ends writing: returns ``spans()`` and drops what only writing needed."""
        return self.spans()


class ScratchBuffer(_SkeletonBuffer):
    """The skeleton written into ``scratch``, an unlinked temporary file (sparse: the tensors' regions are never
    written), so that its metadata stays on disk and out of the server's memory; the written ranges are tracked
    (merged, two int lists) to tell metadata from free space. Reads use ``os.pread``: safe from several threads."""

    def __init__(self, scratch):
        super().__init__()
        self.scratch = scratch  # kept open: the layout reads from it for as long as it lives
        self._fd = scratch.fileno()
        self._starts: list[int] = []
        self._ends: list[int] = []
        self.error: OSError | None = None  # a write that failed (a full disk): the layout builds in memory instead

    def _put(self, offset: int, data) -> None:
        mv = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(mv):
                done += os.pwrite(self._fd, mv[done:], offset + done)
        except OSError as e:
            self.error = e
            raise
        lo, hi = offset, offset + len(mv)
        i = bisect.bisect_left(self._ends, lo)  # first range ending at or after lo: touches or overlaps
        j = bisect.bisect_right(self._starts, hi)  # ranges from j on start after hi
        if i < j:
            lo, hi = min(lo, self._starts[i]), max(hi, self._ends[j - 1])
        self._starts[i:j] = [lo]
        self._ends[i:j] = [hi]

    def read_at(self, offset: int, out: memoryview) -> None:
        pos, end = offset, offset + len(out)
        while pos < end:
            data = os.pread(self._fd, end - pos, pos)
            if not data:  # beyond the file's end: zeros
                out[pos - offset:] = bytes(end - pos)
                break
            out[pos - offset:pos - offset + len(data)] = data
            pos += len(data)

    def _cut(self, size: int) -> None:
        try:
            os.ftruncate(self._fd, size)
        except OSError as e:
            self.error = e
            raise
        i = bisect.bisect_left(self._starts, size)
        del self._starts[i:], self._ends[i:]
        if self._ends and self._ends[-1] > size:
            self._ends[-1] = size

    def spans(self) -> list:
        return list(zip(self._starts, self._ends))

    def finish(self) -> list:
        spans = self.spans()
        self._starts, self._ends = [], []
        return spans


class SparseBuffer(_SkeletonBuffer):
    """The skeleton kept in memory (when no temporary file can be made): only written ranges are kept, merged,
    each with its bytes."""

    def __init__(self):
        super().__init__()
        self._starts: list[int] = []
        self._data: list[bytearray] = []

    def _put(self, lo: int, b) -> None:
        b = bytes(b)
        hi = lo + len(b)
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

    def read_at(self, offset: int, out: memoryview) -> None:
        n = len(out)
        out[:] = bytes(n)
        lo, hi = offset, offset + n
        i = max(0, bisect.bisect_right(self._starts, lo) - 1)
        while i < len(self._starts) and self._starts[i] < hi:
            s, d = self._starts[i], self._data[i]
            a, z = max(lo, s), min(hi, s + len(d))
            if a < z:
                out[a - lo:z - lo] = d[a - s:z - s]
            i += 1

    def _cut(self, size: int) -> None:
        i = bisect.bisect_left(self._starts, size)
        del self._starts[i:], self._data[i:]
        if self._starts and self._starts[-1] + len(self._data[-1]) > size:
            del self._data[-1][size - self._starts[-1]:]

    def spans(self) -> list:
        return [(s, s + len(d)) for s, d in zip(self._starts, self._data)]


def new_buffer() -> _SkeletonBuffer:
    """A ``ScratchBuffer`` on an unlinked temporary file in the temporary directory (``$TMPDIR``), or a
    ``SparseBuffer`` in memory when no temporary file can be made there."""
    try:
        return ScratchBuffer(tempfile.TemporaryFile(prefix="ckptfs-hdf5-"))
    except OSError as e:
        log.warning("no temporary file for the HDF5 skeleton (%s): kept in memory", e)
        return SparseBuffer()


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


class _Writer:
    """Creates the skeleton's datasets and attributes through h5py's low-level API, with each HDF5 type, dataspace
    and property list made once: h5py's high-level ``obj.attrs[name] = value`` costs ~40 µs more per attribute, and a
    tensor has seven or eight.

    It makes the same HDF5 calls, in the same order, as the high-level code it replaces — ``f.attrs[name] = value``
    on the root group, ``Dataset(dsid).attrs[name] = value`` on a dataset — because HDF5 places metadata by the state
    of its metadata cache, so that with thousands of keys even an extra or a missing call moves bytes: an attribute
    is written as h5py's ``AttributeManager.create`` does (``H5Aexists``, then create, write, close; the value made an
    array by h5py's own ``array_for_new_object``, its types by ``py_create``), and a root attribute opens the root
    group for that one attribute, as ``f.attrs`` does (the root group is never held open).
    """

    def __init__(self):
        self._types: dict = {}
        self._spaces: dict = {}
        self._dcpl = _dcpl()
        self._lcpl = _lcpl()

    def space(self, shape: tuple):
        space = self._spaces.get(shape)
        if space is None:
            space = self._spaces[shape] = h5py.h5s.create_simple(shape)
        return space

    def root_attr(self, fid, name: str, value) -> None:
        """An attribute of the root group of the file ``fid``."""
        self.attr(h5py.h5o.open(fid, b"/"), name, value)

    def attr(self, oid, name: str, value) -> None:
        """A new attribute of the object ``oid``."""
        data = array_for_new_object(value)
        key = (data.dtype.str, h5py.check_string_dtype(data.dtype))  # a vlen string dtype equals plain object
        types = self._types.get(key)
        if types is None:  # (file type, memory type) as h5py's AttributeManager.create makes them
            types = self._types[key] = (h5py.h5t.py_create(data.dtype, logical=True), h5py.h5t.py_create(data.dtype))
        bname = name.encode()
        if h5py.h5a.exists(oid, bname):  # never (the names are new), but the high-level call asks
            raise ValueError(f"attribute {name!r} written twice")
        attr = h5py.h5a.create(oid, bname, types[0], self.space(data.shape))
        try:
            attr.write(data, mtype=types[1])
        finally:
            attr.close()

    def tensor(self, parent, key: str, entry: TensorEntry):
        """The contiguous dataset of ``entry`` with its attributes (as cstorch's TorchTensorSerializer or
        NumpyArraySerializer writes them)."""
        t = entry.tensor
        dtype = h5_storage_dtype(t.dtype)
        tid = self._types.get(dtype)
        if tid is None:
            tid = self._types[dtype] = h5py.h5t.py_create(dtype, logical=True)
        space = self.space(t.shape) if t.ndim else h5py.h5s.create(h5py.h5s.SCALAR)
        dsid = h5py.h5d.create(parent, key.encode(), tid, space, dcpl=self._dcpl, lcpl=self._lcpl)
        md = entry_metadata(entry)
        self.attr(dsid, "__NUMPY__", _TRUE)
        if entry.numpy:
            self.attr(dsid, "__TYPE__", md["__TYPE__"])
            self.attr(dsid, "compressed", _FALSE)
            self.attr(dsid, "is_bfloat16", np.bool_(md["is_bfloat16"]))
            return dsid
        self.attr(dsid, "__TORCH__", _TRUE)
        self.attr(dsid, "__TYPE__", md["__TYPE__"])
        self.attr(dsid, "compressed", _FALSE)
        self.attr(dsid, "dtypes", np.array(md["dtypes"], dtype=h5py.string_dtype()))
        if "rtfx_dtypes" in md:
            self.attr(dsid, "rtfx_dtypes", np.array(md["rtfx_dtypes"], dtype=np.int64))
        self.attr(dsid, "shapes", np.array([list(t.shape)], dtype=np.int64) if t.ndim else np.zeros((1, 0), np.float64))
        return dsid

    def pickled(self, parent, key: str, entry: BytesEntry) -> None:
        """The null-dataspace dataset of an opaque object (ObjectSerializer)."""
        dsid = h5py.h5d.create(parent, key.encode(), h5py.h5t.IEEE_F32LE, h5py.h5s.create(h5py.h5s.NULL),
                               dcpl=_dcpl(track_attr_order=True), lcpl=self._lcpl)
        self.attr(dsid, "__TYPE__", "ObjectSerializer")
        self.attr(dsid, "compressed", _FALSE)
        self.attr(dsid, "__BYTES__", np.frombuffer(entry.data, dtype="V1"))


_TRUE, _FALSE = np.bool_(True), np.bool_(False)


@dataclass(eq=False, slots=True)
class Skeleton:
    """A built skeleton: the ``buffer`` holding what HDF5 wrote, the ranges it wrote (``spans``, [(start, end)]: the
    metadata), the ranges left for the tensors' bytes (``regions``, [(offset, tensor)]) and the file ``size``."""

    buffer: _SkeletonBuffer
    spans: list
    regions: list
    size: int


def build_skeleton(items: list, *, cstorch_version: str, format_version: float, spec_text: str,
                   buffer: _SkeletonBuffer | None = None) -> Skeleton:
    """Write the HDF5 metadata of ``items`` (``[(flat key, entry)]``) into ``buffer`` (default: ``new_buffer()``)."""
    buf = new_buffer() if buffer is None else buffer
    regions = []
    # track_order: the root group gets a v2 object header with indexed (dense) attribute storage; with the
    # compact v1 storage cstorch uses, adding n root attributes costs O(n^2) (130 s for 12,000 keys)
    with h5py.File(buf, "w", track_order=True) as f:
        w = _Writer()
        w.root_attr(f.id, "__spec__", spec_text)
        w.root_attr(f.id, "__version__", np.float64(format_version))
        w.root_attr(f.id, "__cstorch_version__", cstorch_version)
        for key, entry in items:
            if isinstance(entry, TensorEntry):
                t = entry.tensor
                dsid = w.tensor(f.id, key, entry)
                off = dsid.get_offset()
                if t.nbytes:
                    if off is None or dsid.get_storage_size() != t.nbytes:
                        raise RuntimeError(f"{key}: HDF5 did not allocate {t.nbytes} contiguous bytes")
                    regions.append((off, t))
            elif isinstance(entry, BytesEntry):
                w.pickled(f.id, key, entry)
        for key, entry in items:
            w.root_attr(f.id, key + ".__metadata__", hdf5_spec.key_metadata_attr(key, entry_metadata(entry)))
        w.root_attr(f.id, "__SUCCESS__", _TRUE)
    release_hdf5_free_lists()  # the metadata cache's decoded headers (~80 MB for thousands of keys), bounded but kept
    skel = Skeleton(buf, buf.finish(), regions, buf.eof)
    _check_disjoint(skel)
    return skel


def _check_disjoint(skel: Skeleton) -> None:
    spans = sorted([(a, b, "m") for a, b in skel.spans] + [(o, o + t.nbytes, "d") for o, t in skel.regions])
    for (a0, a1, ak), (b0, b1, bk) in zip(spans, spans[1:]):
        if b0 < a1 and "d" in (ak, bk):
            raise RuntimeError(f"HDF5 wrote metadata into a data region at {b0}")
    if spans and spans[-1][1] > skel.size:
        raise RuntimeError("data region beyond end of file")


class _Body:
    """The whole file as one piece that finds its parts by bisecting arrays, instead of a piece per key: the tensors'
    regions ``[starts[i], ends[i])`` are read from ``tensors[i]`` through the cache; every other byte comes from the
    skeleton buffer — HDF5 metadata in the ranges HDF5 wrote (``meta_starts``/``meta_ends``), zeros (free space)
    elsewhere. About 40 B per tensor. ``prefetch`` lets the read engine's read-ahead reach the tensors."""

    __slots__ = ("layout", "buffer", "size", "starts", "ends", "tensors", "meta_starts", "meta_ends")

    def __init__(self, layout: "Hdf5Layout", skel: Skeleton):
        self.layout = layout  # names the tensors (explain, errors)
        self.buffer = skel.buffer
        regions = sorted(skel.regions, key=lambda r: r[0])
        self.starts = array("q", [o for o, _ in regions])
        self.ends = array("q", [o + t.nbytes for o, t in regions])
        self.tensors = [t for _, t in regions]
        self.meta_starts = array("q", [a for a, _ in skel.spans])
        self.meta_ends = array("q", [b for _, b in skel.spans])
        self.size = skel.size

    @property
    def what(self) -> str:
        return f"HDF5 file {self.layout.name}"

    def fill(self, out: memoryview, a: int, cache) -> int:
        starts, ends, n, pos = self.starts, self.ends, len(out), 0
        i = bisect.bisect_right(starts, a) - 1  # the last region starting at or before the position
        while pos < n:
            at = a + pos
            while i + 1 < len(starts) and starts[i + 1] <= at:
                i += 1
            if i >= 0 and at < ends[i]:
                k = min(n - pos, ends[i] - at)
                t = self.tensors[i]
                got = t.read_into(at - starts[i], out[pos:pos + k], cache)
                if got != k:
                    raise TensorReadError(self.layout.name, f"tensor {self.layout.key_of(t)} produced {got} bytes "
                                                            f"for its bytes [{at - starts[i]}, {at - starts[i] + k})")
            else:
                k = min(n - pos, (starts[i + 1] if i + 1 < len(starts) else self.size) - at)
                self.buffer.read_at(at, out[pos:pos + k])
            pos += k
        return pos

    def prefetch(self, a: int, b: int, cache) -> None:
        i = max(bisect.bisect_right(self.starts, a) - 1, 0)
        while i < len(self.starts) and self.starts[i] < b:
            lo, hi = self.starts[i], self.ends[i]
            if a < hi:
                self.tensors[i].prefetch(max(a, lo) - lo, min(b, hi) - lo, cache)
            i += 1

    def explain(self, a: int) -> list:
        i = bisect.bisect_right(self.starts, a) - 1
        if i >= 0 and a < self.ends[i]:
            t = self.tensors[i]
            return TensorBytes(t, self.layout.key_of(t)).explain(a - self.starts[i])
        j = bisect.bisect_right(self.meta_starts, a) - 1
        if j >= 0 and a < self.meta_ends[j]:
            lo, hi = self.meta_starts[j], self.meta_ends[j]
            return [f"HDF5 metadata: file bytes [{lo}, {hi}), {hi - lo} bytes written when the file was planned"]
        lo = max(self.ends[i] if i >= 0 else 0, self.meta_ends[j] if j >= 0 else 0)
        hi = min(self.starts[i + 1] if i + 1 < len(self.starts) else self.size,
                 self.meta_starts[j + 1] if j + 1 < len(self.meta_starts) else self.size)
        return [f"HDF5 free space: file bytes [{lo}, {hi}), {hi - lo} zero bytes"]

    @property
    def metadata_bytes(self) -> int:
        return sum(self.meta_ends) - sum(self.meta_starts)


class _ChildBuild:
    """A skeleton being built by a forked child process (``Hdf5Layout.fork_build``): it writes the HDF5 metadata into
    ``buffer``'s scratch file (the descriptor is shared across the fork) and sends what the layout needs back
    through a pipe as JSON: the written ranges, the data regions' offsets in the order of the tensors, the size."""

    def __init__(self, pid: int, fd: int, buffer: "ScratchBuffer"):
        self.pid, self.fd, self.buffer = pid, fd, buffer
        self._finalizer = weakref.finalize(self, _ChildBuild._reap, pid, fd, True)

    @staticmethod
    def _reap(pid: int, fd: int, kill: bool) -> int | None:
        """Close the pipe and wait for the child (killed first when its result is not wanted); its exit status."""
        try:
            os.close(fd)
        except OSError:
            pass
        if kill:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            return os.waitpid(pid, 0)[1]
        except ChildProcessError:
            return None

    def result(self, items: list) -> Skeleton | None:
        """The child's skeleton (waits for it; the GIL is free meanwhile), or None if it failed (the caller then
        builds in this process, which raises the error the child met)."""
        chunks = []
        try:
            while True:
                data = os.read(self.fd, 1 << 20)
                if not data:
                    break
                chunks.append(data)
        except OSError:
            chunks = []
        self._finalizer.detach()
        status = _ChildBuild._reap(self.pid, self.fd, False)  # None: reaped by someone else; the JSON tells
        if status not in (0, None) or not chunks:
            return None
        try:
            msg = json.loads(b"".join(chunks))
            tensors = [e.tensor for _, e in items if isinstance(e, TensorEntry) and e.tensor.nbytes]
            if len(tensors) != len(msg["offsets"]):
                return None
            buf = self.buffer
            buf.eof = int(msg["size"])
            skel = Skeleton(buf, [(int(a), int(b)) for a, b in msg["spans"]],
                            [(int(o), t) for o, t in zip(msg["offsets"], tensors)], buf.eof)
        except (ValueError, KeyError, TypeError):
            return None
        _check_disjoint(skel)
        return skel


def _child_build(layout: "Hdf5Layout", items: list, buf: "ScratchBuffer", fd: int) -> None:
    """In the forked child: build, send the result, exit (never returns; no cleanup of the parent's state runs)."""
    code = 1
    try:
        try:  # die with the server (Linux): the child must not outlive the process that waits for it
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        skel = layout._build(items, buf)
        data = memoryview(json.dumps({"spans": skel.spans, "offsets": [o for o, _ in skel.regions],
                                      "size": skel.size}).encode())
        while data:
            data = data[os.write(fd, data):]
        code = 0
    except BaseException:  # noqa: BLE001 - any failure: the parent builds itself and reports it
        pass
    finally:
        os._exit(code)


class Hdf5Layout(PiecedFile):
    """The bytes of a lazily generated format-0.5 ``.mdl``: ``size`` and ``read(offset, n)``.

    ``root``: a ``Container`` tree whose leaves are entries (``TensorEntry`` … ``LinkEntry``); the same
    entry object under two keys is written once and linked, like cstorch does for repeated objects.
    The skeleton is built (the file planned) on first use of ``size`` or ``read``. What stays in memory per key is
    the entry tree and the arrays of one ``_Body`` piece; the metadata bytes stay in the skeleton's temporary file.
    """

    def __init__(self, root, *, cstorch_version: str = CSTORCH_VERSION, format_version: float = FORMAT_VERSION,
                 cache: BlockCache | None = None, path=None):
        self.root = root
        self.path = path
        self.cstorch_version = cstorch_version
        self.format_version = format_version
        items = resolve_entries(root, path)  # raises for what cannot be laid out, before anything is built
        self.notes = [f"{k}: dtype {e.tensor.dtype.name} has no RtFx code; cstorch 2.10 cannot write it"
                      for k, e in items if isinstance(e, TensorEntry) and not e.numpy
                      and e.tensor.dtype.name not in RTFX_CODES]
        self._child: _ChildBuild | None = None
        super().__init__(name=str(path) if path is not None else "HDF5 file", cache=cache, plan=self._plan_file)

    def fork_build(self) -> bool:
        """Start building the skeleton now in a forked child process, on another CPU and outside this process's GIL;
        the first use of the file (``size``, ``read``) then only waits for the child and adopts its result. The
        child makes the same calls as a build in this process, so the bytes are the same; if it fails, the first
        use builds here (and raises what the child met).

        Only while this process has a single thread (a fork copies no other thread, and any lock another thread
        held would stay held in the child): otherwise, and without ``os.fork`` or a scratch file, nothing is
        started and False is returned (the skeleton is built on first use, as without this call)."""
        if self._child is not None or not hasattr(os, "fork") or threading.active_count() != 1:
            return False
        buf = new_buffer()
        if not isinstance(buf, ScratchBuffer):
            return False
        items = self.items
        r, w = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            os.close(r)
            os.close(w)
            return False
        if pid == 0:
            os.close(r)
            _child_build(self, items, buf, w)  # never returns
        os.close(w)
        self._child = _ChildBuild(pid, r, buf)
        return True

    @property
    def items(self) -> list:
        """``[(flat key, entry)]`` in spec order, recomputed from ``root`` on each use (a string and a tuple per key
        are not worth keeping for the build and ``explain``)."""
        return resolve_entries(self.root, self.path)

    def key_of(self, tensor: VirtualTensor) -> str:
        """The first flat key whose entry holds ``tensor`` (its description if none does)."""
        for key, entry in self.items:
            if isinstance(entry, TensorEntry) and entry.tensor is tensor:
                return key
        return tensor.describe()

    def _build(self, items: list, buffer: _SkeletonBuffer) -> Skeleton:
        return build_skeleton(items, cstorch_version=self.cstorch_version, format_version=self.format_version,
                              spec_text=hdf5_spec.spec_attr(self.root), buffer=buffer)

    def _plan_file(self) -> list:
        items = self.items
        child, self._child = self._child, None
        if child is not None:
            skel = child.result(items)
            if skel is not None:
                return [_Body(self, skel)]
            log.warning("%s: the HDF5 skeleton's build process failed: building it here", self.name)
        buf = new_buffer()
        try:
            try:
                skel = self._build(items, buf)
            except Exception:
                if getattr(buf, "error", None) is None:
                    raise
                log.warning("temporary file of the HDF5 skeleton failed (%s): built in memory", buf.error)
                skel = self._build(items, SparseBuffer())
        except (ValueError, KeyError, OSError) as e:
            raise CheckpointError(self.path, f"cannot lay out the HDF5 file: {e}") from e
        return [_Body(self, skel)]

    @property
    def metadata_bytes(self) -> int:
        """Bytes of HDF5 metadata (no tensor data), kept in the skeleton's buffer."""
        return self.plan().pieces[0].metadata_bytes
