"""Write a whole virtual tree (or the views it was built with) as real files: ``ckptfs export CKPT OUTDIR``.

The result is what ``cp -r MOUNT/. OUTDIR`` gives, file for file and byte for byte, without FUSE. Files are cut into
blocks that a thread pool decodes in parallel; each block is written at its offset into ``<file>.part``, which is
renamed to its name once complete (after an fsync), with the mount's modification time. From a tree in object
storage the blocks are announced to their storage ahead of the ones queued (``ANNOUNCE_AHEAD``), so the objects'
parts are fetched concurrently while blocks decode; memory: the parts' budget plus the blocks in flight. Folders and files are made
through ``ckptfs.state.outfiles`` (no link followed below OUTDIR, no FIFO opened, nothing but a regular file replaced). A
re-run keeps a file only when the record of an earlier export (``export_record``) says it finished that very file
from the same content, and redoes the rest; leftover ``.part`` files are rewritten from the start.

A file the tree serves at several paths (the repository folder ``hub/`` mirrors the HF model's files) is written
once, at its shallowest path: its other paths become hard links to it (``OutputDir.link``: a copy where the file
system has no hard links), so the export costs no disk for them.

Each block is read once, so the tree's cache drops a block as soon as it was read whole (``BlockCache.sequential``).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from ..errors import CkptfsError
from ..state.outfiles import OutputDir, OutputError
from ..progress import progress_bar
from ..tree.base import Tree
from .export_record import ExportRecord, content_key

log = logging.getLogger(__name__)

BLOCK = 8 << 20
PART = ".part"
#: from a tree in object storage, the blocks this many bytes past the last one queued are announced to their storage
#: (``PiecedFile.will_need``): their parts are fetched concurrently, across objects, while the queued blocks decode
#: (the parts' ahead budget bounds what is fetched; a block announced when the budget was full is fetched when read)
ANNOUNCE_AHEAD = 64 << 20


@dataclass
class ExportReport:
    files: int = 0  # files written by this run
    kept: int = 0  # files left as a previous run finished them
    bytes: int = 0  # bytes written by this run


def read_failed(path: str, off: int, err: Exception) -> CkptfsError:
    """The error to report for a read of ``path`` at ``off`` that raised ``err`` (itself when it says the path)."""
    if isinstance(err, CkptfsError):
        return err
    return CkptfsError("/" + path, f"read failed at offset {off}: {type(err).__name__}: {err}")


def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class _PartFile:
    """One file being written: ``<name>.part`` created on its first block, renamed when its last block is in."""

    def __init__(self, entry, outdir: OutputDir, rel: str, nblocks: int, mtime_ns: int, record: ExportRecord,
                 key: str | None):
        self.entry, self.outdir, self.rel, self.mtime_ns = entry, outdir, rel, mtime_ns
        self.record, self.key = record, key
        self.left = nblocks
        self.out = None
        self.lock = threading.Lock()

    @property
    def target(self) -> Path:
        return self.outdir.path / self.rel

    def _open(self) -> None:
        if self.out is None:
            self.out = self.outdir.create(self.rel, PART)
            os.ftruncate(self.out.fd, self.entry.size)

    def write(self, offset: int, data: bytes) -> bool:
        """Write one block; True when it was the file's last (the file is then in place)."""
        with self.lock:
            self._open()
        view = memoryview(data)
        while view:
            n = os.pwrite(self.out.fd, view, offset)
            view, offset = view[n:], offset + n
        with self.lock:
            self.left -= 1
            if self.left:
                return False
            self._finish()
            return True

    def _finish(self) -> None:
        fd = os.dup(self.out.fd)
        try:
            st = self.out.place(self.mtime_ns)
            if self.key is not None:
                self.record.add(self.rel, self.key, st, fd)
        finally:
            os.close(fd)
        self.out = None

    def abandon(self) -> None:
        with self.lock:
            if self.out is not None:
                self.out.abandon()
                self.out = None


def _opener(outdir: OutputDir, rel: str):
    def read_fd():
        parent, _, name = rel.rpartition("/")
        try:
            return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                           dir_fd=outdir.folder(parent))
        except OSError:
            return None
    return read_fd


