"""The server-side read-ahead (ckptfs.tensor.readahead) as a pieced file drives it: which blocks get computed, by whom.

A sequential read of a file made of tensors queues the blocks after it for the read-ahead thread, within the piece
being read too (a safetensors data section is one TensorRun piece holding every tensor), and a block read whole and
dropped by the streaming cache is not computed again for nobody. Bytes are checked against the arrays every time.
"""
from __future__ import annotations

import threading
from array import array
from collections import Counter

import numpy as np
import pytest

from ckptfs.tensor import base as tensor_mod
from ckptfs.tensor.cache import BlockCache
from ckptfs.layouts.cursor import FROM_MEMORY_RUN, ReadCursor
from ckptfs.layouts.pieces import Literal, PiecedFile, TensorRun
from ckptfs.tensor.readahead import READ_AHEAD
from ckptfs.layouts.file import fill
from ckptfs.tensor.base import ArrayTensor

BLOCK = 256 << 10  # small blocks (above the small-read and sequential-read sizes) so a few MB span many


class CountingTensor(ArrayTensor):
    """An array tensor that counts the cache blocks computed for it, per thread name."""

    __slots__ = ("computed",)

    def __init__(self, array):
        super().__init__(array)
        self.computed = Counter()

    def _block(self, blk, be):
        self.computed[(threading.current_thread().name, blk)] += 1
        return super()._block(blk, be)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(tensor_mod, "BLOCK_BYTES", BLOCK)
    yield
    _cursors.clear()
    assert READ_AHEAD.wait_idle(30), "read-ahead still busy after 30 s"


