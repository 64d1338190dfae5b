"""One S3 object read by byte ranges: the blob interface a local checkpoint file offers (``read_spans``,
``read_into``, ``read_scattered``, ``will_need``), over HTTP range requests.

Every request names the ETag the object had when it was listed (``If-Match``): once the object is replaced, reads
fail with ``SourceChangedError`` instead of returning bytes of another version.

* **Small reads** (a peek, a chunk's frame header, HDF5 metadata) are exact ranges; ranges a read asks for together
  (``read_spans``, ``read_scattered``) are merged when less than ``MERGE_GAP`` apart and fetched concurrently:
  a request costs a round trip, a few hundred KB more of an answer cost less.
* **Large reads** (``PART_MIN`` bytes or more: a cache block's chunks, a tensor's data), and every read of an object
  smaller than ``PART_MIN`` (a norm's weights: fetched whole, once), go through *parts*, the
  object cut at multiples of ``PART_BYTES``: the parts a read needs are fetched concurrently (at most ``MAX_IN_FLIGHT``
  requests at once for one pool, ``MAX_IN_FLIGHT_PER_OBJECT`` of them for one object: an object that does not
  answer leaves request threads to the others) and kept in the cache of the object's ``PartPool`` (least recently
  used first out): the pool of the tree that opened it, whose budget is that tree's share of its ``--cache-size``
  (``tree.memory``), never another tree's (an object opened alone: its own, of the defaults). The object keeps no
  stream state of its own: a reader's cursor (``ckptfs.layouts.cursor``) announces what its stream reads next
  through ``will_need`` (``VirtualTensor.will_need``), so the endpoint is busy while the caller converts, and a
  peek stays within the parts it touches.
* **Parts asked for ahead** (``will_need``) are fetched by aligned groups of ``FETCH_PARTS`` parts, one request
  per group: a request has a cost of its own at the endpoint (moto copies the whole object for every range it serves;
  S3 bills and answers each request on its own), and a stream reads every part of the group anyway. At most the
  ahead budget (``AHEAD_BYTES`` unless set) of them are in flight or unread at once; until a read uses them they are
  the last parts the cache lets go of (a window of parts announced ahead must not push out the parts announced
  before it, not read yet): an announcement past the budget queues nothing, and they stay until a read uses them. A
  loader reading in an order of its own reads them later: letting go of parts no read used for a while fetched a
  loader's parts twice (docs/measurements.md, "S3: parts fetched ahead within their budget"). Once one is dropped
  unread all the same (a budget made smaller), fetching ahead pauses (``PAUSE_AHEADS``).
* **Parts read out of order** (a safetensors file generated from one ``.mdl`` object reads the object's tensors in
  the file's order): the pool notes which bytes of each part reads used (``partreads.PartReads``). A part some of
  whose bytes no read used yet is let go of after the spent ones, and only while the pool is over its whole budget
  (another tensor lies there, read later); a spent part let go of is not fetched ahead again, and a read of the
  bytes no read used of a part let go of fetches just those: each byte of the object is fetched about once.

Memory, per pool: its budget (``PartPool.set_memory``: parts read, and parts asked for ahead and not read yet), the
parts in flight for reads waiting (at most ``MAX_IN_FLIGHT`` × ``PART_BYTES``) and ``BODY_STEP`` per answer arriving
(an answer is copied into its parts' buffers as it arrives), whatever the number of objects. A failed part
is dropped from the cache, so a later read asks again.
"""
from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor

from .base import Blob, ShortRead, count_waited_read
from .partreads import PartReads
from ckptfs.storage.etag import normal_etag
from .s3client import S3Client

