"""Chunk-parallel reads of HDF5 datasets compressed with the LZ4 filter (id 32004), bypassing HDF5's filter pipeline.

HDF5 decodes chunks one at a time, with per-chunk overhead, under h5py's global lock. For a chunked dataset whose
*only* filter is LZ4 (every Cerebras tensor), ``LZ4ChunkReader.read(box)`` does the work itself:

1. the chunks under the box come from a per-dataset index built once with ``chunk_iter`` (file offset, stored size,
   filter mask of every allocated chunk; ``_IndexLRU`` bounds the memory of all indexes together); a small read
   of a dataset not indexed yet (at most ``_LOOKUP_CHUNKS`` chunks, at most half of them: a peek at a tensor's
   start) looks its chunks up one by one instead (``get_chunk_info_by_coord``, one B-tree lookup each);
2. the stored bytes are fetched into a thread-local buffer: over coalesced file ranges, from the page cache or
   straight from the disk (``ckptfs.source.filereads``), when the file is a plain (sec2) file whose chunk addresses
   were checked against ``read_direct_chunk`` once per open file (our own read-only handles, shared by the file's
   readers and closed with the last of them), otherwise chunk by chunk with ``dset.id.read_direct_chunk`` (no
   filter applied). A small read over chunks stored raw (a peek) fetches only each chunk's frame header and the
   rows it needs, every range announced to the kernel first so that a cold disk reads them together;
3. the HDF5-LZ4 framing is checked and decoded here: a run of neighbouring chunks stored raw (incompressible
   data, i.e. most real weights) is copied into the output with one strided numpy copy; other chunks are decoded
   with ``LZ4_decompress_safe`` from hdf5plugin's own ``libh5lz4.so`` through ctypes (which releases the GIL);
4. unallocated chunks give the dataset's fill value.

The chunks of one read are split over a small shared thread pool (the calling thread takes one share) when the
read has enough compressed chunks to decode; chunks stored raw are memory copies and stay in the calling thread.
Reads over a few chunks (up to 64 when at most 4 are compressed: a cache block of raw weights) go chunk by chunk in
plain Python, which costs less than numpy's set-up of the batch.

Framing (hdf5plugin ``src/LZ4/H5Zlz4.c``): 8-byte big-endian total uncompressed size, 4-byte big-endian block size
(clamped to the total), then per block a 4-byte big-endian stored size and the block; a block whose stored size
equals its uncompressed size is stored raw. A chunk whose filter mask has bit 0 set skipped the (optional) filter
and is stored raw. Anything that does not decode to exactly the chunk's size raises ``CorruptChunkError`` — never
wrong bytes. Trailing bytes after the last block are ignored, as HDF5's own filter does.

``plan(dset)`` returns a reader, or None when the plain h5py hyperslab read must be used (not an h5py Dataset,
contiguous, 0-d, other or extra filters, compound/string/complex types, a file type that h5py would convert, or
the LZ4 library cannot be loaded). ``read`` returns None (the caller then uses h5py, so errors stay the same) for
a box out of range, a closed dataset, or a box touching an unallocated chunk of a dataset whose fill value HDF5
would not apply (fill time "never" / undefined fill value).

Block alignment: ``aligned_block_elems`` (``ckptfs.tensor``) rounds a tensor's cache-block size to whole chunk rows
(``chunks[0]`` rows of all trailing dimensions), so consecutive blocks never decode the same chunk.

Threads: ``CKPTFS_DECODE_THREADS`` (default ``os.cpu_count()``; 1 = serial, in the calling thread) or
``set_decode_threads(n)``.

Limitation: a file written with ``H5Pset_chunk_opts(H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS)`` (never done by h5py or
cstorch) stores partial edge chunks unfiltered without saying so in the filter mask; h5py cannot query that flag,
so such edge chunks fail to decode and raise ``CorruptChunkError`` (an error, not wrong data).
"""
from __future__ import annotations

import ctypes
import itertools
import math
import mmap
import os
import struct
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..virtual_tensor import aligned_block_elems  # noqa: F401 - cache-block alignment to chunk rows lives with the blocks
from ..storage.base import ShortRead
from ..storage.local import LocalFile as SourceFile
from .lz4filter import LZ4_FILTER_ID, lz4_library

ENV_THREADS = "CKPTFS_DECODE_THREADS"
#: total chunk-index entries (20 bytes each) kept across all readers before the least recently used are dropped
INDEX_BUDGET_ENTRIES = 1_000_000
#: chunks further apart than this in the file are fetched by separate reads
_MAX_GAP = 64 << 10
#: thread-local scratch buffers larger than this are not kept between reads
_KEEP_SCRATCH_BYTES = 64 << 20
#: split a read over threads only when it has at least this many bytes to decode (compressed chunks)
_MIN_PARALLEL_BYTES = 256 << 10
#: stored bytes fetched and placed at a time by one thread
_BATCH_BYTES = 4 << 20
#: reads over at most this many chunks go chunk by chunk in plain Python (numpy set-up costs more)
_FEW_CHUNKS = 4
#: ... and so do reads over at most this many chunks of which at most ``_FEW_CHUNKS`` are not stored raw (raw chunks
#: are incompressible weights: nothing to decode, so nothing to share over threads). A 2 MB cache block of a bf16
#: matrix is 32 chunks of cstorch's shape; read chunk by chunk it cost 0.41-0.50 CPU-s per GB against 0.61-0.69
#: through the numpy batch (in-process, page cache warm, best of 5, interleaved)
_FEW_RAW_CHUNKS = 64
#: ``_read_few``'s answer when the read has more compressed chunks than it takes: use the batch
_BATCH = object()
#: a small read of a raw chunk whose rows start at most this far after its frame header reads header and rows as one
#: range (the disk reads whole pages anyway); further on, as two
_MERGE_ROWS_GAP = 4096
#: while a dataset is not indexed, reads look their chunks up in HDF5's chunk index (one B-tree lookup each) and
#: remember them, up to this many chunks (and half of the dataset's); a read needing more indexes the dataset. A
#: peek at the start of every tensor decodes a handful of chunks, and indexing all of them cost more than the rest
_LOOKUP_CHUNKS = 64

