"""Files ckptfs writes for the user (``ckptfs export``): created without following a link, never opening a FIFO or a
device, never replacing what is not a regular file.

An ``OutputDir`` is the folder the user named — followed as given, the user chose it — held open as a directory
descriptor. Every folder below it is created or opened through its parent's descriptor with ``O_NOFOLLOW``: a
symbolic link planted at ``OUTDIR/tensors`` is refused, not followed. A file is written under a temporary name
(``<name>.part``) created with ``O_CREAT | O_EXCL | O_NOFOLLOW``, which neither follows a link nor opens a FIFO
that is already there, and renamed over its final name only when that name is free or holds a regular file. A
leftover temporary file is removed first only when it is a regular file; a link, FIFO, device or folder of that name
stops the export with one line naming it (it is not what an earlier export left, and nothing is written through it).
"""
from __future__ import annotations

import errno
import os
import stat as stat_mod
from pathlib import Path

from ..errors import CkptfsError

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_O_NEW = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_KINDS = ((stat_mod.S_ISLNK, "a symbolic link"), (stat_mod.S_ISDIR, "a directory"), (stat_mod.S_ISFIFO, "a FIFO"),
          (stat_mod.S_ISCHR, "a character device"), (stat_mod.S_ISBLK, "a block device"),
          (stat_mod.S_ISSOCK, "a socket"))


class OutputError(CkptfsError):
    """An output path ckptfs will not write to or over (a link, a FIFO, a device…), or cannot."""


def kind_of(st: os.stat_result) -> str | None:
    """What a non-regular file is ("a symbolic link", "a FIFO"…), from ``lstat``; None for a regular file."""
    if stat_mod.S_ISREG(st.st_mode):
        return None
    return next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")


