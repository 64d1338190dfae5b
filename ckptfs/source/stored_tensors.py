"""The source tensors of a checkpoint: VirtualTensors whose ``read(box)`` reads only that box.

* ``H5DatasetTensor``: a dataset of the checkpoint (or of an external .mdl); only the chunks under the
  box are decompressed. LZ4-only chunked datasets (every Cerebras tensor) are decoded by
  ``lz4chunks.LZ4ChunkReader`` (chunks in parallel, outside HDF5's serial filter pipeline); anything
  else is an h5py hyperslab selection of exactly the box. Its cache blocks are aligned to chunk rows.
  Its chunks can also be looked at as stored (``stored_layout``, ``stored_chunk``, ``read_stored_chunk``):
  ``ckptfs diff`` tells equal chunks apart without decoding them.
* ``FullTensor``: a constant-fill tensor (DeferredFullTensor) with no data on disk.
* ``FileRegionTensor``: raw little-endian C-order elements at an offset of a plain file
  (a .safetensors data block, a legacy DeferredFileTensor file), read run by run.

Any failure while reading becomes ``TensorReadError(checkpoint path, "tensor <key>: <problem>")``.
"""
from __future__ import annotations

import itertools
import math
import os
import threading
from array import array
from pathlib import Path

import numpy as np

from ..dtypes import BFLOAT16, DType
from ..errors import SourceChangedError, TensorReadError
from ..storage.local import FileIdentity
from ..virtual_tensor import Box, VirtualTensor, box_shape, shared_shape
from . import lz4chunks
from .confine import Confinement, RefusedReference, open_regular
from .h5safe import H5Refused, open_dataset
from .h5store import H5Store, one_line
from .validate import dataset_problem


_open_lock = threading.Lock()


def _shape_str(shape) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


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
        return d, (lz4chunks.plan(d) if self.ndim else None)

    def _chunk_reader(self, d):
        """The LZ4 chunk reader for dataset object ``d`` (None: plain h5py reads): the one planned when the dataset
        was opened, or a new plan for another object (a dataset closed and opened again meanwhile, a test's spy)."""
        o = self._open
        if o is not None and o[0] is d:
            return o[1]
        return lz4chunks.plan(d) if self.ndim else None

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

    def chunk_origins(self):
        """The first element of every chunk of the grid, in C order of the grid."""
        return itertools.product(*(range(0, n, c) for n, c in zip(self.shape, self.chunks)))

    def chunk_box(self, origin: tuple) -> Box:
        """The elements of the chunk starting at ``origin`` (edge chunks clipped to the shape)."""
        return tuple((o, min(o + c, n)) for o, c, n in zip(origin, self.chunks, self.shape))


def _to_storage(arr: np.ndarray, st: np.dtype) -> np.ndarray:
    """Reinterpret/convert an array read from disk to the DType's storage (bf16 int16 bits -> '<u2').

    C-contiguous, but may come back 1-d for a 0-d input: callers reshape to the box.
    """
    if arr.dtype == st:
        return np.ascontiguousarray(arr)
    if arr.dtype.kind in "iu" and st.kind in "iu" and arr.dtype.itemsize == st.itemsize:
        le = arr.dtype.newbyteorder("<")
        return np.ascontiguousarray(arr, dtype=le).view(st)  # same bits, other integer type
    return np.ascontiguousarray(arr.astype(st))


def float_to_bf16_bits(value: float) -> int:
    """Round a float to bfloat16 (nearest-even, as torch does) and return its 16-bit pattern."""
    u = int(np.array(value, dtype=np.float32).view(np.uint32))
    if (u & 0x7F800000) == 0x7F800000 and (u & 0x007FFFFF):
        return 0x7FC0 | ((u >> 16) & 0x8000)  # NaN
    u += 0x7FFF + ((u >> 16) & 1)
    return (u >> 16) & 0xFFFF


def fill_element(value, dtype: DType):
    """The storage element for a constant fill ``value`` (None -> zero)."""
    if value is None:
        value = 0
    if dtype is BFLOAT16 or dtype.name == "bfloat16":
        return np.uint16(float_to_bf16_bits(float(value)))
    if dtype.name == "bool":
        return np.bool_(bool(value))
    if not dtype.npy_native:
        raise ValueError(f"constant fill of {dtype.name} is not supported")
    return np.array(value).astype(dtype.storage)[()]


class FullTensor(VirtualTensor):
    """A tensor whose every element is ``fill`` (DeferredFullTensor; ``fill=None`` means zeros)."""

    __slots__ = ("fill", "_elem")

    def __init__(self, shape, dtype: DType, fill):
        super().__init__(shape, dtype)
        self.fill = fill
        self._elem = fill_element(fill, dtype)

    def describe(self) -> str:
        v = "uninitialised (zeros)" if self.fill is None else repr(self.fill)
        return f"constant {v} {_shape_str(self.shape)} {self.dtype.name}"

    def read(self, box: Box) -> np.ndarray:
        return np.full(box_shape(box), self._elem, dtype=self.dtype.storage)


def box_runs(shape, box) -> list[tuple[int, int]]:
    """The box as C-order ``(first element, element count)`` runs of consecutive elements.

    Trailing dimensions the box covers completely are merged, so a row range is one run.
    """
    shape = tuple(int(n) for n in shape)
    box = tuple((int(a), int(b)) for a, b in box)
    if not shape:
        return [(0, 1)]
    k = len(shape) - 1  # the box covers dims k+1.. fully
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1
    inner = math.prod(shape[k + 1:])
    run = (box[k][1] - box[k][0]) * inner
    if run == 0 or any(b <= a for a, b in box[:k]):
        return []
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    runs = []
    for idx in itertools.product(*(range(a, b) for a, b in box[:k])):
        start = sum(i * s for i, s in zip(idx, strides)) + box[k][0] * strides[k]
        runs.append((start, run))
    return runs


