"""How a tree shares ``--cache-size``: its block cache, and, over object storage, the parts fetched from it.

``--cache-size`` bounds what a server keeps beyond its fixed costs. A local checkpoint gives it all to the tree's
block cache (``BlockCache``: converted tensor blocks). A checkpoint in object storage also holds the parts of objects
it fetched, read or fetched ahead and not read yet, in the tree's own part pool (``storage.s3object.PartPool``); those
take ``REMOTE_SHARE`` of it, and the block cache the rest, so a mount of an S3 checkpoint stays within the same bound
as one of a local file. Every budget is its tree's: two trees in one process (two mounts, the API's trees) never
share or resize each other's pool.

A run (``tree/run.py``) has one block cache for its checkpoints' trees and one remote share (``RunParts``), split in
equal shares among the pools of the checkpoint trees built at the moment: one checkpoint read alone has all of it,
two built at once half each, and a tree closed gives its share back to the others.
"""
from __future__ import annotations

import threading

from ..tensor.cache import BlockCache
from ..storage.s3url import is_s3_url

#: the part of ``--cache-size`` that parts fetched from object storage may hold (measured: docs/measurements.md,
#: "S3: memory within --cache-size")
REMOTE_SHARE = 0.5


def remote_bytes(cache_size: int) -> int:
    """The bytes of ``cache_size`` that parts fetched from object storage may hold."""
    return int(cache_size * REMOTE_SHARE)


def tree_cache(cache_size: int, where) -> BlockCache:
    """The block cache of a tree over ``where`` (a path or an ``s3://`` URL), within ``cache_size`` bytes with the
    parts it fetches from object storage (``tree_parts``)."""
    if not is_s3_url(str(where)):
        return BlockCache(cache_size)
    cache = BlockCache(cache_size - remote_bytes(cache_size))
    cache.remote = True
    return cache


def tree_parts(cache_size: int, where):
    """The part pool of a tree over ``where`` (``storage.s3object.PartPool``, its budget the remote share of
    ``cache_size``; closed with the tree), or None for a local checkpoint."""
    if not is_s3_url(str(where)):
        return None
    from ..storage.s3object import PartPool  # only for object storage: a local mount never imports boto3

    return PartPool(remote_bytes(cache_size))


def streamed(tree) -> None:
    """The readers of ``tree`` stream its files in order (``ckptfs export``): its part pools keep less of their budget
    for parts read and more for parts fetched ahead (``storage.s3object.READ_SHARES``). Nothing for a local tree."""
    parts = getattr(tree, "parts", None)
    if parts is not None:
        parts.set_use("stream")


def announce_window(tree, wanted: int) -> int:
    """How far ahead a reader of ``tree`` announces what it reads next to the tree's object storage: ``wanted``, or
    nothing when the tree's part pool cannot hold that much fetched ahead (its parts would be let go of unread and
    fetched again: docs/measurements.md, "S3: an .mdl object read in the safetensors file's order"). A local tree
    announces nothing (its storage reads ahead by itself); a run's checkpoints have pools of their own."""
    cache = getattr(tree, "cache", None)
    if cache is None or not cache.remote:
        return 0
    budget = getattr(getattr(tree, "parts", None), "ahead_limit", None)
    return wanted if budget is None or budget >= wanted else 0


class RunParts:
    """The remote share of a run's ``--cache-size``, split equally among the pools of its checkpoint trees built now
    (``pool`` makes one, ``rebalance`` after one is closed). The total stays within the share: a new pool's share is
    taken from the others before it exists."""

    def __init__(self, cache_size: int):
        self.budget = remote_bytes(cache_size)
        self.use = "load"  # how the checkpoints' readers read (``set_use``)
        self._pools: list = []
        self._lock = threading.Lock()

    def pool(self):
        """A pool for one more checkpoint tree (closed with that tree; then ``rebalance``)."""
        from ..storage.s3object import PartPool

        with self._lock:
            live = [p for p in self._pools if not p.closed]
            share = self.budget // (len(live) + 1)
            for p in live:
                p.set_memory(share)
            pool = PartPool(share, self.use)
            self._pools = live + [pool]
            return pool

    def set_use(self, use: str) -> None:
        """Split every pool's share for readers that read as ``use`` says (``PartPool.set_use``), now and later."""
        with self._lock:
            self.use = use
            for p in self._pools:
                if not p.closed:
                    p.set_use(use)

    def rebalance(self) -> None:
        """Give the shares of closed pools back to the others."""
        with self._lock:
            self._pools = [p for p in self._pools if not p.closed]
            for p in self._pools:
                p.set_memory(self.budget // len(self._pools))

    @property
    def pools(self) -> list:
        """The pools of the trees built now."""
        with self._lock:
            return [p for p in self._pools if not p.closed]
