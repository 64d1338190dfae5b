"""What ``ckptfs export CKPT OUTDIR`` finished, so that a re-run keeps exactly those files.

A file left in OUTDIR is kept only when the record of an earlier export says it wrote that very file from the same
content: the same ``content`` key (the checkpoint's identity, the options that shape the file, the files laid over
it, the file's path and size), the same file identity (device, inode, size, mtime, ctime: any write to the file,
even one that restores its mtime, changes its ctime) and the same digest of sampled blocks of its bytes. Everything
else is written again — a zeroed file of the right size and mtime, the files of an export with other options
(``--zip-crc zero``, another ``--config``).

Records are ckptfs's own state files (``ckptfs.state.files``): one per output folder in ``exports/`` under the cache
directory, trusted only when the user's own and sealed; without a usable cache directory nothing is kept and a
re-run writes every file again.
"""
from __future__ import annotations

import hashlib
import os
import re
import threading
import time

from ..state.files import StateDir

FOLDER = "exports"
KIND = "export-record"
FORMAT = 1
#: records kept (one per output folder), the least recently written removed first
MAX_RECORDS = 256
MAX_RECORD_BYTES = 256 << 20
MAX_TOTAL_BYTES = 1 << 30
#: a record is written again at most this often while files finish (and once at the end)
FLUSH_SECONDS = 2.0
#: bytes read at each of ``SAMPLES`` evenly spaced places (and at the end) for a file's digest
SAMPLE = 64 << 10
SAMPLES = 16
_NAME = re.compile(r"[0-9a-f]{40}\.json")


def identity_of(st: os.stat_result) -> list:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def digest(fd: int, size: int) -> str:
    """A digest of a file's size and ``SAMPLES`` blocks of ``SAMPLE`` bytes spread over it (all of a small file)."""
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    if size <= SAMPLE * (SAMPLES + 1):
        starts = range(0, size, SAMPLE)
    else:
        starts = sorted({(size - SAMPLE) * i // SAMPLES for i in range(SAMPLES + 1)})
    for start in starts:
        h.update(os.pread(fd, SAMPLE, start))
    return h.hexdigest()


def content_key(tree_identity: str, rel: str, size: int) -> str:
    return hashlib.sha256(f"{tree_identity}\0{rel}\0{size}".encode("utf-8", "surrogatepass")).hexdigest()


class ExportRecord:
    """The finished files of one output folder: ``{path: [content key, identity, digest]}``."""

    def __init__(self, outdir_fd: int, outdir, cache_root):
        st = os.fstat(outdir_fd)
        self.where = {"outdir": os.path.realpath(outdir), "dir": [st.st_dev, st.st_ino]}
        self.name = hashlib.sha256(repr(sorted(self.where.items())).encode("utf-8", "surrogatepass")
                                   ).hexdigest()[:40] + ".json"
        self.cache_root = cache_root
        self.files: dict = {}
        self._dirty = False
        self._flushed = time.monotonic()
        self._lock = threading.Lock()  # files finish on the export's threads
        self._writing = threading.Lock()  # one flush at a time, so a later state is never overwritten by an earlier
        folder = StateDir.open(cache_root, FOLDER, create=False) if cache_root is not None else None
        if folder is not None:
            with folder:
                loaded = folder.load(self.name, KIND, MAX_RECORD_BYTES)
            if loaded is not None and loaded[0].get("format") == FORMAT and \
                    all(loaded[0].get(k) == v for k, v in self.where.items()):
                for rec in loaded[1]:
                    if type(rec) is list and len(rec) == 4 and type(rec[0]) is str:
                        self.files[rec[0]] = rec[1:]

    def finished(self, rel: str, key: str, st: os.stat_result | None, read_fd) -> bool:
        """Whether the file at ``rel`` (``st``: its ``lstat``) is one an earlier export finished from content
        ``key`` and left untouched; ``read_fd()`` opens it for the digest (a descriptor, or None)."""
        rec = self.files.get(rel)
        if rec is None or st is None or rec[0] != key or rec[1] != identity_of(st):
            return False
        fd = read_fd()
        if fd is None:
            return False
        try:
            return identity_of(os.fstat(fd)) == rec[1] and digest(fd, st.st_size) == rec[2]
        except OSError:
            return False
        finally:
            os.close(fd)

    def add(self, rel: str, key: str, st: os.stat_result, fd: int) -> None:
        """Record a file this export placed (``fd`` still open on it, ``st`` its ``fstat`` once placed)."""
        rec = [key, identity_of(st), digest(fd, st.st_size)]
        with self._lock:
            self.files[rel] = rec
            self._dirty = True
        if time.monotonic() - self._flushed >= FLUSH_SECONDS:
            self.flush()

    def relinked(self, rel: str, st: os.stat_result) -> None:
        """The recorded file at ``rel`` got another name (a hard link this export made): its new identity ``st``."""
        with self._lock:
            rec = self.files.get(rel)
            if rec is not None and rec[1][:2] == [st.st_dev, st.st_ino]:
                rec[1] = identity_of(st)
                self._dirty = True

    def forget(self, rel: str) -> None:
        with self._lock:
            if self.files.pop(rel, None) is not None:
                self._dirty = True

    def flush(self) -> bool:
        """Write the record (when something changed); False when there is no usable cache directory."""
        with self._writing:
            return self._flush()

    def _flush(self) -> bool:
        with self._lock:
            if not self._dirty or self.cache_root is None:
                return False
            self._flushed = time.monotonic()
            lines = [[rel, *rec] for rel, rec in sorted(self.files.items())]
            self._dirty = False
        folder = StateDir.open(self.cache_root, FOLDER)
        if folder is None:
            return False
        with folder:
            header = {"ckptfs": KIND, "format": FORMAT, **self.where}
            ok = folder.write(self.name, header, lines, max_bytes=MAX_RECORD_BYTES)
            if ok:
                folder.prune(_NAME, KIND, keep={self.name}, max_count=MAX_RECORDS, max_bytes=MAX_TOTAL_BYTES)
            return ok
