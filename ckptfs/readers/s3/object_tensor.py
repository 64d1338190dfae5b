"""A tensor stored as one object of Cerebras' S3 layout: the array's bytes in C order, zstd-compressed when its
metadata says so.

``object_problem`` checks, when the catalog is built, what ``__METADATA__`` says about the object against the object
the listing shows (shape × element size = the data size, the stored size = the object's size, one part, and a
compressed object's data at most ``MAX_EXPANSION`` times its size: the work a read may cause is bounded by the bytes
the object holds, not by what the metadata declares), so that a crafted entry makes that tensor unreadable with a
reason. The first answer of the endpoint for the object also
carries the object's own user metadata, which must agree (``S3ObjectTensor`` checks it once).

Reads: an uncompressed object is read by the byte ranges under the box (``S3Object.read_spans``). A compressed one
is one zstd frame, decoded as a stream (``zstandard``) with its window bounded (``MAX_WINDOW``) and never past the
data size: a read continues from where the last one of that tensor stopped (sequential blocks decode the frame
once), or starts again from the front; a read of the last ``TAIL`` bytes it decoded (reads finishing out of order)
is served from them. The last few such streams are kept (``KEEP_STREAMS``). A compressed tensor
is one chunk (``chunk_shape``): a tensor of up to ``MAX_BLOCK_BYTES`` is one cache block, decoded once.
"""
from __future__ import annotations

import hashlib
import json
import math
import threading
from collections import OrderedDict

import numpy as np

from ...dtypes import DType
from ...errors import SourceChangedError, StorageError, TensorReadError
from ...storage.rangedfile import RangedFile
from ...storage.s3object import PART_MIN, S3Object
from ...tensor.base import Box, VirtualTensor, box_shape
from ...tensor.regions import box_runs

#: largest zstd window a compressed object may ask for (zstd's default levels use at most 8 MiB)
MAX_WINDOW = 128 << 20
#: compressed streams kept open (their positions) across all tensors
KEEP_STREAMS = 4
#: decompressed bytes skipped at a time when a read starts inside the object
_SKIP = 1 << 20
#: decoded bytes a stream keeps behind its position: reads that arrive out of order (the multi-threaded FUSE loop's
#: threads, the read-ahead's) within this distance are served from them instead of decoding the frame again from
#: its front
TAIL = 8 << 20
#: a compressed object may decompress to at most this many times its own size (or ``EXPANSION_FLOOR``, if more):
#: zstd's format lets 4 bytes stand for 128 KiB (32,768×), so a 32 MiB object can declare 1 TiB of zeros, and a read
#: at its end decodes all of it (59 s of CPU for 4 KiB). Real weights and optimizer state compress 1–2×.
MAX_EXPANSION = 1024
#: data size a compressed object may always have, whatever its ratio (a constant tensor of up to 1 GiB: a read inside
#: it decodes at most that, a few tenths of a second)
EXPANSION_FLOOR = 1 << 30


def object_problem(md: dict, shape: tuple, dtype: DType, size: int) -> str | None:
    """Why the tensor metadata ``md`` does not describe an object of ``size`` bytes holding ``shape`` elements of
    ``dtype`` (None when it does)."""
    nbytes = math.prod(shape) * dtype.itemsize
    sizes, bounds = md.get("data_sizes"), md.get("boundaries")
    if not (isinstance(sizes, list) and isinstance(bounds, list) and len(sizes) == len(bounds) == 1):
        return f"data_sizes {sizes!r} / boundaries {bounds!r}: one part expected"
    data, stored = sizes[0], bounds[0]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (data, stored)):
        return f"data_sizes {sizes!r} / boundaries {bounds!r} are not sizes"
    if data != nbytes:
        return f"data size {data} is not shape {list(shape)} × {dtype.itemsize} bytes = {nbytes}"
    if stored != size:
        return f"stored size {stored} but the object holds {size} bytes"
    compressed = md.get("compressed")
    if compressed not in (None, True, False):
        return f"compressed flag {compressed!r} is not a boolean"
    if not compressed and stored != data:
        return f"uncompressed, yet its stored size {stored} is not its data size {data}"
    if compressed and data > max(EXPANSION_FLOOR, MAX_EXPANSION * stored):
        return (f"compressed object of {stored} bytes declares {data} bytes of data (more than {MAX_EXPANSION}× its "
                f"size and {EXPANSION_FLOOR >> 30} GiB): a read inside it would decode up to all of that")
    numpy_md = md.get("__NUMPY__")
    if isinstance(numpy_md, dict):
        try:
            item = np.dtype(str(numpy_md.get("dtype"))).itemsize
            nshape = [int(n) for n in numpy_md.get("shape")]
        except (TypeError, ValueError):
            return f"__NUMPY__ {numpy_md!r} does not describe an array"
        if nshape != list(shape) or item != dtype.itemsize:
            return f"__NUMPY__ says {nshape} of {item}-byte elements, the tensor is {list(shape)} {dtype.name}"
    return None


