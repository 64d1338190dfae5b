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
