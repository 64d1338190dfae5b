"""The torch.save zip archive (torch 2.13 byte layout) of a nested object with virtual-tensor leaves.

``TorchZipLayout(obj, archive_name)`` knows its exact ``size`` and every offset from metadata alone
(data.pkl, record names and sizes) and plans the file as pieces (``ckptfs.layouts.pieces``): per record its
local header, its payload or tensor bytes, its data descriptor; then the central directory and the tail. A read
touches only the tensor byte ranges that overlap it. The output equals ``torch.save(obj)`` byte for byte
(each leaf becoming a distinct tensor over one storage per distinct ``VirtualTensor``), except the
40 digits of ``.data/serialization_id`` (and, with CRCs, that record's CRC). See
docs/torch-safetensors-hf-bytes.md §1–3.

CRCs: ``crc="zero"`` is torch's ``compute_crc32=False`` layout. ``crc="exact"`` writes real CRC-32
values: a tensor record's CRC is accumulated while its bytes are read in order (a sequential copy
hashes nothing twice); a read that needs a CRC not yet known (a data descriptor, or the central
directory, which torch reads first) streams the missing part of those records once, in bounded
blocks. Known CRCs are kept in ``crc_store`` under ``identity`` so that other mounts reuse them.
"""
from __future__ import annotations

import bisect
import hashlib
import struct
import threading
import zlib
from array import array
from dataclasses import dataclass

from ..cache import BlockCache
from ..errors import CkptfsError, TensorReadError
from ..tensor import VirtualTensor
from .crc import CrcStore
from .pickle2 import Global, PersistentId, PickleTypeError, Reduce, dumps2
from .pieces import Computed, Literal, PiecedFile, TensorBytes

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
            func, stype, numel, extra = _V2, Global("torch", dt.torch_storage), x.numel, ()
        else:
            func, stype, numel, extra = _V3, _UNTYPED, x.nbytes, (Global("torch", dt.name),)
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
    """A record's placement plus its CRC state (``hashed`` bytes folded into ``running`` so far).

    Kept small (an archive of 100,000 tensors has 100,000 of them): the name is the archive's ``prefix`` plus
    ``key`` (``data/<key>`` for a storage number), the data offset is computed."""

    __slots__ = ("prefix", "key", "header_offset", "size", "payload", "tensor", "crc", "hashed", "running")

    def __init__(self, prefix: bytes, key: bytes | int, header_offset: int, size: int, payload: bytes | None,
                 tensor: VirtualTensor | None):
        self.prefix = prefix
        self.key = key
        self.header_offset = header_offset
        self.size = size
        self.payload = payload
        self.tensor = tensor
        self.crc: int | None = None
        self.hashed = 0
        self.running = 0

    @property
    def name(self) -> bytes:
        key = self.key
        return self.prefix + (b"data/%d" % key if type(key) is int else key)

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


