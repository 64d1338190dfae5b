"""One engine for files made of pieces: every generated file format is planned as a sorted list of pieces, and
only this module reads them.

A file is the concatenation of its pieces, each one of:

* ``Literal(data)`` — bytes known when the file is planned (a safetensors or npy header, a pickle, a zip local
  header, HDF5 metadata);
* ``Zeros(size)`` — zero bytes (HDF5 free space and alignment);
* ``TensorBytes(tensor, start, size, name)`` — bytes ``[start, start + size)`` of a virtual tensor's C-order image,
  read through the mount's block cache; an ``on_read(offset in piece, bytes)`` hook sees them as they are read
  (a torch zip folds them into a record's CRC);
* ``Computed(size, compute, what)`` — bytes produced on demand by ``compute(a, b)`` (the bytes ``[a, b)`` of the
  piece): a zip central directory or data descriptor, whose CRCs need the tensors' bytes first;
* ``TensorRun(names, tensors)`` — tensors laid end to end (a safetensors data section): one piece for any number
  of tensors, kept as two lists and one array of offsets, so that a file of 100,000 tensors holds no object per
  tensor.

Large literal content (for 100,000 keys: ~13 MB of data.pkl per torch zip, ~10 MB of safetensors header, both
repetitive) is kept compressed: ``packed(data)`` returns ``data`` itself below ``PACK_AT`` bytes, else a
``PackedBytes`` (independent zlib chunks, sliced like bytes, the last chunk used kept decompressed).

``PiecedFile(pieces, name=…, cache=…)`` is a ``VirtualFile`` with an exact ``size`` and the single read loop,
``readinto(offset, out, cursor)`` (the range already clipped to the file by ``virtual_file.fill``): it finds the first
piece with one bisect, lets each overlapping piece fill its share of the one buffer ``out``, and checks that every
piece produced exactly its share (an error names the file and the piece); the reader's ``ReadCursor``
(``ckptfs.layouts.cursor``) then says which bytes after it to compute ahead and announce to the storage. A file
whose plan is expensive passes ``plan=`` instead of ``pieces`` and is planned on first use, once (under a lock of
its own); a file whose plan is cheap and pure (one per tensor: an .npy file) overrides ``_own_pieces()`` instead and is
planned when read, without a lock (two first readers may both plan it; either plan serves); only the plans of the
last ``KEEP_OWN_PLANS`` such files read are kept, so that copying 100,000 .npy files does not keep 100,000 plans.
``explain(offset)``
says which piece serves a byte and, for tensor bytes, which element, cache block and source region
(``ckptfs explain``).

A new output format only plans pieces: see docs/architecture.md, "Adding an output format".
"""
from __future__ import annotations

import threading
import weakref
import zlib
from array import array
from collections import deque
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..tensor.cache import BlockCache
from ..errors import TensorReadError
from ..storage.base import waited_reads
from .cursor import ReadCursor
from .file import VirtualFile
from ..tensor.base import VirtualTensor, trace_element, unravel


# -- pieces -----------------------------------------------------------------------------------------------------


class Literal:
    """Bytes known when the file is planned (``bytes``, or a ``PackedBytes`` for large content)."""

    __slots__ = ("data", "what")

    def __init__(self, data: bytes, what: str = "bytes"):
        self.data = data
        self.what = what

    @property
    def size(self) -> int:
        return len(self.data)

    def fill(self, out: memoryview, a: int, cache) -> int:
        out[:] = self.data[a:a + len(out)]
        return len(out)

    def explain(self, a: int) -> list:
        return [f"{self.what}: {self.size} bytes known when the file was planned"]


class Zeros:
    """``size`` zero bytes."""

    __slots__ = ("size", "what")

    def __init__(self, size: int, what: str = "zeros"):
        self.size = int(size)
        self.what = what

    def fill(self, out: memoryview, a: int, cache) -> int:
        out[:] = bytes(len(out))
        return len(out)

    def explain(self, a: int) -> list:
        return [f"{self.what}: {self.size} zero bytes"]


