"""Fetching stored chunks into one scratch buffer: over coalesced file ranges from a ``Blob``, or chunk by chunk
through HDF5 (``read_direct_chunk``, no filter applied) when the reader has no such file.

A file that ends inside a chunk raises ``CorruptChunkError`` naming the chunk, never zeros.
"""
from __future__ import annotations

import numpy as np

from ....storage.base import Blob, ShortRead
from .frame import CorruptChunkError
from .grid import ChunkGrid
from ....storage.base import thread_scratch as scratch

#: chunks further apart than this in the file are fetched by separate reads
MAX_GAP = 64 << 10


def scratch_raw(n: int):
    """This thread's scratch buffer of at least ``n`` bytes for raw chunk bytes read from the file."""
    return scratch("raw", n)


def fetch_found(grid: ChunkGrid, dset, file: Blob | None, found: list) -> tuple:
    """Read the chunks ``found`` (``(offset, size, mask, grid indices)`` each) of ``dset`` into one buffer: one read
    per run of chunks at most ``MAX_GAP`` apart in ``file``, or chunk by chunk with ``read_direct_chunk`` without
    one; returns the buffer and each chunk's position in it."""
    pos = [0] * len(found)
    if file is None:
        buf = scratch("raw", sum(f[1] for f in found))
        mv, did, at = memoryview(buf), dset.id, 0
        for k, (_, size, _, idx) in enumerate(found):
            got = len(did.read_direct_chunk(grid.coords(idx), out=mv[at:at + size])[1])
            if got != size:
                raise CorruptChunkError(grid.coords(idx), f"chunk read returned {got} of {size} bytes")
            pos[k], at = at, at + size
        return buf, pos
    spans = []  # [file offset, end, chunks]: chunks in file order, each starting at most MAX_GAP after the
    for k in sorted(range(len(found)), key=lambda k: found[k][0]):  # last one's end (never overlapping it)
        off, size = found[k][0], found[k][1]
        if spans and spans[-1][1] <= off <= spans[-1][1] + MAX_GAP:
            spans[-1][1] = off + size
            spans[-1][2].append(k)
        else:
            spans.append([off, off + size, [k]])
    try:
        buf, at = file.read_spans([(lo, end) for lo, end, _ in spans], scratch_raw)
    except ShortRead as e:
        lo, end, ks = spans[e.k]
        raise CorruptChunkError(grid.coords(found[ks[0]][3]),
                                f"file ends inside the chunk ({e.got} of {end - lo} bytes)") from None
    for (lo, _, ks), a in zip(spans, at):
        for k in ks:
            pos[k] = a + found[k][0] - lo
    return buf, pos


def fetch_scattered(grid: ChunkGrid, file: Blob, spans: list, chunk_of) -> tuple:
    """``file.read_scattered(spans)``: ``(buffer, positions)``; ``chunk_of(k)`` names the grid indices of the chunk
    span ``k`` belongs to, should the file end inside it."""
    try:
        buf, at = file.read_scattered(spans, scratch_raw)
    except ShortRead as e:
        raise CorruptChunkError(grid.coords(chunk_of(e.k)),
                                f"file ends inside the chunk ({e.got} of {spans[e.k][1] - spans[e.k][0]} bytes)"
                                ) from None
    return buf, at


def fetch_sorted(grid: ChunkGrid, file: Blob, offs: np.ndarray, sizes: np.ndarray, li: np.ndarray) -> tuple:
    """Read the chunks (linear indices ``li``, stored at ``offs``, ``sizes`` bytes) with one read per group of
    neighbouring chunks in ``file``; returns the buffer and their positions in it."""
    order = np.argsort(offs, kind="stable") if (np.diff(offs) < 0).any() else None
    o = offs if order is None else offs[order]
    sz = sizes if order is None else sizes[order]
    ends = o + sz
    breaks = np.flatnonzero((o[1:] - ends[:-1] > MAX_GAP) | (o[1:] < ends[:-1])) + 1
    starts = np.concatenate(([0], breaks))
    span_lo = o[starts]
    span_len = np.maximum.reduceat(ends, starts) - span_lo
    try:
        buf, at = file.read_spans(zip(span_lo.tolist(), (span_lo + span_len).tolist()), scratch_raw)
    except ShortRead as e:
        first = int(starts[e.k]) if order is None else int(order[starts[e.k]])
        raise CorruptChunkError(grid.coords(grid.chunk_idx(int(li[first]))),
                                f"file ends inside the chunk ({e.got} of {int(span_len[e.k])} bytes)") from None
    span_at = np.array(at, dtype=np.int64)
    pos_sorted = np.repeat(span_at - span_lo, np.diff(np.concatenate((starts, [len(o)])))) + o
    if order is None:
        return buf, pos_sorted
    pos = np.empty_like(pos_sorted)
    pos[order] = pos_sorted
    return buf, pos


def fetch_each(grid: ChunkGrid, dset, sizes: np.ndarray, li: np.ndarray) -> tuple:
    """Read the chunks one by one with ``read_direct_chunk``, back to back in the buffer; their positions."""
    pos = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    buf = scratch("raw", int(sizes.sum()))
    mv = memoryview(buf)
    did = dset.id
    for k, p, n in zip(li.tolist(), pos.tolist(), sizes.tolist()):
        coords = grid.coords(grid.chunk_idx(k))
        _, got = did.read_direct_chunk(coords, out=mv[p:p + n])
        if len(got) != n:
            raise CorruptChunkError(coords, f"chunk read returned {len(got)} of {n} bytes")
    return buf, pos