class _Records(TensorBytes):
    """Every record of the archive — each one's local header, data and data descriptor — as one piece that finds
    its records by bisecting their offsets: no object per record beyond the ``_Record`` itself. The data of a
    tensor record is folded into the record's CRC as it is read. (A ``TensorBytes`` so that the read-ahead of the
    read engine reaches the tensors' bytes.)"""

    __slots__ = ("zf",)

    def __init__(self, zf: "TorchZipLayout"):
        self.zf = zf
        self.tensor = None
        self.start = 0
        self.size = zf.cd_offset
        self.name = None
        self.on_read = None

    @property
    def what(self) -> str:
        return f"zip records of {self.zf.archive_name}"

    def _at(self, a: int) -> int:
        return bisect.bisect_right(self.zf._starts, a) - 1

    @staticmethod
    def _parts(rec: "_Record") -> tuple:
        """``(first, stop)`` of the header, the data and the descriptor, relative to the record's header."""
        h, d = rec.header_offset, rec.data_offset
        return (0, d - h), (d - h, d - h + rec.size), (d - h + rec.size, rec.end - h)

    def fill(self, out: memoryview, a: int, cache) -> int:
        zf, n, pos = self.zf, len(out), 0
        i = self._at(a)
        while pos < n:
            rec = zf._records[i]
            k = min(rec.end, a + n) - (a + pos)
            got = self._fill_record(rec, out[pos:pos + k], a + pos - rec.header_offset, cache)
            if got != k:
                raise TensorReadError(zf.archive_name, f"zip record {rec.name.decode()} produced {got} bytes for "
                                                       f"{k} at offset {a + pos - rec.header_offset}")
            pos += k
            i += 1
        return pos

    def _fill_record(self, rec: "_Record", out: memoryview, a: int, cache) -> int:
        n, pos = len(out), 0
        for part, (lo, hi) in enumerate(self._parts(rec)):
            if pos >= n:
                break
            if a + pos >= hi:
                continue
            s, k = a + pos - lo, min(hi, a + n) - (a + pos)
            dst = out[pos:pos + k]
            if part == 1 and rec.payload is None:
                got = rec.tensor.read_into(s, dst, cache)
                if rec.crc is None and got:
                    self.zf._fold(rec, s, dst[:got])
            else:
                src = rec.local_header() if part == 0 else rec.payload if part == 1 else self.zf._descriptor(rec)
                chunk = src[s:s + k]
                got = len(chunk)
                dst[:got] = chunk
            if got != k:
                return pos + got
            pos += k
        return pos

    def prefetch(self, a: int, b: int, cache) -> None:
        zf = self.zf
        i = self._at(a)
        while i < len(zf._records) and zf._starts[i] < b:
            rec = zf._records[i]
            lo, hi = self._parts(rec)[1]
            lo, hi = lo + rec.header_offset, hi + rec.header_offset
            if rec.payload is None and a < hi and b > lo and hasattr(rec.tensor, "prefetch"):
                rec.tensor.prefetch(max(a, lo) - lo, min(b, hi) - lo, cache)
            i += 1

    def explain(self, a: int) -> list:
        rec = self.zf._records[self._at(a)]
        name = rec.name.decode()
        a -= rec.header_offset
        (_, h_end), (d_lo, d_hi), (_, e_hi) = self._parts(rec)
        if a < h_end:
            return [f"zip local header of {name}: {h_end} bytes made when read"]
        if a >= d_hi:
            return [f"zip data descriptor of {name} (its CRC-32): {e_hi - d_hi} bytes computed when read"]
        if rec.payload is not None:
            return [f"zip record {name}: {len(rec.payload)} bytes known when the file was planned"]
        label = self.zf._labels[rec.key] if type(rec.key) is int else None
        return TensorBytes(rec.tensor, name + (f" ({label})" if label else "")).explain(a - d_lo)