class FileRegionTensor(VirtualTensor):
    """Raw little-endian C-order elements of a plain file starting at ``offset``.

    ``path`` is where a confined reference led (``confine``); every read re-checks it against ``confinement``,
    opens it as a regular file only, and compares the file with ``identity`` (its version when the catalog was
    built; None when it did not exist then) before and after reading, so bytes never mix two versions."""

    __slots__ = ("path", "offset", "key", "checkpoint_path", "referenced_as", "what", "identity", "confinement")

    def __init__(self, path: Path, offset: int, shape, dtype: DType, key: str, checkpoint_path: Path,
                 referenced_as: str | None = None, what: str = "file", *, identity: FileIdentity | None = None,
                 confinement: Confinement | None = None):
        super().__init__(shape, dtype)
        self.path = path if isinstance(path, Path) else Path(path)  # shared, not copied: a model's tensors
        self.offset = int(offset)  # share a few paths
        self.key = key
        self.checkpoint_path = checkpoint_path if isinstance(checkpoint_path, Path) else Path(checkpoint_path)
        self.referenced_as = referenced_as
        self.what = what
        self.identity = identity
        self.confinement = confinement

    def describe(self) -> str:
        return f"{self.what} {self.path.name} @{self.offset} {_shape_str(self.shape)} {self.dtype.name}"

    def _fail(self, problem) -> TensorReadError:
        return TensorReadError(self.checkpoint_path, f"tensor {self.key}: {one_line(problem)}")

    def _missing(self) -> TensorReadError:
        ref = f" (referenced as {self.referenced_as!r})" if self.referenced_as else ""
        return self._fail(f"external {self.what} {self.path} not found{ref}")

    def _changed(self, now: FileIdentity | None) -> None:
        """``SourceChangedError`` when the file is not the version the catalog saw (the first version seen is kept
        when the catalog saw none)."""
        if self.identity is None:
            self.identity = now
            return
        why = "removed" if now is None else self.identity.difference(now)
        if why:
            raise SourceChangedError(self.checkpoint_path, f"tensor {self.key}: external {self.what} {self.path} "
                                                           f"changed since it was opened ({why}); remount to serve "
                                                           "the new version")

    def open(self) -> int:
        """A descriptor on the file, confined, regular and of the expected version."""
        if not self.path.exists():
            raise self._missing()
        try:
            if self.confinement is not None:
                self.confinement.recheck(self.path)
            fd = open_regular(self.path)
        except RefusedReference as e:
            raise self._fail(f"external reference refused: {e.problem}") from None
        except FileNotFoundError:
            raise self._missing() from None
        except OSError as e:
            raise self._fail(e) from e
        try:
            self._changed(FileIdentity.of_stat(os.fstat(fd)))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def data_offset(self) -> int:
        """Absolute offset of the first element in the file."""
        return self.offset

    def read(self, box: Box) -> np.ndarray:
        shape = box_shape(box)
        st = self.dtype.storage
        runs = box_runs(self.shape, box)
        item = st.itemsize
        out = np.empty(math.prod(shape), dtype=st)
        if not runs:
            return out.reshape(shape)
        base = self.data_offset()
        buf = memoryview(out.view(np.uint8))
        pos = 0
        fd = self.open()
        try:
            for start, n in runs:
                nb = n * item
                at = base + start * item
                while nb:  # every pass makes progress or fails
                    got = os.preadv(fd, [buf[pos:pos + nb]], at)
                    if got <= 0:
                        raise self._fail(f"external {self.what} {self.path.name} is truncated")
                    pos, nb, at = pos + got, nb - got, at + got
            self._changed(FileIdentity.of_stat(os.fstat(fd)))
        except OSError as e:
            raise self._fail(e) from e
        finally:
            os.close(fd)
        return out.reshape(shape)


class SafetensorsTensor(FileRegionTensor):
    """Tensor ``name`` of an external .safetensors file (DeferredSafeTensor). ``offset`` is where its data starts
    when the catalog read that from the header of the version ``identity`` names (every read checks the file is
    still that version); otherwise (-1) the header is read on first use and checked against the shape and dtype
    the catalog announced."""

    __slots__ = ("name",)

    def __init__(self, path: Path, name: str, shape, dtype: DType, key: str, checkpoint_path: Path,
                 referenced_as: str | None = None, *, identity: FileIdentity | None = None,
                 confinement: Confinement | None = None, offset: int = -1):
        super().__init__(path, offset, shape, dtype, key, checkpoint_path, referenced_as, what="safetensors file",
                         identity=identity, confinement=confinement)
        self.name = name

    def describe(self) -> str:
        return f"safetensors {self.path.name}:{self.name} {_shape_str(self.shape)} {self.dtype.name}"

    def data_offset(self) -> int:
        if self.offset >= 0:
            return self.offset
        from .safetensors_ref import read_safetensors_header

        os.close(self.open())  # confined, regular, the expected version
        try:
            entry = read_safetensors_header(self.path).get(self.name)
        except RefusedReference as e:
            raise self._fail(f"external reference refused: {e.problem}") from None
        except (OSError, ValueError) as e:
            raise self._fail(f"safetensors file {self.path.name}: {e}") from e
        if entry is None:
            raise self._fail(f"safetensors file {self.path.name} has no tensor {self.name!r}")
        if entry.shape != self.shape or entry.dtype != self.dtype:
            raise self._fail(f"safetensors tensor {self.name!r} is {_shape_str(entry.shape)} {entry.dtype.name}, "
                             f"expected {_shape_str(self.shape)} {self.dtype.name}")
        self.offset = entry.offset
        return self.offset
