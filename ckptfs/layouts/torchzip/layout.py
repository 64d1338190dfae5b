"""The torch.save zip archive (torch 2.13 byte layout) of a nested object with virtual-tensor leaves.

``TorchZipLayout(obj, archive_name)`` knows its exact ``size`` and every offset from metadata alone
(data.pkl, record names and sizes) and plans the file as pieces (``ckptfs.layouts.pieces``): per record its
local header, its payload or tensor bytes, its data descriptor; then the central directory and the tail. A read
touches only the tensor byte ranges that overlap it. The output equals ``torch.save(obj)`` byte for byte
(each leaf becoming a distinct tensor over one storage per distinct ``VirtualTensor``), except the
40 digits of ``.data/serialization_id`` (and, with CRCs, that record's CRC); torch's own writer is the reference
(``tests/layouts/test_layout_torchzip.py`` compares byte for byte).

CRCs: ``crc="zero"`` is torch's ``compute_crc32=False`` layout. ``crc="exact"`` writes real CRC-32
values: a tensor record's CRC is accumulated while its bytes are read in order (a sequential copy
hashes nothing twice); a read that needs a CRC not yet known (a data descriptor, or the central
directory, which torch reads first) streams the missing part of those records once, in bounded
blocks. Known CRCs are kept in ``crc_store`` under ``identity`` so that other mounts reuse them.
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import struct
import threading
from array import array
from dataclasses import dataclass

from ...tensor.cache import BlockCache
from ...errors import CkptfsError, TensorReadError
from ...tensor.base import VirtualTensor
from .crc_store import CrcStore, crc32
from .pickle_writer import Global, PersistentId, PickleTypeError, Reduce, dumps2
from ..pieces import Computed, Literal, PiecedFile, TensorBytes, packed

__all__ = ["TorchZipLayout", "ZipEntry", "build_data_pkl", "contiguous_strides"]

ALIGN = 64
U32 = 0xFFFFFFFF
_LOCAL_SIG, _CD_SIG, _DESC_SIG = 0x04034B50, 0x02014B50, 0x08074B50
_EOCD64_SIG, _LOC64_SIG, _EOCD_SIG = 0x06064B50, 0x07064B50, 0x06054B50
_TAIL = 56 + 20 + 22
_SAVE_EVERY = 256 << 20  # persist running CRCs after this many newly hashed bytes

# strings torch's persistent_id uses (interned, like torch's literals, so identities match)
_STORAGE = "storage"
_CPU = "cpu"
_OD = Global("collections", "OrderedDict")
_V2 = Global("torch._utils", "_rebuild_tensor_v2")
_V3 = Global("torch._utils", "_rebuild_tensor_v3")
_UNTYPED = Global("torch.storage", "UntypedStorage")


def contiguous_strides(shape) -> tuple:
    """torch's strides of a contiguous tensor (empty dims count as 1)."""
    strides = []
    acc = 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(strides))


@functools.lru_cache(maxsize=None)
def _torch_global(name: str) -> Global:
    """``torch.<name>`` (a storage class or dtype), one object per name."""
    return Global("torch", name)


def build_data_pkl(obj) -> tuple[bytes, list[VirtualTensor]]:
    """torch's data.pkl for ``obj`` and its storages in key order (``data/0``, ``data/1``, …).

    Every appearance of a ``VirtualTensor`` is a distinct tensor; one storage per distinct object.
    """
    keys: dict[int, str] = {}
    storages: list[VirtualTensor] = []

    def reducer(x):
        if not isinstance(x, VirtualTensor):
            return None
        key = keys.get(id(x))
        if key is None:
            key = keys[id(x)] = str(len(storages))
            storages.append(x)
        dt = x.dtype
        if dt.torch_storage is not None:
            func, stype, numel, extra = _V2, _torch_global(dt.torch_storage), x.numel, ()
        else:
            func, stype, numel, extra = _V3, _UNTYPED, x.nbytes, (_torch_global(dt.name),)
        pid = PersistentId((_STORAGE, stype, key, _CPU, numel))
        size = tuple([int(n) for n in x.shape])  # fresh tuples, as tuple(tensor.size())
        stride = tuple(list(contiguous_strides(x.shape)))
        return Reduce(func, (pid, 0, size, stride, False, Reduce(_OD, ())) + extra)

    return dumps2(obj, reducer), storages


