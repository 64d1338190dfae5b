"""The virtual file: what every generated file offers the tree above it — an exact ``size`` from the first ``stat``,
and ``readinto(offset, out, cursor)`` filling a caller's buffer (``cursor``: the reader's ``ReadCursor``, what a file
may prepare after the read; a file that prepares nothing ignores it).

Implementations (a layout's ``PiecedFile``, a view's ``BytesFile``, an overlay file) fill exactly the range asked
for; they never see a range that runs past their end: ``fill`` is the one place a request is clipped to the file
and the count it produced checked, for the tree's reads and for ``read``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from ..errors import TensorReadError


class VirtualFile(ABC):
    """A file generated on read. ``size`` is exact and fixed (a ``deferred`` file computes it on first use)."""

    __slots__ = ()  # a mount may hold 100,000 files: subclasses choose whether they have a __dict__
    size: int
    #: True for a file whose layout is built on first use (``start()`` builds it in the background)
    deferred = False

    @abstractmethod
    def readinto(self, offset: int, out: memoryview, cursor=None) -> int:
        """Fill ``out`` with bytes ``[offset, offset + len(out))``, a range inside the file (``fill`` clipped it);
        returns ``len(out)``. ``cursor``: the reader's ``ckptfs.layouts.cursor.ReadCursor`` (None: a one-off read)."""

    def read(self, offset: int, n: int) -> bytes:
        """Bytes ``[offset, offset + n)``, fewer at the file's end."""
        where = getattr(self, "name", None) or type(self).__name__
        if offset < 0 or n < 0:
            raise ValueError(f"{where}: invalid read of {n} bytes at offset {offset}")
        buf = bytearray(max(0, min(n, self.size - offset)))
        fill(self, offset, memoryview(buf), where)
        return bytes(buf)


def fill(vf: VirtualFile, offset: int, out: memoryview, where: str, size: int | None = None, cursor=None) -> int:
    """Fill ``out`` from byte ``offset`` (at least 0) of ``vf``, clipped at its end (``size``: the size its tree
    fixed, default ``vf.size``): the count, exactly the clipped length, or ``TensorReadError(where, …)`` when the
    file produced another count. ``cursor``: the reader's, handed to the file."""
    want = max(0, min(len(out), (vf.size if size is None else size) - offset))
    if want == 0:
        return 0
    got = vf.readinto(offset, out[:want], cursor)
    if got != want:
        raise TensorReadError(where, f"produced {got} bytes for a read of {want} at offset {offset}")
    return want
