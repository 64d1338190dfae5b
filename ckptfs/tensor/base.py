"""The virtual tensor: shape and dtype known from metadata, data produced on demand by region.

Every layer speaks this interface. Sources (HDF5 datasets, external files, constant fills) and the
mapping core's operations (transpose, slice, concat, permute, scale, cast, generated) are all
``VirtualTensor`` subclasses that implement ``read(box)``. File layouts only ever call ``read_into``
(through ``ckptfs.layouts.pieces``), which turns a C-order byte range into cache blocks of the mount's
bounded ``BlockCache``.

Cache blocks: a tensor's bytes are cached in blocks of ``block_elems()`` elements under the key
``(cache_key, block number)``. ``cache_key`` names the data, not the object: a tensor that only renames
another (an alias) shares the other's key and blocks. Blocks are whole rows and, when the data is stored in
chunks (``chunk_shape``, seen through transposes and other layout operations), whole chunk rows, so that
consecutive blocks never decode the same chunk. ``element_source(index)`` says where one element comes from
(``ckptfs explain``).

A *box* is a tuple of ``(start, stop)`` pairs, one per dimension (``()`` for a 0-d tensor).
``read(box)`` returns a C-contiguous numpy array of ``dtype.storage`` with the box's shape.
"""
from __future__ import annotations

import itertools
import math
import threading
from abc import ABC, abstractmethod
from typing import Iterator, Sequence

import numpy as np

from .cache import NO_CACHE, BlockCache
from ..dtypes import DType

Box = tuple  # tuple[tuple[int, int], ...]

_ids = itertools.count(1)
_uid_lock = threading.Lock()

#: target size of one cached block of a tensor's bytes: 2 MiB took ~13% less server CPU per GB than 1 MiB (half the
#: Python per block; docs/measurements.md, "Cache blocks of 2 MiB")
BLOCK_BYTES = 2 << 20
#: largest block a chunk-aligned block may grow to (one chunk row can exceed BLOCK_BYTES); also an S3 tensor's
#: largest single block (``source/s3tensor.py``)
MAX_BLOCK_BYTES = 4 << 20
#: a read of at most this many bytes of a block a streaming cache does not hold decodes only its own chunks
SMALL_READ = 64 << 10


#: distinct shapes kept by ``shared_shape`` (a checkpoint has a few dozen; past this bound tuples are not shared)
MAX_SHARED_SHAPES = 4096
_shapes: dict = {}


def shared_shape(shape: Sequence[int]) -> tuple:
    """``shape`` as a tuple of ints, the same tuple object for every equal shape (up to ``MAX_SHARED_SHAPES``
    distinct ones): a checkpoint of 100,000 tensors has a few dozen shapes, so its tensors need not hold 100,000
    equal tuples. Also used for chunk shapes."""
    t = tuple(int(n) for n in shape)
    s = _shapes.get(t)
    if s is not None:
        return s
    if len(_shapes) < MAX_SHARED_SHAPES:
        return _shapes.setdefault(t, t)
    return t


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_shape(box: Box) -> tuple:
    return tuple(b - a for a, b in box)


def flat_range_to_boxes(shape: Sequence[int], start: int, stop: int) -> Iterator[Box]:
    """Split the C-order element range [start, stop) of ``shape`` into boxes, in order.

    At most ``2*ndim - 1`` boxes; their elements, flattened and concatenated, are exactly the range.
    """
    shape = tuple(int(n) for n in shape)
    if start >= stop:
        return
    if not shape:
        yield ()
        return
    inner = math.prod(shape[1:])
    if inner == 0:
        return
    r0, off0 = divmod(start, inner)
    r1, off1 = divmod(stop, inner)
    rest = shape[1:]
    if off0 == 0 and off1 == 0:
        yield ((r0, r1),) + full_box(rest)
        return
    if r0 == r1:  # inside one row
        for sub in flat_range_to_boxes(rest, off0, off1):
            yield ((r0, r0 + 1),) + sub
        return
    if off0:
        for sub in flat_range_to_boxes(rest, off0, inner):
            yield ((r0, r0 + 1),) + sub
        r0 += 1
    if r1 > r0:
        yield ((r0, r1),) + full_box(rest)
    if off1:
        for sub in flat_range_to_boxes(rest, 0, off1):
            yield ((r1, r1 + 1),) + sub