_HEADER = struct.Struct(">QI")
_BLOCK = struct.Struct(">I")
_RAW_HEAD = _HEADER.size + _BLOCK.size  # a one-block frame stored raw: 16 header bytes, then the data
_HEAD = struct.Struct(">QII")  # total size, block size, first block's stored size
_HEAD_DTYPE = np.dtype([("total", ">u8"), ("block", ">u4"), ("stored", ">u4")])


class CorruptChunkError(Exception):
    """A stored chunk that does not decode to exactly its expected bytes; ``coords`` is its dataset offset."""

    def __init__(self, coords: tuple, detail: str):
        self.coords = tuple(int(c) for c in coords)
        self.detail = detail
        super().__init__(f"chunk at {self.coords}: {detail}")


# -- the LZ4 library -----------------------------------------------------------------------------------------------
_lib_lock = threading.Lock()
_lib_state: list = []  # [] = not tried; [fn] = loaded; [None] = unavailable


def lz4_decompress_safe():
    """``LZ4_decompress_safe(src, dst, compressed_size, capacity) -> int`` from hdf5plugin's libh5lz4, or None."""
    if _lib_state:
        return _lib_state[0]
    with _lib_lock:
        if not _lib_state:
            lib = lz4_library()
            try:
                fn = lib.LZ4_decompress_safe
                fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int)
                fn.restype = ctypes.c_int
            except AttributeError:  # no library (None has no such attribute), or one without the symbol
                fn = None
            _lib_state.append(fn)
    return _lib_state[0]


def _addr(buf) -> int:
    """Address of a writable buffer (bytearray / numpy array)."""
    if isinstance(buf, np.ndarray):
        return buf.__array_interface__["data"][0]
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def decode_frame(raw, raw_addr: int, nbytes: int, dst_addr: int, coords: tuple = ()) -> None:
    """Decode one HDF5-LZ4 framed chunk (``raw``, a bytes-like at ``raw_addr``) into ``nbytes`` at ``dst_addr``.

    Raises ``CorruptChunkError`` unless the frame decodes to exactly ``nbytes``.
    """
    fn = lz4_decompress_safe()
    if fn is None:
        raise CorruptChunkError(coords, "LZ4 library unavailable")
    size = len(raw)
    if size < _HEADER.size:
        raise CorruptChunkError(coords, f"{size}-byte chunk is shorter than the LZ4 header")
    total, block = _HEADER.unpack_from(raw, 0)
    if total != nbytes:
        raise CorruptChunkError(coords, f"header says {total} bytes, chunk holds {nbytes}")
    if block > total:
        block = total
    if block == 0 and total:
        raise CorruptChunkError(coords, "block size 0")
    pos, done = _HEADER.size, 0
    while done < total:
        n = min(block, total - done)
        if pos + 4 > size:
            raise CorruptChunkError(coords, f"truncated at block {done // block}")
        (stored,) = _BLOCK.unpack_from(raw, pos)
        pos += 4
        if pos + stored > size:
            raise CorruptChunkError(coords, f"block {done // block} runs past the chunk's end")
        if stored == n:
            ctypes.memmove(dst_addr + done, raw_addr + pos, n)
        else:
            try:
                got = fn(raw_addr + pos, dst_addr + done, stored, n)
            except (ctypes.ArgumentError, OSError) as e:
                raise CorruptChunkError(coords, f"LZ4 call failed: {e}") from e
            if got != n:
                raise CorruptChunkError(coords, f"block {done // block} decodes to {got} bytes, not {n}")
        pos += stored
        done += n


# -- threads -------------------------------------------------------------------------------------------------------
_pool_lock = threading.Lock()
_threads: int | None = None
_pool: ThreadPoolExecutor | None = None
_local = threading.local()


def _env_threads() -> int:
    v = os.environ.get(ENV_THREADS, "").strip()
    try:
        n = int(v) if v else (os.cpu_count() or 1)
    except ValueError:
        n = os.cpu_count() or 1
    return max(1, n)


def decode_threads() -> int:
    """Threads used per read (the caller included): ``set_decode_threads`` or ``$CKPTFS_DECODE_THREADS`` or cores."""
    return _threads if _threads is not None else _env_threads()


def set_decode_threads(n: int | None) -> None:
    """Use ``n`` threads per read (1 = serial; None = back to the environment/default). Replaces the shared pool."""
    global _threads, _pool
    with _pool_lock:
        _threads = None if n is None else max(1, int(n))
        old, _pool = _pool, None
    if old is not None:
        old.shutdown(wait=False)


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < workers:  # noqa: SLF001 (grow on demand)
            old, _pool = _pool, ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptfs-lz4")
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's pool threads: start a fresh pool on next use."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _scratch(name: str, n: int) -> mmap.mmap:
    """A thread-local scratch buffer of at least ``n`` bytes (big ones are not kept), page-aligned (an anonymous
    mapping) as direct reads need (``filereads.ALIGN``)."""
    buf = getattr(_local, name, None)
    if buf is not None and len(buf) >= n:
        return buf
    buf = mmap.mmap(-1, max(n, 1))
    if n <= _KEEP_SCRATCH_BYTES:
        setattr(_local, name, buf)
    return buf


