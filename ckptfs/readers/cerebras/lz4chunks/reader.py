"""``LZ4ChunkReader.read(box)``: a box of one LZ4-only chunked dataset, and which way to read it.

A read looks up the chunks under the box (``index``), fetches their stored bytes (``fetch``, from the reader's
``Blob`` when it has one) and places them into the output (``grid``); unallocated chunks give the dataset's
fill value. Which way, by the size of the read:

* a peek over chunks that are all stored raw (at most a quarter of each needed) reads only each chunk's frame
  header, checked, and the rows it needs, every range announced to the kernel first so that a cold disk reads them
  together;
* a cache block of whole chunk rows over chunks all stored raw, in the grid's order in the file and close together
  (incompressible weights written in one go) is one file read, its frame headers checked at once, and one strided
  copy per run of neighbours (``_read_raw_rows``);
* a read over a few chunks (up to ``FEW_CHUNKS``, or ``FEW_RAW_CHUNKS`` when at most ``FEW_CHUNKS`` of them are
  compressed: a cache block of raw weights) goes chunk by chunk in plain Python, which costs less than numpy's
  set-up of the batch; neighbouring raw chunks are still placed as one run;
* anything larger is a ``BatchRead``, split over the decoding threads (the calling thread takes one share) when it
  has at least ``MIN_PARALLEL_BYTES`` of compressed chunks to decode; chunks stored raw are memory copies, which a
  second thread slowed down (memory-bound), so they stay in the calling thread.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from ....storage.base import Blob, ShortRead
from ..lz4filter import LZ4_FILTER_ID
from . import frame
from .batch import BatchRead
from .fetch import MAX_GAP, fetch_found, fetch_scattered, scratch_raw
from .files import OpenChunkFile, local_chunk_files
from .frame import RAW_HEAD, stored_raw
from .grid import ChunkGrid
from .index import ChunkIndex
from .pool import decode_threads, in_parallel

#: split a read over threads only when it has at least this many bytes to decode (compressed chunks)
MIN_PARALLEL_BYTES = 256 << 10
#: reads over at most this many chunks go chunk by chunk in plain Python (numpy set-up costs more)
FEW_CHUNKS = 4
#: ... and so do reads over at most this many chunks of which at most ``FEW_CHUNKS`` are not stored raw (a 2 MB
#: cache block of a bf16 matrix is 32 chunks of cstorch's shape; measured in docs/measurements.md)
FEW_RAW_CHUNKS = 64
#: a small read of a raw chunk whose rows start at most this far after its frame header reads header and rows as one
#: range (the disk reads whole pages anyway); further on, as two
MERGE_ROWS_GAP = 4096
#: ``_read_few``'s answer when the read has more compressed chunks than it takes: use the batch
_BATCH = object()
#: stored chunks less than this far apart are announced ahead as one range (``will_need``)
ANNOUNCE_GAP = 1 << 20
#: the most separate ranges one ``will_need`` announces (chunks of consecutive rows are usually stored in order: one)
ANNOUNCE_RANGES = 16

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
    if frame.lz4_decompress_safe() is None:
        return "LZ4 library unavailable"
    return None


def plan(dset, *, open_file: OpenChunkFile = local_chunk_files.open) -> "LZ4ChunkReader | None":
    """A chunk reader for ``dset``, or None when the plain h5py read must be used (also if HDF5 cannot say);
    ``open_file``: where its stored chunks are fetched from."""
    try:
        dcpl = dset.id.get_create_plist() if hasattr(dset, "id") else None
        return LZ4ChunkReader(dset, dcpl, open_file=open_file) if why_not(dset, dcpl) is None else None
    except (OSError, RuntimeError, ValueError, TypeError, KeyError, AttributeError):
        return None


class LZ4ChunkReader:
    """Reads boxes of one LZ4-only chunked dataset (``dset``) by decoding its chunks itself (see the module
    docstring); ``open_file`` gives the file its chunks are fetched from (asked once, on the first read)."""

    def __init__(self, dset, dcpl=None, *, open_file: OpenChunkFile = local_chunk_files.open):
        from h5py import h5d

        did = dset.id
        dcpl = dcpl if dcpl is not None else did.get_create_plist()
        self.dset = dset
        self.dtype = did.dtype  # what h5py returns: the output's dtype
        self.grid = ChunkGrid(did.shape, dcpl.get_chunk(), self.dtype.itemsize)
        self.index = ChunkIndex(dset, self.grid)
        self.fill_ok = (dcpl.get_fill_time() != h5d.FILL_TIME_NEVER
                        and dcpl.fill_value_defined() != h5d.FILL_VALUE_UNDEFINED)
        self.fill = None
        if self.fill_ok:  # as h5py's ``Dataset.fillvalue``, from the property list already at hand
            fill = np.zeros((1,), self.dtype)
            dcpl.get_fill_value(fill)
            self.fill = fill.view(self.grid.udtype)[0]
        self._open_file = open_file
        self._file: "Blob | bool | None" = None  # None: not yet asked; False: none, use read_direct_chunk

    @property
    def file(self) -> Blob | None:
        """The file chunks are fetched from; None before the first read that fetched any, or when there is none."""
        return self._file or None

    def _chunk_file(self, first_stored) -> Blob | None:
        """The file to fetch from (None: use ``read_direct_chunk``), asked for once per reader; ``first_stored()``
        gives ``(coords, offset, size)`` of one allocated chunk to check it with (None: none yet, ask again next
        time). It is only called while the file is not known."""
        file = self._file
        if file is None:
            probe = first_stored()
            if probe is None:
                return None
            file = self._file = self._open_file(self.dset, *probe) or False
        return file or None

    def prepare(self) -> None:
        """Read the chunk index and settle where chunks are fetched from now, as the first read would (a mount's
        background work: the first reader then waits for neither)."""
        offs, sizes, _ = self.index.arrays()
        self._chunk_file(lambda: self.index.first_stored(offs, sizes))

    def will_need(self, e0: int, e1: int, continuing: bool = False) -> None:
        """Announce to the chunk file (``Blob.will_need``) the stored chunks holding elements ``[e0, e1)`` of the
        dataset in C order: every chunk of the chunk rows under those elements, as the file ranges they are stored
        in (neighbours less than ``ANNOUNCE_GAP`` apart as one, at most ``ANNOUNCE_RANGES`` ranges). Bounded work:
        the chunk index (built once per dataset, as a read builds it) and slices of it; nothing is read. Nothing is
        announced when chunks come through HDF5 (no file). ``continuing``: as ``VirtualTensor.will_need``."""
        g = self.grid
        row = math.prod(g.shape[1:])  # elements of one row along the first dimension
        if e1 <= e0 or not g.shape or row == 0 or not self.dset.id.valid:
            return
        c0, c1 = e0 // row // g.chunks[0], (-(-e1 // row) - 1) // g.chunks[0] + 1  # the chunk rows under them
        offs, sizes, _ = self.index.arrays()
        file = self._chunk_file(lambda: self.index.first_stored(offs, sizes))
        if file is None:
            return
        lo, hi = c0 * g.gstride[0], min(c1 * g.gstride[0], g.nchunks)
        stored = sizes[lo:hi] >= 0
        if not stored.any():
            return
        at, size = offs[lo:hi][stored], sizes[lo:hi][stored]
        order = np.argsort(at, kind="stable")
        at, end = at[order], np.maximum.accumulate((at + size)[order])
        firsts = np.concatenate(([0], np.flatnonzero(at[1:] > end[:-1] + ANNOUNCE_GAP) + 1))[:ANNOUNCE_RANGES]
        lasts = np.concatenate((firsts[1:], [len(at)])) - 1
        for a, b in zip(at[firsts].tolist(), end[lasts].tolist()):
            file.will_need(a, b - a, announced=not continuing)

    def read(self, box) -> np.ndarray | None:
        """The box as a C-contiguous array of ``dset.dtype``; None if the caller must use h5py for this box (out of
        range, a closed dataset, or an unallocated chunk without a fill value HDF5 would apply)."""
        g = self.grid
        box = tuple((int(a), int(b)) for a, b in box)
        if len(box) != len(g.shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(box, g.shape)):
            return None  # out of range: h5py reports it exactly as before
        if not self.dset.id.valid:
            return None  # closed: h5py raises as before
        out = np.empty(tuple(b - a for a, b in box), g.udtype)
        if out.size == 0:
            return out.view(self.dtype)
        ranges = g.ranges(box)
        n = math.prod(len(r) for r in ranges)
        if self.index.may_look_up(ranges, n, out.nbytes):
            return self._read_few(box, out, ranges, None)  # a peek: its chunks looked up, the dataset not indexed
        offs, sizes, masks = arrays = self.index.arrays()
        if self._read_raw_rows(box, out, ranges, arrays):
            return out.view(self.dtype)
        if n <= FEW_RAW_CHUNKS:  # plain Python is cheaper than numpy
            got = self._read_few(box, out, ranges, arrays, None if n <= FEW_CHUNKS else FEW_CHUNKS)
            if got is not _BATCH:
                return got
        file = self._chunk_file(lambda: self.index.first_stored(offs, sizes))
        # every chunk under the box, in C order of the chunk grid
        li = np.zeros([len(r) for r in ranges], np.int64)
        for d, (r, s) in enumerate(zip(ranges, g.gstride)):
            li += (np.arange(r.start, r.stop) * s).reshape([-1 if i == d else 1 for i in range(len(ranges))])
        li = li.reshape(-1)
        csize = sizes[li]
        hole = csize < 0
        if hole.any():
            if not self.fill_ok:
                return None
            for k in np.flatnonzero(hole).tolist():
                out[g.slices(box, g.chunk_idx(int(li[k])))[1]] = self.fill
            li, csize = li[~hole], csize[~hole]
            if not li.size:
                return out.view(self.dtype)
        job = BatchRead(g, self.dset, box, out, li, offs[li], csize, masks[li], file)
        # only LZ4 decoding gains from threads: raw chunks are memory copies (docs/measurements.md)
        work = int((csize < g.chunk_nbytes).sum()) * g.chunk_nbytes
        threads = 1 if work < MIN_PARALLEL_BYTES else min(decode_threads(), li.size)
        bounds = [li.size * t // threads for t in range(threads + 1)]
        parts = [(bounds[t], bounds[t + 1]) for t in range(threads) if bounds[t + 1] > bounds[t]]
        if len(parts) == 1:
            job.run(*parts[0])
        else:
            in_parallel(job.run, parts)
        return out.view(self.dtype)

    def _read_few(self, box, out, ranges, arrays, most_packed: int | None = None):
        """``read`` for a box over a few chunks, chunk by chunk in plain Python; each chunk's place comes from
        ``arrays`` (None: looked up, ``ChunkIndex.lookup_at``); neighbouring chunks are fetched with one read. With
        ``most_packed``: ``_BATCH`` (nothing fetched) if more chunks than that are not the size of a raw one."""
        g = self.grid
        found = []  # (offset, size, mask, grid indices) of the allocated chunks
        lookup, last, gstride = self.index.lookup_at, ranges[-1], g.gstride
        for head in itertools.product(*ranges[:-1]):  # C order: the last grid index varies fastest
            base = sum(i * s for i, s in zip(head, gstride))
            for j in last:
                idx = head + (j,)
                off, size, mask = lookup(base + j, idx, arrays)
                if size < 0:
                    if not self.fill_ok:
                        return None
                    out[g.slices(box, idx)[1]] = self.fill
                else:
                    found.append((off, size, mask, idx))
        if not found:
            return out.view(self.dtype)
        nbytes = g.chunk_nbytes
        if most_packed is not None:
            raw_size = nbytes + RAW_HEAD
            if sum(size != raw_size for _, size, _, _ in found) > most_packed:
                return _BATCH
        file = self._chunk_file(lambda: (g.coords(found[0][3]), found[0][0], found[0][1]))
        if file is not None and self._read_rows(box, out, found, file):
            return out.view(self.dtype)
        buf, pos = fetch_found(g, self.dset, file, found)
        raw1 = [stored_raw(buf, p, size, mask, nbytes) for (_, size, mask, _), p in zip(found, pos)]
        k = 0
        while k < len(found):
            e = g.raw_run_end(found, pos, raw1, k, box)
            idx, p = found[k][3], pos[k]
            if e - k > 1:
                g.place_run(out, box, buf, p + RAW_HEAD, nbytes + RAW_HEAD, sum(i * s for i, s in zip(idx, gstride)),
                            e - k)
            else:
                g.place_chunk(out, box, buf, p, found[k][1], found[k][2], idx, raw1[k])
            k = e
        return out.view(self.dtype)

    def _read_raw_rows(self, box, out, ranges, arrays) -> bool:
        """Place a box of whole chunk rows (a cache block: whole rows, starting and ending on chunk boundaries) whose
        chunks are all stored raw, in the grid's order in the file and at most ``MAX_GAP`` apart (incompressible
        weights written in one go, with an HDF5 index node here and there between them): one read, the frame headers
        checked at once, one strided copy per run of neighbours, no Python per chunk. False, with nothing placed,
        when the box or its chunks are not of that kind (a box cutting chunk rows keeps ``_read_rows``, which reads
        only its rows), or a header says a chunk is not stored raw after all (the general path then decodes or
        reports it)."""
        g = self.grid
        shape, (a0, b0), c0 = g.shape, box[0], g.chunks[0]
        if (len(shape) < 2 or shape[-1] % g.chunks[-1] or a0 % c0 or (b0 % c0 and b0 != shape[0])
                or any(box[d] != (0, shape[d]) for d in range(1, len(shape)))):
            return False
        lo, hi = ranges[0].start * g.gstride[0], ranges[0].stop * g.gstride[0]  # its chunks: one stretch of the grid
        nbytes = g.chunk_nbytes
        raw_size = nbytes + RAW_HEAD
        offs, sizes, masks = (x[lo:hi] for x in arrays)
        step = np.diff(offs)
        if not ((sizes == raw_size).all() and not (masks & 1).any()
                and ((step >= raw_size) & (step <= raw_size + MAX_GAP)).all()):
            return False
        first = int(offs[0])
        file = self._chunk_file(lambda: (g.coords(g.chunk_idx(lo)), first, raw_size))
        if file is None:
            return False
        try:
            buf, at = file.read_spans([(first, int(offs[-1]) + raw_size)], scratch_raw)
        except ShortRead:
            return False  # reported, naming the chunk, by the general path
        pos = offs - (first - at[0])
        _, raw, _ = frame.frame_heads(buf, pos, sizes, masks, nbytes)
        if not raw.all():
            return False
        # runs of neighbours: a new one at each row of chunks along the last dimension and after each gap
        per_row = g.counts[-1]
        cut = np.flatnonzero(step != raw_size) + 1
        starts = sorted(set(range(0, hi - lo, per_row)).union(cut.tolist()))
        for k, e in zip(starts, starts[1:] + [hi - lo]):
            g.place_run(out, box, buf, int(pos[k]) + RAW_HEAD, raw_size, lo + k, e - k)
        return True

    def _read_rows(self, box, out, found: list, file: Blob) -> bool:
        """Place a small read over chunks that are all stored raw by reading, of each chunk, only its frame header
        (checked) and the rows (indices along the first dimension) the box needs, all ranges requested at once
        (``Blob.read_scattered``): a 4 KiB peek at a bf16 matrix needs ~256 bytes of each of 32 chunks of
        64 KB. False, with nothing placed, when a chunk is not the size of a raw frame, the box needs more than a
        quarter of one, or a header says the chunk is not stored raw after all."""
        g = self.grid
        nbytes = g.chunk_nbytes
        raw_size, slab, c0, (a0, b0) = nbytes + RAW_HEAD, g.cstrides[0], g.chunks[0], box[0]
        spans, where = [], []  # where: (header span, rows span, offset of the rows in it, first row, last row + 1)
        for off, size, mask, idx in found:
            lo, hi = max(a0 - idx[0] * c0, 0), min(b0 - idx[0] * c0, c0)
            if size != raw_size or mask & 1 or (hi - lo) * slab * 4 > nbytes:
                return False
            rows, end = off + RAW_HEAD + lo * slab, off + RAW_HEAD + hi * slab
            if rows - off <= MERGE_ROWS_GAP:  # the rows follow the header closely: one range
                spans.append((off, end))
                where.append((len(spans) - 1, len(spans) - 1, rows - off, lo, hi))
            else:
                spans += [(off, off + RAW_HEAD), (rows, end)]
                where.append((len(spans) - 2, len(spans) - 1, 0, lo, hi))
        buf, at = fetch_scattered(g, file, spans,
                                  lambda s: found[next(k for k, (h, r, _, _, _) in enumerate(where) if s in (h, r))][3])
        for (_, size, mask, _), (h, _, _, _, _) in zip(found, where):
            if not stored_raw(buf, at[h], size, mask, nbytes):
                return False  # the whole chunk is read and decoded (or reported) the usual way
        for (_, _, _, idx), (_, r, skip, lo, hi) in zip(found, where):
            src, dst = g.slices(box, idx)
            rows = np.ndarray((hi - lo,) + g.chunks[1:], g.udtype, buf, at[r] + skip)
            out[dst] = rows[(slice(None),) + src[1:]]
        return True

    def close(self) -> None:
        """Drop the index and the file handle (the dataset belongs to the caller)."""
        self.index.drop()
        self._file = None

