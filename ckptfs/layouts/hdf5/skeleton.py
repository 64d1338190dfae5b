"""Writing the HDF5 skeleton of a format-0.5 checkpoint: every group, dataset and attribute cstorch 2.10 writes, with
each tensor's data region allocated (contiguous, never written) but not filled — the metadata of the file, not its
tensor bytes. The same entries give the same bytes: HDF5 places metadata by the state of its cache, so the writer
makes exactly the calls, in the order, of the high-level h5py code it replaces."""
from __future__ import annotations

from dataclasses import dataclass

import h5py
import numpy as np
from h5py._hl.base import array_for_new_object

from ...readers.cerebras.h5store import release_hdf5_free_lists
from . import spec_attr as hdf5_spec
from .buffers import SkeletonBuffer, new_buffer
from .entries import BytesEntry, TensorEntry, entry_metadata, h5_storage_dtype


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

    buffer: SkeletonBuffer
    spans: list
    regions: list
    size: int


def _create(buf) -> h5py.File:
    """A new HDF5 file on ``buf``, as ``h5py.File(buf, "w", track_order=True)`` makes it but with no timestamps in
    the root group's header: HDF5 1.14 stamps it with the time of creation, so the bytes of two builds of the same
    checkpoint would differ from one second to the next."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_EARLIEST, h5py.h5f.LIBVER_LATEST)
    fapl.set_fileobj_driver(h5py.h5fd.fileobj_driver, buf)
    fcpl = h5py.h5p.create(h5py.h5p.FILE_CREATE)
    order = h5py.h5p.CRT_ORDER_TRACKED | h5py.h5p.CRT_ORDER_INDEXED
    fcpl.set_link_creation_order(order)
    fcpl.set_attr_creation_order(order)
    fcpl.set_obj_track_times(False)
    return h5py.File(h5py.h5f.create(b"ckptfs-skeleton", h5py.h5f.ACC_TRUNC, fapl=fapl, fcpl=fcpl))


def build_skeleton(items: list, *, cstorch_version: str, format_version: float, spec_text: str,
                   buffer: SkeletonBuffer | None = None) -> Skeleton:
    """Write the HDF5 metadata of ``items`` (``[(flat key, entry)]``) into ``buffer`` (default: ``new_buffer()``)."""
    buf = new_buffer() if buffer is None else buffer
    regions = []
    # track_order: the root group gets a v2 object header with indexed (dense) attribute storage; with the
    # compact v1 storage cstorch uses, adding n root attributes costs O(n^2) (130 s for 12,000 keys)
    with _create(buf) as f:
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
    check_disjoint(skel)
    return skel


def check_disjoint(skel: Skeleton) -> None:
    spans = sorted([(a, b, "m") for a, b in skel.spans] + [(o, o + t.nbytes, "d") for o, t in skel.regions])
    for (a0, a1, ak), (b0, b1, bk) in zip(spans, spans[1:]):
        if b0 < a1 and "d" in (ak, bk):
            raise RuntimeError(f"HDF5 wrote metadata into a data region at {b0}")
    if spans and spans[-1][1] > skel.size:
        raise RuntimeError("data region beyond end of file")
