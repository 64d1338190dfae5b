"""The chunk grid of one dataset: which chunks a box covers, and placing fetched chunks into the box's array.

Pure geometry and memory copies, no I/O. Bytes are copied as unsigned integers of the element's size (bit-exact
whatever the type); a chunk is placed from its LZ4 frame (``frame``): the raw payload copied, anything else decoded.
"""
from __future__ import annotations

import math

import numpy as np

from .frame import RAW_HEAD, CorruptChunkError, address, decode_frame
from ....storage.base import thread_scratch as scratch


class ChunkGrid:
    """``shape`` cut into ``chunks``; chunks are numbered in C order of the grid (``counts`` chunks per dimension).

    ``box``: ``((start, stop), ...)`` per dimension; ``idx``: a chunk's grid indices; ``li``: its linear number.
    """

    __slots__ = ("shape", "chunks", "udtype", "chunk_nbytes", "counts", "nchunks", "gstride", "cstrides", "run_axes")

    def __init__(self, shape: tuple, chunks: tuple, itemsize: int):
        self.shape = tuple(int(n) for n in shape)
        self.chunks = tuple(int(c) for c in chunks)
        self.udtype = np.dtype(f"u{itemsize}")  # bytes are copied as unsigned ints: bit-exact
        self.chunk_nbytes = math.prod(self.chunks) * itemsize
        self.counts = tuple(-(-n // c) for n, c in zip(self.shape, self.chunks))
        self.nchunks = math.prod(self.counts)
        #: linear number = sum(idx * gstride); byte strides of a chunk in C order
        self.gstride = tuple(math.prod(self.counts[i + 1:]) for i in range(len(self.counts)))
        self.cstrides = tuple(math.prod(self.chunks[i + 1:]) * itemsize for i in range(len(self.chunks)))
        nd = len(self.chunks)
        self.run_axes = tuple(range(1, nd)) + (0, nd)  # (run, *chunk) -> (*chunk[:-1], run, chunk[-1])

    def ranges(self, box) -> list:
        """The grid indices the box covers, per dimension."""
        return [range(a // c, (b - 1) // c + 1) for (a, b), c in zip(box, self.chunks)]

    def chunk_idx(self, li: int) -> tuple:
        """Grid indices of the chunk with linear index ``li``."""
        idx = []
        for g in reversed(self.counts):
            li, i = divmod(li, g)
            idx.append(i)
        return tuple(reversed(idx))

    def coords(self, idx: tuple) -> tuple:
        """Dataset offset of the chunk with grid indices ``idx``."""
        return tuple(i * c for i, c in zip(idx, self.chunks))

    def slices(self, box, idx) -> tuple:
        """``(chunk-relative, box-relative)`` slices of the overlap of chunk ``idx`` (grid indices) with ``box``."""
        src, dst = [], []
        for (a, b), c, i in zip(box, self.chunks, idx):
            lo, hi = max(a, i * c), min(b, i * c + c)
            src.append(slice(lo - i * c, hi - i * c))
            dst.append(slice(lo - a, hi - a))
        return tuple(src), tuple(dst)

    def place_run(self, out: np.ndarray, box, buf, offset: int, step: int, li0: int, nrun: int) -> None:
        """Copy ``nrun`` decoded chunks from ``li0`` on, neighbours along the last dimension found every ``step``
        bytes from ``buf[offset]``, into ``out`` (the array of ``box``) with one strided copy."""
        nd, c, item = len(self.chunks), self.chunks[-1], self.udtype.itemsize
        idx = self.chunk_idx(li0)
        src_sel, dst_off, dst_shape = [slice(None)], (idx[-1] * c - box[-1][0]) * item, []
        for d in range(nd - 1):
            (a, b), cd, i = box[d], self.chunks[d], idx[d]
            lo, hi = max(a, i * cd), min(b, i * cd + cd)
            src_sel.append(slice(lo - i * cd, hi - i * cd))
            dst_off += (lo - a) * out.strides[d]
            dst_shape.append(hi - lo)
        # a chunk's rows along the last dimension are whole and contiguous on both sides: copy each as one opaque
        # item of c * item bytes (numpy then copies whole rows instead of element by element: several times faster
        # for the narrow chunks h5py picks, e.g. 32 columns of bf16)
        row = np.dtype((np.void, c * item))
        src = np.ndarray((nrun,) + self.chunks[:-1], row, buf, offset, (step,) + self.cstrides[:-1])
        src = src[tuple(src_sel)]
        dst = np.ndarray(tuple(dst_shape) + (nrun,), row, out, dst_off, out.strides[:-1] + (c * item,))
        np.copyto(dst, src.transpose(self.run_axes[:-1]), casting="no")

    def place_chunk(self, out: np.ndarray, box, buf, p: int, size: int, mask: int, idx: tuple, raw: bool) -> None:
        """One chunk (grid indices ``idx``, filter mask ``mask``; ``raw``: a one-block frame stored raw) stored at
        ``buf[p:p+size]``, copied or decoded into ``out`` (the array of ``box``)."""
        nbytes, ud = self.chunk_nbytes, self.udtype
        src, dst_sl = self.slices(box, idx)
        dst = out[dst_sl]
        if mask & 1:  # the optional LZ4 filter was skipped: stored as is
            if size != nbytes:
                raise CorruptChunkError(self.coords(idx), f"unfiltered chunk has {size} bytes, expected {nbytes}")
            chunk = np.ndarray(self.chunks, ud, buf, p)
        elif raw:
            chunk = np.ndarray(self.chunks, ud, buf, p + RAW_HEAD)
        else:
            frame = memoryview(buf)[p:p + size]
            whole = all(s.start == 0 and s.stop == n for s, n in zip(src, self.chunks))
            if whole and dst.flags.c_contiguous:  # decode straight into the output
                decode_frame(frame, address(buf) + p, nbytes, dst.__array_interface__["data"][0], self.coords(idx))
                return
            tmp = scratch("dec", nbytes)
            decode_frame(frame, address(buf) + p, nbytes, address(tmp), self.coords(idx))
            chunk = np.ndarray(self.chunks, ud, tmp)
        dst[...] = chunk[src]

    def raw_run_end(self, found: list, pos, raw: list, k: int, box) -> int:
        """End of the run of chunks from ``found[k]`` (``(offset, size, mask, idx)`` each, fetched at ``pos``;
        ``raw``: stored raw) that one strided copy places: neighbours along the last dimension, stored raw, back
        to back in the fetched buffer, none cut by the box along that dimension (``k + 1``: chunk ``k`` alone)."""
        c, step = self.chunks[-1], self.chunk_nbytes + RAW_HEAD
        (a, b), idx, p = box[-1], found[k][3], pos[k]
        if not raw[k] or idx[-1] * c < a or idx[-1] * c + c > b:
            return k + 1
        e = k + 1
        while (e < len(found) and raw[e] and found[e][3][:-1] == idx[:-1] and found[e][3][-1] == idx[-1] + e - k
               and found[e][3][-1] * c + c <= b and pos[e] == p + (e - k) * step):
            e += 1
        return e
