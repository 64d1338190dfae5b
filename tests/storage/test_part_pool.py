"""The part pool of object storage (``storage.s3object.PartPool``) without an endpoint: what it fetches ahead and
what it keeps, with a fetch function standing in for the requests."""
from __future__ import annotations

import threading

from ckptfs.storage.s3object import PartPool


def _filler(log: list):
    """A ``get(lo, hi, buffers)`` that records each request and fills its buffers."""
    lock = threading.Lock()

    def get(lo, hi, buffers, filled=None):
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
    pool = PartPool(4000, "stream")  # 1000 bytes for parts read, 3000 for parts fetched ahead
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


def test_parts_fetched_ahead_stay_until_read_whatever_reads_do_meanwhile():
    """A loader reading in an order of its own fetches parts itself and reads the parts fetched ahead for it later:
    they stay however much it reads meanwhile (announcements past the budget wait), and each read of one makes room
    for one more."""
    pool = PartPool(4000, "stream")  # 1000 bytes for parts read, 3000 for parts fetched ahead
    log: list = []
    get = _filler(log)
    try:
        ahead = [("file", k) for k in range(3)]
        assert pool.ahead(ahead, [(k * 1000, k * 1000 + 1000) for k in range(3)], get)
        _arrived(pool, ahead)
        for k in range(10):  # its own order: ten times the ahead budget of parts it fetches itself
            pool.part(("own", k), _fill, 1000).result(10)
        assert not pool.ahead([("file", 3)], [(3000, 4000)], get)
        with pool.lock:
            assert all(key in pool.parts for key in ahead)
        assert pool.cached(("file", 0)) is not None
        assert pool.ahead([("file", 3)], [(3000, 4000)], get)
    finally:
        pool.close()


def _fill(bufs, filled=None) -> int:
    for b in bufs:
        b[:] = b"\x02" * len(b)
    return sum(len(b) for b in bufs)


def test_a_pools_budget_is_split_by_how_its_readers_read():
    """A loader's pool keeps half its budget for parts read (it comes back to parts it half read), a stream's a
    quarter (it reads in order and announces far ahead); a pool told its readers stream splits the same budget so,
    at once, and its new budgets hold."""
    load, stream = PartPool(4000), PartPool(4000, "stream")
    try:
        assert (load.keep_bytes, load.ahead_limit) == (2000, 2000)
        assert (stream.keep_bytes, stream.ahead_limit) == (1000, 3000)
        load.set_use("stream")
        assert (load.keep_bytes, load.ahead_limit) == (1000, 3000)
        load.set_memory(8000)
        assert (load.keep_bytes, load.ahead_limit) == (2000, 6000)
    finally:
        load.close()
        stream.close()