# -- chunk indexes -------------------------------------------------------------------------------------------------
class _IndexLRU:
    """Bounds the memory of all readers' chunk indexes: least recently used ones are dropped (and rebuilt on use).

    Readers are held weakly, so a reader (its dataset handle and direct file handle) dies with its tensor.
    """

    def __init__(self, budget: int):
        self.budget = budget
        self._readers: "OrderedDict[int, tuple]" = OrderedDict()  # id -> (weakref, entries)
        self._entries = 0
        self._lock = threading.RLock()  # a reader's weakref callback may run while the lock is held

    def touch(self, reader: "LZ4ChunkReader") -> None:
        key = id(reader)
        with self._lock:
            if key in self._readers:
                self._readers.move_to_end(key)
                return
            self._readers[key] = (weakref.ref(reader, lambda _r, key=key: self._drop(key)), reader.nchunks)
            self._entries += reader.nchunks
            while self._entries > self.budget and len(self._readers) > 1:
                _, (ref, n) = self._readers.popitem(last=False)
                self._entries -= n
                old = ref()
                if old is not None:
                    old._index = None  # noqa: SLF001

    def _drop(self, key: int) -> None:
        with self._lock:
            item = self._readers.pop(key, None)
            if item is not None:
                self._entries -= item[1]

    def forget(self, reader: "LZ4ChunkReader") -> None:
        self._drop(id(reader))


_indexes = _IndexLRU(INDEX_BUDGET_ENTRIES)


# -- direct file access ---------------------------------------------------------------------------------------------
_raw_lock = threading.Lock()
_raw_files: "weakref.WeakValueDictionary[tuple, SourceFile]" = weakref.WeakValueDictionary()
_raw_refused: set = set()


def _raw_file(dset, coords: tuple, offset: int, size: int) -> "SourceFile | None":
    """A direct handle on the file holding ``dset``, if it is a plain file (sec2 driver) whose chunk addresses are
    file offsets: checked once per open file by reading one chunk (``coords``, at ``offset``) both ways."""
    from h5py import h5fd, h5i

    if not hasattr(os, "preadv"):
        return None
    try:
        fid = h5i.get_file_id(dset.id)
        st = os.fstat(fid.get_vfd_handle())
        key = (fid.fileno, st.st_dev, st.st_ino)
        with _raw_lock:
            rf = _raw_files.get(key)
            if rf is not None or key in _raw_refused:
                return rf
            if fid.get_access_plist().get_driver() == h5fd.SEC2:
                rf = SourceFile(os.fsdecode(fid.name))
                mine = os.fstat(rf.fd)
                _, want = dset.id.read_direct_chunk(coords)
                if (mine.st_dev, mine.st_ino) == key[1:] and os.pread(rf.fd, size, offset) == bytes(want):
                    _raw_files[key] = rf
                    return rf
            _raw_refused.add(key)
            return None
    except (OSError, ValueError, RuntimeError, TypeError, AttributeError):
        return None


_memory_types: dict = {}  # numpy dtype -> its HDF5 memory type (``h5t.py_create``), made once per dtype


def _memory_type(dt: np.dtype):
    t = _memory_types.get(dt)
    if t is None:
        from h5py import h5t

        t = _memory_types[dt] = h5t.py_create(dt)
    return t


def why_not(dset, dcpl=None) -> str | None:
    """Why ``dset`` cannot use the chunk reader (None if it can); ``dcpl``: its creation property list, if at hand."""
    import h5py
    from h5py import h5d

    if not isinstance(dset, h5py.Dataset):
        return "not an h5py Dataset"
    did = dset.id
    if dcpl is None:
        dcpl = did.get_create_plist()
    if dcpl.get_layout() != h5d.CHUNKED or not did.shape:
        return "not chunked"
    dt = did.dtype
    if dt.kind not in "biuf" or dt.itemsize not in (1, 2, 4, 8) or dt.fields is not None or dt.subdtype is not None:
        return f"element type {dt}"
    if dcpl.get_nfilters() != 1 or dcpl.get_filter(0)[0] != LZ4_FILTER_ID:
        return "filters other than LZ4 alone"
    try:
        if not did.get_type() == _memory_type(dt):
            return "file type needs conversion"
    except (TypeError, ValueError):
        return "file type needs conversion"
    if not hasattr(did, "read_direct_chunk") or not (hasattr(did, "chunk_iter") or hasattr(did, "get_chunk_info")):
        return "h5py without direct chunk access"
    if lz4_decompress_safe() is None:
        return "LZ4 library unavailable"
    return None


def plan(dset) -> "LZ4ChunkReader | None":
    """A chunk reader for ``dset``, or None when the plain h5py read must be used (also if HDF5 cannot say)."""
    try:
        dcpl = dset.id.get_create_plist() if hasattr(dset, "id") else None
        return LZ4ChunkReader(dset, dcpl) if why_not(dset, dcpl) is None else None
    except (OSError, RuntimeError, ValueError, TypeError, KeyError, AttributeError):
        return None