class TensorBytes:
    """Bytes ``[start, start + size)`` of ``tensor``'s C-order little-endian image."""

    __slots__ = ("tensor", "start", "size", "name", "on_read")

    def __init__(self, tensor: VirtualTensor, name: str, start: int = 0, size: int | None = None,
                 on_read: Callable[[int, memoryview], None] | None = None):
        self.tensor = tensor
        self.name = name
        self.start = int(start)
        self.size = tensor.nbytes - self.start if size is None else int(size)
        self.on_read = on_read

    @property
    def what(self) -> str:
        return f"tensor {self.name}"

    def fill(self, out: memoryview, a: int, cache) -> int:
        n = self.tensor.read_into(self.start + a, out, cache)
        if self.on_read is not None and n:
            self.on_read(a, out[:n])
        return n

    def prefetch(self, a: int, b: int, cache, done=None) -> bool:
        """Queue bytes ``[a, b)`` of the piece for the read-ahead thread (``VirtualTensor.prefetch``)."""
        return self.tensor.prefetch(self.start + a, self.start + min(b, self.size), cache, done)

    def will_need(self, a: int, b: int, continuing: bool = False) -> None:
        """Announce bytes ``[a, b)`` of the piece to the tensor's storage (``VirtualTensor.will_need``)."""
        if a < self.size:
            self.tensor.will_need(self.start + a, self.start + min(b, self.size), continuing)

    def explain(self, a: int) -> list:
        t = self.tensor
        byte = self.start + a
        item = t.dtype.itemsize
        element = unravel(byte // item, t.shape) if t.shape else ()
        bb = t.block_elems() * item
        blk = byte // bb
        lines = [f"tensor {self.name}: {t.describe()}",
                 f"  byte {byte} of its {t.nbytes} = byte {byte % item} of element {list(element)} "
                 f"({t.dtype.name}, {item} bytes each)",
                 f"  cache block {blk}: tensor bytes [{blk * bb}, {min((blk + 1) * bb, t.nbytes)})"]
        for src, idx in trace_element(t, element)[1:]:
            chunks = src.chunk_shape()
            where = ""
            if chunks and len(chunks) == len(idx):
                where = f", chunk {[i // c for i, c in zip(idx, chunks)]} of chunks {list(chunks)}"
            lines.append(f"  <- element {list(idx)} of {src.describe()}{where}")
        return lines


class Computed:
    """``size`` bytes produced on demand: ``compute(a, b)`` returns bytes ``[a, b)`` of the piece."""

    __slots__ = ("size", "compute", "what")

    def __init__(self, size: int, compute: Callable[[int, int], bytes], what: str):
        self.size = int(size)
        self.compute = compute
        self.what = what

    def fill(self, out: memoryview, a: int, cache) -> int:
        data = self.compute(a, a + len(out))
        n = len(data)
        if n == len(out):
            out[:] = data
        return n

    def explain(self, a: int) -> list:
        return [f"{self.what}: {self.size} bytes computed when read"]


class TensorRun:
    """Tensors laid end to end: tensor ``i`` is bytes ``[offsets[i], offsets[i + 1])`` of the piece.

    One piece for a whole data section (safetensors): ``names`` and ``tensors`` are lists and ``offsets`` one
    ``array('q')`` of ``len(tensors) + 1`` values starting at 0, so a tensor costs two list slots and 8 bytes here,
    not a piece object. ``file`` names the file in errors."""

    __slots__ = ("names", "tensors", "offsets", "what", "file")

    def __init__(self, names: Sequence[str], tensors: Sequence[VirtualTensor], offsets: array,
                 what: str = "tensor data", file: str = "tensor data"):
        if len(offsets) != len(tensors) + 1 or offsets[0] != 0 or len(names) != len(tensors):
            raise ValueError(f"{file}: a run of {len(tensors)} tensors needs {len(tensors) + 1} offsets from 0")
        self.names = names
        self.tensors = tensors
        self.offsets = offsets
        self.what = what
        self.file = file

    @property
    def size(self) -> int:
        return self.offsets[-1]

    def _at(self, a: int) -> int:
        """The tensor holding byte ``a`` (empty tensors hold none: the last tensor starting at or before ``a``)."""
        return bisect_right(self.offsets, a) - 1

    def fill(self, out: memoryview, a: int, cache) -> int:
        offsets, n, pos = self.offsets, len(out), 0
        i = self._at(a)
        while pos < n:
            begin, end = offsets[i], offsets[i + 1]
            k = min(end, a + n) - (a + pos)
            if k > 0:
                got = self.tensors[i].read_into(a + pos - begin, out[pos:pos + k], cache)
                if got != k:
                    raise TensorReadError(self.file, f"tensor {self.names[i]} produced {got} bytes for its bytes "
                                                     f"[{a + pos - begin}, {a + pos - begin + k})")
                pos += k
            i += 1
        return pos

    def prefetch(self, a: int, b: int, cache, done=None) -> bool:
        """Queue the tensors' bytes overlapping bytes ``[a, b)`` of the piece for the read-ahead thread; False when
        the queue refused some (``VirtualTensor.prefetch``)."""
        offsets = self.offsets
        i = self._at(a)
        while i < len(self.tensors) and offsets[i] < b:
            begin, end = offsets[i], offsets[i + 1]
            if end > begin and not self.tensors[i].prefetch(max(a, begin) - begin, min(b, end) - begin, cache, done):
                return False
            i += 1
        return True

    def will_need(self, a: int, b: int, continuing: bool = False) -> None:
        """Announce the tensors' bytes overlapping bytes ``[a, b)`` of the piece to their storage."""
        offsets = self.offsets
        i = self._at(a)
        while i < len(self.tensors) and offsets[i] < b:
            begin, end = offsets[i], offsets[i + 1]
            if end > begin:
                self.tensors[i].will_need(max(a, begin) - begin, min(b, end) - begin, continuing)
            i += 1

    def explain(self, a: int) -> list:
        i = self._at(a)
        begin, end = self.offsets[i], self.offsets[i + 1]
        lines = TensorBytes(self.tensors[i], self.names[i]).explain(a - begin)
        return lines + [f"  tensor {i + 1} of {len(self.tensors)} laid end to end: bytes [{begin}, {end}) of the "
                        f"{self.what}"]


class PackedBytes:
    """Bytes kept zlib-compressed in independent ``CHUNK``-byte chunks; ``len()`` and slicing as ``bytes``.

    For large literal content (a torch data.pkl, a safetensors header): a checkpoint of 100,000 keys has ~13 MB of
    pickle per zip, mostly repeated opcodes and names; zlib at level 1 (fast: ~0.1 s for that pickle) packs it
    about 3.5-fold and a JSON header about 8-fold. A slice decompresses only the chunks it overlaps; the last chunk
    decompressed is kept (one ``(index, bytes)`` tuple, replaced whole, so concurrent readers see either the old or
    the new one), so a sequential read decompresses each chunk once."""

    __slots__ = ("size", "_chunks", "_window")

    CHUNK = 64 << 10

    def __init__(self, data: bytes, level: int = 1):
        view = memoryview(data)
        self.size = len(view)
        self._chunks = [zlib.compress(view[i:i + self.CHUNK], level) for i in range(0, self.size, self.CHUNK)]
        self._window: tuple = (-1, b"")

    def __len__(self) -> int:
        return self.size

    def _chunk(self, i: int) -> bytes:
        index, data = self._window
        if index != i:
            data = zlib.decompress(self._chunks[i])
            self._window = (i, data)
        return data

    def __getitem__(self, key: slice) -> bytes:
        if not isinstance(key, slice):
            raise TypeError("PackedBytes is read by slices")
        a, b, step = key.indices(self.size)
        if step != 1:
            raise ValueError("PackedBytes slices have step 1")
        if a >= b:
            return b""
        first, last = a // self.CHUNK, (b - 1) // self.CHUNK
        base = first * self.CHUNK
        if first == last:
            return self._chunk(first)[a - base:b - base]
        data = b"".join(self._chunk(i) for i in range(first, last + 1))
        return data[a - base:b - base]

    def __bytes__(self) -> bytes:
        return self[0:self.size]

    @property
    def packed_size(self) -> int:
        """Bytes held compressed."""
        return sum(len(c) for c in self._chunks)


#: literal content from this size on is kept packed (a 7B model's data.pkl is ~50 KB and stays plain bytes)
PACK_AT = 1 << 20


def packed(data: bytes) -> "bytes | PackedBytes":
    """``data`` itself when small, else the same bytes as a ``PackedBytes``."""
    return PackedBytes(data) if len(data) >= PACK_AT else data


Piece = Literal | Zeros | TensorBytes | Computed | TensorRun


# -- the file ---------------------------------------------------------------------------------------------------

#: how many files that plan themselves keep their plan (the most recently planned; older ones plan again if read)
KEEP_OWN_PLANS = 256
#: those files (weak references: a closed tree's files are not kept), oldest first; a file may appear twice
#: (dropping its plan early is harmless)
_own_planned: deque = deque()


@dataclass(frozen=True)
class Plan:
    """Pieces with their start offsets (an ``array('q')``; empty pieces dropped) and the file size."""

    starts: array
    pieces: list
    size: int

    def tensor_from(self, offset: int) -> tuple | None:
        """``(piece, tensor in it)`` of the tensor bytes holding file byte ``offset``, or else of the first ones after
        it (None: no tensor bytes from there on)."""
        i = bisect_right(self.starts, offset) - 1
        while i < len(self.pieces) and getattr(self.pieces[i], "will_need", None) is None:
            i += 1
        if i == len(self.pieces):
            return None
        at = getattr(self.pieces[i], "_at", None)
        return i, (at(max(offset, self.starts[i]) - self.starts[i]) if at is not None else 0)

    @classmethod
    def of(cls, pieces: Sequence) -> "Plan":
        starts, kept, pos = array("q"), [], 0
        for p in pieces:
            if p.size < 0:
                raise ValueError(f"{p.what}: negative size {p.size}")
            if p.size:
                starts.append(pos)
                kept.append(p)
                pos += p.size
        return cls(starts, kept, pos)


@dataclass(frozen=True)
class Explanation:
    """What serves byte ``offset`` of a file (``ckptfs explain``)."""

    file: str
    offset: int
    size: int
    piece: int = -1  # index among the file's pieces (-1: past the end)
    pieces: int = 0
    start: int = 0  # the piece's first byte in the file
    end: int = 0
    lines: list = field(default_factory=list)

    def text(self) -> str:
        if self.piece < 0:
            return f"{self.file}: offset {self.offset} is past the end ({self.size} bytes)"
        head = (f"{self.file}: byte {self.offset} of {self.size} is in piece {self.piece + 1} of {self.pieces}, "
                f"file bytes [{self.start}, {self.end}), offset {self.offset - self.start} in the piece")
        return "\n".join([head] + [f"  {ln}" for ln in self.lines])


class _Deferred:
    """The plan of a file given ``plan=``, not made yet: what makes it and the lock under which it is made once."""

    __slots__ = ("make", "lock")

    def __init__(self, make: Callable[[], Sequence]):
        self.make = make
        self.lock = threading.Lock()


class PiecedFile(VirtualFile):
    """A generated file made of pieces: exact ``size``, ``readinto(offset, out)`` and ``explain(offset)``.

    Slotted (a mount of 100,000 tensors has ~100,000 .npy files): a file holds its name, cache and plan — a
    ``Plan``, a ``_Deferred`` (given ``plan=``: the only files with a lock) or None (a file that plans itself, not
    read lately). What its readers' streams prepare ahead is theirs (``ckptfs.layouts.cursor``), not the file's."""

    __slots__ = ("name", "cache", "_plan", "__weakref__")

    def __init__(self, pieces: Sequence | None = None, *, name: str, cache: BlockCache | None = None,
                 plan: Callable[[], Sequence] | None = None):
        given = (pieces is not None) + (plan is not None)
        plans_itself = type(self)._own_pieces is not PiecedFile._own_pieces
        if given > 1 or (given == 0) != plans_itself:
            raise TypeError("give pieces or plan")
        self.name = name
        self.cache = cache
        self._plan: Plan | _Deferred | None = (Plan.of(pieces) if pieces is not None
                                               else _Deferred(plan) if plan is not None else None)

    def _own_pieces(self) -> Sequence:
        """The pieces of a file that plans itself (a subclass's cheap, pure plan)."""
        raise TypeError(f"{self.name}: no pieces")

    def plan(self) -> Plan:
        """The pieces (planned on first use when the file was given ``plan=`` or plans itself)."""
        p = self._plan
        if type(p) is Plan:
            return p
        if p is None:  # cheap and pure: a concurrent first reader may plan it too
            p = self._plan = Plan.of(self._own_pieces())
            _own_planned.append(weakref.ref(self))
            while len(_own_planned) > KEEP_OWN_PLANS:  # readers holding a dropped plan keep using it
                try:
                    old = _own_planned.popleft()()
                except IndexError:  # emptied by a concurrent reader
                    break
                if old is not None:
                    old._plan = None
            return p
        with p.lock:  # a _Deferred: made once
            if type(self._plan) is not Plan:
                self._plan = Plan.of(p.make())
        return self._plan

    @property
    def size(self) -> int:
        return self.plan().size

    def readinto(self, offset: int, out: memoryview, cursor: ReadCursor | None = None) -> int:
        """Fill ``out`` with bytes ``[offset, offset + len(out))`` of the file, a range inside it; returns the count.

        The one read loop of every pieced file: one bisect, then each overlapping piece fills its share of ``out``
        and must produce exactly that many bytes. With the reader's ``cursor`` (its open handle's), the bytes after
        the read that the cursor asks for are then queued for the read-ahead threads and announced to the storage;
        without one nothing is prepared."""
        plan = self.plan()
        end = offset + len(out)
        if offset >= end:
            return 0
        i = bisect_right(plan.starts, offset) - 1
        pos = offset
        waited = waited_reads()
        while pos < end:
            piece, start = plan.pieces[i], plan.starts[i]
            a = pos - start
            k = min(end - start, piece.size) - a
            got = piece.fill(out[pos - offset:pos - offset + k], a, self.cache)
            if got != k:
                raise TensorReadError(self.name, f"{piece.what} produced {got} bytes for its bytes [{a}, {a + k})")
            pos += k
            i += 1
        cache = self.cache
        if cursor is not None and cache is not None and (cache.read_ahead or cache.announce_ahead):
            step = cursor.advance(offset, end, waited=waited_reads() > waited, read_ahead=cache.read_ahead,
                                  announce_ahead=cache.announce_ahead,
                                  announce_limit=lambda a, b: _announce_limit(plan, a, b))
            if step.prepare is not None:  # from the last piece read: one piece may hold many tensors (a TensorRun)
                refused = _read_ahead(plan, i - 1, *step.prepare, cache, cursor.block_computed)
                if refused is not None:
                    cursor.refused(refused)
            if step.announce is not None:  # the tensor being read first: its bytes continue the stream
                a, b = step.announce
                mine = _tensor_end(plan, end - 1)
                _announce(plan, i - 1, a, min(b, mine), continuing=True)
                _announce(plan, i - 1, max(a, mine), b)
        return end - offset

    def will_need(self, a: int, b: int) -> None:
        """Announce the tensor bytes of file bytes ``[a, b)`` to their storage, in the file's order (best effort,
        never waits: an S3 object's parts are queued while the ahead budget allows, the rest is asked for when
        read). The FUSE server announces a whole file of a tree in object storage when it is opened
        (``VirtualTree.opened``): a loader reads it in the model's order, not the file's, so the read-ahead behind
        a stream of reads does not serve it."""
        plan = self.plan()
        a, b = max(0, a), min(b, plan.size)
        if a < b:
            _announce(plan, bisect_right(plan.starts, a) - 1, a, b)

    def explain(self, offset: int) -> Explanation:
        plan = self.plan()
        if not 0 <= offset < plan.size:
            return Explanation(self.name, offset, plan.size)
        i = bisect_right(plan.starts, offset) - 1
        piece, start = plan.pieces[i], plan.starts[i]
        return Explanation(self.name, offset, plan.size, i, len(plan.pieces), start, start + piece.size,
                           piece.explain(offset - start))


def _read_ahead(plan: Plan, i: int, a: int, b: int, cache, done) -> int | None:
    """Queue the tensor bytes of file bytes ``[a, b)`` (pieces from ``i`` on, piece ``i`` holding or preceding byte
    ``a``) for the read-ahead threads, each block reported to ``done`` once computed: None, or the first file byte of
    a piece whose blocks the queue refused (full)."""
    while i < len(plan.pieces) and plan.starts[i] < b:
        piece, start = plan.pieces[i], plan.starts[i]
        prefetch = getattr(piece, "prefetch", None)  # tensor bytes
        if prefetch is not None and start + piece.size > a:
            if prefetch(max(a - start, 0), b - start, cache, done) is False:
                return max(a, start)
        i += 1
    return None


def _announce_limit(plan: Plan, start: int, end: int) -> int:
    """Where announcing stops for the reads in order ``[start, end)``: nowhere before the file's end when they went
    on from one tensor into the next, else at the end of the tensor they are in (a loader reading each tensor whole
    in its own order: the tensors after it in the file are not what comes next)."""
    first, last = plan.tensor_from(start), plan.tensor_from(end - 1)
    if first is not None and last is not None and first != last:
        return plan.size
    return _tensor_end(plan, end - 1)


def _tensor_end(plan: Plan, offset: int) -> int:
    """The file byte after the tensor bytes holding byte ``offset`` (or the first ones after it; ``offset + 1`` when
    there are none)."""
    at = plan.tensor_from(offset)
    if at is None:
        return offset + 1
    i, k = at
    piece = plan.pieces[i]
    offsets, ends = getattr(piece, "offsets", None), getattr(piece, "ends", None)
    rel = offsets[k + 1] if offsets is not None else ends[k] if ends is not None and k < len(ends) else piece.size
    return plan.starts[i] + rel


def _announce(plan: Plan, i: int, a: int, b: int, continuing: bool = False) -> None:
    """Announce the tensor bytes of file bytes ``[a, b)`` to their storage (pieces from ``i`` on); ``continuing``:
    they continue the tensor the stream reads now (``VirtualTensor.will_need``)."""
    if a >= b:
        return
    while i < len(plan.pieces) and plan.starts[i] < b:
        piece, start = plan.pieces[i], plan.starts[i]
        will_need = getattr(piece, "will_need", None)  # tensor bytes
        if will_need is not None and start + piece.size > a:
            will_need(max(a - start, 0), b - start, continuing)
        i += 1