#: the tensor metadata fields an object's own metadata must repeat
CHECKED_FIELDS = ("__NUMPY__", "compressed", "data_sizes", "boundaries", "shapes", "dtypes")


def metadata_fingerprint(md: dict) -> str:
    """What the object's own metadata must repeat, as one short digest (kept per tensor instead of the fields)."""
    fields = {f: md.get(f) for f in CHECKED_FIELDS}
    return hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=12).hexdigest()


class _Streams:
    """The last ``KEEP_STREAMS`` decompression streams (tensor -> stream), least recently used first out."""

    def __init__(self):
        self.lock = threading.Lock()
        self.streams: OrderedDict = OrderedDict()

    def take(self, owner):
        with self.lock:
            return self.streams.pop(id(owner), (None, None))[1]

    def give(self, owner, stream) -> None:
        with self.lock:
            self.streams[id(owner)] = (owner, stream)
            while len(self.streams) > KEEP_STREAMS:
                self.streams.popitem(last=False)


_streams = _Streams()


class _Stream:
    """A zstd decompression stream over one object, at decompressed position ``pos``, keeping the last ``TAIL``
    bytes it decoded (``tail``, ending at ``pos``): a read of those is served again without starting over."""

    def __init__(self, blob: S3Object, limit: int):
        import zstandard

        self.reader = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW).stream_reader(
            RangedFile(blob), read_size=max(PART_MIN, 1 << 20), read_across_frames=False)
        self.pos = 0
        self.limit = limit
        self.tail = bytearray()

    @property
    def kept_from(self) -> int:
        """Where the bytes ``tail`` holds begin."""
        return self.pos - len(self.tail)

    def read(self, n: int, keep: int = TAIL) -> int:
        """Decode up to ``n`` more bytes into ``tail`` (then trimmed to its last ``keep`` bytes): how many came."""
        out = self.reader.read(n)
        self.pos += len(out)
        self.tail += out
        if len(self.tail) > keep:
            del self.tail[:len(self.tail) - keep]
        return len(out)