def _run_file(sizes, read_ahead=4 * BLOCK):
    rng = np.random.default_rng(7)
    arrays = [rng.integers(0, 2**31, size=n // 4, dtype=np.int32) for n in sizes]
    tensors = [CountingTensor(a) for a in arrays]
    offsets = array("q", [0])
    for a in arrays:
        offsets.append(offsets[-1] + a.nbytes)
    cache = BlockCache(64 << 20)
    cache.streaming = True
    cache.read_ahead = read_ahead
    head = b"H" * 100
    f = PiecedFile([Literal(head), TensorRun([f"t{i}" for i in range(len(arrays))], tensors, offsets)],
                   name="model.safetensors", cache=cache)
    expected = head + b"".join(a.tobytes() for a in arrays)
    return f, tensors, expected


def _blocks(t) -> int:
    bb = t.block_elems() * t.dtype.itemsize
    return -(-t.nbytes // bb)


#: the stream the tests' reads belong to (an open handle's cursor), one per file
_cursors: dict = {}


def _read(f, offset, n, cursor=None) -> bytes:
    """What a FUSE read of ``n`` bytes at ``offset`` through an open handle gets (clipped at the end as the tree clips
    it): the handle's cursor is the file's own one unless given."""
    buf = bytearray(n)
    got = fill(f, offset, memoryview(buf), "f", cursor=cursor or _cursors.setdefault(id(f), ReadCursor()))
    return bytes(buf[:got])


def test_sequential_read_prepares_the_next_blocks_of_the_same_run():
    f, tensors, expected = _run_file([20 * BLOCK])  # one tensor, 20 blocks, inside one TensorRun piece
    t = tensors[0]
    assert _read(f, 0, 100 + BLOCK) == expected[:100 + BLOCK]
    assert READ_AHEAD.wait_idle(30)
    ahead = {blk for (who, blk) in t.computed if who == "ckptfs-readahead"}
    # the read ended inside block 1; the 4 blocks' worth after it (blocks 1..5) were prepared in the background
    assert {2, 3, 4} <= ahead, t.computed
    assert all(n == 1 for n in t.computed.values()), t.computed


def test_whole_sequential_read_computes_each_block_once():
    f, tensors, expected = _run_file([7 * BLOCK + 12, 3 * BLOCK, 5 * BLOCK + 4])
    out, pos, step = bytearray(), 0, BLOCK // 2
    while pos < f.size:
        out += _read(f, pos, step)
        pos += step
    assert bytes(out) == expected
    assert READ_AHEAD.wait_idle(30)
    per_block = Counter()
    for t in tensors:
        for (who, blk), n in t.computed.items():
            per_block[(id(t), blk)] += n
    # every block computed exactly once (a tensor's short last block may instead be read small, uncached, when the
    # reader gets there before the read-ahead does)
    assert sum(_blocks(t) for t in tensors) - len(tensors) <= len(per_block) <= sum(_blocks(t) for t in tensors)
    assert set(per_block.values()) == {1}


def test_blocks_read_whole_are_not_prepared_again_when_the_reader_jumps_back():
    f, tensors, expected = _run_file([12 * BLOCK])
    t = tensors[0]
    start = 100 + 6 * BLOCK  # read the second half first, whole and sequentially: its blocks are dropped
    pos = start
    while pos < f.size:
        assert _read(f, pos, BLOCK) == expected[pos:pos + BLOCK]
        pos += BLOCK
    assert READ_AHEAD.wait_idle(30)
    assert f.cache.size == 0  # every block was read whole and dropped (streaming cache)
    # then the first half: its read-ahead window reaches into the second half, which nobody will read again
    pos = 100
    while pos < start:
        assert _read(f, pos, BLOCK) == expected[pos:pos + BLOCK]
        pos += BLOCK
    assert READ_AHEAD.wait_idle(30)
    assert set(t.computed.values()) == {1}, t.computed
    assert {blk for _, blk in t.computed} == set(range(12))


def test_a_read_of_a_dropped_block_still_computes_it():
    f, tensors, expected = _run_file([4 * BLOCK])
    pos = 100
    while pos < f.size:
        assert _read(f, pos, BLOCK) == expected[pos:pos + BLOCK]
        pos += BLOCK
    assert READ_AHEAD.wait_idle(30)
    before = sum(tensors[0].computed.values())
    assert _read(f, 100 + BLOCK, 4096) == expected[100 + BLOCK:100 + BLOCK + 4096]  # the kernel dropped its page
    assert _read(f, 100 + 2 * BLOCK, BLOCK) == expected[100 + 2 * BLOCK:100 + 3 * BLOCK]
    assert sum(tensors[0].computed.values()) >= before + 1


def test_several_workers_compute_each_queued_block_once():
    from ckptfs.tensor.readahead import ReadAhead

    ra = ReadAhead(max_queued=64, workers=3)
    cache = BlockCache(64 << 20)
    done, lock = Counter(), threading.Lock()

    def compute(k):
        def run():
            with lock:
                done[k] += 1
            return bytes([k % 256]) * 1000
        return run

    for k in range(40):
        ra.submit(cache, ("t", k), compute(k))
        ra.submit(cache, ("t", k), compute(k))  # a second request for a queued block is dropped
    assert ra.wait_idle(30)
    assert done == Counter({k: 1 for k in range(40)})
    assert all(cache.get_or_compute(("t", k), lambda: b"") == bytes([k]) * 1000 for k in range(40))
    assert len([th for th in ra._threads if th.is_alive()]) <= 3


@pytest.mark.parametrize("disk", [False, True])
def test_a_second_worker_computes_only_while_blocks_go_to_the_disk(disk):
    """Blocks whose reads waited for the storage (the ``waited_reads`` hook counts them) are computed two at a time;
    blocks from memory one at a time (after the first, which starts with all workers)."""
    from ckptfs.tensor.readahead import ReadAhead

    waits = threading.local()
    ra = ReadAhead(max_queued=64, workers=2, waited_reads=lambda: getattr(waits, "n", 0))
    cache = BlockCache(64 << 20)
    lock, running, most = threading.Lock(), [0], []

    def compute():
        with lock:
            running[0] += 1
            most.append(running[0])
        if disk:  # what a storage backend counts for a read that waited (a direct read from the disk)
            waits.n = getattr(waits, "n", 0) + 1
        threading.Event().wait(0.02)
        with lock:
            running[0] -= 1
        return b"x"

    for k in range(12):
        ra.submit(cache, ("d", k), compute)
    assert ra.wait_idle(30)
    assert len(most) == 12
    assert (max(most[2:]) == 2) if disk else (max(most[2:]) == 1)


def test_a_peek_and_the_kernels_small_follow_up_queue_nothing():
    f, tensors, expected = _run_file([20 * BLOCK])
    t = tensors[0]
    # what the kernel sends for a 4 KiB read at a tensor's start: 4 KiB, then 16 KiB after it (initial read-ahead)
    assert _read(f, 100, 4096) == expected[100:4196]
    assert _read(f, 4196, 16384) == expected[4196:20580]
    assert READ_AHEAD.wait_idle(30)
    assert not any(who == "ckptfs-readahead" for who, _ in t.computed), t.computed
    # a reader that goes on (the kernel's read-ahead grows: 32, 64 KiB...) gets the read-ahead
    assert _read(f, 20580, 32768) == expected[20580:53348]
    assert _read(f, 53348, 65536) == expected[53348:118884]
    assert READ_AHEAD.wait_idle(30)
    assert {blk for who, blk in t.computed if who == "ckptfs-readahead"} >= {1, 2, 3}, t.computed


def test_an_idle_worker_is_not_woken_for_a_block_it_may_not_take():
    """With blocks from the page cache one worker computes at a time; the other sleeps through the whole queue
    instead of waking (a thread switch and a GIL hand-off) for every block queued or finished."""
    from ckptfs.tensor.readahead import ReadAhead

    class CountingCondition(threading.Condition):
        waits = 0

        def wait(self, timeout=None):
            CountingCondition.waits += 1
            return super().wait(timeout)

    ra = ReadAhead(max_queued=64, workers=2)
    lock = threading.Lock()
    ra._cond, ra._idle = CountingCondition(lock), threading.Condition(lock)
    cache = BlockCache(64 << 20)
    done, queued = Counter(), threading.Event()

    def compute(k):
        def run():
            queued.wait(30)  # the first blocks start once all are queued: the rest wait in the queue
            threading.Event().wait(0.002)  # computing a block lets other threads run (GIL released)
            done[k] += 1
            return b"x"
        return run

    for k in range(20):
        ra.submit(cache, ("w", k), compute(k))
    queued.set()
    assert ra.wait_idle(30)
    assert done == Counter({k: 1 for k in range(20)})
    # each worker waits once when it has nothing it may take (and again when the queue runs dry): not per block
    assert CountingCondition.waits <= 6, CountingCondition.waits


def test_a_block_computed_from_memory_alone_marks_its_cursor_and_one_that_waited_clears_it():
    """The worker reports each block to the cursor that queued it: ``FROM_MEMORY_RUN`` blocks in a row whose reads
    were all known to come from memory (the ``memory_reads`` hook counted them, ``waited_reads`` did not move) make
    the cursor ``from_memory``, and any other block clears it. The cache holds no such state."""
    from ckptfs.tensor.readahead import ReadAhead

    counts = threading.local()

    def counter(name):
        return lambda: getattr(counts, name, 0)

    def compute(kind):
        def run():
            setattr(counts, kind, getattr(counts, kind, 0) + 1)  # what the storage counts for one read
            return b"x"
        return run

    ra = ReadAhead(workers=1, waited_reads=counter("waited"), memory_reads=counter("memory"))
    cache = BlockCache(1 << 20)
    cursor, other = ReadCursor(), ReadCursor()
    blocks = iter(range(10_000))

    def run(kind, n=1):
        for _ in range(n):
            assert ra.submit(cache, ("m", next(blocks)), compute(kind), cursor.block_computed)
            assert ra.wait_idle(30)
        return cursor.from_memory

    assert not run("memory", FROM_MEMORY_RUN - 1)  # a short run: what a cold read meets between its own waits
    assert not run("waited")
    assert not run("memory", FROM_MEMORY_RUN - 1)
    assert run("memory")  # the run is long enough
    assert not run("waited") and cursor.memory_run == 0
    assert run("memory", FROM_MEMORY_RUN)
    assert not other.from_memory  # another stream of the same cache is not told
    assert not run("neither")  # reads the storage could not tell about: read ahead as before


def test_sequential_reads_queue_nothing_while_blocks_come_from_memory_until_one_of_their_own_waits(monkeypatch):
    """With its cursor ``from_memory``, a sequential read computes its own blocks and queues none (a thread computing
    ahead only took turns with the reader); once a read of the reader's own waits for the storage, the blocks after
    it are queued again. Bytes are exact either way."""
    from ckptfs.layouts import pieces

    f, tensors, expected = _run_file([24 * BLOCK])
    t = tensors[0]
    cursor = _cursors.setdefault(id(f), ReadCursor())
    cursor.from_memory = True
    for off in range(0, 100 + 8 * BLOCK, BLOCK):
        assert _read(f, off, BLOCK) == expected[off:off + BLOCK]
    assert READ_AHEAD.wait_idle(30)
    assert not [blk for (who, blk) in t.computed if who == "ckptfs-readahead"]
    waits = iter(range(1, 1000))  # every call a new count: the read's own blocks waited
    monkeypatch.setattr(pieces, "waited_reads", lambda: next(waits))
    off = 100 + 8 * BLOCK
    assert _read(f, off, BLOCK) == expected[off:off + BLOCK]
    assert READ_AHEAD.wait_idle(30)
    assert not cursor.from_memory
    ahead = sorted(blk for (who, blk) in t.computed if who == "ckptfs-readahead")
    assert ahead and min(ahead) >= 9, ahead