class OutputDir:
    """The folder the user asked ckptfs to write into, and the folders and files it writes below it."""

    def __init__(self, path, *, create: bool = True):
        self.path = Path(path)
        try:
            if create:
                os.makedirs(self.path, exist_ok=True)
            self.fd = os.open(self.path, _O_DIR)
        except OSError as e:
            raise OutputError(self.path, f"cannot open the output directory: {e.strerror or e}") from None
        self._folders: dict = {"": self.fd}

    def close(self) -> None:
        for fd in self._folders.values():
            os.close(fd)
        self._folders = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def folder(self, rel: str) -> int:
        """A descriptor on the folder ``rel`` ("a/b", "" for the top), each missing folder created; ``OutputError``
        when a component is a link or not a folder."""
        fd = self._folders.get(rel)
        if fd is not None:
            return fd
        parent, _, name = rel.rpartition("/")
        pfd = self.folder(parent)
        where = self.path / rel
        try:
            os.mkdir(name, 0o777, dir_fd=pfd)
        except FileExistsError:
            pass
        except OSError as e:
            raise OutputError(where, f"cannot create directory: {e.strerror or e}") from None
        try:
            fd = os.open(name, _O_DIR | os.O_NOFOLLOW, dir_fd=pfd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                st = self._lstat(pfd, name)
                what = kind_of(st) if st is not None else "not a directory"
                raise OutputError(where, f"is {what}, not a directory; ckptfs does not write through it "
                                         "(remove it, or export elsewhere)") from None
            raise OutputError(where, f"cannot open directory: {e.strerror or e}") from None
        self._folders[rel] = fd
        return fd

    @staticmethod
    def _lstat(dir_fd: int, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def lstat(self, rel: str) -> os.stat_result | None:
        """``lstat`` of ``rel`` below the folder (None when absent); its folders are opened as ``folder`` does."""
        parent, _, name = rel.rpartition("/")
        return self._lstat(self.folder(parent), name)

    def remove_leftover(self, rel: str) -> bool:
        """Remove ``rel`` if it is a regular file (a temporary file an interrupted run left); anything else stays."""
        parent, _, name = rel.rpartition("/")
        dfd = self.folder(parent)
        st = self._lstat(dfd, name)
        if st is None or kind_of(st) is not None:
            return False
        os.unlink(name, dir_fd=dfd)
        return True

    def create(self, rel: str, suffix: str = ".part") -> "OutputFile":
        """A new file that will become ``rel``: ``<rel><suffix>``, created empty (open for reading and writing). A leftover
        regular file of that name (an interrupted run's) is removed first; anything else there is an ``OutputError``."""
        parent, _, name = rel.rpartition("/")
        dfd = self.folder(parent)
        tmp = name + suffix
        st = self._lstat(dfd, tmp)
        if st is not None and kind_of(st) is not None:
            raise OutputError(self.path / (rel + suffix), f"is {kind_of(st)}, not a file an earlier export left; "
                                                          "ckptfs neither writes through it nor removes it")
        if st is not None:
            os.unlink(tmp, dir_fd=dfd)
        try:
            fd = os.open(tmp, _O_NEW, 0o644, dir_fd=dfd)
        except OSError as e:
            raise OutputError(self.path / (rel + suffix), f"cannot create: {e.strerror or e}") from None
        return OutputFile(self, rel, dfd, tmp, name, fd)


    def link(self, src_rel: str, rel: str) -> os.stat_result | None:
        """``rel`` as a hard link to the placed file ``src_rel`` (a copy where the file system refuses hard links),
        made under ``<rel>.part`` and renamed as ``create``'s files are. The ``lstat`` of ``src_rel`` afterwards (a
        link changes its ctime), or None when ``rel`` already was that file."""
        sparent, _, sname = src_rel.rpartition("/")
        sfd = self.folder(sparent)
        src = self._lstat(sfd, sname)
        if src is None or kind_of(src) is not None:
            raise OutputError(self.path / src_rel, "is not the regular file this export wrote")
        parent, _, name = rel.rpartition("/")
        dfd = self.folder(parent)
        now = self._lstat(dfd, name)
        if now is not None and (now.st_dev, now.st_ino) == (src.st_dev, src.st_ino):
            return None
        out = self.create(rel, ".part")  # the leftover checks; the empty file is replaced by the link
        os.close(out.fd)
        os.unlink(out.tmp, dir_fd=dfd)
        mtime_ns = None  # a link shares the file's modification time
        try:
            os.link(sname, out.tmp, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
            out.fd = os.open(out.tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise OutputError(self.path / rel, f"cannot link: {e.strerror or e}") from None
            out, mtime_ns = self._copy(sfd, sname, rel), src.st_mtime_ns
        try:
            out.place(mtime_ns)
        finally:
            out.abandon()
        return self._lstat(sfd, sname)

    def _copy(self, sfd: int, sname: str, rel: str) -> "OutputFile":
        out = self.create(rel, ".part")
        fd = os.open(sname, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sfd)
        try:
            while os.sendfile(out.fd, fd, None, 1 << 30):
                pass
        finally:
            os.close(fd)
        return out


def write_file(outdir: OutputDir, rel: str, data: bytes) -> None:
    """Write the small file ``rel`` below ``outdir`` whole: ``<rel>.tmp`` created new, renamed over ``rel``."""
    out = outdir.create(rel, ".tmp")
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(out.fd, view):]
        out.place()
    finally:
        out.abandon()


class OutputFile:
    """A file being written under its temporary name; ``place`` renames it to its final name."""

    def __init__(self, outdir: OutputDir, rel: str, dir_fd: int, tmp: str, name: str, fd: int):
        self.outdir, self.rel, self.dir_fd, self.tmp, self.name, self.fd = outdir, rel, dir_fd, tmp, name, fd

    @property
    def target(self) -> Path:
        return self.outdir.path / self.rel

    def place(self, mtime_ns: int | None = None) -> os.stat_result:
        """fsync, set the modification time, rename over the final name (only if that is free or a regular file)
        and close; the placed file's ``fstat``."""
        os.fsync(self.fd)
        if mtime_ns is not None:
            os.utime(self.fd, ns=(mtime_ns, mtime_ns))
        st = OutputDir._lstat(self.dir_fd, self.name)
        what = kind_of(st) if st is not None else None
        if what is not None:
            raise OutputError(self.target, f"is {what}; ckptfs does not replace it with the exported file "
                                           "(remove it, or export elsewhere)")
        os.rename(self.tmp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        placed = os.fstat(self.fd)
        self.close()
        return placed

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def abandon(self) -> None:
        """Close and remove the temporary file (the final name is left as it was)."""
        self.close()
        try:
            os.unlink(self.tmp, dir_fd=self.dir_fd)
        except OSError:
            pass