#: the object is fetched in parts of this size for large reads (and cached by part)
PART_BYTES = 8 << 20
#: a read of at least this many bytes goes through parts (smaller ones are exact ranges)
PART_MIN = 512 << 10
#: parts queued beyond a sequential read (or a ``will_need``)
READ_AHEAD_PARTS = 2
#: requests in flight at once, all objects together
MAX_IN_FLIGHT = 8
#: requests of one object in flight at once; its further requests wait without holding a request thread, so that an
#: object whose endpoint does not answer (a stalled or hostile key) leaves threads for the other objects' reads
MAX_IN_FLIGHT_PER_OBJECT = MAX_IN_FLIGHT // 2
#: parts kept after a read used them (bytes), all objects of a pool together, unless its budget says otherwise
PART_CACHE_BYTES = 32 << 20
#: parts asked for ahead (``will_need``) are fetched by aligned groups of this many parts, one request each
FETCH_PARTS = 4
#: bytes asked for ahead (``will_need``) and not read yet, all objects of a pool together, unless its budget says so
AHEAD_BYTES = 96 << 20
#: once a part fetched ahead is dropped unread (the only way: a budget made smaller under it), nothing announced is
#: fetched ahead until reads have fetched this many times the ahead budget in parts: a loader reading out of file
#: order would otherwise have objects fetched twice (announced, dropped, read again)
PAUSE_AHEADS = 2
#: the share of a pool's budget for parts reads used (the rest: parts fetched ahead), by how its readers read: a
#: loader reads an ``.mdl`` object's tensors far apart in the object's order and comes back to parts it half read; a
#: stream (``ckptfs export``) reads in order and announces far ahead (docs/measurements.md, "S3: parts read and parts
#: fetched ahead")
READ_SHARES = {"load": 0.5, "stream": 0.25}
#: ranges of one ``read_spans``/``read_scattered`` closer than this are fetched as one request
MERGE_GAP = 1 << 20


