"""The confinement rule for every byte that does not come from the checkpoint file itself.

A checkpoint may refer to other files (format 0.5 ``DeferredNumpyArray`` / ``DeferredSafeTensor`` ``path``, legacy
``DeferredFileTensor`` / ``DeferredH5Tensor`` ``filepath``). A crafted checkpoint could name ``/etc/passwd`` or
``../../secret``, and a mount shared with ``--allow-other`` would then serve those bytes to other users. So a
reference is followed only when, after resolving every symlink, it lands inside the checkpoint's own folder (or
a folder the user allowed with ``--allow-external``), and only to a regular file: a FIFO, device, socket or
directory is refused before it is opened (opening a FIFO would block the server). Files are opened with
``O_NOFOLLOW | O_NONBLOCK`` and checked again with ``fstat``, so a symlink or FIFO swapped in after the check
is refused too.

A refused reference makes only that tensor unreadable, with the reason (``info``, ``ls -l``, README.txt).
"""
from __future__ import annotations

import os
import stat as stat_mod
from dataclasses import dataclass
from pathlib import Path

from ..storage.local import LocalFile, within


class RefusedReference(Exception):
    """A reference ckptfs will not follow; ``problem`` is one line saying why."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem


_KINDS = ((stat_mod.S_ISFIFO, "a FIFO"), (stat_mod.S_ISDIR, "a directory"), (stat_mod.S_ISCHR, "a character device"),
          (stat_mod.S_ISBLK, "a block device"), (stat_mod.S_ISSOCK, "a socket"))


def non_regular_kind(st: os.stat_result) -> str | None:
    """What a non-regular file is ("a FIFO", "a directory"…); None for a regular file."""
    if stat_mod.S_ISREG(st.st_mode):
        return None
    for test, name in _KINDS:
        if test(st.st_mode):
            return name
    return "not a regular file"


def regular_stat(path) -> os.stat_result:
    """``os.stat`` of a regular file; ``RefusedReference`` for anything else (``OSError`` if it cannot be stat'ed)."""
    st = os.stat(path)
    kind = non_regular_kind(st)
    if kind is not None:
        raise RefusedReference(f"{path} is {kind}, not a regular file")
    return st


def open_regular(path) -> int:
    """A read-only descriptor on the regular file ``path`` (the last component must not be a symlink); never
    blocks on a FIFO. ``RefusedReference`` for a symlink or a non-regular file, ``OSError`` otherwise."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == getattr(os, "ELOOP", -1):
            raise RefusedReference(f"{path} became a symlink after it was checked") from None
        raise
    try:
        kind = non_regular_kind(os.fstat(fd))
    except OSError:
        os.close(fd)
        raise
    if kind is not None:
        os.close(fd)
        raise RefusedReference(f"{path} is {kind}, not a regular file")
    return fd


def open_regular_file(path) -> LocalFile:
    """The regular file ``path`` as a ``LocalFile`` (the storage layer's ``Blob``), opened as ``open_regular`` does."""
    return LocalFile(path, fd=open_regular(path))


def read_regular(path, limit: int) -> bytes:
    """At most ``limit`` bytes of the regular file ``path`` (a small pointer or ref), opened as ``open_regular``
    does: ``RefusedReference`` for a link or a non-regular file, ``OSError`` otherwise."""
    blob = open_regular_file(path)
    try:
        return blob.read(0, limit)
    finally:
        blob.close()


@dataclass(frozen=True)
class Confinement:
    """Where external references may lead: the checkpoint's folder, then the ``--allow-external`` folders
    (all as real paths, symlinks resolved)."""

    folder: str  # the checkpoint's own folder
    allowed: tuple = ()  # further folders the user opted in

    @classmethod
    def of(cls, checkpoint_path, allow_external=()) -> "Confinement":
        folder = os.path.realpath(Path(checkpoint_path).absolute().parent)
        return cls(folder, tuple(os.path.realpath(Path(p).absolute()) for p in allow_external or ()))

    @property
    def roots(self) -> tuple:
        return (self.folder,) + self.allowed

    def contains(self, real: str) -> bool:
        return within(real, self.roots)

    def resolve(self, ref: str) -> Path:
        """The real path (every symlink resolved) a reference names, if it is inside a root; else
        ``RefusedReference``. Relative references are relative to the checkpoint's folder. An absolute reference
        that does not exist here (a path of the machine that saved the checkpoint) falls back to the file of the
        same name in the checkpoint's folder. The target need not exist (callers say "not found")."""
        text = str(ref)
        if "\0" in text:
            raise RefusedReference(f"reference {text!r} contains a NUL byte")
        p = Path(text)
        cand = p if p.is_absolute() else Path(self.folder) / p
        real = os.path.realpath(cand)
        if self.contains(real):
            return Path(real)
        local = os.path.realpath(Path(self.folder) / p.name) if p.name not in ("", ".", "..") else None
        if local is not None and not os.path.lexists(cand) and os.path.lexists(local) and self.contains(local):
            return Path(local)
        hint = "" if self.allowed else " (to allow a folder, mount with --allow-external DIR)"
        raise RefusedReference(f"reference {text!r} resolves to {real}, outside the checkpoint's folder "
                               f"{self.folder}{hint}")

    def recheck(self, real: Path) -> None:
        """At read time: ``real`` (from ``resolve``) still resolves to itself inside a root (no symlink was swapped
        into its path since)."""
        now = os.path.realpath(real)
        if now != str(real) or not self.contains(now):
            raise RefusedReference(f"{real} now resolves to {now}, not to the file that was checked")
