"""The Cerebras H5 file ``tensorflow-to-h5`` writes (the appliance's ``H5Saver`` layout), served lazily.

One dataset per variable at the file's root, named ``urllib.parse.quote(name, safe='')``, with the attribute
``__H5_TYPE__`` = ``NumpyArrayH5Type`` (a variable-length UTF-8 string, as h5py writes a ``str``); no root
attributes. ``H5Saver().load()`` lists the root, unquotes each name and reads each dataset whole with h5py, so any
HDF5 storage it can read will do: here every dataset is CONTIGUOUS, allocated early, unfiltered and never filled
(H5Saver's own writer compressed with LZ4 chunks), so that a tensor's bytes are one range at a fixed offset, read
from the source only when that range is read. Scalars get a scalar dataspace; bool is h5py's enum over int8.

The metadata is built once with h5py into a scratch buffer (``hdf5_buffers``), exactly as the format-0.5 layout
(``hdf5``) does; the file is served by that layout's one-piece body. The same variables give the same bytes.
"""
from __future__ import annotations

from urllib.parse import quote

import h5py
from h5py._hl.base import array_for_new_object

from ckptfs.tensor.cache import BlockCache
from ckptfs.errors import CheckpointError
from ckptfs.layouts.hdf5.layout import _Body
from ckptfs.layouts.hdf5.buffers import SkeletonBuffer, SparseBuffer, new_buffer
from ckptfs.layouts.hdf5.entries import h5_storage_dtype
from ckptfs.layouts.hdf5.skeleton import Skeleton, check_disjoint
from ckptfs.layouts.pieces import PiecedFile
from ckptfs.readers.cerebras.h5store import release_hdf5_free_lists
from ckptfs.tensor.base import VirtualTensor

#: the ``__H5_TYPE__`` of a numpy array in H5Saver's files
NUMPY_H5_TYPE = "NumpyArrayH5Type"
#: element types an H5Saver file holds (numpy's numbers and bool; not bfloat16, float8 or strings)
H5SAVER_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                            "float16", "float32", "float64", "complex64", "complex128"})


def dataset_name(variable: str) -> str:
    """The root dataset name H5Saver gives a variable: ``quote(name, safe='')``."""
    return quote(variable, safe="")


def why_not_h5saver(tensor: VirtualTensor) -> str | None:
    """Why ``tensor`` has no H5Saver representation (None when it has one)."""
    name = tensor.dtype.name
    if name in H5SAVER_DTYPES:
        return None
    return f"{name}: no H5Saver representation"


def build_h5saver_skeleton(items: list, buffer: SkeletonBuffer) -> Skeleton:
    """Write the HDF5 metadata of ``items`` (``[(variable name, tensor)]``, names distinct once quoted) into
    ``buffer``: each dataset allocated, contiguous, never written."""
    regions = []
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    dcpl.set_obj_track_times(False)
    lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
    lcpl.set_char_encoding(h5py.h5t.CSET_UTF8)
    value = array_for_new_object(NUMPY_H5_TYPE)  # as h5py's ``attrs[name] = str`` writes it
    str_file, str_mem = h5py.h5t.py_create(value.dtype, logical=True), h5py.h5t.py_create(value.dtype)
    scalar = h5py.h5s.create(h5py.h5s.SCALAR)
    types: dict = {}
    with h5py.File(buffer, "w") as f:
        for name, t in items:
            dtype = h5_storage_dtype(t.dtype)
            tid = types.get(dtype)
            if tid is None:
                tid = types[dtype] = h5py.h5t.py_create(dtype, logical=True)
            space = h5py.h5s.create_simple(tuple(t.shape)) if t.ndim else scalar
            qname = dataset_name(name).encode("utf-8", "surrogateescape")
            dsid = h5py.h5d.create(f.id, qname, tid, space, dcpl=dcpl, lcpl=lcpl)
            attr = h5py.h5a.create(dsid, b"__H5_TYPE__", str_file, scalar)
            try:
                attr.write(value, mtype=str_mem)
            finally:
                attr.close()
            off = dsid.get_offset()
            if t.nbytes:
                if off is None or dsid.get_storage_size() != t.nbytes:
                    raise RuntimeError(f"{name}: HDF5 did not allocate {t.nbytes} contiguous bytes")
                regions.append((off, t))
            dsid.close()
    release_hdf5_free_lists()
    skel = Skeleton(buffer, buffer.finish(), regions, buffer.eof)
    check_disjoint(skel)
    return skel


class H5SaverLayout(PiecedFile):
    """The bytes of a lazily generated H5Saver file of ``items`` (``[(variable name, VirtualTensor)]``, every dtype
    one ``why_not_h5saver`` accepts): ``size`` and ``readinto``; the skeleton is built on first use."""

    def __init__(self, items: list, *, cache: BlockCache | None = None, path=None):
        seen: dict = {}
        for name, t in items:
            why = why_not_h5saver(t)
            if why:
                raise CheckpointError(path, f"variable {name!r}: {why}")
            q = dataset_name(name)
            if q in seen:
                raise CheckpointError(path, f"variables {seen[q]!r} and {name!r} have the same dataset name {q!r}")
            seen[q] = name
        self.items = list(items)
        self.path = path
        super().__init__(name=str(path) if path is not None else "H5Saver file", cache=cache, plan=self._plan_file)

    def key_of(self, tensor: VirtualTensor) -> str:
        """The variable whose tensor is ``tensor`` (its description if none is)."""
        for name, t in self.items:
            if t is tensor:
                return name
        return tensor.describe()

    def _plan_file(self) -> list:
        buf = new_buffer()
        try:
            try:
                skel = build_h5saver_skeleton(self.items, buf)
            except Exception:
                if getattr(buf, "error", None) is None:
                    raise
                skel = build_h5saver_skeleton(self.items, SparseBuffer())
        except (ValueError, KeyError, OSError, RuntimeError) as e:
            raise CheckpointError(self.path, f"cannot lay out the H5 file: {e}") from e
        return [_Body(self, skel)]