class PartPool:
    """The request threads and part cache of one owner: a tree (``tree.memory``), a checkpoint opened without one
    (``readers.s3.open``), or an object opened alone. Its budget is its owner's alone; its threads start on first use
    and stop on ``close``; in a forked child it is emptied (the parent's threads and answers in flight are not there)."""

    def __init__(self, budget: int | None = None, use: str = "load"):
        self.read_share = READ_SHARES[use]  # ``READ_SHARES``: how the budget is split
        self.keep_bytes, self.ahead_limit = PART_CACHE_BYTES, AHEAD_BYTES
        if budget is not None:
            self.keep_bytes, self.ahead_limit = _split(budget, self.read_share)
        self.closed = False
        self._empty()
        _live.add(self)

    def _empty(self) -> None:
        self.lock = threading.Lock()
        self.executor: ThreadPoolExecutor | None = None
        self.request_threads: set = set()  # idents of this pool's request threads
        self.parts: OrderedDict = OrderedDict()  # (object id, part) -> (Future[buffer], size), oldest use first
        self.bytes = 0
        self.unread: set = set()  # parts fetched ahead (in flight or arrived) that no read has used yet (trimmed last)
        self.paused = 0  # bytes of parts reads must fetch before anything is fetched ahead again (``PAUSE_AHEADS``)
        self.sent: dict = {}  # object id -> its requests given to the request threads and not finished
        self.waiting: dict = {}  # object id -> deque of its requests waiting for one of those to finish
        self.reads = PartReads(PART_MIN)  # the bytes reads used of each part; the spent parts let go of

    @property
    def budget(self) -> int:
        """Bytes of parts this pool keeps at most (read, and fetched ahead and not read yet; parts in flight apart)."""
        return self.keep_bytes + self.ahead_limit

    def submit(self, fn, *args) -> Future:
        with self.lock:
            ex = self._executor()
        return ex.submit(fn, *args)

    def _executor(self) -> ThreadPoolExecutor:
        """The request threads, started on first use (called with the lock held)."""
        if self.closed:
            raise PoolClosed("the part pool was closed with its tree: no more requests")
        if self.executor is None:
            threads = self.request_threads  # the initializer holds the set, not the pool (no cycle keeps it alive)
            self.executor = ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="ckptfs-s3",
                                               initializer=lambda: threads.add(threading.get_ident()))
        return self.executor

    def on_request_thread(self) -> bool:
        """Whether the calling thread is one of this pool's request threads."""
        return threading.get_ident() in self.request_threads

    def part(self, key, fetch, size: int, need: tuple | None = None) -> Future | None:
        """The future of part ``key`` (``fetch(buffers, filled)`` submitted when it is neither cached nor in flight).
        None, nothing submitted, when the read needs just ``need`` (``(lo, hi)`` within the part) of a part let go of
        after reads used some of it, bytes no read used yet (``PartReads.read_gone``): the caller fetches that range
        alone."""
        with self.lock:
            got = self.parts.get(key)
            if got is not None:
                self.parts.move_to_end(key)
                self.unread.discard(key)
                return got[0]
            if need is not None and self.reads.read_gone(key, *need, size):
                return None
            self.reads.forget(key)
            self.paused = max(0, self.paused - size)
            request = self._register([key], [size], ahead=False)
        return self._launch(request, fetch)[0]

    def ahead(self, keys: list, ranges: list, get, announced: bool = True) -> bool:
        """Ask for the consecutive parts ``keys`` (object bytes ``ranges``) ahead of any read: one request
        (``get(lo, hi, buffers, filled)``) for them all when none is cached or in flight, else one for each missing
        part. False (nothing queued) when the parts fetched ahead and not read yet, in flight or arrived, would pass
        the ahead budget. The parts count as unread until a read uses them. False too for parts ``announced`` by a
        reader (``will_need``) while paused: a part fetched ahead was dropped unread not long ago (an object's own
        read-ahead behind a sequential read goes on)."""
        with self.lock:
            if self.paused and announced:
                return False
            sizes = [hi - lo for lo, hi in ranges]
            missing = [k for k, key in enumerate(keys) if key not in self.parts]
            # parts arrived and not read count as well as those in flight: queueing past the budget would have the
            # cache let go of the parts announced first, which the reader needs first (fetched twice, then)
            if self._unread_bytes() + sum(sizes[k] for k in missing) > self.ahead_limit:
                return False
            groups = [range(len(keys))] if len(missing) == len(keys) else [[k] for k in missing]
            requests = [(self._register([keys[k] for k in g], [sizes[k] for k in g], ahead=True),
                         ranges[g[0]][0], ranges[g[-1]][1]) for g in groups]
        for request, lo, hi in requests:  # outside the lock: an answer may arrive before its callback is added
            self._launch(request, lambda bufs, filled, lo=lo, hi=hi: get(lo, hi, bufs, filled))
        return True

    def _register(self, keys: list, sizes: list, ahead: bool) -> tuple:
        """Enter the parts ``keys`` (of ``sizes`` bytes), in flight, into the cache (called with the lock held): the
        request ``_launch`` sends."""
        futures = [Future() for _ in keys]
        for key, size, fut in zip(keys, sizes, futures):
            self.parts[key] = (fut, size)
        self.bytes += sum(sizes)
        if ahead:
            self.unread.update(keys)
        self._trim()
        return keys, sizes, futures, ahead

    def _launch(self, request: tuple, fetch) -> list:
        """Send a registered request (``fetch(buffers, filled)`` fills its parts' buffers end to end, calls
        ``filled(k)`` as soon as buffer ``k`` is whole, and returns the count; called without the lock, which the
        answer's callback takes): the parts' futures, each done as soon as its part arrived (a reader of the first
        part of a group goes on while the others arrive)."""
        keys, sizes, futures, ahead = request
        total = sum(sizes)

        def run() -> list:
            parts = [_part_buffer(size) for size in sizes]  # allocated once the request is sent, not while queued

            def filled(k: int) -> None:
                if not futures[k].done():
                    futures[k].set_result(parts[k])
            got = fetch(parts, filled)
            if got != total:
                raise OSError(f"{got} bytes for the {total} asked for")
            return parts

        obj = keys[0][:-1]  # (bucket, key, etag) of a part key

        def done(f: Future) -> None:
            err = OSError("the part pool was closed with its tree") if f.cancelled() else f.exception()
            for k, (key, size, fut) in enumerate(zip(keys, sizes, futures)):
                if fut.done():  # arrived whole before the rest: its bytes stand whatever happened after
                    continue
                if err is not None:
                    self.forget(key, fut, size)
                    fut.set_exception(err)
                else:
                    fut.set_result(f.result()[k])
            if err is None:  # parts in flight could not be trimmed when asked for: the budget holds once they are here
                with self.lock:
                    self._trim()
            self._finished(obj)

        def send() -> None:
            try:
                inner = self.submit(run)
            except (PoolClosed, RuntimeError) as e:  # the pool was closed, or the interpreter is shutting down
                inner = Future()
                inner.set_exception(e)
            inner.add_done_callback(done)

        with self.lock:
            if self.sent.get(obj, 0) >= MAX_IN_FLIGHT_PER_OBJECT:  # sent when one of the object's requests ends
                self.waiting.setdefault(obj, deque()).append(send)
                return futures
            self.sent[obj] = self.sent.get(obj, 0) + 1
        send()
        return futures

    def _finished(self, obj) -> None:
        """One request of object ``obj`` ended: send its next waiting request, if any."""
        with self.lock:
            queue = self.waiting.get(obj)
            if queue:
                send = queue.popleft()
                if not queue:
                    del self.waiting[obj]
            else:
                send = None
                if self.sent.get(obj, 0) <= 1:
                    self.sent.pop(obj, None)
                else:
                    self.sent[obj] -= 1
        if send is not None:
            send()

    def cached(self, key):
        """Part ``key``'s bytes if fetched already or in flight (no request of its own; a request thread does not wait
        for a part in flight, which may be queued behind it)."""
        with self.lock:
            got = self.parts.get(key)
            self.unread.discard(key)
        if got is None or (not got[0].done() and self.on_request_thread()):
            return None
        try:
            return got[0].result()
        except Exception:  # noqa: BLE001 - the part's own request failed: the caller asks for its range itself
            return None

    def holds(self, key) -> bool:
        with self.lock:
            return key in self.parts

    def used(self, key, lo: int, hi: int) -> None:
        """A read used bytes ``[lo, hi)`` (within the part) of part ``key``, held by the pool."""
        with self.lock:
            got = self.parts.get(key)
            if got is not None:
                self.reads.read(key, lo, hi, got[1])

    def was_read(self, key) -> bool:
        """Whether part ``key`` was let go of after reads used some of its bytes (not fetched ahead, whole, again)."""
        with self.lock:
            return key not in self.parts and self.reads.was_read(key)

    def forget(self, key, fut: Future, size: int) -> None:
        with self.lock:
            got = self.parts.get(key)
            if got is not None and got[0] is fut:
                del self.parts[key]
                self.unread.discard(key)
                self.reads.forget(key)
                self.bytes -= size

    def _trim(self) -> None:
        """Drop the least recently used finished parts beyond the budgets: ``keep_bytes`` for parts reads used,
        ``ahead_limit`` for parts fetched ahead and not read yet (a reader that stopped leaves them). Parts in flight
        stay. Of the parts reads used, the spent ones (``PartReads``) go first; one with bytes no read used yet goes
        only while the pool is over its whole budget: another tensor of a generated file, read later, lies there."""
        unread = self._unread_bytes()
        over_read, over_unread = self.bytes - unread - self.keep_bytes, unread - self.ahead_limit
        if over_read <= 0 and over_unread <= 0:
            return
        for key in list(self.parts):
            fut, size = self.parts[key]
            if not fut.done():
                continue
            if key in self.unread:
                if over_unread > 0:
                    self.paused = PAUSE_AHEADS * self.ahead_limit
                    self._drop(key, size)
                    over_unread -= size
            elif over_read > 0 and self.reads.spent(key, size):
                self._drop(key, size)
                over_read -= size
        for key in list(self.parts):
            if over_read <= 0 or self.bytes <= self.budget:
                break
            fut, size = self.parts[key]
            if fut.done() and key not in self.unread:
                self._drop(key, size)
                over_read -= size

    def _unread_bytes(self) -> int:
        """Bytes of the parts fetched ahead, in flight or arrived, that no read used yet (called with the lock held)."""
        return sum(self.parts[k][1] for k in self.unread)

    def _drop(self, key, size: int) -> None:
        """Let go of finished part ``key`` (called with the lock held)."""
        del self.parts[key]
        self.unread.discard(key)
        self.bytes -= size
        self.reads.dropped(key, size)

    def set_memory(self, budget: int) -> None:
        """Bound the parts by ``budget`` bytes: the pool's share (``READ_SHARES``) for parts reads used, the rest for
        parts fetched ahead and not read yet."""
        with self.lock:
            self.keep_bytes, self.ahead_limit = _split(budget, self.read_share)
            self._trim()

    def set_use(self, use: str) -> None:
        """Split the same budget for readers that read as ``use`` says (``READ_SHARES``)."""
        with self.lock:
            self.read_share = READ_SHARES[use]
            self.keep_bytes, self.ahead_limit = _split(self.keep_bytes + self.ahead_limit, self.read_share)
            self._trim()

    def close(self) -> None:
        """Let go of every part and stop the request threads (a request running ends on its own: nothing waits for
        it); requests waiting for a thread fail, and so does any later one (``PoolClosed``)."""
        with self.lock:
            self.closed = True
            ex, self.executor = self.executor, None
            waiting, self.waiting = self.waiting, {}
            self.parts.clear()
            self.unread.clear()
            self.reads.clear()
            self.bytes = 0
        if ex is not None:
            ex.shutdown(wait=False, cancel_futures=True)
        for queue in waiting.values():
            for send in queue:
                send()  # fails its parts at once (the pool refuses it)

    def reset(self, keep_budgets: bool = False) -> None:
        """Empty (in a forked child, whose threads and answers in flight are the parent's: ``keep_budgets``)."""
        if not keep_budgets:
            self.keep_bytes, self.ahead_limit = PART_CACHE_BYTES, AHEAD_BYTES
        self._empty()