class S3ObjectTensor(VirtualTensor):
    """Tensor ``key`` of a checkpoint in Cerebras' S3 layout, stored as object ``blob`` (see the module docstring).

    ``expected``: ``metadata_fingerprint`` of its entry in ``__METADATA__``, which the object's own metadata must
    repeat (None: not checked).
    """

    __slots__ = ("blob", "key", "checkpoint", "compressed", "expected", "_checked", "_lock")

    def __init__(self, blob: S3Object, key: str, checkpoint, shape, dtype: DType, *, compressed: bool,
                 expected: str | None = None):
        super().__init__(shape, dtype)
        self.blob = blob
        self.key = key
        self.checkpoint = checkpoint  # the checkpoint's location, for messages
        self.compressed = bool(compressed)
        self.expected = expected
        self._checked = expected is None
        self._lock = threading.Lock() if compressed else None

    def describe(self) -> str:
        kind = "zstd object" if self.compressed else "object"
        return f"{kind} {self.blob.key} [{', '.join(map(str, self.shape))}] {self.dtype.name}"

    def chunk_shape(self):
        return self.shape if self.compressed and self.ndim else None

    def will_need(self, start: int, stop: int, continuing: bool = False) -> None:
        """An uncompressed object holds the image's bytes as they are: the same range of the object is fetched
        ahead (a compressed one is decoded as a stream from its front: nothing to announce)."""
        if not self.compressed and stop > start:
            self.blob.will_need(start, stop - start, announced=not continuing)

    def _fail(self, problem: str) -> TensorReadError:
        return TensorReadError(self.checkpoint, f"tensor {self.key}: {problem}")

    def read(self, box: Box) -> np.ndarray:
        shape = box_shape(box)
        st = self.dtype.storage
        out = np.empty(math.prod(shape), dtype=st)
        runs = box_runs(self.shape, box)
        item = st.itemsize
        spans = [(start * item, (start + n) * item) for start, n in runs]
        try:
            if spans:
                if self.compressed:
                    self._read_compressed(spans, memoryview(out.view(np.uint8)))
                else:
                    buf, at = self.blob.read_spans(spans, bytearray)
                    dst, pos = memoryview(out.view(np.uint8)), 0
                    for (lo, end), a in zip(spans, at):
                        dst[pos:pos + end - lo] = memoryview(buf)[a:a + end - lo]
                        pos += end - lo
            self._check_metadata()
        except (SourceChangedError, TensorReadError):
            raise
        except StorageError as e:
            raise self._fail(e.problem) from None
        except Exception as e:  # noqa: BLE001 - a zstd error, a short object: never wrong bytes
            raise self._fail(f"{type(e).__name__}: {' '.join(str(e).split())}") from e
        return out.reshape(shape)

    def _check_metadata(self) -> None:
        """Once: the object's own metadata (from the first answer) repeats what ``__METADATA__`` says."""
        if self._checked:
            return
        meta = self.blob.user_metadata
        if meta is None:
            return  # served from a cache filled by another reader of the same object: checked there
        text = meta.get("metadata") or meta.get("Metadata")
        try:
            own = json.loads(text) if text else None
        except ValueError:
            own = None
        if not isinstance(own, dict):
            raise self._fail("the object carries no Cerebras metadata (its 'metadata' header is missing or not JSON)")
        if metadata_fingerprint(own) != self.expected:
            raise self._fail("the object's own metadata (shape, dtype, compression or sizes) disagrees with its "
                             "entry in __METADATA__")
        self._checked = True

    def _read_compressed(self, spans: list, out: memoryview) -> None:
        """Decode the frame from the first span's start to the last one's end and place the spans."""
        lo, hi = spans[0][0], spans[-1][1]
        with self._lock:
            stream = _streams.take(self)
            if stream is None or stream.kept_from > lo:
                stream = _Stream(self.blob, self.nbytes)
            while stream.pos < lo:  # skip to the read
                if not stream.read(min(_SKIP, lo - stream.pos)):
                    raise self._fail(f"the zstd frame ends at {stream.pos} bytes, before the {self.nbytes} of its "
                                     "data size")
            keep = max(TAIL, hi - stream.kept_from)
            while stream.pos < hi:
                if not stream.read(hi - stream.pos, keep):
                    raise self._fail(f"the zstd frame ends at {stream.pos} bytes, before the {self.nbytes} of its "
                                     "data size")
            if stream.pos == self.nbytes and self._more(stream):
                raise self._fail(f"the zstd frame decodes to more than its data size of {self.nbytes} bytes")
            with memoryview(stream.tail) as kept:
                data = kept[lo - stream.kept_from:hi - stream.kept_from]
                pos = 0
                for a, b in spans:
                    out[pos:pos + b - a] = data[a - lo:b - lo]
                    pos += b - a
                data.release()
            if len(stream.tail) > TAIL:
                del stream.tail[:len(stream.tail) - TAIL]
            _streams.give(self, stream)

    @staticmethod
    def _more(stream: _Stream) -> bool:
        """Whether the frame holds a byte past the data size (read without moving the stream's kept bytes)."""
        return bool(stream.reader.read(1))
