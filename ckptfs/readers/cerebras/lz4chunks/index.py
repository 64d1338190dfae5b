"""Where each chunk of a dataset is stored: file offset, stored size and filter mask, from HDF5's chunk index.

A dataset is indexed whole, once, with ``chunk_iter`` (arrays over the grid; ``IndexLRU`` bounds the memory of all
indexes together). Before that, a small read (at most ``LOOKUP_BYTES``, over at most ``LOOKUP_CHUNKS`` chunks, at
most half of the dataset's: a peek at a tensor's start) looks its chunks up one by one instead
(``get_chunk_info_by_coord``, one B-tree lookup each) and remembers them until the dataset is indexed.
"""
from __future__ import annotations

import itertools
from array import array
import threading
import weakref
from collections import OrderedDict

import numpy as np

from .grid import ChunkGrid

#: total chunk-index entries (20 bytes each) kept across all datasets before the least recently used are dropped
INDEX_BUDGET_ENTRIES = 1_000_000
#: chunks looked up one by one, at most, before the dataset is indexed: a peek at the start of every tensor decodes
#: a handful of chunks, and indexing all of them costs more than the rest of the peek
LOOKUP_CHUNKS = 64
#: ... and only by reads of at most this many bytes: a larger one (a cache block) indexes the dataset at once, which
#: sequential blocks reach within two blocks anyway, after paying for the lookups (docs/measurements.md)
LOOKUP_BYTES = 64 << 10


class IndexLRU:
    """Bounds the memory of all chunk indexes: least recently used ones are dropped (and rebuilt on use).

    Indexes are held weakly, so an index dies with its reader (and the reader with its tensor).
    """

    def __init__(self, budget: int):
        self.budget = budget
        self._indexes: "OrderedDict[int, tuple]" = OrderedDict()  # id -> (weakref, entries)
        self._entries = 0
        self._lock = threading.RLock()  # an index's weakref callback may run while the lock is held

    def touch(self, index: "ChunkIndex") -> None:
        key = id(index)
        with self._lock:
            if key in self._indexes:
                self._indexes.move_to_end(key)
                return
            n = index.grid.nchunks
            self._indexes[key] = (weakref.ref(index, lambda _r, key=key: self._drop(key)), n)
            self._entries += n
            while self._entries > self.budget and len(self._indexes) > 1:
                _, (ref, n) = self._indexes.popitem(last=False)
                self._entries -= n
                old = ref()
                if old is not None:
                    old._arrays = None  # noqa: SLF001 (rebuilt on its next use)

    def _drop(self, key: int) -> None:
        with self._lock:
            item = self._indexes.pop(key, None)
            if item is not None:
                self._entries -= item[1]

    def forget(self, index: "ChunkIndex") -> None:
        self._drop(id(index))


#: the budget shared by every reader in the process
indexes = IndexLRU(INDEX_BUDGET_ENTRIES)


