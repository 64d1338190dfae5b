"""Write a whole virtual tree (or the views it was built with) as real files: ``ckptfs export CKPT OUTDIR``.

The result is what ``cp -r MOUNT/. OUTDIR`` gives, file for file and byte for byte, without FUSE. Files are cut into
blocks that a thread pool decodes in parallel; each block is written at its offset into ``<file>.part``, which is
renamed to its name once complete (after an fsync), with the mount's modification time. A re-run after an
interruption keeps every file that is already there with its expected size and that modification time (a finished
file) and redoes the rest; leftover ``.part`` files are rewritten from the start.

A file the tree serves at several paths (the repository folder ``hub/`` mirrors the HF model's files) is written
once: its other paths become hard links to it (a copy where the file system has no hard links), so the export
costs no disk for them.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from ..errors import CkptfsError
from ..progress import progress_bar
from ..tree.base import Tree

BLOCK = 8 << 20
PART = ".part"


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


def finished(target: Path, size: int, mtime_ns: int) -> bool:
    """Whether ``target`` is a file a previous export completed: regular, the expected size and mtime."""
    try:
        st = os.lstat(target)
    except OSError:
        return False
    import stat as stat_mod

    return stat_mod.S_ISREG(st.st_mode) and st.st_size == size and st.st_mtime_ns == mtime_ns


class _PartFile:
    """One file being written: ``<name>.part`` opened on its first block, renamed when its last block is in."""

    def __init__(self, entry, target: Path, nblocks: int, mtime_ns: int):
        self.entry, self.target, self.mtime_ns = entry, target, mtime_ns
        self.part = target.with_name(target.name + PART)
        self.left = nblocks
        self.fd = None
        self.lock = threading.Lock()

    def _open(self) -> None:
        if self.fd is None:
            self.fd = os.open(self.part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
            os.ftruncate(self.fd, self.entry.size)

    def write(self, offset: int, data: bytes) -> bool:
        """Write one block; True when it was the file's last (the file is then in place)."""
        with self.lock:
            self._open()
        view = memoryview(data)
        while view:
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n
        with self.lock:
            self.left -= 1
            if self.left:
                return False
            self._finish()
            return True

    def _finish(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        os.utime(self.part, ns=(self.mtime_ns, self.mtime_ns))
        if self.target.is_dir() and not self.target.is_symlink():
            raise CkptfsError(self.target, "is a directory; cannot export the file of that name over it")
        os.replace(self.part, self.target)

    def abandon(self) -> None:
        with self.lock:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
            try:
                os.unlink(self.part)
            except OSError:
                pass


def _plan(tree: Tree, outdir: Path, block: int) -> tuple:
    """([(part file, offset, length)], {part files}, kept count, bytes to write, [(written target, its other
    path)])."""
    jobs, parts, kept, total, links = [], [], 0, 0, []
    paths = list(tree.walk())
    entries = {path: tree.lookup(path) for path in paths}
    first: dict = {}  # id(VirtualFile) -> the target it is written to: its shallowest path (the root's, not hub/'s)
    for path in sorted(paths, key=lambda p: (p.count("/"), p)):
        first.setdefault(id(entries[path].file), outdir / path)
    for path in paths:
        e = entries[path]
        mtime_ns = tree.attr(e).mtime_ns
        target = outdir / path
        same = first[id(e.file)]
        if finished(target, e.size, mtime_ns):
            kept += 1
            stale = target.with_name(target.name + PART)
            if stale.exists() and not stale.is_dir():
                stale.unlink()  # left by an earlier interrupted run of a file since finished
            continue
        if same != target:
            links.append((same, target))
            continue
        nblocks = max(1, -(-e.size // block))
        pf = _PartFile(e, target, nblocks, mtime_ns)
        parts.append(pf)
        total += e.size
        jobs += [(pf, off, min(block, e.size - off)) for off in range(0, max(e.size, 1), block)]
    return jobs, parts, kept, total, links


def _link(src: Path, dest: Path) -> None:
    """``dest`` as a hard link to the finished ``src`` (a copy with its mtime where hard links are refused)."""
    import shutil

    part = dest.with_name(dest.name + PART)
    try:
        if part.exists() and not part.is_dir():
            part.unlink()
        try:
            os.link(src, part)
        except OSError:
            shutil.copyfile(src, part)
            st = os.stat(src)
            os.utime(part, ns=(st.st_mtime_ns, st.st_mtime_ns))
        if dest.is_dir() and not dest.is_symlink():
            raise CkptfsError(dest, "is a directory; cannot export the file of that name over it")
        os.replace(part, dest)
    except OSError as e:
        raise CkptfsError(dest, f"cannot write: {e.strerror or e}") from e


def _make_dirs(tree: Tree, outdir: Path) -> None:
    files = set(tree.walk())
    outdir.mkdir(parents=True, exist_ok=True)
    for path in tree.walk(dirs=True):
        if path not in files:
            (outdir / path).mkdir(parents=True, exist_ok=True)


def export_tree(tree: Tree, outdir, *, threads: int | None = None, progress: bool = False, block: int = BLOCK
                ) -> ExportReport:
    """Write every file of ``tree`` under ``outdir`` (see the module docstring); returns what was done."""
    outdir = Path(outdir)
    try:
        _make_dirs(tree, outdir)
    except OSError as e:
        raise CkptfsError(e.filename or outdir, f"cannot create directory: {e.strerror or e}") from e
    jobs, parts, kept, total, links = _plan(tree, outdir, block)
    report = ExportReport(kept=kept)
    bar = progress_bar(total, f"export {outdir.name or outdir}") if progress and total else None

    def run(job):
        pf, off, n = job
        try:
            data = tree.read(pf.entry, off, n) if n else b""
        except Exception as err:
            raise read_failed(pf.entry.path, off, err) from err
        try:
            done = pf.write(off, data)
        except OSError as err:
            raise CkptfsError(pf.target, f"cannot write: {err.strerror or err}") from err
        return len(data), done

    pool = ThreadPoolExecutor(max_workers=threads or default_threads(), thread_name_prefix="ckptfs-export")
    pending = set()
    ok = False
    try:
        window = 4 * (threads or default_threads())  # blocks in flight: bounded memory, files finish in order
        for job in jobs:
            pending.add(pool.submit(run, job))
            if len(pending) >= window:
                pending = _drain(pending, report, bar, FIRST_COMPLETED)
        while pending:
            pending = _drain(pending, report, bar, FIRST_EXCEPTION)
        for src, dest in links:
            _link(src, dest)
            report.files += 1
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