def _storage_labels(obj) -> dict:
    """For a flat state dict: ``{id(tensor): its first key}`` (how ``ckptfs explain`` names a storage)."""
    if not isinstance(obj, dict):
        return {}
    labels: dict = {}
    for k, v in obj.items():
        if isinstance(v, VirtualTensor):
            labels.setdefault(id(v), str(k))
    return labels


@dataclass(frozen=True)
class ZipEntry:
    """One zip record: full name, local header offset, data offset and size."""

    name: str
    header_offset: int
    data_offset: int
    size: int


class _Record:
    """One record's placement — full name, local header offset, size — made on demand from the layout's arrays
    (never kept), and the bytes derived from it: local header, data descriptor, central directory entry."""

    __slots__ = ("name", "header_offset", "size")

    def __init__(self, name: bytes, header_offset: int, size: int):
        self.name = name
        self.header_offset = header_offset
        self.size = size

    @property
    def data_offset(self) -> int:
        start = self.header_offset + 30 + len(self.name) + self.zip64_len + 4
        return start + (-start) % ALIGN

    @property
    def zip64(self) -> bool:
        return self.size >= U32 or self.header_offset >= U32

    @property
    def zip64_len(self) -> int:
        if not self.zip64:
            return 0
        return 4 + 16 * (self.size >= U32) + 8 * (self.header_offset >= U32)

    @property
    def data_end(self) -> int:
        return self.data_offset + self.size

    @property
    def end(self) -> int:
        return self.data_end + ((24 if self.zip64 else 16) if self.size else 0)

    def local_header(self) -> bytes:
        extra = b""
        if self.zip64:
            body = (struct.pack("<QQ", self.size, 0) if self.size >= U32 else b"") + \
                   (struct.pack("<Q", self.header_offset) if self.header_offset >= U32 else b"")
            extra = struct.pack("<HH", 1, len(body)) + body
        pad = self.data_offset - (self.header_offset + 30 + len(self.name) + len(extra) + 4)
        extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        flags = 0x0808 if self.size else 0x0800
        return struct.pack("<IHHHHHIIIHH", _LOCAL_SIG, 0, flags, 0, 0, 0, 0, 0, 0,
                           len(self.name), len(extra)) + self.name + extra

    def descriptor(self, crc: int) -> bytes:
        if not self.size:
            return b""
        if self.zip64:
            return struct.pack("<IIQQ", _DESC_SIG, crc, self.size, self.size)
        return struct.pack("<IIII", _DESC_SIG, crc, self.size, self.size)

    def cd_len(self) -> int:
        big, far = self.size >= U32, self.header_offset >= U32
        return 46 + len(self.name) + ((4 + 16 * big + 8 * far) if (big or far) else 0)

    def cd_entry(self, crc: int) -> bytes:
        big, far = self.size >= U32, self.header_offset >= U32
        extra = b""
        if big or far:
            body = (struct.pack("<QQ", self.size, self.size) if big else b"") + \
                   (struct.pack("<Q", self.header_offset) if far else b"")
            extra = struct.pack("<HH", 1, len(body)) + body
        flags = 0x0808 if self.size else 0x0800
        return struct.pack("<IHHHHHHIIIHHHHHII", _CD_SIG, 0, 0, flags, 0, 0, 0, crc,
                           min(self.size, U32), min(self.size, U32), len(self.name), len(extra), 0, 0, 0, 0,
                           min(self.header_offset, U32)) + self.name + extra