class ChunkIndex:
    """The stored chunks of one dataset (``dset``, an h5py Dataset, cut as ``grid``)."""

    def __init__(self, dset, grid: ChunkGrid):
        self.dset = dset
        self.grid = grid
        self._arrays = None
        self._lock = threading.Lock()
        self._can_look_up = hasattr(dset.id, "get_chunk_info_by_coord")
        self._looked_up: dict | None = None  # linear chunk index -> (offset, size, mask) while not indexed

    @property
    def indexed(self) -> bool:
        """Whether the whole dataset is indexed now (not dropped by the budget)."""
        return self._arrays is not None

    @property
    def looked_up(self) -> int:
        """Chunks looked up one by one and remembered (none once the dataset is indexed)."""
        return len(self._looked_up or ())

    def arrays(self) -> tuple:
        """``(offsets, sizes, masks)`` arrays over the chunk grid in C order; size -1 = unallocated. Built on first
        use (and after the budget dropped them)."""
        arrays = self._arrays
        if arrays is None:
            with self._lock:
                arrays = self._arrays
                if arrays is None:
                    arrays = self._arrays = self._build()
                    self._looked_up = None
        indexes.touch(self)
        return arrays

    def _build(self) -> tuple:
        """The arrays, from HDF5's report of each stored chunk gathered into flat machine-word arrays: no per-chunk
        objects are kept, so indexing costs a few dozen bytes a chunk (``validate.chunking_problem`` bounds the
        chunks a tensor may have)."""
        g = self.grid
        offs = np.zeros(g.nchunks, dtype=np.int64)
        sizes = np.full(g.nchunks, -1, dtype=np.int64)
        masks = np.zeros(g.nchunks, dtype=np.uint32)
        did = self.dset.id
        coords, at, size, mask = array("q"), array("q"), array("q"), array("q")

        def take(info) -> None:
            if info.chunk_offset is not None and info.byte_offset is not None:
                coords.extend(info.chunk_offset)
                at.append(info.byte_offset)
                size.append(info.size)
                mask.append(info.filter_mask)

        if hasattr(did, "chunk_iter"):
            did.chunk_iter(take)
        else:
            for i in range(did.get_num_chunks()):
                take(did.get_chunk_info(i))
        n = len(at)
        if n:
            co = np.frombuffer(coords, np.int64).reshape(n, -1)
            li = (co // np.array(g.chunks)) @ np.array(g.gstride, dtype=np.int64)
            offs[li] = np.frombuffer(at, np.int64)
            sizes[li] = np.frombuffer(size, np.int64)
            masks[li] = np.frombuffer(mask, np.int64)
        return offs, sizes, masks

    def first_stored(self, offs, sizes):
        """``(coords, offset, size)`` of the first allocated chunk in the arrays, or None."""
        hit = np.flatnonzero(sizes >= 0)
        if not hit.size:
            return None
        li = int(hit[0])
        return self.grid.coords(self.grid.chunk_idx(li)), int(offs[li]), int(sizes[li])

    def lookup_at(self, li: int, idx: tuple, arrays) -> tuple:
        """``(offset, size, filter mask)`` of the chunk with linear index ``li`` (grid indices ``idx``): from
        ``arrays`` (those of ``arrays()``), or with None from the chunks looked up so far or one lookup in HDF5's
        chunk index (then remembered); size -1 = unallocated."""
        if arrays is not None:
            return int(arrays[0][li]), int(arrays[1][li]), int(arrays[2][li])
        seen = self._looked_up
        if seen is None:
            seen = self._looked_up = {}
        got = seen.get(li)
        if got is None:
            info = self.dset.id.get_chunk_info_by_coord(tuple(i * c for i, c in zip(idx, self.grid.chunks)))
            got = seen[li] = ((0, -1, 0) if info.byte_offset is None
                              else (int(info.byte_offset), int(info.size), int(info.filter_mask)))
        return got

    def may_look_up(self, ranges, n: int, nbytes: int) -> bool:
        """Whether a read of ``nbytes`` over the chunks ``ranges`` (``n`` of them) looks them up rather than indexing
        the dataset: only while it is not indexed, for a read of at most ``LOOKUP_BYTES``, and while the chunks looked
        up stay within ``LOOKUP_CHUNKS`` and half of the dataset's."""
        if self._arrays is not None or not self._can_look_up or nbytes > LOOKUP_BYTES:
            return False
        cap = min(LOOKUP_CHUNKS, self.grid.nchunks // 2)
        seen = self._looked_up or {}
        if n + len(seen) <= cap:
            return True
        if n > cap:
            return False
        gstride = self.grid.gstride
        new = sum(sum(i * s for i, s in zip(idx, gstride)) not in seen for idx in itertools.product(*ranges))
        return new + len(seen) <= cap

    def drop(self) -> None:
        """Forget the arrays and the chunks looked up."""
        indexes.forget(self)
        self._arrays = None
        self._looked_up = None
