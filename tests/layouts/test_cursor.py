"""The prefetch cursor (ckptfs.layouts.cursor): one per open handle, its policy pinned.

Through a tree's handles (``VirtualTree.open`` → ``handle(fh).cursor``), the way the FUSE adapter reads: two handles of
one file keep a stream each; and on the cursor itself: a peek prepares nothing, a stream's window doubles up to the
cap, a reader that does not consume what was prepared gets nothing more (backpressure), refused blocks stop the
growth. Bytes are checked against the arrays every time.
"""
from __future__ import annotations

import threading
from array import array
from collections import Counter

import numpy as np
import pytest

from ckptfs.layouts.cursor import FIRST_WINDOW, NOTHING, ReadCursor
from ckptfs.layouts.pieces import Literal, PiecedFile, TensorRun
from ckptfs.tensor import base as tensor_mod
from ckptfs.tensor.base import ArrayTensor
from ckptfs.tensor.cache import BlockCache
from ckptfs.tensor import readahead
from ckptfs.tensor.readahead import READ_AHEAD
from ckptfs.tree.virtual import VirtualTree

BLOCK = 256 << 10
KiB, MiB = 1 << 10, 1 << 20


class CountingTensor(ArrayTensor):
    """An array tensor that counts the cache blocks computed for it by the read-ahead threads."""

    __slots__ = ("ahead",)

    def __init__(self, array):
        super().__init__(array)
        self.ahead = Counter()

    def _block(self, blk, be):
        if threading.current_thread().name == "ckptfs-readahead":
            self.ahead[blk] += 1
        return super()._block(blk, be)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(tensor_mod, "BLOCK_BYTES", BLOCK)
    yield
    assert READ_AHEAD.wait_idle(30), "read-ahead still busy after 30 s"


def _tree(nbytes: int, read_ahead: int = 4 * BLOCK):
    """A tree of one safetensors-like file (a 100-byte header, one tensor of ``nbytes``) over a streaming cache with
    ``read_ahead`` on, as the FUSE server sets it: ``(tree, tensor, expected bytes)``."""
    data = np.random.default_rng(3).integers(0, 2**31, size=nbytes // 4, dtype=np.int32)
    t = CountingTensor(data)
    cache = BlockCache(64 << 20)
    cache.streaming, cache.read_ahead = True, read_ahead
    f = PiecedFile([Literal(b"H" * 100), TensorRun(["t"], [t], array("q", [0, data.nbytes]))], name="m", cache=cache)
    return VirtualTree({"m.safetensors": f}, cache=cache), t, b"H" * 100 + data.tobytes()


def _read(tree, fh, offset, n) -> bytes:
    """A read through open handle ``fh`` (its cursor), as the FUSE adapter makes it."""
    h = tree.handle(fh)
    buf = bytearray(n)
    got = tree.readinto(h.entry, offset, memoryview(buf), h.cursor)
    return bytes(buf[:got])


def _step(c, offset, n, read_ahead=4 * MiB, announce_ahead=0, waited=False):
    return c.advance(offset, offset + n, waited=waited, read_ahead=read_ahead, announce_ahead=announce_ahead)


def test_two_handles_reading_one_file_interleaved_keep_a_stream_each():
    """Two readers of one file, their 64 KiB reads interleaved (each continuing its own previous read): each handle's
    cursor sees its own stream, so the blocks after both readers are computed ahead. With the stream kept by the
    file, each read looked like a jump and neither got read-ahead."""
    tree, t, expected = _tree(40 * BLOCK, read_ahead=2 * BLOCK)  # both windows fit the read-ahead queue at once
    e = tree.lookup("m.safetensors")
    a, b = tree.open(e), tree.open(e)
    assert a != b and tree.handle(a).cursor is not tree.handle(b).cursor
    pos = {a: 100, b: 100 + 20 * BLOCK}
    for _ in range(8):
        for fh in (a, b):
            assert _read(tree, fh, pos[fh], 64 * KiB) == expected[pos[fh]:pos[fh] + 64 * KiB]
            pos[fh] += 64 * KiB
    assert READ_AHEAD.wait_idle(30)
    # the block after where each reader stopped (a in block 2, b in block 22), which neither read itself
    assert 3 in t.ahead and 23 in t.ahead, t.ahead
    assert set(t.ahead.values()) == {1}
    tree.release(a)
    with pytest.raises(Exception):
        tree.handle(a)
    assert _read(tree, b, pos[b], 4 * KiB) == expected[pos[b]:pos[b] + 4 * KiB]  # b stays open
    tree.release(b)


def test_a_one_off_read_without_a_cursor_prepares_nothing():
    tree, t, expected = _tree(20 * BLOCK)
    for off in range(100, 100 + 4 * BLOCK, BLOCK):
        assert tree.read("m.safetensors", off, BLOCK) == expected[off:off + BLOCK]
    assert READ_AHEAD.wait_idle(30)
    assert not t.ahead


def test_a_peek_and_the_kernels_follow_up_prepare_nothing():
    """4 KiB, then the kernel's 16 KiB initial read-ahead after it: no bytes to prepare, through a handle too."""
    c = ReadCursor()
    assert _step(c, 100, 4 * KiB) is NOTHING
    assert _step(c, 100 + 4 * KiB, 16 * KiB) is NOTHING
    tree, t, expected = _tree(20 * BLOCK)
    fh = tree.open(tree.lookup("m.safetensors"))
    assert _read(tree, fh, 100, 4 * KiB) == expected[100:100 + 4 * KiB]
    assert _read(tree, fh, 100 + 4 * KiB, 16 * KiB) == expected[100 + 4 * KiB:100 + 20 * KiB]
    assert READ_AHEAD.wait_idle(30)
    assert not t.ahead, t.ahead


def test_a_sequential_streams_window_doubles_up_to_its_cap():
    """Reads of 128 KiB in order: the first prepares ``FIRST_WINDOW`` after it, each extension doubles the window,
    and it stops at the cap (the tree's ``cache.read_ahead``); the prepared ranges follow each other without a gap
    or an overlap."""
    cap = 4 * MiB
    c = ReadCursor()
    ranges, sizes = [], []
    for off in range(0, 32 * MiB, 128 * KiB):
        step = _step(c, off, 128 * KiB, read_ahead=cap)
        if step.prepare is not None:
            ranges.append(step.prepare)
            sizes.append(step.prepare[1] - (off + 128 * KiB))
    assert sizes[0] == FIRST_WINDOW
    assert sizes[:3] == [FIRST_WINDOW, 2 * FIRST_WINDOW, cap]
    assert max(sizes) == cap and c.prepared.size == cap
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), ranges  # contiguous, nothing asked twice
    assert ranges[-1][1] <= 32 * MiB + cap


