"""How a tree shares ``--cache-size``: its block cache, and, over object storage, the parts fetched from it.

``--cache-size`` bounds what a server keeps beyond its fixed costs. A local checkpoint gives it all to the tree's
block cache (``BlockCache``: converted tensor blocks). A checkpoint in object storage also holds the parts of objects
it fetched, read or fetched ahead and not read yet (``storage.s3object``); those take ``REMOTE_SHARE`` of it, and the
block cache the rest, so a mount of an S3 checkpoint stays within the same bound as one of a local file.
"""
from __future__ import annotations

from ..tensor.cache import BlockCache
from ..storage.s3url import is_s3_url

#: the part of ``--cache-size`` that parts fetched from object storage may hold (measured: docs/measurements.md,
#: "S3: memory within --cache-size")
REMOTE_SHARE = 0.5


def tree_cache(cache_size: int, where) -> BlockCache:
    """The block cache of a tree over ``where`` (a path or an ``s3://`` URL), within ``cache_size`` bytes with the
    parts it fetches from object storage."""
    if not is_s3_url(str(where)):
        return BlockCache(cache_size)
    from ..storage import s3object  # only for object storage: a local mount never imports boto3

    parts = int(cache_size * REMOTE_SHARE)
    s3object.set_memory(parts)
    cache = BlockCache(cache_size - parts)
    cache.remote = True
    return cache
