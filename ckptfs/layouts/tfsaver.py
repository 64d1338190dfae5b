"""A TensorFlow saver checkpoint generated from virtual tensors: ``<prefix>.index``, ``<prefix>.data-0000i-of-0000N``
and the ``checkpoint`` state file, the bytes TensorFlow writes for the same variables (``ckptfs.tfbundle`` has the
format).

Plan, from metadata only: the tensors in the given order (the tf view passes them sorted by name, the order in
which a TF1 ``tf.compat.v1.train.Saver`` adds them), optionally grouped into shards by name prefix
(``shard_by``: each group its own shards) and split by TF's ``MaxShardSizePolicy`` (``max_shard_size``: tensors
cut into slices as TF cuts them); each data shard is its records' C-order little-endian bytes end to end, no
padding. A data file is pieces (``ckptfs.layouts.pieces``): runs of whole tensors as one ``TensorRun``, a slice as a
``BoxBytes`` (its rows read from the tensor), so any byte range reads only the tensors it overlaps.

The index holds each record's masked CRC-32C, which needs the record's bytes: it is computed when the index is first
read (every record once, kept for the life of the layout, and persisted in the CRC store under the checkpoint's
identity when one is given, so a later mount of the same checkpoint reads none of them). Its size does not depend on
the CRCs (each is a fixed32 field, written even when 0), so ``stat`` is exact without reading a tensor.
"""
from __future__ import annotations

import hashlib
import math
import threading
from array import array
from dataclasses import dataclass
from typing import Sequence

from ckptfs.tensor.cache import BlockCache
from ckptfs.errors import CkptfsError, TensorReadError
from ckptfs.layouts.pieces import Computed, Literal, PiecedFile, TensorRun, packed
from ckptfs.tfbundle import (DT, BundleEntry, BundleHeader, checkpoint_state, crc32c, data_file_name, encode_index,
                             encode_slice_key, mask)
from ckptfs.tfbundle.sharding import max_shard_size_shards, prefix_groups
from ckptfs.layouts.file import VirtualFile
from ckptfs.tensor.base import VirtualTensor

__all__ = ["TFSaverLayout", "Record", "BoxBytes", "tf_dtype", "TF_DTYPES"]