class TorchZipLayout(PiecedFile):
    """``torch.save(obj)`` as a lazily generated file: ``size`` and ``read(offset, n)``."""

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

        prefix = (archive_name + "/").encode("utf-8")
        sid = b"%040d" % (int.from_bytes(hashlib.sha256(self.signature.encode()).digest(), "big") % 10**40)
        items: list[tuple[bytes | int, bytes | None, VirtualTensor | None]] = [
            (b"data.pkl", pkl, None), (b".format_version", b"1", None), (b".storage_alignment", b"64", None),
            (b"byteorder", b"little", None)]
        items += [(i, None, t) for i, t in enumerate(storages)]  # named data/<i>
        items += [(b"version", b"3\n", None), (b".data/serialization_id", sid, None)]
        self._labels = [labels.get(id(t)) for t in storages]  # the state-dict key of each storage (explain)

        self._records: list[_Record] = []
        starts = array("q")
        pos = 0
        for key, payload, tensor in items:
            size = len(payload) if payload is not None else tensor.nbytes
            rec = _Record(prefix, key, pos, size, payload, tensor)
            starts.append(pos)
            if crc == "zero":
                rec.crc = 0
            elif payload is not None:
                rec.crc = zlib.crc32(payload)
            elif size == 0:
                rec.crc = 0
            self._records.append(rec)
            pos = rec.end
        self.cd_offset = pos
        self._starts = starts  # each record's local header offset
        self._cd_starts = array("q")  # each record's central directory entry, relative to the central directory
        for r in self._records:
            self._cd_starts.append(pos - self.cd_offset)
            pos += r.cd_len()
        self.cd_size = pos - self.cd_offset
        self.tail_offset = pos
        self._tail = self._build_tail()

        self._unknown = sum(r.crc is None for r in self._records)  # CRCs still to compute
        self._store = crc_store if crc == "exact" and identity is not None else None
        self._store_key = CrcStore.key(identity, self.signature) if self._store is not None else None
        self._unsaved = 0
        if self._store is not None and self._unknown:
            self._load_store()
        super().__init__(self._pieces(), name=archive_name, cache=cache)

    # -- metadata ----------------------------------------------------------------------------------
    @property
    def entries(self) -> list[ZipEntry]:
        """The records in file order."""
        return [ZipEntry(r.name.decode("utf-8"), r.header_offset, r.data_offset, r.size) for r in self._records]

    def _signature(self, pkl: bytes, storages: list[VirtualTensor]) -> str:
        h = hashlib.sha256()
        h.update(b"ckptfs-torchzip-1\0" + self.archive_name.encode("utf-8", "surrogatepass") + b"\0")
        h.update(hashlib.sha256(pkl).digest())  # names, dtypes, shapes, structure
        for t in storages:
            h.update(f"{t.dtype.name}{list(t.shape)}{t.describe()}\0".encode("utf-8", "surrogatepass"))
        return h.hexdigest()

    def _build_tail(self) -> bytes:
        n = len(self._records)
        eocd64 = struct.pack("<IQHHIIQQQQ", _EOCD64_SIG, 44, 0x031E, 45, 0, 0, n, n, self.cd_size, self.cd_offset)
        loc = struct.pack("<IIQI", _LOC64_SIG, 0, self.tail_offset, 1)
        eocd = struct.pack("<IHHHHIIH", _EOCD_SIG, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                           min(self.cd_size, U32), min(self.cd_offset, U32), 0)
        return eocd64 + loc + eocd

    # -- pieces ------------------------------------------------------------------------------------
    def _pieces(self) -> list:
        return [_Records(self), Computed(self.cd_size, self._central_directory, "zip central directory (CRC-32s)"),
                Literal(self._tail, "zip64 end records")]

    def _descriptor(self, rec: _Record) -> bytes:
        self._ensure_crcs((rec,))
        return rec.descriptor(rec.crc)

    def _central_directory(self, a: int, b: int) -> bytes:
        """Bytes [a, b) of the central directory: the entries overlapping them, their CRCs made known first."""
        i = bisect.bisect_right(self._cd_starts, a) - 1
        j = bisect.bisect_left(self._cd_starts, b)
        recs = self._records[i:j]
        self._ensure_crcs(recs)
        entries = b"".join(r.cd_entry(r.crc) for r in recs)
        base = self._cd_starts[i]
        return entries[a - base:b - base]

    # -- CRCs --------------------------------------------------------------------------------------
    def _fold(self, rec: _Record, a: int, data: bytes) -> None:
        """Extend ``rec``'s running CRC with freshly read bytes at ``a`` if they continue it."""
        if rec.crc is not None:  # set once, never unset: no lock needed to see it
            return
        with self._lock:
            if rec.crc is not None or not (a <= rec.hashed < a + len(data)):
                return
            mv = memoryview(data)[rec.hashed - a:]
            rec.running = zlib.crc32(mv, rec.running)
            rec.hashed += len(mv)
            self._unsaved += len(mv)
            if rec.hashed == rec.size:
                self._set_crc(rec, rec.running)
                if self._store is not None and (self._unsaved >= _SAVE_EVERY or not self._unknown):
                    self._save_store()

    def _ensure_crcs(self, recs) -> None:
        """Make the CRC of every record in ``recs`` known, hashing the parts not yet folded in.

        One hasher at a time (``_hash_lock``); it reads one cache block at a time outside the state
        lock and folds it like any read, so concurrent sequential readers keep folding too.
        """
        if not self._unknown or all(r.crc is not None for r in recs):
            return
        with self._hash_lock:
            hashed_any = False
            for rec in recs:
                t = rec.tensor
                while rec.crc is None:
                    block = max(1, t.block_elems() * t.dtype.itemsize)
                    pos = rec.hashed
                    stop = min(rec.size, (pos // block + 1) * block)
                    self._fold(rec, pos, t.read_bytes(pos, stop, self.cache))
                    hashed_any = True
                    if rec.crc is None and rec.hashed <= pos:  # every pass makes progress or fails
                        raise TensorReadError(self.archive_name, f"{rec.name.decode()}: the tensor gave no bytes at "
                                                                 f"offset {pos} of {rec.size} (its CRC-32 cannot be "
                                                                 "computed)")
            if hashed_any and self._store is not None:
                with self._lock:
                    self._save_store()

    def _set_crc(self, rec: _Record, crc: int) -> None:
        rec.crc = crc
        self._unknown -= 1

    def _load_store(self) -> None:
        stored = self._store.load(self._store_key)
        for rec in self._records:
            if rec.crc is None:
                c = stored.get(rec.name.decode("utf-8"))
                if c is not None:
                    self._set_crc(rec, c)

    def _save_store(self) -> None:
        """Persist the known tensor-record CRCs (caller holds the lock)."""
        crcs = {r.name.decode("utf-8"): r.crc for r in self._records if r.tensor is not None and r.crc is not None}
        self._unsaved = 0
        if crcs:
            self._store.save(self._store_key, crcs)