class _Records:
    """Every record of the archive — each one's local header, data and data descriptor — as one piece that finds
    its records by bisecting their offsets: no object per record. The data of a tensor record is folded into the
    record's CRC as it is read."""

    __slots__ = ("zf",)

    def __init__(self, zf: "TorchZipLayout"):
        self.zf = zf

    @property
    def size(self) -> int:
        return self.zf.cd_offset

    @property
    def what(self) -> str:
        return f"zip records of {self.zf.archive_name}"

    def _at(self, a: int) -> int:
        return bisect.bisect_right(self.zf._starts, a) - 1

    @staticmethod
    def _parts(rec: _Record) -> tuple:
        """``(first, stop)`` of the header, the data and the descriptor, relative to the record's header."""
        h, d = rec.header_offset, rec.data_offset
        return (0, d - h), (d - h, d - h + rec.size), (d - h + rec.size, rec.end - h)

    def fill(self, out: memoryview, a: int, cache) -> int:
        zf, n, pos = self.zf, len(out), 0
        i = self._at(a)
        while pos < n:
            rec = zf._record(i)
            k = min(zf._starts[i + 1], a + n) - (a + pos)
            got = self._fill_record(i, rec, out[pos:pos + k], a + pos - rec.header_offset, cache)
            if got != k:
                raise TensorReadError(zf.archive_name, f"zip record {rec.name.decode()} produced {got} bytes for "
                                                       f"{k} at offset {a + pos - rec.header_offset}")
            pos += k
            i += 1
        return pos

    def _fill_record(self, i: int, rec: _Record, out: memoryview, a: int, cache) -> int:
        zf, n, pos = self.zf, len(out), 0
        tensor = zf._tensor(i)
        for part, (lo, hi) in enumerate(self._parts(rec)):
            if pos >= n:
                break
            if a + pos >= hi:
                continue
            s, k = a + pos - lo, min(hi, a + n) - (a + pos)
            dst = out[pos:pos + k]
            if part == 1 and tensor is not None:
                got = tensor.read_into(s, dst, cache)
                if got:
                    zf._fold(i, s, dst[:got])
            else:
                src = rec.local_header() if part == 0 else zf._payload(i) if part == 1 else zf._descriptor(i, rec)
                chunk = src[s:s + k]
                got = len(chunk)
                dst[:got] = chunk
            if got != k:
                return pos + got
            pos += k
        return pos

    def prefetch(self, a: int, b: int, cache, done=None) -> bool:
        zf = self.zf
        i = self._at(a)
        while i < zf._count and zf._starts[i] < b:
            tensor = zf._tensor(i)
            if tensor is not None:
                rec = zf._record(i)
                lo, hi = rec.data_offset, rec.data_end
                if a < hi and b > lo and not tensor.prefetch(max(a, lo) - lo, min(b, hi) - lo, cache, done):
                    return False
            i += 1
        return True

    def explain(self, a: int) -> list:
        zf = self.zf
        i = self._at(a)
        rec = zf._record(i)
        name = rec.name.decode()
        a -= rec.header_offset
        (_, h_end), (d_lo, d_hi), (_, e_hi) = self._parts(rec)
        if a < h_end:
            return [f"zip local header of {name}: {h_end} bytes made when read"]
        if a >= d_hi:
            return [f"zip data descriptor of {name} (its CRC-32): {e_hi - d_hi} bytes computed when read"]
        tensor = zf._tensor(i)
        if tensor is None:
            return [f"zip record {name}: {rec.size} bytes known when the file was planned"]
        label = zf._labels[i - _HEAD] if zf._labels is not None else None
        return TensorBytes(tensor, name + (f" ({label})" if label else "")).explain(a - d_lo)


#: records before the storages (data.pkl, .format_version, .storage_alignment, byteorder) and after them
_HEAD, _TAIL_RECORDS = 4, 2


