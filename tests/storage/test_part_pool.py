"""The part pool of object storage (``storage.s3object.PartPool``) without an endpoint: what it fetches ahead and
what it keeps, with a fetch function standing in for the requests."""
from __future__ import annotations

import threading

from ckptfs.storage.s3object import PartPool


def _filler(log: list):
    """A ``get(lo, hi, buffers)`` that records each request and fills its buffers."""
    lock = threading.Lock()

    def get(lo, hi, buffers):
        with lock:
            log.append((lo, hi))
        for b in buffers:
            b[:] = b"\x01" * len(b)
        return sum(len(b) for b in buffers)
    return get


def _arrived(pool: PartPool, keys) -> None:
    for key in keys:
        with pool.lock:
            fut = pool.parts[key][0]
        fut.result(10)


def test_parts_arrived_ahead_and_not_read_count_against_the_ahead_budget():
    """Parts fetched ahead that arrived and were not read yet count as well as those in flight: an announcement past
    the ahead budget queues nothing, so the parts announced first — which the reader needs first — are never let go
    of unread to make room for later ones (they would be fetched twice)."""
    pool = PartPool(4000)  # 1000 bytes for parts read, 3000 for parts fetched ahead
    log: list = []
    get = _filler(log)
    try:
        first = [("object", 0), ("object", 1)]
        assert pool.ahead(first, [(0, 1000), (1000, 2000)], get)
        _arrived(pool, first)
        assert pool.ahead([("object", 2)], [(2000, 3000)], get)  # 3000 bytes ahead: the whole budget
        _arrived(pool, [("object", 2)])
        assert not pool.ahead([("object", 3)], [(3000, 4000)], get)  # nothing read yet: no room
        with pool.lock:
            assert sorted(pool.parts) == [("object", 0), ("object", 1), ("object", 2)]
        assert log == [(0, 2000), (2000, 3000)]
        assert pool.cached(("object", 0)) is not None  # read: room for one more part ahead
        assert pool.ahead([("object", 3)], [(3000, 4000)], get)
        _arrived(pool, [("object", 3)])
        with pool.lock:
            assert ("object", 1) in pool.parts and ("object", 2) in pool.parts
    finally:
        pool.close()


def test_parts_fetched_ahead_that_reads_went_past_make_room():
    """Parts fetched ahead and never read (a reader that stopped) hold the ahead budget only until reads used the
    budget's worth of other parts; then an announcement lets go of them, oldest first, and is fetched."""
    pool = PartPool(4000)  # 1000 bytes for parts read, 3000 for parts fetched ahead
    log: list = []
    get = _filler(log)
    try:
        stale = [("stopped", k) for k in range(3)]
        assert pool.ahead(stale, [(k * 1000, k * 1000 + 1000) for k in range(3)], get)
        _arrived(pool, stale)
        assert not pool.ahead([("next", 0)], [(0, 1000)], get)
        for k in range(2):  # reads elsewhere, 2000 bytes: not yet past the budget
            pool.part(("elsewhere", k), lambda bufs: _fill(bufs), 1000).result(10)
        assert not pool.ahead([("next", 0)], [(0, 1000)], get)
        pool.part(("elsewhere", 2), lambda bufs: _fill(bufs), 1000).result(10)
        assert pool.ahead([("next", 0)], [(0, 1000)], get)  # 3000 bytes read since: the oldest goes
        _arrived(pool, [("next", 0)])
        with pool.lock:
            assert ("stopped", 0) not in pool.parts and ("stopped", 1) in pool.parts and ("next", 0) in pool.parts
    finally:
        pool.close()


def test_a_part_fetched_ahead_and_read_is_not_let_go_of_as_passed():
    """A part fetched ahead that a read used no longer counts as unread: it is kept as a read part, whatever reads
    do next."""
    pool = PartPool(4000)
    get = _filler([])
    try:
        assert pool.ahead([("o", 0)], [(0, 1000)], get)
        _arrived(pool, [("o", 0)])
        assert pool.cached(("o", 0)) is not None
        with pool.lock:
            assert pool.unread == {} and pool.clock == 1000
    finally:
        pool.close()


def _fill(bufs) -> int:
    for b in bufs:
        b[:] = b"\x02" * len(b)
    return sum(len(b) for b in bufs)
