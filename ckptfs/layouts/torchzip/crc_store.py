"""CRC-32 of zip records: the function (``crc32``), and a persistent store of computed values, so a checkpoint's
records are hashed once, not per mount.

``crc32`` is zlib-ng's when it is installed (a dependency: the same CRC-32 as zlib's, computed with SIMD, ~24 GB/s
here against zlib's ~2.8 GB/s, which cost ~0.35 CPU-s per GB of a CRC-exact ``.bin``), else zlib's.

One small file per key (``crc/<key>.json``), one of ckptfs's own state files (``ckptfs.state.files``: trusted only
when it is the user's own and its seal verifies; written atomically; a missing, unwritable or untrusted folder just
disables persistence, and a file that does not verify reads as empty). A key is a hash of the caller's ``identity``
(``vfs.content_identity``: the source checkpoint's real path and full identity — device, inode, size, mtime, ctime —
its params and the content options) and of the layout's signature (record names, dtypes, shapes, archive name), so a
changed checkpoint (even one rewritten with its size and mtime restored) or a changed layout never reuses stale
values.
"""
from __future__ import annotations

import hashlib
import os
import re
import threading
from pathlib import Path

try:
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - zlib-ng is a dependency; the standard library's is the same function
    from zlib import crc32

from ...state.dirs import cache_dir
from ...state.files import StateDir

__all__ = ["CrcStore", "crc32", "default_crc_dir"]

FOLDER = "crc"
KIND = "zip-crcs"
_FORMAT = 1
#: a CRC file is at most this large (100,000 records take ~4 MB)
MAX_FILE_BYTES = 64 << 20
#: CRC files kept at most, in count and in bytes (the least recently written go first)
MAX_FILES = 4096
MAX_TOTAL_BYTES = 1 << 30
_NAME = re.compile(r"[0-9a-f]{40}\.json")


def default_crc_dir() -> Path:
    """``crc/`` under ckptfs's cache directory (``ckptfs.state.dirs``)."""
    return cache_dir() / FOLDER


class CrcStore:
    """CRC-32 values by record name, persisted per (identity, signature) key in ``crc/`` under ``cache_root``
    (default: ckptfs's cache directory); thread-safe."""

    def __init__(self, cache_root: str | os.PathLike | None = None):
        self.cache_root = Path(cache_root) if cache_root is not None else cache_dir()
        self._lock = threading.Lock()

    @property
    def directory(self) -> Path:
        return self.cache_root / FOLDER

    @staticmethod
    def key(identity: str, signature: str) -> str:
        """File key for a checkpoint ``identity`` and a layout ``signature``."""
        return hashlib.sha256(f"{identity}\0{signature}".encode("utf-8", "surrogatepass")).hexdigest()[:40]

    def load(self, key: str) -> dict[str, int]:
        """Stored CRCs for ``key`` ({} when absent, not trusted, or not what was stored for it)."""
        folder = StateDir.open(self.cache_root, FOLDER, create=False)
        if folder is None:
            return {}
        with folder:
            loaded = folder.load(f"{key}.json", KIND, MAX_FILE_BYTES)
        if loaded is None:
            return {}
        head, values = loaded
        if head.get("format") != _FORMAT or head.get("key") != key or len(values) != 1 or type(values[0]) is not dict:
            return {}
        return {k: v for k, v in values[0].items() if isinstance(k, str) and type(v) is int and 0 <= v <= 0xFFFFFFFF}

    def save(self, key: str, crcs: dict[str, int]) -> bool:
        """Merge ``crcs`` into the stored values of ``key``; False when nothing could be written."""
        with self._lock:
            merged = self.load(key)
            if all(merged.get(k) == v for k, v in crcs.items()):
                return True
            merged.update(crcs)
            folder = StateDir.open(self.cache_root, FOLDER)
            if folder is None:
                return False
            with folder:
                ok = folder.write(f"{key}.json", {"ckptfs": KIND, "format": _FORMAT, "key": key},
                                  [dict(sorted(merged.items()))], max_bytes=MAX_FILE_BYTES)
                if ok:
                    folder.prune(_NAME, KIND, keep={f"{key}.json"}, max_count=MAX_FILES, max_bytes=MAX_TOTAL_BYTES)
                return ok