class PoolClosed(OSError):
    """A request asked of a part pool after its owner closed it."""


def _split(budget: int, read_share: float) -> tuple:
    """``(bytes for parts reads used, bytes for parts fetched ahead)`` of a budget: ``read_share`` of it and the
    rest."""
    budget = max(0, int(budget))
    keep = int(budget * read_share)
    return keep, budget - keep


#: the pools alive now, emptied in a forked child (fork is a process's event; this holds no pool alive)
_live: "weakref.WeakSet[PartPool]" = weakref.WeakSet()


def _after_fork() -> None:
    for pool in list(_live):
        pool.reset(keep_budgets=True)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


class S3Object(Blob):
    """A ranged-read blob over one version (``etag``) of ``s3://bucket/key`` of ``size`` bytes."""

    def __init__(self, client: S3Client, bucket: str, key: str, size: int, etag: str, mtime_ns: int = 0,
                 pool: PartPool | None = None):
        self.client = client
        self.pool = pool if pool is not None else PartPool()  # its owner's (a tree's); alone: its own, default budget
        self._own_pool = pool is None
        self.bucket, self.key = bucket, key
        self._size, self.etag, self.mtime_ns = int(size), normal_etag(etag), int(mtime_ns)
        self._id = (bucket, key, etag)
        self.user_metadata: dict | None = None  # the object's user metadata, from the first answer

    @property
    def name(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    @property
    def size(self) -> int:
        return self._size

    @property
    def version(self) -> str:
        return self.etag

    def current_version(self) -> str:
        """The object's ETag now (``OSError`` when it is gone or the endpoint cannot be asked)."""
        from ..errors import StorageError

        try:
            info = self.client.head(self.bucket, self.key)
        except StorageError as e:
            raise OSError(str(e)) from None
        if info is None:
            raise FileNotFoundError(self.name)
        return info.etag

    def __repr__(self) -> str:
        return f"S3Object({self.name}, {self.size} bytes, {self.etag})"

    # -- requests ------------------------------------------------------------------------------------------------
    def _get(self, lo: int, hi: int, into: memoryview | list | None = None, filled=None):
        r = self.client.get(self.bucket, self.key, start=lo, end=hi, etag=self.etag, into=into, on_filled=filled)
        if self.user_metadata is None:
            self.user_metadata = r.metadata
        return r.count if into is not None else r.data

    def _part_range(self, i: int) -> tuple:
        return i * PART_BYTES, min(self.size, (i + 1) * PART_BYTES)

    def _part(self, i: int, need: tuple | None = None) -> Future | None:
        """Part ``i``'s future; None when the read needs only ``need`` of it, bytes of a spent part no read used yet
        (``PartPool.part``)."""
        lo, hi = self._part_range(i)
        return self.pool.part((*self._id, i), lambda bufs, filled: self._get(lo, hi, bufs, filled), hi - lo,
                              need)

    def will_need(self, offset: int, length: int | None = None, announced: bool = True) -> None:
        """Queue the parts under ``[offset, offset + length)`` (None: ``READ_AHEAD_PARTS`` parts) that are neither
        cached nor in flight, by groups of ``FETCH_PARTS`` aligned parts, one request each (the group holding
        ``offset`` from ``offset`` on), while the ahead budget allows (best effort, no waiting). ``announced``: asked
        for by a reader (paused after parts fetched ahead were dropped unread), not by this object's own read-ahead."""
        if length is None:
            length = READ_AHEAD_PARTS * PART_BYTES
        if offset >= self.size or length <= 0:
            return
        first, last = offset // PART_BYTES, (self.size - 1) // PART_BYTES
        for g in range(first // FETCH_PARTS, (min(self.size, offset + length) - 1) // PART_BYTES // FETCH_PARTS + 1):
            parts = range(max(first, g * FETCH_PARTS), min(last, (g + 1) * FETCH_PARTS - 1) + 1)  # not behind
            for run in _runs([i for i in parts if not self.pool.was_read((*self._id, i))]):  # not whole again
                if not self.pool.ahead([(*self._id, i) for i in run], [self._part_range(i) for i in run], self._get,
                                       announced):
                    return  # enough in flight ahead: a later read announces the rest again

    # -- reads ---------------------------------------------------------------------------------------------------
    def read_into(self, view: memoryview, offset: int, need: int) -> tuple[int, bool]:
        """Read ``need`` bytes from ``offset`` into ``view`` (fewer only at the end of the object): ``(count,
        whether the read waited for the endpoint)`` (False when fetched parts held it all)."""
        need = max(0, min(need, self.size - offset))
        if need == 0:
            return 0, False
        if self._through_parts(need):
            waited = self._from_parts(view, offset, need)
        else:
            waited = not self._from_cache(view, offset, need)
            if waited:
                self._get(offset, offset + need, view[:need])
        if waited:
            count_waited_read()
        return need, waited

    def _from_cache(self, view: memoryview, offset: int, need: int) -> bool:
        """Fill ``view[:need]`` from a part fetched or in flight, if one holds the whole range (a small object
        announced ahead is one part: asking for its range again would fetch it twice)."""
        i = _one_part(offset, offset + need)
        if i is None:
            return False
        data = self.pool.cached((*self._id, i))
        if data is None:
            return False
        lo = offset - i * PART_BYTES
        view[:need] = memoryview(data)[lo:lo + need]
        self.pool.used((*self._id, i), lo, lo + need)
        return True

    def _through_parts(self, need: int) -> bool:
        """Whether a read of ``need`` bytes goes through parts: a large one, or any read of an object smaller than
        ``PART_MIN`` (one part, fetched whole once: two reads of it, or a read and an announcement racing, never ask
        for its bytes twice)."""
        return need >= PART_MIN or self.size < PART_MIN

    def _held(self, lo: int, hi: int) -> bool:
        """Whether one part, fetched or in flight, holds ``[lo, hi)``."""
        i = _one_part(lo, hi)
        return i is not None and self.pool.holds((*self._id, i))

    def _from_parts(self, view: memoryview, offset: int, need: int) -> bool:
        """Copy ``[offset, offset + need)`` from the parts under it (fetched now if need be): whether any part had
        to be waited for."""
        end = offset + need
        first, last = offset // PART_BYTES, (end - 1) // PART_BYTES
        futures = [self._part(i, _within(i, offset, end)) for i in range(first, last + 1)]
        pos, waited = 0, False
        for i, fut in zip(range(first, last + 1), futures):
            lo, hi = _within(i, offset, end)
            if fut is None:  # bytes no read used of a part let go of: just those
                self._get(i * PART_BYTES + lo, i * PART_BYTES + hi, view[pos:pos + hi - lo])
                waited = True
            else:
                waited |= not fut.done()
                data = fut.result()
                view[pos:pos + hi - lo] = memoryview(data)[lo:hi]
                self.pool.used((*self._id, i), lo, hi)
            pos += hi - lo
        return waited

    def read(self, offset: int, n: int) -> bytes:
        """``n`` bytes from ``offset`` (fewer at the end of the object), through the part cache."""
        buf = bytearray(max(0, min(n, self.size - offset)))
        self.read_into(memoryview(buf), offset, len(buf))
        return bytes(buf)

    def read_spans(self, spans, scratch, hint: bool = True, gap: int = MERGE_GAP) -> tuple:
        """The ranges ``spans`` (``(offset, end)`` each) into one buffer of ``scratch(size)``: ``(buffer, position of
        each span's first byte)``. Ranges less than ``MERGE_GAP`` apart are fetched as one request, the
        requests concurrently; ``ShortRead`` when the object ends inside a span."""
        spans = [(int(lo), int(end)) for lo, end in spans]
        for k, (lo, end) in enumerate(spans):
            if end > self.size:
                raise ShortRead(k, max(0, self.size - lo))
        starts, total = [], 0
        for lo, end in spans:
            starts.append(total)
            total += end - lo
        buf = scratch(total)
        mv = memoryview(buf)
        groups = _merge(spans, gap)
        # small groups (exact ranges) go to the request threads, all but one; large ones are read here, their parts
        # fetched concurrently (a request thread never waits for another request: no deadlock)
        # (a small group inside a part fetched or in flight is copied here, where waiting for that part is safe)
        asked, here = [], []
        for g in groups:
            (here if self._through_parts(g[1] - g[0]) or self._held(g[0], g[1]) else asked).append(g)
        # in MAX_IN_FLIGHT_PER_OBJECT lanes at most, this thread's included, each reading its groups in turn: as many
        # requests at once all the way through (HDF5 metadata fetched ahead asks for a hundred ranges at a time)
        lanes = [asked[k::MAX_IN_FLIGHT_PER_OBJECT] for k in range(min(MAX_IN_FLIGHT_PER_OBJECT, len(asked)))] or [[]]
        futures = [self.pool.submit(self._place_each, mv, lane, spans, starts) for lane in lanes[1:]]
        try:
            self._place_each(mv, lanes[0] + here, spans, starts)
        finally:
            for f in futures:
                f.result()
        return buf, starts

    def _place_each(self, mv: memoryview, groups: list, spans: list, starts: list) -> None:
        for g in groups:
            self._place(mv, *g, spans, starts)

    def _place(self, mv: memoryview, lo: int, hi: int, members: list, spans: list, starts: list) -> None:
        """Fetch ``[lo, hi)`` (one merged group) and copy each member span to its place in ``mv``."""
        if len(members) == 1:
            k = members[0]
            self.read_into(mv[starts[k]:starts[k] + hi - lo], lo, hi - lo)
            return
        tmp = bytearray(hi - lo)
        self.read_into(memoryview(tmp), lo, hi - lo)
        for k in members:
            a, b = spans[k]
            mv[starts[k]:starts[k] + b - a] = tmp[a - lo:b - lo]

    def read_scattered(self, spans, scratch, gap: int | None = None) -> tuple:
        """``read_spans`` for small ranges far apart (a peek's rows in each chunk): the same concurrency, and the same
        merging unless ``gap`` says ranges that far apart are not worth one request (metadata fetched ahead: a
        range between two nodes would be a part of data)."""
        return self.read_spans(spans, scratch, hint=False, gap=MERGE_GAP if gap is None else gap)

    def close(self) -> None:
        """Close the object's own pool, if it has one (a pool given belongs to its owner; the connections belong to
        the client)."""
        if self._own_pool:
            self.pool.close()


def _part_buffer(size: int):
    """A writable buffer of ``size`` bytes for a part's answer, not zeroed first (every byte is written before it is
    read: a part's request fails unless it filled it): zeroing a new ``bytearray`` cost more CPU than any other step
    of a fetch (docs/measurements.md, "S3: part buffers")."""
    import numpy as np  # here: the object store is opened by commands that need no numpy before their first request

    return memoryview(np.empty(size, np.uint8))


def _one_part(lo: int, hi: int) -> int | None:
    """The part holding all of ``[lo, hi)``, or None when the range crosses a part boundary."""
    i = lo // PART_BYTES
    return i if (hi - 1) // PART_BYTES == i else None


def _within(i: int, lo: int, hi: int) -> tuple:
    """``[lo, hi)`` of the object cut to part ``i``, as offsets within the part."""
    base = i * PART_BYTES
    return max(lo, base) - base, min(hi, base + PART_BYTES) - base


def _runs(parts: list) -> list:
    """``parts`` (ascending part numbers) cut where they do not follow each other."""
    runs: list = []
    for i in parts:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _merge(spans: list, gap: int = MERGE_GAP) -> list:
    """``[(lo, hi, [span indices])]``: the spans grouped where they lie less than ``gap`` apart."""
    order = sorted(range(len(spans)), key=lambda k: spans[k])
    groups: list = []
    for k in order:
        lo, end = spans[k]
        if groups and lo - groups[-1][1] <= gap and end - groups[-1][0] <= 4 * PART_BYTES:
            g = groups[-1]
            g[1] = max(g[1], end)
            g[2].append(k)
        else:
            groups.append([lo, end, [k]])
    return [tuple(g) for g in groups]
