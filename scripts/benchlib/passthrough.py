"""A trivial read-only passthrough FUSE filesystem over one directory, on the same binding and options as ckptfs
(mfusepy on libfuse 3 through ``ckptfs.fuse.operations.fuse_class``: reads filled into libfuse's buffer, one loop thread,
kernel cache, the same read-ahead, malloc pinned). Its ``cp`` throughput is the ceiling the ckptfs server's first
read of a file can reach with this binding on this machine (the bench's "passthrough ceiling" line).

Usage: ``python passthrough.py SRC_DIR MOUNTPOINT`` (foreground; unmount with ``fusermount3 -u``).
"""
from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ckptfs.fuse.operations import READ_AHEAD_KB, fuse_class, load_mfusepy, mount_target, pin_malloc, raise_read_ahead  # noqa: E402


class Passthrough:
    use_ns = True

    def __init__(self, root: str, mnt: str):
        self._root = os.path.abspath(root)
        self._target = mount_target(mnt)
        self._fds: dict = {}

    def _path(self, path: str) -> str:
        return os.path.join(self._root, path.lstrip("/"))

    def getattr(self, path, fh=None):
        st = os.lstat(self._path(path))
        return {k: getattr(st, k) for k in ("st_mode", "st_ino", "st_nlink", "st_size", "st_uid", "st_gid",
                                            "st_mtime_ns", "st_ctime_ns", "st_atime_ns")} | {
            "st_mtime": st.st_mtime_ns, "st_ctime": st.st_ctime_ns, "st_atime": st.st_atime_ns}

    def readdir(self, path, fh):
        return [".", ".."] + os.listdir(self._path(path))

    def readdir_plus(self, path, fh, start: int = 0):
        """What ``fuse_class``'s READDIRPLUS asks for: ``(position, name, attributes)`` from ``start`` on."""
        names = self.readdir(path, fh)
        return [(i + 1, n, self.getattr(os.path.join(path, n)) if n not in (".", "..") else None)
                for i, n in enumerate(names) if i >= start]

    def open(self, path, flags):
        fd = os.open(self._path(path), os.O_RDONLY)
        self._fds[fd] = True
        return fd

    def readinto(self, path, out, offset, fh) -> int:
        return os.preadv(fh, [out], offset)

    def read(self, path, size, offset, fh):
        return os.pread(fh, size, offset)

    def release(self, path, fh):
        self._fds.pop(fh, None)
        os.close(fh)
        return 0

    def init_with_config(self, conn, config):
        if conn is not None and hasattr(conn, "max_readahead"):
            conn.max_readahead = READ_AHEAD_KB << 10
        raise_read_ahead(self._target)

    def statfs(self, path):
        return {"f_bsize": 1 << 20, "f_frsize": 4096, "f_namemax": 255}

    def access(self, path, amode):
        if amode & os.W_OK:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return 0


def main(src: str, mnt: str) -> None:
    fuse = load_mfusepy()
    pin_malloc()
    fuse_class(fuse)(Passthrough(src, mnt), mnt, foreground=True, nothreads=True, ro=True, kernel_cache=True,
                     attr_timeout=86400, entry_timeout=86400, use_ino=True, fsname="passthrough")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
