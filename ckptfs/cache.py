"""A bounded, thread-safe LRU cache of byte blocks (``bytes`` or read-only byte ``memoryview``s): the only place
tensor data is kept in memory.

Each mounted tree owns one (``VirtualTree.cache``, sized by ``--cache-size``) and hands it to every file it
serves; nothing here is process-wide except ``NO_CACHE``, which keeps nothing (reads outside any tree)."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Hashable

DEFAULT_CACHE_BYTES = 256 << 20


class BlockCache:
    """LRU of ``bytes`` values bounded by total size; values larger than the bound are not kept."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES):
        self.max_bytes = int(max_bytes)
        self._data: "OrderedDict[Hashable, bytes]" = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def size(self) -> int:
        return self._size

    def get_or_compute(self, key: Hashable, compute: Callable[[], bytes]) -> bytes:
        with self._lock:
            val = self._data.get(key)
            if val is not None:
                self._data.move_to_end(key)
                self.hits += 1
                return val
            self.misses += 1
        val = compute()
        self.put(key, val)
        return val

    def put(self, key: Hashable, val: bytes) -> None:
        if len(val) > self.max_bytes:
            return
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._size -= len(old)
            self._data[key] = val
            self._size += len(val)
            while self._size > self.max_bytes and self._data:
                _, v = self._data.popitem(last=False)
                self._size -= len(v)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._size = 0


#: keeps nothing: what a read without a tree's cache goes through
NO_CACHE = BlockCache(0)
