"""The source tensors of a checkpoint: VirtualTensors whose ``read(box)`` reads only that box.

* ``H5DatasetTensor``: a dataset of the checkpoint (or of an external .mdl); only the chunks under the
  box are decompressed. LZ4-only chunked datasets (every Cerebras tensor) are decoded by
  ``lz4chunks.LZ4ChunkReader`` (chunks in parallel, outside HDF5's serial filter pipeline); anything
  else is an h5py hyperslab selection of exactly the box. Its cache blocks are aligned to chunk rows.
  Its chunks can also be looked at as stored (``stored_layout``, ``stored_chunk``, ``read_stored_chunk``):
  ``ckptfs diff`` tells equal chunks apart without decoding them.
* ``FullTensor``: a constant-fill tensor (DeferredFullTensor) with no data on disk.
* ``BlobRegionTensor`` (``ckptfs.tensor.regions``): raw little-endian C-order elements at an offset of a plain
  file (a .safetensors data block, a legacy DeferredFileTensor file), read run by run.

Any failure while reading becomes ``TensorReadError(checkpoint path, "tensor <key>: <problem>")``.
"""
from __future__ import annotations

import logging

import math
import threading
from array import array

import numpy as np

from ckptfs.tensor.regions import (
    _shape_str,
    _to_storage,
)

from ...dtypes import DType
from ...errors import TensorReadError
from ...storage.local import FileIdentity
from ...tensor.base import Box, VirtualTensor, box_shape, shared_shape
from . import lz4chunks
from .h5safe import H5Refused, open_dataset
from .h5store import H5Store
from ...errors import one_line
from ...catalog.validate import dataset_problem

log = logging.getLogger(__name__)

_open_lock = threading.Lock()


