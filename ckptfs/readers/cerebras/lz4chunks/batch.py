"""A read over many chunks, vectorised with numpy: fetched in batches, framing checked at once, placed run by run.

A run is a row of neighbouring chunks along the last dimension, none cut by the box there: stored raw and back to
back in the buffer (incompressible data, i.e. most real weights) it is placed with one strided copy; otherwise its
one-block frames are decoded back to back into scratch (1-d: straight into the output) and then placed. Every other
chunk (cut by the box, multi-block frames, stored without the filter) is placed alone.
"""
from __future__ import annotations

import numpy as np

from .fetch import fetch_each, fetch_sorted
from ....storage.base import Blob
from .frame import RAW_HEAD, address, decode_single_blocks, frame_heads
from .grid import ChunkGrid
from ....storage.base import thread_scratch as scratch

#: stored bytes fetched and placed at a time by one thread
BATCH_BYTES = 4 << 20


class BatchRead:
    """One read of ``box`` into ``out``: the chunks under it (linear indices ``li`` in C order, stored at ``offs``,
    ``sizes`` bytes, filter ``masks``), fetched from ``file`` (None: through HDF5). ``run(i, j)`` does chunks
    ``i..j-1``; disjoint ranges may run in parallel."""

    def __init__(self, grid: ChunkGrid, dset, box, out, li, offs, sizes, masks, file: Blob | None):
        self.grid, self.dset, self.box, self.out = grid, dset, box, out
        self.li, self.offs, self.sizes, self.masks, self.file = li, offs, sizes, masks, file

    def run(self, i: int, j: int) -> None:
        """Chunks ``i..j-1``, in batches of about ``BATCH_BYTES`` stored bytes (bounded memory)."""
        ends = np.searchsorted(np.cumsum(self.sizes[i:j]), np.arange(BATCH_BYTES, int(self.sizes[i:j].sum()),
                                                                     BATCH_BYTES), side="right")
        for lo, hi in zip([0, *ends.tolist()], [*ends.tolist(), j - i]):
            if hi > lo:
                self._batch(i + lo, i + hi)

    def _batch(self, i: int, j: int) -> None:
        """Fetch chunks ``i..j-1``, check their framing at once, then place them run by run."""
        g, out, box = self.grid, self.out, self.box
        li, sizes, masks = self.li[i:j], self.sizes[i:j], self.masks[i:j]
        buf, pos = (fetch_sorted(g, self.file, self.offs[i:j], sizes, li) if self.file is not None
                    else fetch_each(g, self.dset, sizes, li))
        nbytes, c, count = g.chunk_nbytes, g.chunks[-1], g.counts[-1]
        a, b = box[-1]
        single, raw1, stored = frame_heads(buf, pos, sizes, masks, nbytes)
        ci = li % count  # chunk index along the last dimension
        cand = single & (ci * c >= a) & (ci * c + c <= b)  # not cut by the box along the last dimension
        # runs: neighbours along the last dimension, placed with one strided copy each
        nxt = cand[:-1] & cand[1:] & (np.diff(li) == 1) & (ci[1:] != 0)
        starts = np.flatnonzero(cand & ~np.concatenate(([False], nxt)))
        ends = np.flatnonzero(cand & ~np.concatenate((nxt, [False]))) + 1
        step = nbytes + RAW_HEAD
        for s0, e0 in zip(starts.tolist(), ends.tolist()):
            if raw1[s0:e0].all() and (e0 - s0 == 1 or (np.diff(pos[s0:e0]) == step).all()):
                g.place_run(out, box, buf, int(pos[s0]) + RAW_HEAD, step, int(li[s0]), e0 - s0)  # raw, back to back
            else:
                self._decode_run(buf, pos[s0:e0], stored[s0:e0], raw1[s0:e0], int(li[s0]))
        for k in np.flatnonzero(~cand).tolist():
            g.place_chunk(out, box, buf, int(pos[k]), int(sizes[k]), int(masks[k]), g.chunk_idx(int(li[k])),
                          bool(raw1[k]))

    def _decode_run(self, buf, pos, stored, raw1, li0: int) -> None:
        """Decode a run of one-block chunks back to back into scratch (1-d: straight into the output), then place it."""
        g = self.grid
        nbytes, nrun = g.chunk_nbytes, len(pos)
        if len(g.chunks) == 1:  # the run's output is one contiguous range
            tmp = None
            dst = self.out.__array_interface__["data"][0] + (li0 * g.chunks[0] - self.box[0][0]) * g.udtype.itemsize
        else:
            tmp = scratch("dec", nrun * nbytes)
            dst = address(tmp)
        decode_single_blocks(address(buf) + RAW_HEAD, pos, stored, raw1, dst, nbytes,
                             lambda k: g.coords(g.chunk_idx(li0 + k)))
        if tmp is not None:
            g.place_run(self.out, self.box, tmp, 0, nbytes, li0, nrun)
