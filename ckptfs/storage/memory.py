"""An in-memory blob: bytes held by the process, read through the same interface as a file or an object.

For what ckptfs builds itself and serves as a source (small generated files), and as the reference implementation
the storage contract tests (tests/storage/test_blob_contract.py) hold every backend to. ``replace`` stands for a
writer changing the stored bytes: ``current_version()`` then differs from the ``version`` the blob was opened with.
"""
from __future__ import annotations

import threading

from .base import Blob


class MemoryBlob(Blob):
    """``data`` read by byte ranges; its version is a counter bumped by ``replace``."""

    def __init__(self, data: bytes, name: str = "memory"):
        self.name = name
        self._data = bytes(data)
        self._lock = threading.Lock()
        self._stored = (self._data, 0)  # what a new open would see: (bytes, version)
        self._version = 0
        self._closed = False

    @property
    def size(self) -> int:
        return len(self._data)

    @property
    def version(self) -> int:
        return self._version

    def current_version(self) -> int:
        return self._stored[1]

    def replace(self, data: bytes) -> None:
        """Store other bytes under the same name: this blob keeps reading what it opened, its version no longer
        current."""
        with self._lock:
            self._stored = (bytes(data), self._stored[1] + 1)

    def read_into(self, view: memoryview, offset: int, need: int) -> tuple[int, bool]:
        if self._closed:
            raise ValueError(f"{self.name}: read after close")
        if offset < 0 or need < 0:
            raise ValueError(f"{self.name}: negative range ({offset}, {need})")
        got = max(0, min(need, len(self._data) - offset))
        view[:got] = self._data[offset:offset + got]
        return got, False

    def close(self) -> None:
        self._closed = True