class H5DatasetTensor(VirtualTensor):
    """Dataset ``name`` of an HDF5 file; shape and dtype come from the checkpoint's metadata.

    One per checkpoint key, so slots only: until its first read it holds the store, two strings (the catalog
    passes the flat key itself as both when they are equal), the shared shape and chunk tuples. A read opens the
    dataset and plans its LZ4 reads (``_open``); the store closes the least recently read ones beyond its bound
    (``H5Store.used``), and such a tensor opens its dataset again when read next."""

    __slots__ = ("store", "name", "key", "_chunks", "_open")

    def __init__(self, store: H5Store, name: str, key: str, shape, dtype: DType, *, chunks: tuple | None = None):
        super().__init__(shape, dtype)
        self.store = store
        self.name = name  # dataset path inside the file (h5py follows '/' as groups)
        self.key = key  # flat key, for messages
        self._chunks = None if chunks is None else shared_shape(chunks)  # when the catalog read the header
        self._open = None  # (h5py Dataset, LZ4ChunkReader | None) while the dataset is open

    def describe(self) -> str:
        where = "" if self.store.path == self.store.checkpoint_path else f" of {self.store.path.name}"
        return f"h5 dataset {self.name!r}{where} {_shape_str(self.shape)} {self.dtype.name}"

    def _fail(self, problem) -> TensorReadError:
        return TensorReadError(self.store.checkpoint_path, f"tensor {self.key}: {one_line(problem)}")

    def dataset(self):
        """The h5py Dataset, checked against the metadata shape and element size (no data read)."""
        return self._opened()[0]

    def _opened(self) -> tuple:
        """``(dataset, LZ4 reader or None)``, opening and planning the dataset if it is not open."""
        o = self._open
        if o is None:
            with _open_lock:  # concurrent FUSE readers open (and plan) each dataset once
                o = self._open
                if o is None:
                    o = self._open = self._open_dataset()
        self.store.used(self)
        return o

    def close_dataset(self) -> None:
        """Let go of the open dataset and its plan (h5py closes it once no read under way still holds it)."""
        self._open = None

    def _open_dataset(self) -> tuple:
        f = self.store.file(f"tensor {self.key}")
        try:
            d, info = open_dataset(f, self.name)  # never crosses into another file (h5safe)
        except H5Refused as e:
            raise self._fail(e.problem) from None
        except (OSError, KeyError, ValueError, RuntimeError) as e:
            raise self._fail(f"cannot open dataset {self.name!r}: {e}") from e
        if d is None:
            raise self._fail(f"dataset {self.name!r} is missing from {self.store.path.name}")
        why = dataset_problem(info, self.shape, self.dtype.itemsize, self.name)
        if why:
            raise self._fail(why)
        self._chunks = None if info.chunks is None else shared_shape(info.chunks)
        return d, (lz4chunks.plan(d, open_file=self.store.chunk_file) if self.ndim else None)

    def _chunk_reader(self, d):
        """The LZ4 chunk reader for dataset object ``d`` (None: plain h5py reads): the one planned when the dataset
        was opened, or a new plan for another object (a dataset closed and opened again meanwhile, a test's spy)."""
        o = self._open
        if o is not None and o[0] is d:
            return o[1]
        return lz4chunks.plan(d, open_file=self.store.chunk_file) if self.ndim else None

    def will_need(self, start: int, stop: int, continuing: bool = False) -> None:
        """Announce bytes ``[start, stop)`` of the image to the storage as the stored chunks under them
        (``LZ4ChunkReader.will_need``: chunk index lookups only, nothing read or decoded). Best effort: a failure is
        left for the read that needs the bytes to report."""
        if self.ndim == 0 or stop <= start:
            return
        item = self.dtype.itemsize
        try:
            self.store.will_index(self.name)
            reader = self._opened()[1]
            if reader is not None:
                reader.will_need(start // item, -(-stop // item), continuing)
        except (TensorReadError, OSError, KeyError, ValueError, RuntimeError) as e:  # not a programming error
            log.debug("announcing %s [%d, %d) failed: %s", self.describe(), start, stop, e)

    def read_index(self) -> None:
        """Open the dataset and read its chunk index now (a mount's background work, ``readers.s3.open``), so that
        the first read or announcement finds it. Best effort, as ``will_need``."""
        if self.ndim == 0:
            return
        try:
            reader = self._opened()[1]
            if reader is not None:
                reader.prepare()
        except (TensorReadError, OSError, KeyError, ValueError, RuntimeError) as e:  # not a programming error
            log.debug("indexing %s failed: %s", self.describe(), e)

    def chunk_shape(self):
        """The dataset's chunk shape: cache blocks are whole chunk rows (``VirtualTensor.block_elems``), so that
        consecutive blocks never decode the same chunk."""
        if self._chunks is None and self._open is None:
            try:
                self.dataset()
            except TensorReadError:
                return None
        return self._chunks or None

    # -- the dataset as stored, without decoding (``ckptfs diff``) ------------------------------------------------
    def stored_layout(self) -> StoredLayout | None:
        """The dataset's ``StoredLayout``, or None when it is not chunked (contiguous, compact, 0-d)."""
        from h5py import h5d

        d = self.dataset()
        try:
            dcpl = d.id.get_create_plist()
            if self.ndim == 0 or dcpl.get_layout() != h5d.CHUNKED:
                return None
            filters = tuple((int(code), tuple(int(v) for v in values))
                            for code, _flags, values, _name in (dcpl.get_filter(i) for i in range(dcpl.get_nfilters())))
            fill = np.zeros((1,), d.id.dtype)
            dcpl.get_fill_value(fill)
            return StoredLayout(tuple(d.shape), tuple(int(c) for c in dcpl.get_chunk()), filters, d.id.dtype.str,
                                fill.tobytes())
        except (OSError, RuntimeError, ValueError, TypeError) as e:
            raise self._fail(f"cannot read the dataset's storage layout: {e}") from e

    def stored_chunk(self, origin: tuple) -> tuple | None:
        """``(filter mask, file address, stored size)`` of the chunk starting at element ``origin``; None when it is
        not allocated (it reads as the fill value). One lookup in HDF5's chunk index, no data read."""
        d = self.dataset()
        try:
            info = d.id.get_chunk_info_by_coord(tuple(origin))
        except (OSError, RuntimeError, ValueError, TypeError, AttributeError) as e:
            raise self._fail(f"cannot look chunk {tuple(origin)} up: {e}") from e
        if info.byte_offset is None:
            return None
        return int(info.filter_mask), int(info.byte_offset), int(info.size)

    def stored_chunk_origins(self) -> np.ndarray:
        """The first elements of the allocated chunks, one row each, in C order of the chunk grid (no data read;
        the count is bounded by ``validate.chunking_problem``). Chunks not listed read as the fill value."""
        d = self.dataset()
        rows = array("q")
        try:
            d.id.chunk_iter(lambda info: rows.extend(info.chunk_offset) if info.byte_offset is not None else None)
        except (OSError, RuntimeError, ValueError, TypeError, AttributeError) as e:
            raise self._fail(f"cannot list the stored chunks: {e}") from e
        out = np.frombuffer(rows, np.int64).reshape(-1, max(1, self.ndim))
        return out[np.lexsort(out.T[::-1])] if len(out) > 1 else out

    def unwritten_fill(self) -> np.ndarray | None:
        """When nothing of the dataset is written (no chunk, no contiguous storage) and HDF5 gives its fill value
        for every element: that value, as a one-element storage array; else None. No data read."""
        from h5py import h5d

        d = self.dataset()
        try:
            if d.id.get_storage_size() != 0:
                return None
            dcpl = d.id.get_create_plist()
            if dcpl.get_fill_time() == h5d.FILL_TIME_NEVER or \
                    dcpl.fill_value_defined() == h5d.FILL_VALUE_UNDEFINED:
                return None
            fill = np.zeros((1,), d.id.dtype)
            dcpl.get_fill_value(fill)
        except (OSError, RuntimeError, ValueError, TypeError, AttributeError) as e:
            raise self._fail(f"cannot read the dataset's fill value: {e}") from e
        return _to_storage(fill, self.dtype.storage).reshape(1)

    def read_stored_chunk(self, origin: tuple) -> bytes:
        """The stored (still encoded) bytes of the allocated chunk starting at element ``origin``."""
        d = self.dataset()
        what = f"tensor {self.key}"
        try:
            _, data = d.id.read_direct_chunk(tuple(origin))
        except (OSError, RuntimeError, ValueError, TypeError, KeyError) as e:
            self.store.verify(what)
            raise self._fail(f"cannot read stored chunk {tuple(origin)}: {e}") from e
        self.store.verify(what)  # these bytes belong to the version of the file the tensor was planned from
        return bytes(data)

    def file_identity(self) -> FileIdentity | None:
        """The version of the file this dataset lives in (None before the file was first opened)."""
        self.store.file(f"tensor {self.key}")
        return self.store.identity

    def read(self, box: Box) -> np.ndarray:
        shape = box_shape(box)
        st = self.dtype.storage
        if self.ndim and math.prod(shape) == 0:
            return np.empty(shape, st)
        what = f"tensor {self.key}"
        d = self.dataset()
        try:
            if self.ndim == 0:
                arr = np.asarray(d[()])
            else:
                reader = self._chunk_reader(d)
                arr = reader.read(box) if reader is not None else None
                if arr is None:
                    arr = d[tuple(slice(a, b) for a, b in box)]
        except lz4chunks.CorruptChunkError as e:
            self.store.verify(what)  # a chunk "corrupted" by a rewrite of the file is reported as that
            raise self._fail(f"corrupt LZ4 chunk at {e.coords}") from e
        except (OSError, KeyError, ValueError, RuntimeError, TypeError) as e:
            self.store.verify(what)
            raise self._fail(e) from e
        self.store.verify(what)  # these bytes belong to the version of the file the tensor was planned from
        return _to_storage(np.asarray(arr), st).reshape(shape)


class StoredLayout:
    """How a chunked dataset is stored, from its header: two datasets with equal layouts store equal chunks as
    equal bytes (the same filters with the same parameters, chunk shape, stored type and fill value), so their
    chunks can be compared as stored, without decoding (``ckptfs diff``)."""

    __slots__ = ("shape", "chunks", "filters", "stored_type", "fill")

    def __init__(self, shape: tuple, chunks: tuple, filters: tuple, stored_type: str, fill: bytes):
        self.shape, self.chunks, self.filters, self.stored_type, self.fill = shape, chunks, filters, stored_type, fill

    def _key(self) -> tuple:
        return self.shape, self.chunks, self.filters, self.stored_type, self.fill

    def __eq__(self, other) -> bool:
        return isinstance(other, StoredLayout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def chunk_box(self, origin: tuple) -> Box:
        """The elements of the chunk starting at ``origin`` (edge chunks clipped to the shape)."""
        return tuple((o, min(o + c, n)) for o, c, n in zip(origin, self.chunks, self.shape))