class LZ4ChunkReader:
    """Reads boxes of one LZ4-only chunked dataset by decoding its chunks itself (see the module docstring)."""

    def __init__(self, dset, dcpl=None):
        from h5py import h5d

        did = dset.id
        dcpl = dcpl if dcpl is not None else did.get_create_plist()
        self.dset = dset
        self.shape = tuple(int(n) for n in did.shape)
        self.chunks = tuple(int(c) for c in dcpl.get_chunk())
        self.dtype = did.dtype  # what h5py returns: the output's dtype
        self.udtype = np.dtype(f"u{self.dtype.itemsize}")  # bytes are copied as unsigned ints: bit-exact
        self.chunk_nbytes = math.prod(self.chunks) * self.dtype.itemsize
        self.grid = tuple(-(-n // c) for n, c in zip(self.shape, self.chunks))
        self.nchunks = math.prod(self.grid)
        self._gstride = tuple(math.prod(self.grid[i + 1:]) for i in range(len(self.grid)))
        self._cstrides = tuple(math.prod(self.chunks[i + 1:]) * self.dtype.itemsize for i in range(len(self.chunks)))
        nd = len(self.chunks)
        self._run_axes = tuple(range(1, nd)) + (0, nd)  # (run, *chunk) -> (*chunk[:-1], run, chunk[-1])
        self.fill_ok = (dcpl.get_fill_time() != h5d.FILL_TIME_NEVER
                        and dcpl.fill_value_defined() != h5d.FILL_VALUE_UNDEFINED)
        self.fill = None
        if self.fill_ok:  # as h5py's ``Dataset.fillvalue``, from the property list already at hand
            fill = np.zeros((1,), self.dtype)
            dcpl.get_fill_value(fill)
            self.fill = fill.view(self.udtype)[0]
        self._index = None
        self._lock = threading.Lock()
        self._raw: "SourceFile | bool | None" = None  # None: not yet checked; False: use read_direct_chunk
        self._can_look_up = hasattr(dset.id, "get_chunk_info_by_coord")
        self._looked_up: dict | None = None  # linear chunk index -> (offset, size, mask) while not indexed

    # -- index -------------------------------------------------------------------------------------------------
    def index(self):
        """``(offsets, sizes, masks)`` arrays over the chunk grid in C order; size -1 = unallocated."""
        idx = self._index
        if idx is None:
            with self._lock:
                idx = self._index
                if idx is None:
                    idx = self._index = self._build_index()
                    self._looked_up = None
        _indexes.touch(self)
        return idx

    def _build_index(self):
        offs = np.zeros(self.nchunks, dtype=np.int64)
        sizes = np.full(self.nchunks, -1, dtype=np.int64)
        masks = np.zeros(self.nchunks, dtype=np.uint32)
        did = self.dset.id
        infos: list = []
        if hasattr(did, "chunk_iter"):
            did.chunk_iter(infos.append)
        else:
            infos = [did.get_chunk_info(i) for i in range(did.get_num_chunks())]
        infos = [i for i in infos if i.chunk_offset is not None and i.byte_offset is not None]
        if infos:
            n = len(infos)
            co = np.array([i.chunk_offset for i in infos], dtype=np.int64).reshape(n, -1)
            li = (co // np.array(self.chunks)) @ np.array(self._gstride, dtype=np.int64)
            offs[li] = np.fromiter((i.byte_offset for i in infos), np.int64, n)
            sizes[li] = np.fromiter((i.size for i in infos), np.int64, n)
            masks[li] = np.fromiter((i.filter_mask for i in infos), np.int64, n)
        return offs, sizes, masks

    def _direct(self, first_stored) -> "SourceFile | None":
        """The direct file handle (None: use ``read_direct_chunk``), looked up once per reader; ``first_stored()``
        gives ``(coords, offset, size)`` of one allocated chunk to check the handle with (None: none yet, ask again
        next time). It is only called while the handle is not known."""
        raw = self._raw
        if raw is None:
            probe = first_stored()
            if probe is None:
                return None
            raw = self._raw = _raw_file(self.dset, *probe) or False
        return raw or None

    def _first_indexed(self, offs, sizes):
        """``(coords, offset, size)`` of the first allocated chunk of the index, or None."""
        hit = np.flatnonzero(sizes >= 0)
        if not hit.size:
            return None
        li = int(hit[0])
        return tuple(i * c for i, c in zip(self._chunk_idx(li), self.chunks)), int(offs[li]), int(sizes[li])

    def _lookup(self, idx: tuple, index) -> tuple:
        """``(offset, size, filter mask)`` of the chunk with grid indices ``idx``: from ``index`` (the arrays of
        ``index()``), or with None from the chunks looked up so far or one lookup in HDF5's chunk index (then
        remembered); size -1 = unallocated."""
        return self._lookup_at(sum(i * s for i, s in zip(idx, self._gstride)), idx, index)

    def _lookup_at(self, li: int, idx: tuple, index) -> tuple:
        """``_lookup`` of the chunk with linear index ``li`` (and grid indices ``idx``)."""
        if index is not None:
            return int(index[0][li]), int(index[1][li]), int(index[2][li])
        seen = self._looked_up
        if seen is None:
            seen = self._looked_up = {}
        got = seen.get(li)
        if got is None:
            info = self.dset.id.get_chunk_info_by_coord(tuple(i * c for i, c in zip(idx, self.chunks)))
            got = seen[li] = ((0, -1, 0) if info.byte_offset is None
                              else (int(info.byte_offset), int(info.size), int(info.filter_mask)))
        return got

    def _may_look_up(self, ranges, n: int) -> bool:
        """Whether a read over the chunks ``ranges`` (``n`` of them) looks them up rather than indexing the dataset:
        only while it is not indexed, and while the chunks looked up stay within ``_LOOKUP_CHUNKS`` and half of
        the dataset's."""
        if self._index is not None or not self._can_look_up:
            return False
        cap = min(_LOOKUP_CHUNKS, self.nchunks // 2)
        seen = self._looked_up or {}
        if n + len(seen) <= cap:
            return True
        if n > cap:
            return False
        new = sum(sum(i * s for i, s in zip(idx, self._gstride)) not in seen for idx in itertools.product(*ranges))
        return new + len(seen) <= cap

    # -- reading -----------------------------------------------------------------------------------------------
    def read(self, box) -> np.ndarray | None:
        """The box as a C-contiguous array of ``dset.dtype``; None if the caller must use h5py for this box."""
        box = tuple((int(a), int(b)) for a, b in box)
        if len(box) != len(self.shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(box, self.shape)):
            return None  # out of range: h5py reports it exactly as before
        if not self.dset.id.valid:
            return None  # closed: h5py raises as before
        out = np.empty(tuple(b - a for a, b in box), self.udtype)
        if out.size == 0:
            return out.view(self.dtype)
        ranges = [range(a // c, (b - 1) // c + 1) for (a, b), c in zip(box, self.chunks)]
        n = math.prod(len(r) for r in ranges)
        if self._may_look_up(ranges, n):
            return self._read_few(box, out, ranges, None)  # a peek: its chunks looked up, the dataset not indexed
        offs, sizes, masks = index = self.index()
        if n <= _FEW_RAW_CHUNKS:  # plain Python is cheaper than numpy
            got = self._read_few(box, out, ranges, index, None if n <= _FEW_CHUNKS else _FEW_CHUNKS)
            if got is not _BATCH:
                return got
        direct = self._direct(lambda: self._first_indexed(offs, sizes))
        # every chunk under the box, in C order of the chunk grid
        li = np.zeros([len(r) for r in ranges], np.int64)
        for d, (r, s) in enumerate(zip(ranges, self._gstride)):
            li += (np.arange(r.start, r.stop) * s).reshape([-1 if i == d else 1 for i in range(len(ranges))])
        li = li.reshape(-1)
        csize = sizes[li]
        hole = csize < 0
        if hole.any():
            if not self.fill_ok:
                return None
            for k in np.flatnonzero(hole).tolist():
                out[self._slices(box, self._chunk_idx(int(li[k])))[1]] = self.fill
            li, csize = li[~hole], csize[~hole]
            if not li.size:
                return out.view(self.dtype)
        job = _Job(self, box, out, li, offs[li], csize, masks[li], direct)
        # only LZ4 decoding gains from threads: chunks stored raw (incompressible weights) are plain memory
        # copies, which a second thread slowed down in measurements (memory-bound), so they stay serial
        work = int((csize < self.chunk_nbytes).sum()) * self.chunk_nbytes
        threads = 1 if work < _MIN_PARALLEL_BYTES else min(decode_threads(), li.size)
        bounds = [li.size * t // threads for t in range(threads + 1)]
        parts = [(bounds[t], bounds[t + 1]) for t in range(threads) if bounds[t + 1] > bounds[t]]
        if len(parts) == 1:
            job.run(*parts[0])
        else:
            _in_parallel(job.run, parts)
        return out.view(self.dtype)

    def _read_few(self, box, out, ranges, index, most_packed: int | None = None):
        """``read`` for a box over a few chunks, chunk by chunk in plain Python; each chunk's place comes from
        ``index`` (None: looked up, ``_lookup``); neighbouring chunks are fetched with one ``preadv``. With
        ``most_packed``: ``_BATCH`` (nothing fetched) if more chunks than that are not the size of a raw one."""
        found = []  # (offset, size, mask, grid indices) of the allocated chunks
        lookup, last = self._lookup_at, ranges[-1]
        for head in itertools.product(*ranges[:-1]):  # C order: the last grid index varies fastest
            base = sum(i * s for i, s in zip(head, self._gstride))
            for j in last:
                idx = head + (j,)
                off, size, mask = lookup(base + j, idx, index)
                if size < 0:
                    if not self.fill_ok:
                        return None
                    out[self._slices(box, idx)[1]] = self.fill
                else:
                    found.append((off, size, mask, idx))
        if not found:
            return out.view(self.dtype)
        if most_packed is not None:
            raw_size = self.chunk_nbytes + _RAW_HEAD
            if sum(size != raw_size for _, size, _, _ in found) > most_packed:
                return _BATCH
        direct = self._direct(lambda: (tuple(i * c for i, c in zip(found[0][3], self.chunks)), found[0][0],
                                       found[0][1]))
        if direct is not None and self._read_rows(box, out, found, direct):
            return out.view(self.dtype)
        job = _Job(self, box, out, None, None, None, None, direct)
        buf, pos = job.fetch_few(found)
        raw1 = [self._stored_raw(buf, p, size, mask) for (_, size, mask, _), p in zip(found, pos)]
        k = 0
        while k < len(found):
            e = self._raw_run_end(found, pos, raw1, k, box)
            idx, p = found[k][3], pos[k]
            if e - k > 1:
                job.place_run(buf, p + _RAW_HEAD, self.chunk_nbytes + _RAW_HEAD,
                              sum(i * s for i, s in zip(idx, self._gstride)), e - k)
            else:
                job.one(buf, p, found[k][1], found[k][2], idx, raw1[k])
            k = e
        return out.view(self.dtype)

    def _read_rows(self, box, out, found: list, direct: SourceFile) -> bool:
        """Place a small read over chunks that are all stored raw by reading, of each chunk, only its frame header
        (checked) and the rows (indices along the first dimension) the box needs, all ranges announced to the
        kernel at once (``SourceFile.read_scattered``): a 4 KiB peek at a bf16 matrix needs ~256 bytes of each of
        32 chunks of 64 KB. False, with nothing placed, when a chunk is not the size of a raw frame, the box needs
        more than a quarter of one, or a header says the chunk is not stored raw after all."""
        raw_size, slab, c0, (a0, b0) = self.chunk_nbytes + _RAW_HEAD, self._cstrides[0], self.chunks[0], box[0]
        spans, where = [], []  # where: (header span, rows span, offset of the rows in it, first row, last row + 1)
        for off, size, mask, idx in found:
            lo, hi = max(a0 - idx[0] * c0, 0), min(b0 - idx[0] * c0, c0)
            if size != raw_size or mask & 1 or (hi - lo) * slab * 4 > self.chunk_nbytes:
                return False
            rows, end = off + _RAW_HEAD + lo * slab, off + _RAW_HEAD + hi * slab
            if rows - off <= _MERGE_ROWS_GAP:  # the rows follow the header closely: one range
                spans.append((off, end))
                where.append((len(spans) - 1, len(spans) - 1, rows - off, lo, hi))
            else:
                spans += [(off, off + _RAW_HEAD), (rows, end)]
                where.append((len(spans) - 2, len(spans) - 1, 0, lo, hi))
        try:
            buf, at, _ = direct.read_scattered(spans, lambda n: _scratch("raw", n))
        except ShortRead as e:
            k = next(k for k, (h, r, _, _, _) in enumerate(where) if e.k in (h, r))
            raise CorruptChunkError(tuple(i * c for i, c in zip(found[k][3], self.chunks)),
                                    f"file ends inside the chunk ({e.got} of {spans[e.k][1] - spans[e.k][0]} bytes)"
                                    ) from None
        for (_, size, mask, _), (h, _, _, _, _) in zip(found, where):
            if not self._stored_raw(buf, at[h], size, mask):
                return False  # the whole chunk is read and decoded (or reported) the usual way
        for (_, _, _, idx), (_, r, skip, lo, hi) in zip(found, where):
            src, dst = self._slices(box, idx)
            rows = np.ndarray((hi - lo,) + self.chunks[1:], self.udtype, buf, at[r] + skip)
            out[dst] = rows[(slice(None),) + src[1:]]
        return True

    def _raw_run_end(self, found: list, pos, raw1: list, k: int, box) -> int:
        """End of the run of chunks from ``found[k]`` that one strided copy places: neighbours along the last
        dimension, stored raw, back to back in the fetched buffer, none cut by the box along that dimension
        (``k + 1``: chunk ``k`` is placed alone)."""
        c, step = self.chunks[-1], self.chunk_nbytes + _RAW_HEAD
        (a, b), idx, p = box[-1], found[k][3], pos[k]
        if not raw1[k] or idx[-1] * c < a or idx[-1] * c + c > b:
            return k + 1
        e = k + 1
        while (e < len(found) and raw1[e] and found[e][3][:-1] == idx[:-1] and found[e][3][-1] == idx[-1] + e - k
               and found[e][3][-1] * c + c <= b and pos[e] == p + (e - k) * step):
            e += 1
        return e

    def _stored_raw(self, buf, p: int, size: int, mask: int) -> bool:
        """Whether the chunk at ``buf[p:p+size]`` is a one-block LZ4 frame holding its bytes raw."""
        if mask & 1 or size != self.chunk_nbytes + _RAW_HEAD:
            return False
        total, block, stored = _HEAD.unpack_from(buf, p)
        return total == stored == self.chunk_nbytes and block >= total

    def _chunk_idx(self, li: int) -> tuple:
        """Grid indices of the chunk with linear index ``li``."""
        idx = []
        for g in reversed(self.grid):
            li, i = divmod(li, g)
            idx.append(i)
        return tuple(reversed(idx))

    def _slices(self, box, idx) -> tuple:
        """``(chunk-relative, box-relative)`` slices of the overlap of chunk ``idx`` (grid indices) with ``box``."""
        src, dst = [], []
        for (a, b), c, i in zip(box, self.chunks, idx):
            lo, hi = max(a, i * c), min(b, i * c + c)
            src.append(slice(lo - i * c, hi - i * c))
            dst.append(slice(lo - a, hi - a))
        return tuple(src), tuple(dst)

    def close(self) -> None:
        """Drop the index and the direct file handle (the dataset belongs to the caller)."""
        _indexes.forget(self)
        self._index = None
        self._looked_up = None
        self._raw = None


def _in_parallel(fn, parts: list) -> None:
    """``fn(*part)`` for every part: the first in the calling thread, the others in the shared pool."""
    pool = _executor(len(parts) - 1)
    futs = [pool.submit(fn, *p) for p in parts[1:]]
    err = None
    try:
        fn(*parts[0])
    except BaseException as e:  # noqa: BLE001 (wait for the others before raising)
        err = e
    for f in futs:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001
            err = err or e
    if err is not None:
        raise err


class _Job:
    """One ``read``: the chunks under the box (C order) and where they go; ``run(i, j)`` does chunks i..j-1."""

    def __init__(self, reader: LZ4ChunkReader, box, out, li, offs, sizes, masks, direct):
        self.r, self.box, self.out = reader, box, out
        self.li, self.offs, self.sizes, self.masks, self.direct = li, offs, sizes, masks, direct

    def run(self, i: int, j: int) -> None:
        """Chunks ``i..j-1`` of the job, in batches of about ``_BATCH_BYTES`` stored bytes (bounded memory)."""
        ends = np.searchsorted(np.cumsum(self.sizes[i:j]), np.arange(_BATCH_BYTES, int(self.sizes[i:j].sum()),
                                                                     _BATCH_BYTES), side="right")
        for lo, hi in zip([0, *ends.tolist()], [*ends.tolist(), j - i]):
            if hi > lo:
                self._batch(i + lo, i + hi)

    def _batch(self, i: int, j: int) -> None:
        """Fetch chunks ``i..j-1``, check their framing at once, then place them run by run."""
        r = self.r
        li, sizes, masks = self.li[i:j], self.sizes[i:j], self.masks[i:j]
        buf, pos = (self._fetch_direct(self.offs[i:j], sizes, li) if self.direct is not None
                    else self._fetch_chunks(sizes, li))
        nbytes, c, g = r.chunk_nbytes, r.chunks[-1], r.grid[-1]
        a, b = self.box[-1]
        head = np.zeros(len(li), _HEAD_DTYPE)
        ok = (sizes >= _RAW_HEAD) & ((masks & 1) == 0)
        if ok.any():
            ab = np.frombuffer(buf, np.uint8)
            head[ok] = ab[pos[ok, None] + np.arange(_RAW_HEAD)].view(_HEAD_DTYPE)[:, 0]
        stored = head["stored"].astype(np.int64)
        # one-block frames (every chunk under the 1 GiB default block size); raw when stored size == chunk size
        single = ok & (head["total"] == nbytes) & (head["block"] >= nbytes) & (stored + _RAW_HEAD <= sizes)
        raw1 = single & (stored == nbytes)
        ci = li % g  # chunk index along the last dimension
        cand = single & (ci * c >= a) & (ci * c + c <= b)  # not cut by the box along the last dimension
        # runs: neighbours along the last dimension, placed with one strided copy each
        nxt = cand[:-1] & cand[1:] & (np.diff(li) == 1) & (ci[1:] != 0)
        starts = np.flatnonzero(cand & ~np.concatenate(([False], nxt)))
        ends = np.flatnonzero(cand & ~np.concatenate((nxt, [False]))) + 1
        step = nbytes + _RAW_HEAD
        for s0, e0 in zip(starts.tolist(), ends.tolist()):
            if raw1[s0:e0].all() and (e0 - s0 == 1 or (np.diff(pos[s0:e0]) == step).all()):
                self.place_run(buf, int(pos[s0]) + _RAW_HEAD, step, int(li[s0]), e0 - s0)  # stored raw, back to back
            else:
                self._decode_run(buf, pos[s0:e0], stored[s0:e0], raw1[s0:e0], int(li[s0]))
        for k in np.flatnonzero(~cand).tolist():
            idx = r._chunk_idx(int(li[k]))  # noqa: SLF001
            self.one(buf, int(pos[k]), int(sizes[k]), int(masks[k]), idx, bool(raw1[k]))

    def _decode_run(self, buf, pos, stored, raw1, li0: int) -> None:
        """Decode a run of one-block chunks back to back into scratch (1-d: straight into the output), then place it."""
        r = self.r
        nbytes, nrun = r.chunk_nbytes, len(pos)
        fn = lz4_decompress_safe()
        if len(r.chunks) == 1:  # the run's output is one contiguous range
            tmp = None
            dst = self.out.__array_interface__["data"][0] + \
                (li0 * r.chunks[0] - self.box[0][0]) * r.udtype.itemsize
        else:
            tmp = _scratch("dec", nrun * nbytes)
            dst = _addr(tmp)
        src = _addr(buf) + _RAW_HEAD
        for k, (p, n, raw) in enumerate(zip(pos.tolist(), stored.tolist(), raw1.tolist())):
            if raw:
                ctypes.memmove(dst + k * nbytes, src + p, nbytes)
            elif fn(src + p, dst + k * nbytes, n, nbytes) != nbytes:
                raise CorruptChunkError(self._coords(li0 + k), "block 0 does not decode to the chunk's size")
        if tmp is not None:
            self.place_run(tmp, 0, nbytes, li0, nrun)

    def coords(self, idx: tuple) -> tuple:
        """Dataset offset of the chunk with grid indices ``idx``."""
        return tuple(i * c for i, c in zip(idx, self.r.chunks))

    def _coords(self, li: int) -> tuple:
        return self.coords(self.r._chunk_idx(li))  # noqa: SLF001

    def fetch_few(self, found: list):
        """Read the chunks ``found`` (``(offset, size, mask, grid indices)`` each) into one buffer: one ``preadv``
        per run of chunks at most ``_MAX_GAP`` apart in the file, or chunk by chunk with ``read_direct_chunk``
        without a direct handle; returns the buffer and each chunk's position in it."""
        pos = [0] * len(found)
        if self.direct is None:
            buf = _scratch("raw", sum(f[1] for f in found))
            mv, did, at = memoryview(buf), self.r.dset.id, 0
            for k, (_, size, _, idx) in enumerate(found):
                got = len(did.read_direct_chunk(self.coords(idx), out=mv[at:at + size])[1])
                if got != size:
                    raise CorruptChunkError(self.coords(idx), f"chunk read returned {got} of {size} bytes")
                pos[k], at = at, at + size
            return buf, pos
        spans = []  # [file offset, end, chunks]: chunks in file order, each starting at most _MAX_GAP after the
        for k in sorted(range(len(found)), key=lambda k: found[k][0]):  # last one's end (never overlapping it)
            off, size = found[k][0], found[k][1]
            if spans and spans[-1][1] <= off <= spans[-1][1] + _MAX_GAP:
                spans[-1][1] = off + size
                spans[-1][2].append(k)
            else:
                spans.append([off, off + size, [k]])
        try:
            buf, at, _ = self.direct.read_spans([(lo, end) for lo, end, _ in spans], lambda n: _scratch("raw", n))
        except ShortRead as e:
            lo, end, ks = spans[e.k]
            raise CorruptChunkError(self.coords(found[ks[0]][3]),
                                    f"file ends inside the chunk ({e.got} of {end - lo} bytes)") from None
        for (lo, _, ks), a in zip(spans, at):
            for k in ks:
                pos[k] = a + found[k][0] - lo
        return buf, pos

    def _fetch_direct(self, offs, sizes, li):
        """Read the chunks with one ``preadv`` per group of neighbouring chunks; their positions in the buffer."""
        order = np.argsort(offs, kind="stable") if (np.diff(offs) < 0).any() else None
        o = offs if order is None else offs[order]
        sz = sizes if order is None else sizes[order]
        ends = o + sz
        breaks = np.flatnonzero((o[1:] - ends[:-1] > _MAX_GAP) | (o[1:] < ends[:-1])) + 1
        starts = np.concatenate(([0], breaks))
        span_lo = o[starts]
        span_len = np.maximum.reduceat(ends, starts) - span_lo
        try:
            buf, at, _ = self.direct.read_spans(zip(span_lo.tolist(), (span_lo + span_len).tolist()),
                                                lambda n: _scratch("raw", n))
        except ShortRead as e:
            first = int(starts[e.k]) if order is None else int(order[starts[e.k]])
            raise CorruptChunkError(self._coords(int(li[first])),
                                    f"file ends inside the chunk ({e.got} of {int(span_len[e.k])} bytes)") from None
        span_at = np.array(at, dtype=np.int64)
        pos_sorted = np.repeat(span_at - span_lo, np.diff(np.concatenate((starts, [len(o)])))) + o
        if order is None:
            return buf, pos_sorted
        pos = np.empty_like(pos_sorted)
        pos[order] = pos_sorted
        return buf, pos

    def _fetch_chunks(self, sizes, li):
        """Read the chunks one by one with ``read_direct_chunk``, back to back in the buffer."""
        pos = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        buf = _scratch("raw", int(sizes.sum()))
        mv = memoryview(buf)
        did = self.r.dset.id
        for k, p, n in zip(li.tolist(), pos.tolist(), sizes.tolist()):
            _, got = did.read_direct_chunk(self._coords(k), out=mv[p:p + n])
            if len(got) != n:
                raise CorruptChunkError(self._coords(k), f"chunk read returned {len(got)} of {n} bytes")
        return buf, pos

    def place_run(self, buf, offset: int, step: int, li0: int, nrun: int) -> None:
        """Copy ``nrun`` decoded chunks, neighbours along the last dimension found every ``step`` bytes from
        ``buf[offset]``, into the output with one strided copy."""
        r, out = self.r, self.out
        nd, c, item = len(r.chunks), r.chunks[-1], r.udtype.itemsize
        idx = r._chunk_idx(li0)  # noqa: SLF001
        src_sel, dst_off, dst_shape = [slice(None)], (idx[-1] * c - self.box[-1][0]) * item, []
        for d in range(nd - 1):
            (a, b), cd, i = self.box[d], r.chunks[d], idx[d]
            lo, hi = max(a, i * cd), min(b, i * cd + cd)
            src_sel.append(slice(lo - i * cd, hi - i * cd))
            dst_off += (lo - a) * out.strides[d]
            dst_shape.append(hi - lo)
        # a chunk's rows along the last dimension are whole and contiguous on both sides: copy each as one opaque
        # item of c * item bytes (numpy then copies whole rows instead of element by element: several times faster
        # for the narrow chunks h5py picks, e.g. 32 columns of bf16)
        row = np.dtype((np.void, c * item))
        src = np.ndarray((nrun,) + r.chunks[:-1], row, buf, offset, (step,) + r._cstrides[:-1])  # noqa: SLF001
        src = src[tuple(src_sel)]
        dst = np.ndarray(tuple(dst_shape) + (nrun,), row, out, dst_off, out.strides[:-1] + (c * item,))
        np.copyto(dst, src.transpose(r._run_axes[:-1]), casting="no")  # noqa: SLF001

    def one(self, buf, p: int, size: int, mask: int, idx: tuple, raw1: bool) -> None:
        """One chunk (grid indices ``idx``) stored at ``buf[p:p+size]``, copied or decoded into the output."""
        r = self.r
        nbytes, ud = r.chunk_nbytes, r.udtype
        src, dst_sl = r._slices(self.box, idx)  # noqa: SLF001
        dst = self.out[dst_sl]
        if mask & 1:  # the optional LZ4 filter was skipped: stored as is
            if size != nbytes:
                raise CorruptChunkError(self.coords(idx), f"unfiltered chunk has {size} bytes, expected {nbytes}")
            chunk = np.ndarray(r.chunks, ud, buf, p)
        elif raw1:
            chunk = np.ndarray(r.chunks, ud, buf, p + _RAW_HEAD)
        else:
            frame = memoryview(buf)[p:p + size]
            whole = all(s.start == 0 and s.stop == n for s, n in zip(src, r.chunks))
            if whole and dst.flags.c_contiguous:  # decode straight into the output
                decode_frame(frame, _addr(buf) + p, nbytes, dst.__array_interface__["data"][0], self.coords(idx))
                return
            tmp = _scratch("dec", nbytes)
            decode_frame(frame, _addr(buf) + p, nbytes, _addr(tmp), self.coords(idx))
            chunk = np.ndarray(r.chunks, ud, tmp)
        dst[...] = chunk[src]