def box_chunks(box: Box, chunks: Sequence[int]) -> int:
    """How many chunks of shape ``chunks`` the box ``box`` touches."""
    return math.prod(-(-b // c) - a // c for (a, b), c in zip(box, chunks))


def covering_rows(shape: Sequence[int], boxes: Sequence[Box], chunks: Sequence[int] | None) -> Box | None:
    """One box of whole rows covering ``boxes`` (those of one flat element range, ``flat_range_to_boxes``), when
    reading it costs less than reading them one by one: at most twice their elements, and, for a chunked tensor,
    no more chunks than they touch together (a peek at a tensor's first 1.5 rows reads two whole rows once, not a
    row and then a part of the next over the same chunks). None for a single box or when it costs more."""
    if len(boxes) < 2 or not shape:
        return None
    rows = (min(b[0][0] for b in boxes), max(b[0][1] for b in boxes))
    cover = (rows,) + full_box(shape[1:])
    need = sum(math.prod(box_shape(b)) for b in boxes)
    if math.prod(box_shape(cover)) > 2 * need:
        return None
    if chunks is not None and len(chunks) == len(shape) and all(c > 0 for c in chunks):
        if box_chunks(cover, chunks) > sum(box_chunks(b, chunks) for b in boxes):
            return None
    return cover


def aligned_block_elems(shape, chunks, itemsize: int, base: int, max_bytes: int) -> int:
    """A cache-block size (elements) that starts every block on a chunk-row boundary, or ``base`` when not cheap.

    A "chunk row" is ``chunks[0]`` whole rows (all trailing dimensions), so a block of k chunk rows decodes exactly
    the chunks under it and consecutive blocks never share a chunk. The result is the largest multiple of one
    chunk row not above ``base`` (at least one chunk row, if that fits in ``max_bytes``). ``base`` is kept when it
    is already aligned, when the tensor fits in one block, or when one chunk row exceeds ``max_bytes``.
    """
    shape = tuple(int(n) for n in shape)
    if not chunks or not shape or len(chunks) != len(shape):
        return base
    numel = math.prod(shape)
    row = math.prod(shape[1:])
    if numel == 0 or row == 0 or numel <= base:
        return base
    unit = min(int(chunks[0]), shape[0]) * row
    if base % unit == 0:
        return base
    if unit * itemsize > max_bytes:
        return base
    return max(1, base // unit) * unit


def unravel(index: int, shape: Sequence[int]) -> tuple:
    """The multi-dimensional index of C-order element ``index`` of ``shape``."""
    out = []
    for n in reversed(tuple(shape)):
        index, i = divmod(index, int(n)) if n else (index, 0)
        out.append(i)
    return tuple(reversed(out))


class VirtualTensor(ABC):
    """A tensor whose bytes are computed on demand. Subclasses set ``shape``/``dtype`` and ``read``.

    A checkpoint holds one source tensor per key (100,000 for a large one), so the base class keeps only slots:
    ``shape`` (a shared tuple, ``shared_shape``), ``dtype``, and two fields set on first read (``uid``, the block
    size). Subclasses may declare ``__slots__`` too (the source tensors do); one that does not gets a ``__dict__``."""

    __slots__ = ("shape", "dtype", "_uid", "_be")

    shape: tuple
    dtype: DType

    def __init__(self, shape: Sequence[int], dtype: DType):
        self.shape = shared_shape(shape)
        self.dtype = dtype
        self._uid = None  # see uid
        self._be = None  # elements per cache block, computed on first use (block_elems)

    @property
    def uid(self) -> int:
        """A number no other tensor of this process has: the identity of its data in caches. Drawn when first asked
        for (a tensor that is never read needs none) and stable for the object's life."""
        u = self._uid
        if u is None:
            with _uid_lock:  # two threads asking at once get the same number
                u = self._uid
                if u is None:
                    u = self._uid = next(_ids)
        return u

    # -- metadata ---------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def describe(self) -> str:
        """One line saying where the data comes from (used in README.txt and errors)."""
        return f"{type(self).__name__}{list(self.shape)} {self.dtype.name}"

    def sources(self) -> list["VirtualTensor"]:
        """The tensors this one reads from (empty for a source)."""
        return []

    def element_source(self, index: tuple) -> "tuple[VirtualTensor, tuple] | None":
        """The input tensor and index element ``index`` of this tensor is read from; None for a source, a
        generated tensor, or an operation that combines several input elements."""
        return None

    def chunk_shape(self) -> tuple | None:
        """The shape of the units this tensor's data is stored and decoded in, in its own coordinates (an HDF5
        dataset's chunks, seen through layout operations); None when any box costs the same."""
        return None

    @property
    def cache_key(self):
        """The identity of this tensor's data in a block cache (a tensor that renames another shares its key)."""
        return self.uid

    # -- data ---------------------------------------------------------------------------------------
    @abstractmethod
    def read(self, box: Box) -> np.ndarray:
        """Elements inside ``box`` as a C-contiguous array of ``dtype.storage``."""

    def read_all(self) -> np.ndarray:
        return self.read(full_box(self.shape))

    def block_elems(self) -> int:
        """Elements per cache block: whole trailing sub-arrays so that a block is one box if possible.
        Computed once per tensor (block keys must stay stable)."""
        be = self._be
        if be is None:
            be = self._be = self._default_block_elems()
        return be

    def _default_block_elems(self) -> int:
        item = self.dtype.itemsize
        target = max(1, BLOCK_BYTES // item)
        base = target
        # find the smallest k such that one slab prod(shape[k:]) fits in the target
        for k in range(self.ndim + 1):
            slab = math.prod(self.shape[k:])
            if slab <= target:
                base = target if slab == 0 else slab * max(1, target // slab)
                break
        return aligned_block_elems(self.shape, self.chunk_shape(), item, base, MAX_BLOCK_BYTES)

    def read_flat(self, start: int, stop: int) -> np.ndarray:
        """Elements [start, stop) in C order, as a 1-D array (no caching)."""
        return self._read_boxes(flat_range_to_boxes(self.shape, start, stop))

    def _read_boxes(self, boxes) -> np.ndarray:
        """The elements of ``boxes`` (those of one flat range, in order), concatenated as a 1-D array."""
        parts = [self.read(b).reshape(-1) for b in boxes]
        if not parts:
            return np.empty(0, self.dtype.storage)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def read_into(self, start: int, out: memoryview, cache: "BlockCache | None" = None) -> int:
        """Fill ``out`` with bytes [start, start + len(out)) of the tensor's C-order little-endian image, block by
        block through ``cache`` (None: nothing is kept); returns the number of bytes written (fewer at the end)."""
        stop = min(start + len(out), self.nbytes)
        if start >= stop:
            return 0
        cache = cache if cache is not None else NO_CACHE
        be = self.block_elems()
        bb = be * self.dtype.itemsize
        key = self.cache_key
        pos = 0
        for blk in range(start // bb, (stop - 1) // bb + 1):
            lo = max(start - blk * bb, 0)
            hi = min(stop - blk * bb, bb)
            if cache.streaming and hi - lo <= SMALL_READ and not cache.peek((key, blk)):
                n = self._read_small(blk * bb + lo, blk * bb + hi, out[pos:])  # a peek: only its own chunks
            else:
                data = cache.get_or_compute((key, blk), lambda blk=blk: self._block(blk, be))
                n = min(hi, len(data)) - lo
                out[pos:pos + n] = data[lo:lo + n]
                cache.taken((key, blk), n)
            pos += n
        return pos

    def _read_small(self, a: int, b: int, out: memoryview) -> int:
        """Bytes [a, b) of the image read as exactly the elements under them (not cached): only the chunks holding
        those elements are decoded."""
        b = min(b, self.nbytes)
        item = self.dtype.itemsize
        e0, e1 = a // item, -(-b // item)
        boxes = list(flat_range_to_boxes(self.shape, e0, e1))
        cover = covering_rows(self.shape, boxes, self.chunk_shape()) if len(boxes) > 1 else None  # (one box: as is)
        if cover is None:
            arr = self._read_boxes(boxes)
        else:  # one read of whole rows, the range cut out of it
            skip = cover[0][0] * math.prod(self.shape[1:])
            arr = self.read(cover).reshape(-1)[e0 - skip:e1 - skip]
        arr = np.ascontiguousarray(arr).astype(self.dtype.storage, copy=False)
        data = memoryview(arr).cast("B")
        out[:b - a] = data[a - e0 * item:b - e0 * item]
        return b - a

    def will_need(self, start: int, stop: int, continuing: bool = False) -> None:
        """Announce that bytes [start, stop) of the image will be read soon, without reading them: a tensor whose
        storage fetches ahead (an object in S3) starts fetching them. Best effort, never waits; nothing by default (a
        local file's storage announces its next bytes itself, and a computed tensor's sources are read when it is).
        ``continuing``: they continue a stream reading this tensor now (``Blob.will_need(announced=False)``)."""

    def prefetch(self, start: int, stop: int, cache: BlockCache, done=None) -> bool:
        """Queue the cache blocks under bytes [start, stop) for the read-ahead thread (``ckptfs.tensor.readahead``),
        each reported to ``done(from_memory_alone)`` once computed (the reader's cursor); False when the queue was
        full and refused some."""
        from .readahead import READ_AHEAD

        stop = min(stop, self.nbytes)
        if start >= stop:
            return True
        be = self.block_elems()
        bb = be * self.dtype.itemsize
        key = self.cache_key
        for blk in range(start // bb, (stop - 1) // bb + 1):
            if not READ_AHEAD.submit(cache, (key, blk), lambda blk=blk: self._block(blk, be), done):
                return False
        return True

    def read_bytes(self, start: int, stop: int, cache: "BlockCache | None" = None) -> bytes:
        """Bytes [start, stop) of the tensor's C-order little-endian image (see ``read_into``)."""
        stop = min(stop, self.nbytes)
        if start >= stop:
            return b""
        buf = bytearray(stop - start)
        n = self.read_into(start, memoryview(buf), cache)
        return bytes(buf[:n]) if n != len(buf) else bytes(buf)

    def _block(self, blk: int, be: int) -> memoryview:
        """One cache block: a read-only byte view of the block's elements (no copy beyond computing them)."""
        e0 = blk * be
        e1 = min(e0 + be, self.numel)
        arr = np.ascontiguousarray(self.read_flat(e0, e1).reshape(-1)).astype(self.dtype.storage, copy=False)
        arr.flags.writeable = False
        return memoryview(arr).cast("B")


def trace_element(tensor: VirtualTensor, index: tuple) -> list:
    """``[(tensor, index), (input, index in it), …]`` down to where element ``index`` is read or computed."""
    chain = [(tensor, tuple(index))]
    while True:
        nxt = chain[-1][0].element_source(chain[-1][1])
        if nxt is None or len(chain) > 64:
            return chain
        chain.append((nxt[0], tuple(int(i) for i in nxt[1])))


class ArrayTensor(VirtualTensor):
    """A tensor backed by an in-memory numpy array of storage dtype (tests, small generated values)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray, dtype: DType | None = None):
        from ..dtypes import from_numpy

        array = np.asarray(array, order="C")  # keeps 0-d arrays 0-d (ascontiguousarray makes them 1-d)
        dtype = dtype or from_numpy(array.dtype)
        if array.dtype != dtype.storage:
            array = array.view(dtype.storage) if array.dtype.itemsize == dtype.itemsize else array.astype(dtype.storage)
        super().__init__(array.shape, dtype)
        self.array = array

    def read(self, box: Box) -> np.ndarray:
        return np.asarray(self.array[tuple(slice(a, b) for a, b in box) + (Ellipsis,)], order="C")

    def describe(self) -> str:
        return f"array{list(self.shape)} {self.dtype.name}"