#: ckptfs dtype name → TensorFlow DataType name, for the types a saver checkpoint of ckptfs's tensors can hold
TF_DTYPES = {"float32": "float32", "float16": "float16", "float64": "float64", "bfloat16": "bfloat16",
             "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64", "uint8": "uint8", "bool": "bool",
             "uint16": "uint16", "uint32": "uint32", "uint64": "uint64", "complex64": "complex64",
             "complex128": "complex128", "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}
#: bytes read at a time when computing a record's CRC
CRC_CHUNK = 8 << 20


def tf_dtype(tensor: VirtualTensor) -> int | None:
    """The TF ``DataType`` number of ``tensor``'s dtype, None when a saver checkpoint cannot hold it."""
    name = TF_DTYPES.get(tensor.dtype.name)
    return DT[name] if name is not None else None


class BoxBytes:
    """A piece: the C-order bytes of the box ``extents`` (``(start, length)`` per dimension) of ``tensor`` — a slice
    TF saves under its slice key. Read as runs of contiguous tensor bytes (one per row of the outer dimensions)."""

    __slots__ = ("tensor", "name", "extents", "size", "_seg", "_outer", "_strides", "_base")

    def __init__(self, tensor: VirtualTensor, extents, name: str):
        shape, item = tensor.shape, tensor.dtype.itemsize
        self.tensor, self.name, self.extents = tensor, name, tuple(extents)
        rank = len(shape)
        k = rank  # dimensions k.. are whole: one contiguous run spans dimension k-1's range and all after it
        while k > 0 and tuple(self.extents[k - 1]) == (0, shape[k - 1]):
            k -= 1
        strides = [math.prod(shape[i + 1:]) * item for i in range(rank)]
        self._strides = strides
        self._base = sum(s * st for (s, _), st in zip(self.extents, strides))
        if k == 0:
            self._seg, self._outer = tensor.nbytes, ()
        else:
            self._seg = self.extents[k - 1][1] * strides[k - 1]
            self._outer = tuple(length for _, length in self.extents[:k - 1])
        self.size = math.prod(length for _, length in self.extents) * item

    @property
    def what(self) -> str:
        return f"slice {list(self.extents)} of tensor {self.name}"

    def _tensor_offset(self, j: int) -> int:
        off, st = self._base, self._strides
        for i in range(len(self._outer) - 1, -1, -1):
            j, r = divmod(j, self._outer[i])
            off += r * st[i]
        return off

    def fill(self, out: memoryview, a: int, cache) -> int:
        pos, n, seg = 0, len(out), self._seg
        while pos < n:
            j, within = divmod(a + pos, seg)
            k = min(seg - within, n - pos)
            got = self.tensor.read_into(self._tensor_offset(j) + within, out[pos:pos + k], cache)
            pos += got
            if got != k:
                break
        return pos

    def explain(self, a: int) -> list:
        j, within = divmod(a, self._seg)
        return [f"{self.what}: byte {self._tensor_offset(j) + within} of the tensor ({self.tensor.describe()})"]


@dataclass(frozen=True)
class Record:
    """One entry with bytes: a whole tensor (``extents`` None) or one of its slices, at ``offset`` of data shard
    ``shard``."""

    name: str
    tensor: VirtualTensor
    extents: tuple | None
    shard: int
    offset: int
    size: int

    @property
    def key(self) -> bytes:
        if self.extents is None:
            return self.name.encode("utf-8")
        return encode_slice_key(self.name, self.extents)

    @property
    def dims(self) -> tuple:
        return tuple(self.tensor.shape) if self.extents is None else tuple(n for _, n in self.extents)


class _File(PiecedFile):
    __slots__ = ()


class TFSaverLayout:
    """The files of one saver checkpoint ``<prefix>.*`` of ``tensors`` (``(name, tensor)`` in save order):
    ``files()`` → ``{file name: VirtualFile}``. ``prefix`` is also what the ``checkpoint`` file names."""

    def __init__(self, tensors: Sequence[tuple[str, VirtualTensor]], prefix: str, *,
                 max_shard_size: int | None = None, shard_by: int | None = None, cache: BlockCache | None = None,
                 crc_store=None, identity: str | None = None):
        tensors = list(tensors)
        names = [n for n, _ in tensors]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise CkptfsError(prefix, f"tensor name {dup!r} appears twice")
        for name, t in tensors:
            if name == "":
                raise CkptfsError(prefix, "a tensor cannot be named \"\" in a saver checkpoint (the header's key)")
            if tf_dtype(t) is None:
                raise CkptfsError(prefix, f"tensor {name}: dtype {t.dtype.name} cannot be stored in a saver checkpoint")
        self.prefix = prefix
        self.cache = cache
        self.crc_store = crc_store
        self.identity = identity
        by_name = dict(tensors)
        groups = prefix_groups(names, shard_by) if shard_by else [names]
        planned: list = []  # shards: [(name, extents)]
        for group in groups:
            if max_shard_size:
                planned.extend(max_shard_size_shards(
                    [(n, by_name[n].shape, by_name[n].dtype.itemsize) for n in group], max_shard_size))
            elif group:
                planned.append([(n, None) for n in group])
        if not planned:
            planned = [[]]
        self.num_shards = len(planned)
        self.records: list[Record] = []
        self.shard_records: list[list[Record]] = []
        for shard, items in enumerate(planned):
            pos, recs = 0, []
            for name, extents in items:
                t = by_name[name]
                size = t.nbytes if extents is None else math.prod(n for _, n in extents) * t.dtype.itemsize
                recs.append(Record(name, t, None if extents is None else tuple(extents), shard, pos, size))
                pos += size
            self.shard_records.append(recs)
            self.records.extend(recs)
        self._crcs: list | None = None
        self._index = None  # the index's bytes once made (packed when large)
        self._lock = threading.Lock()
        self._index_size = len(self._index_bytes([0] * len(self.records)))

    # -- the index ------------------------------------------------------------------------------------------------

    def _index_bytes(self, crcs: Sequence[int]) -> bytes:
        entries, sliced = [], {}
        for rec, crc in zip(self.records, crcs):
            dtype = tf_dtype(rec.tensor)
            entries.append((rec.key, BundleEntry(dtype, rec.dims, rec.shard, rec.offset, rec.size, crc)))
            if rec.extents is not None:
                first, slices = sliced.setdefault(rec.name, (rec.shard, []))
                slices.append(rec.extents)
        for name, (shard, slices) in sliced.items():
            t = self.records[0].tensor
            t = next(r.tensor for r in self.records if r.name == name)
            entries.append((name.encode("utf-8"), BundleEntry(tf_dtype(t), tuple(t.shape), shard, 0, 0, 0,
                                                              tuple(slices))))
        return encode_index(BundleHeader(num_shards=self.num_shards), entries)

    def _signature(self) -> str:
        h = hashlib.sha256()
        for r in self.records:
            h.update(repr((r.key, r.tensor.dtype.name, tuple(r.tensor.shape), r.size)).encode("utf-8", "surrogatepass"))
        return f"tf-bundle-crc32c:{h.hexdigest()}"

    def _record_pieces(self, rec: Record) -> list:
        if rec.extents is None:
            return [TensorRun([rec.name], [rec.tensor], array("q", [0, rec.size]), "tensor", self.prefix)]
        return [BoxBytes(rec.tensor, rec.extents, rec.name)]

    def _record_crc(self, rec: Record) -> int:
        crc = 0
        buf = bytearray(min(CRC_CHUNK, rec.size))
        for piece in self._record_pieces(rec):
            for a in range(0, piece.size, CRC_CHUNK):
                n = min(CRC_CHUNK, piece.size - a)
                view = memoryview(buf)[:n]
                got = piece.fill(view, a, self.cache)
                if got != n:
                    raise TensorReadError(rec.name, f"produced {got} bytes of {n} at {a} while computing its CRC")
                crc = crc32c(view, crc)
        return mask(crc)

    def crcs(self) -> list:
        """Every record's masked CRC-32C (computed once; persisted when a CRC store and an identity are given)."""
        if self._crcs is not None:
            return self._crcs
        with self._lock:
            if self._crcs is None:
                store, key, known = self.crc_store, None, {}
                if store is not None and self.identity:
                    key = store.key(self.identity, self._signature())
                    known = store.load(key)
                ids = [r.key.hex() for r in self.records]
                out = [known[i] if i in known else self._record_crc(r) for i, r in zip(ids, self.records)]
                if key is not None and len(known) != len(ids):
                    store.save(key, dict(zip(ids, out)))
                self._crcs = out
        return self._crcs

    def _index_part(self, a: int, b: int) -> bytes:
        data = self._index
        if data is None:
            crcs = self.crcs()
            with self._lock:
                if self._index is None:
                    made = self._index_bytes(crcs)
                    if len(made) != self._index_size:  # pragma: no cover - the size never depends on the CRCs
                        raise TensorReadError(self.index_name, f"index came out {len(made)} bytes, "
                                                               f"{self._index_size} announced")
                    self._index = packed(made)
                data = self._index
        return data[a:b]

    # -- the files ------------------------------------------------------------------------------------------------

    @property
    def index_name(self) -> str:
        return f"{self.prefix}.index"

    def data_names(self) -> list[str]:
        return [data_file_name(self.prefix, i, self.num_shards) for i in range(self.num_shards)]

    def _data_file(self, shard: int) -> PiecedFile:
        pieces, run = [], []

        def close_run():
            if run:
                offsets = array("q", [0])
                for r in run:
                    offsets.append(offsets[-1] + r.size)
                pieces.append(TensorRun([r.name for r in run], [r.tensor for r in run], offsets,
                                        "tensors end to end", self.data_names()[shard]))
                run.clear()

        for rec in self.shard_records[shard]:
            if rec.extents is None:
                run.append(rec)
            else:
                close_run()
                pieces.append(BoxBytes(rec.tensor, rec.extents, rec.name))
        close_run()
        return _File(pieces, name=self.data_names()[shard], cache=self.cache)

    def files(self) -> dict[str, VirtualFile]:
        """``{"<prefix>.index": ..., "<prefix>.data-00000-of-0000N": ..., "checkpoint": ...}``."""
        out: dict = {self.index_name: _File([Computed(self._index_size, self._index_part, "bundle index (CRCs "
                                                      "computed from the tensors when first read)")],
                                             name=self.index_name, cache=self.cache)}
        for i, name in enumerate(self.data_names()):
            out[name] = self._data_file(i)
        state = checkpoint_state(self.prefix)
        out["checkpoint"] = _File([Literal(state, "the checkpoint state file")], name="checkpoint", cache=self.cache)
        return out