def _plan(tree: Tree, outdir: OutputDir, record: ExportRecord, block: int) -> tuple:
    """([(part file, offset, length)], {part files}, kept count, bytes to write, [(written path, its other path)])."""
    jobs, parts, kept, total, links = [], [], 0, 0, []
    identity = getattr(tree, "identity", None)
    paths = list(tree.walk())
    entries = {path: tree.lookup(path) for path in paths}
    first: dict = {}  # id(VirtualFile) -> the path it is written at: its shallowest (the root's, not hub/'s)
    for path in sorted(paths, key=lambda p: (p.count("/"), p)):
        first.setdefault(id(entries[path].file), path)
    for path in paths:
        e = entries[path]
        if first[id(e.file)] != path:
            links.append((first[id(e.file)], path))
            continue
        mtime_ns = tree.attr(e).mtime_ns
        key = content_key(identity, path, e.size) if identity else None
        if key is not None and record.finished(path, key, outdir.lstat(path), _opener(outdir, path)):
            kept += 1
            outdir.remove_leftover(path + PART)  # of an earlier run interrupted before this file was finished
            continue
        record.forget(path)
        nblocks = max(1, -(-e.size // block))
        pf = _PartFile(e, outdir, path, nblocks, mtime_ns, record, key)
        parts.append(pf)
        total += e.size
        jobs += [(pf, off, min(block, e.size - off)) for off in range(0, max(e.size, 1), block)]
    return jobs, parts, kept, total, links


def _make_dirs(tree: Tree, outdir: OutputDir) -> None:
    files = set(tree.walk())
    for path in tree.walk(dirs=True):
        if path not in files:
            outdir.folder(path)


def export_tree(tree: Tree, outdir, *, threads: int | None = None, progress: bool = False, block: int = BLOCK,
                cache_root=None) -> ExportReport:
    """Write every file of ``tree`` under ``outdir`` (see the module docstring); returns what was done.
    ``cache_root``: where export records live (default: ckptfs's cache directory)."""
    if cache_root is None:
        from ..state.dirs import cache_dir

        cache_root = cache_dir()
    cache = tree.cache
    with OutputDir(outdir) as out, cache.sequential() if cache is not None else contextlib.nullcontext():
        record = ExportRecord(out.fd, out.path, cache_root)
        try:
            return _export(tree, out, record, threads, progress, block)
        finally:
            record.flush()


def _export(tree: Tree, out: OutputDir, record: ExportRecord, threads, progress: bool, block: int) -> ExportReport:
    _make_dirs(tree, out)
    jobs, parts, kept, total, links = _plan(tree, out, record, block)
    record.flush()  # files found changed are forgotten before any is rewritten
    report = ExportReport(kept=kept)
    bar = progress_bar(total, f"export {out.path.name or out.path}") if progress and total else None

    def run(job):
        pf, off, n = job
        try:
            data = tree.read(pf.entry, off, n) if n else b""
        except Exception as err:
            raise read_failed(pf.entry.path, off, err) from err
        try:
            done = pf.write(off, data)
        except OutputError:
            raise
        except OSError as err:
            raise CkptfsError(pf.target, f"cannot write: {err.strerror or err}") from err
        return len(data), done

    pool = ThreadPoolExecutor(max_workers=threads or default_threads(), thread_name_prefix="ckptfs-export")
    pending = set()
    ok = False
    announce = _Announcer(jobs) if tree.cache is not None and tree.cache.remote else None
    try:
        window = 4 * (threads or default_threads())  # blocks in flight: bounded memory, files finish in order
        for job in jobs:
            if announce is not None:
                announce.queued(job)
            pending.add(pool.submit(run, job))
            if len(pending) >= window:
                pending = _drain(pending, report, bar, FIRST_COMPLETED)
        while pending:
            pending = _drain(pending, report, bar, FIRST_EXCEPTION)
        for src, rel in links:
            st = out.link(src, rel)
            if st is None:
                report.kept += 1
                continue
            report.files += 1
            record.relinked(src, st)  # the written file's ctime moved: it is still the one this export finished
        ok = True
    finally:
        if not ok:
            for f in pending:
                f.cancel()
        pool.shutdown(wait=True, cancel_futures=not ok)
        if not ok:
            for pf in parts:
                if pf.left:
                    pf.abandon()
        if bar:
            bar.close()
    return report


class _Announcer:
    """Announces the blocks of ``jobs`` to their storage in the order they are queued, ``ANNOUNCE_AHEAD`` bytes
    ahead of the last one queued, each once (a tree in object storage: ``cache.remote``)."""

    def __init__(self, jobs: list, ahead: int = ANNOUNCE_AHEAD):
        self.jobs, self.ahead = jobs, ahead
        self.next = 0  # the first job not announced yet
        self.queued_bytes = self.announced_bytes = 0

    def queued(self, job) -> None:
        """``job`` is being queued: announce the jobs up to ``ahead`` bytes past it."""
        self.queued_bytes += job[2]
        while self.next < len(self.jobs) and self.announced_bytes < self.queued_bytes + self.ahead:
            pf, off, n = self.jobs[self.next]
            self.next += 1
            self.announced_bytes += n
            will_need = getattr(pf.entry.file, "will_need", None)  # a generated file (``PiecedFile``)
            if will_need is not None and n:
                try:
                    will_need(off, off + n)
                except Exception as err:  # noqa: BLE001 - a hint: the block's own read reports what is wrong
                    log.debug("announcing %s [%d, %d) failed: %s", pf.entry.path, off, off + n, err)


def _drain(pending: set, report: ExportReport, bar, how) -> set:
    """Wait for ``pending`` (``how``: until one completes, or all / the first failure); account finished blocks;
    re-raise the first failure."""
    done, rest = wait(pending, return_when=how)
    for f in done:
        n, finished_file = f.result()  # raises the block's error
        report.bytes += n
        report.files += int(finished_file)
        if bar:
            bar.update(n)
    return rest