def test_a_stream_that_does_not_consume_what_was_prepared_gets_no_more_and_does_not_grow():
    """Backpressure: after an extension, reads that consume nothing of what was prepared (rereading the same bytes)
    prepare nothing and leave the window as it is; once the reader consumes some of it, the window is extended again,
    doubled, a full window ahead of the reader."""
    c = ReadCursor()
    first = _step(c, 0, 128 * KiB)
    assert first.prepare == (128 * KiB, 128 * KiB + FIRST_WINDOW)
    for _ in range(20):  # the same bytes again and again
        assert _step(c, 0, 128 * KiB) is NOTHING
    assert c.prepared.size == FIRST_WINDOW and c.prepared.to == 128 * KiB + FIRST_WINDOW
    step = _step(c, 128 * KiB, 128 * KiB)  # moved on: part of the window consumed
    assert step.prepare == (128 * KiB + FIRST_WINDOW, 256 * KiB + 2 * FIRST_WINDOW)


def test_blocks_the_queue_refuses_are_asked_for_again_and_stop_the_growth(monkeypatch):
    """A full read-ahead queue (what was queued earlier is not computed yet) refuses blocks: the cursor does not count
    them as prepared (the next read asks again) and its window does not grow; the bytes are right all along."""
    tree, t, expected = _tree(40 * BLOCK)
    monkeypatch.setattr(READ_AHEAD, "max_queued", 0)
    fh = tree.open(tree.lookup("m.safetensors"))
    c = tree.handle(fh).cursor
    pos = 100
    for _ in range(6):
        assert _read(tree, fh, pos, 128 * KiB) == expected[pos:pos + 128 * KiB]
        pos += 128 * KiB
        assert c.prepared.to <= pos and c.prepared.size == FIRST_WINDOW, c
    assert READ_AHEAD.wait_idle(30)
    assert not t.ahead
    monkeypatch.setattr(READ_AHEAD, "max_queued", readahead.MAX_QUEUED)
    assert _read(tree, fh, pos, 128 * KiB) == expected[pos:pos + 128 * KiB]  # room again: prepared from here on
    assert READ_AHEAD.wait_idle(30)
    assert t.ahead and c.prepared.to > pos


