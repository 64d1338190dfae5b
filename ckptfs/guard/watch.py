"""Change detection for the files a mount reads from: a ``FileIdentity`` taken when a file is opened, compared with
a fresh ``stat`` after every read of its bytes.

A checkpoint rewritten in place (same inode), truncated, or replaced by a rename changes its size, mtime, ctime
or inode; a read that sees such a change fails with ``SourceChangedError`` instead of mixing bytes of two versions
(HDF5 and the chunk reader would otherwise read new bytes at offsets planned from the old file). One ``stat`` per
read of tensor data (a cache block) costs about a microsecond. ``ctime`` cannot be set from user space, so even a
copy that restores the old mtime (``cp -p``) is seen.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import SourceChangedError
from ..storage.local import FileIdentity


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
