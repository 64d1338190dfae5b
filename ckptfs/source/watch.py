"""Change detection for the files a mount reads from: a ``FileIdentity`` taken when a file is opened, compared with
a fresh ``stat`` after every read of its bytes.

A checkpoint rewritten in place (same inode), truncated, or replaced by a rename changes its size, mtime, ctime
or inode; a read that sees such a change fails with ``SourceChangedError`` instead of mixing bytes of two versions
(HDF5 and the chunk reader would otherwise read new bytes at offsets planned from the old file). One ``stat`` per
read of tensor data (a cache block) costs about a microsecond. ``ctime`` cannot be set from user space, so even a
copy that restores the old mtime (``cp -p``) is seen.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import SourceChangedError


@dataclass(frozen=True)
class FileIdentity:
    """What a version of a file is: device, inode, size and the modification and change times (ns)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of_stat(cls, st: os.stat_result) -> "FileIdentity":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    @classmethod
    def of_path(cls, path) -> "FileIdentity":
        """The identity of the file at ``path`` now (``OSError`` if it cannot be stat'ed)."""
        return cls.of_stat(os.stat(path))

    def difference(self, other: "FileIdentity") -> str | None:
        """How ``other`` differs from this version, in words (None when it is the same version)."""
        if (self.dev, self.ino) != (other.dev, other.ino):
            return "replaced by another file (inode changed)"
        if self.size != other.size:
            return f"size changed from {self.size} to {other.size} bytes"
        if self.mtime_ns != other.mtime_ns or self.ctime_ns != other.ctime_ns:
            return "modified in place (mtime/ctime changed)"
        return None


def changed_problem(path, identity: FileIdentity | None) -> str | None:
    """Why the file at ``path`` is no longer the version ``identity`` names (None while it still is).

    ``identity`` None means the file did not exist when it was first looked at."""
    try:
        now = FileIdentity.of_path(path)
    except FileNotFoundError:
        return None if identity is None else "removed"
    except OSError as e:
        return f"cannot be stat'ed ({e.strerror or e})"
    if identity is None:
        return "appeared after the checkpoint was opened"
    return identity.difference(now)


def check_unchanged(checkpoint_path, path, identity: FileIdentity | None, what: str, role: str | None = None) -> None:
    """``SourceChangedError(checkpoint_path, ...)`` if ``path`` changed since ``identity`` was taken; ``role``
    names the file in the message (default: "the checkpoint" or "external file <path>")."""
    why = changed_problem(path, identity)
    if why is not None:
        if role is None:
            role = "the checkpoint" if Path(path) == Path(checkpoint_path) else f"external file {path}"
        raise SourceChangedError(checkpoint_path, f"{what}: {role} changed since it was opened ({why}); "
                                                  "remount to serve the new version")