def test_a_jump_starts_a_new_stream_with_small_windows():
    c = ReadCursor()
    for off in range(0, 8 * MiB, 256 * KiB):
        _step(c, off, 256 * KiB)
    assert c.prepared.size == 4 * MiB
    step = _step(c, 64 * MiB, 256 * KiB)  # far away: a new stream
    assert (c.start, c.end) == (64 * MiB, 64 * MiB + 256 * KiB)
    assert step.prepare == (64 * MiB + 256 * KiB, 64 * MiB + 256 * KiB + FIRST_WINDOW)


def test_reads_finishing_out_of_order_stay_one_stream():
    """libfuse's threads finish one stream's requests out of order: a read a little behind the stream's end continues
    it (nothing is prepared twice, the windows keep their size)."""
    c = ReadCursor()
    for off in range(0, 4 * MiB, MiB):
        _step(c, off, MiB)
    size, to = c.prepared.size, c.prepared.to
    assert _step(c, 2 * MiB + 512 * KiB, 256 * KiB) is NOTHING  # late, well inside the stream
    assert (c.start, c.end) == (0, 4 * MiB) and (c.prepared.size, c.prepared.to) == (size, to)


def test_announcing_starts_once_the_stream_is_a_read_ahead_long_and_stays_within_its_tensor():
    """With announcing on, bytes beyond the read-ahead window are announced once the stream is ``read_ahead`` long,
    never before its end plus ``read_ahead``, and not past ``announce_limit`` (the end of the tensor being read,
    for a stream that has not gone from one tensor into the next)."""
    c = ReadCursor()
    got = []
    for off in range(0, 32 * MiB, MiB):
        step = c.advance(off, off + MiB, waited=False, read_ahead=4 * MiB, announce_ahead=64 * MiB,
                         announce_limit=lambda a, b: 40 * MiB)
        if step.announce is not None:
            got.append((off + MiB, step.announce))
    assert got and got[0][0] >= 4 * MiB
    assert all(a >= end + 4 * MiB and b <= 40 * MiB for end, (a, b) in got), got
    assert got[-1][1][1] == 40 * MiB  # grew up to the limit


def test_announcements_continuing_the_tensor_being_read_say_so():
    """Announced bytes of the tensor the stream is reading continue it (``continuing``: a storage holding back
    announcements after some went unread still fetches these, as an object's own read-ahead used to); the tensors
    after it in the file are plain announcements."""
    class Noted(ArrayTensor):
        __slots__ = ("name", "noted")

        def will_need(self, start, stop, continuing=False):
            self.noted.append((start, stop, continuing))

    tensors = []
    for k in range(3):
        t = Noted(np.zeros(12 * MiB, dtype=np.uint8))
        t.name, t.noted = f"t{k}", []
        tensors.append(t)
    cache = BlockCache(0)
    cache.read_ahead, cache.announce_ahead = 4 * MiB, 64 * MiB
    f = PiecedFile([TensorRun(["t0", "t1", "t2"], tensors, array("q", [0, 12 * MiB, 24 * MiB, 36 * MiB]))],
                   name="w", cache=cache)
    c = ReadCursor()
    buf = memoryview(bytearray(MiB))
    t0, t1, t2 = tensors
    for off in range(0, 8 * MiB, MiB):  # inside t0: announced up to its end only, all continuing it
        f.readinto(off, buf, c)
    assert t0.noted and all(cont and stop <= 12 * MiB for _, stop, cont in t0.noted), t0.noted
    assert t1.noted == t2.noted == []
    for off in range(8 * MiB, 20 * MiB, MiB):  # on into t1: the stream is in file order, t2 is announced too
        f.readinto(off, buf, c)
    assert t1.noted and all(cont for *_, cont in t1.noted), t1.noted  # announced while t1 was being read
    assert t2.noted and not any(cont for *_, cont in t2.noted), t2.noted  # the tensor after it