class TorchZipLayout(PiecedFile):
    """``torch.save(obj)`` as a lazily generated file: ``size`` and ``read(offset, n)``.

    Kept per storage (an archive of 100,000 tensors has 100,000): its tensor and, for a flat state dict, its key
    (list slots) and, in arrays indexed by record, its local header offset, central directory offset and CRC (-1
    while unknown) — ~40 bytes. A record's name, size, data offset, headers and directory entry are computed when
    read. The six other records keep their payload; data.pkl is kept packed when large (``pieces.packed``). A CRC
    being folded in keeps its progress in ``_partial`` until it is complete."""

    __slots__ = ("archive_name", "crc_mode", "_lock", "_hash_lock", "storages", "signature", "_prefix", "_fixed",
                 "_labels", "_count", "_starts", "_crcs", "_partial", "_cd_starts", "cd_offset", "cd_size",
                 "tail_offset", "_tail", "_unknown", "_store", "_store_key", "_unsaved")

    def __init__(self, obj, archive_name: str, *, crc: str = "exact", crc_store: CrcStore | None = None,
                 identity: str | None = None, cache: BlockCache | None = None):
        if crc not in ("exact", "zero"):
            raise CkptfsError(archive_name, f"unknown zip CRC mode {crc!r} (expected 'exact' or 'zero')")
        self.archive_name = archive_name
        self.crc_mode = crc
        self._lock = threading.Lock()  # CRC state
        self._hash_lock = threading.Lock()  # one on-demand hashing pass at a time
        try:
            pkl, storages = build_data_pkl(obj)
        except PickleTypeError as e:
            raise CkptfsError(archive_name, f"cannot write to a torch file: {e}") from None
        except RecursionError:
            raise CkptfsError(archive_name, "object nesting too deep to write to a torch file") from None
        self.storages = storages
        self.signature = self._signature(pkl, storages)
        labels = _storage_labels(obj)
        # the state-dict key of each storage (explain), when the object is a flat state dict
        self._labels = [labels.get(id(t)) for t in storages] if labels else None

        self._prefix = (archive_name + "/").encode("utf-8")
        sid = b"%040d" % (int.from_bytes(hashlib.sha256(self.signature.encode()).digest(), "big") % 10**40)
        n = len(storages)
        self._count = count = _HEAD + n + _TAIL_RECORDS
        # record index -> (name after the prefix, payload) for the records that are not storages
        self._fixed = dict(zip([0, 1, 2, 3, count - 2, count - 1], [
            (b"data.pkl", pkl), (b".format_version", b"1"), (b".storage_alignment", b"64"), (b"byteorder", b"little"),
            (b"version", b"3\n"), (b".data/serialization_id", sid)]))
        crcs = {i: 0 if crc == "zero" else crc32(payload) for i, (_, payload) in self._fixed.items()}
        self._fixed[0] = (b"data.pkl", packed(pkl))

        self._starts = array("q")  # each record's local header offset, then the central directory's
        self._crcs = array("q", [-1]) * count  # -1: not known yet
        self._partial: dict[int, tuple[int, int]] = {}  # record -> (bytes hashed, running CRC) while hashing
        pos = 0
        for i in range(count):
            size = self._size(i)
            self._starts.append(pos)
            if i in crcs:
                self._crcs[i] = crcs[i]
            elif crc == "zero" or size == 0:
                self._crcs[i] = 0
            pos = _Record(self._name(i), pos, size).end
        self.cd_offset = pos
        self._starts.append(pos)
        self._cd_starts = array("q")  # each record's central directory entry, relative to the central directory
        for i in range(count):
            self._cd_starts.append(pos - self.cd_offset)
            pos += self._record(i).cd_len()
        self.cd_size = pos - self.cd_offset
        self.tail_offset = pos
        self._tail = self._build_tail()

        self._unknown = self._crcs.count(-1)  # CRCs still to compute
        self._store = crc_store if crc == "exact" and identity is not None else None
        self._store_key = CrcStore.key(identity, self.signature) if self._store is not None else None
        self._unsaved = 0
        if self._store is not None and self._unknown:
            self._load_store()
        super().__init__([_Records(self), Computed(self.cd_size, self._central_directory,
                                                   "zip central directory (CRC-32s)"),
                          Literal(self._tail, "zip64 end records")], name=archive_name, cache=cache)

    # -- records -----------------------------------------------------------------------------------
    def _tensor(self, i: int) -> VirtualTensor | None:
        """The tensor of record ``i`` (None for the records with a payload)."""
        k = i - _HEAD
        return self.storages[k] if 0 <= k < len(self.storages) else None

    def _size(self, i: int) -> int:
        tensor = self._tensor(i)
        return tensor.nbytes if tensor is not None else len(self._fixed[i][1])

    def _payload(self, i: int):
        return self._fixed[i][1]

    def _name(self, i: int) -> bytes:
        k = i - _HEAD
        if 0 <= k < len(self.storages):
            return self._prefix + b"data/%d" % k
        return self._prefix + self._fixed[i][0]

    def _record(self, i: int) -> _Record:
        return _Record(self._name(i), self._starts[i], self._size(i))

    @property
    def entries(self) -> list[ZipEntry]:
        """The records in file order."""
        return [ZipEntry(r.name.decode("utf-8"), r.header_offset, r.data_offset, r.size)
                for r in map(self._record, range(self._count))]

    def _signature(self, pkl: bytes, storages: list[VirtualTensor]) -> str:
        h = hashlib.sha256()
        h.update(b"ckptfs-torchzip-1\0" + self.archive_name.encode("utf-8", "surrogatepass") + b"\0")
        h.update(hashlib.sha256(pkl).digest())  # names, dtypes, shapes, structure
        for t in storages:
            h.update(f"{t.dtype.name}{list(t.shape)}{t.describe()}\0".encode("utf-8", "surrogatepass"))
        return h.hexdigest()

    def _build_tail(self) -> bytes:
        n = self._count
        eocd64 = struct.pack("<IQHHIIQQQQ", _EOCD64_SIG, 44, 0x031E, 45, 0, 0, n, n, self.cd_size, self.cd_offset)
        loc = struct.pack("<IIQI", _LOC64_SIG, 0, self.tail_offset, 1)
        eocd = struct.pack("<IHHHHIIH", _EOCD_SIG, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                           min(self.cd_size, U32), min(self.cd_offset, U32), 0)
        return eocd64 + loc + eocd

    # -- pieces ------------------------------------------------------------------------------------
    def _descriptor(self, i: int, rec: _Record) -> bytes:
        self._ensure_crcs((i,))
        return rec.descriptor(self._crcs[i])

    def _central_directory(self, a: int, b: int) -> bytes:
        """Bytes [a, b) of the central directory: the entries overlapping them, their CRCs made known first."""
        i = bisect.bisect_right(self._cd_starts, a) - 1
        j = bisect.bisect_left(self._cd_starts, b)
        self._ensure_crcs(range(i, j))
        crcs = self._crcs
        entries = b"".join(self._record(k).cd_entry(crcs[k]) for k in range(i, j))
        base = self._cd_starts[i]
        return entries[a - base:b - base]

    # -- CRCs --------------------------------------------------------------------------------------
    def _fold(self, i: int, a: int, data: bytes) -> None:
        """Extend record ``i``'s running CRC with freshly read bytes at ``a`` if they continue it."""
        if self._crcs[i] >= 0:  # set once, never unset: no lock needed to see it
            return
        with self._lock:
            hashed, running = self._partial.get(i, (0, 0))
            if self._crcs[i] >= 0 or not (a <= hashed < a + len(data)):
                return
            mv = memoryview(data)[hashed - a:]
            running = crc32(mv, running)
            hashed += len(mv)
            self._unsaved += len(mv)
            if hashed < self._size(i):
                self._partial[i] = (hashed, running)
                return
            self._partial.pop(i, None)
            self._set_crc(i, running)
            if self._store is not None and (self._unsaved >= _SAVE_EVERY or not self._unknown):
                self._save_store()

    def _ensure_crcs(self, records) -> None:
        """Make the CRC of every record in ``records`` (indices) known, hashing the parts not yet folded in.

        One hasher at a time (``_hash_lock``); it reads one cache block at a time outside the state
        lock and folds it like any read, so concurrent sequential readers keep folding too.
        """
        crcs = self._crcs
        if not self._unknown or all(crcs[i] >= 0 for i in records):
            return
        with self._hash_lock:
            hashed_any = False
            todo = [i for i in records if crcs[i] < 0]
            for k, i in enumerate(todo):
                if crcs[i] >= 0:
                    continue
                t, size = self._tensor(i), self._size(i)
                block = max(1, t.block_elems() * t.dtype.itemsize)
                while crcs[i] < 0:
                    pos = self._partial.get(i, (0, 0))[0]
                    stop = min(size, (pos // block + 1) * block)
                    self._hash_ahead(todo, k, stop)
                    self._fold(i, pos, t.read_bytes(pos, stop, self.cache))
                    hashed_any = True
                    if crcs[i] < 0 and self._partial.get(i, (0, 0))[0] <= pos:  # every pass progresses or fails
                        raise TensorReadError(self.archive_name, f"{self._name(i).decode()}: the tensor gave no "
                                                                 f"bytes at offset {pos} of {size} (its CRC-32 "
                                                                 "cannot be computed)")
            if hashed_any and self._store is not None:
                with self._lock:
                    self._save_store()

    def _hash_ahead(self, todo: list, k: int, stop: int) -> None:
        """While the hasher reads record ``todo[k]`` up to ``stop``, queue the ``cache.read_ahead`` bytes after it
        for the read-ahead threads (into the next record when this one ends sooner), as a sequential read gets."""
        ra = self.cache.read_ahead if self.cache is not None else 0
        while ra > 0 and k < len(todo):
            t = self._tensor(todo[k])
            t.prefetch(stop, stop + ra, self.cache)
            ra -= max(0, self._size(todo[k]) - stop)
            k, stop = k + 1, 0

    def _set_crc(self, i: int, crc: int) -> None:
        self._crcs[i] = crc
        self._unknown -= 1

    def _storage_records(self) -> range:
        return range(_HEAD, _HEAD + len(self.storages))

    def _load_store(self) -> None:
        stored = self._store.load(self._store_key)
        for i in self._storage_records():
            if self._crcs[i] < 0:
                c = stored.get(self._name(i).decode("utf-8"))
                if c is not None:
                    self._set_crc(i, c)

    def _save_store(self) -> None:
        """Persist the known tensor-record CRCs (caller holds the lock)."""
        crcs = {self._name(i).decode("utf-8"): self._crcs[i] for i in self._storage_records() if self._crcs[i] >= 0}
        self._unsaved = 0
        if crcs:
            self._store.save(self._store_key, crcs)
