"""How a tree's part pools split their budget by how its readers read (``tree.memory.streamed``): an export streams,
a mount's loaders come back to parts they half read."""
from __future__ import annotations

from ckptfs.storage.s3object import PartPool
from ckptfs.tree.memory import RunParts, remote_bytes, streamed


class _Tree:
    def __init__(self, parts):
        self.parts = parts


def test_an_exported_trees_pool_keeps_more_for_parts_fetched_ahead():
    pool = PartPool(8000)
    try:
        assert (pool.keep_bytes, pool.ahead_limit) == (4000, 4000)
        streamed(_Tree(pool))
        assert (pool.keep_bytes, pool.ahead_limit) == (2000, 6000)
        streamed(_Tree(None))  # a local tree: nothing to split
    finally:
        pool.close()


def test_a_runs_pools_are_split_for_its_readers_now_and_later():
    run = RunParts(64 << 20)
    first = run.pool()
    streamed(_Tree(run))
    second = run.pool()
    try:
        share = remote_bytes(64 << 20) // 2
        for p in (first, second):
            assert p.keep_bytes + p.ahead_limit == share and p.keep_bytes == share // 4, (p.keep_bytes, p.ahead_limit)
    finally:
        first.close()
        second.close()
