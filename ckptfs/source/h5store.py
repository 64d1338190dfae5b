"""Opening HDF5 files: the checkpoint itself (with a clear error for every kind of bad input) and
the external files its tensors refer to (opened on first use, one handle per file, closed with the
checkpoint)."""
from __future__ import annotations

import os
import re
import struct
import threading
from pathlib import Path

import h5py
import hdf5plugin  # noqa: F401  registers the LZ4 filter (id 32004) that every Cerebras dataset uses

from ..errors import CheckpointError, TensorReadError

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_SIGNATURE_OFFSETS = (0, 512, 1024, 2048, 4096, 8192)


def one_line(text) -> str:
    """Collapse a message to a single line (HDF5 errors can span several)."""
    return " ".join(str(text).split())


def sniff_non_hdf5(path: Path) -> str | None:
    """Why ``path`` is not an HDF5 file (naming what it looks like), or None if it has the HDF5 signature."""
    size = path.stat().st_size
    if size == 0:
        return "empty file (0 bytes), not a Cerebras checkpoint"
    with open(path, "rb") as fh:
        head = fh.read(16)
        for off in _SIGNATURE_OFFSETS:
            if off + 8 > size:
                break
            fh.seek(off)
            if fh.read(8) == HDF5_SIGNATURE:
                return None
    if head.startswith(b"PK\x03\x04"):
        return "not an HDF5 file: it looks like a torch zip checkpoint (torch.save), not a Cerebras .mdl"
    if len(head) >= 9:
        (n,) = struct.unpack("<Q", head[:8])
        if 2 <= n <= size - 8 and head[8:9] == b"{":
            return "not an HDF5 file: it looks like a safetensors file, not a Cerebras .mdl"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "not an HDF5 file: it looks like a pickle (legacy torch.save), not a Cerebras .mdl"
    return "not an HDF5 file (no HDF5 signature), not a Cerebras checkpoint"


_TRUNC = re.compile(r"truncated file: eof = (\d+).*stored_eof = (\d+)")


def open_h5(path, *, error=CheckpointError) -> h5py.File:
    """Open ``path`` read-only with ``locking="best-effort"`` (falling back to no locking).

    Raises ``error(path, problem)`` with a one-line problem for a missing file, a directory, a non-HDF5
    file (saying if it looks like safetensors or a torch zip), a truncated or otherwise unreadable HDF5 file.
    """
    p = Path(path)
    if not p.exists():
        raise error(p, "no such file")
    if p.is_dir():
        raise error(p, "is a directory, not a checkpoint file")
    if not os.access(p, os.R_OK):
        raise error(p, "permission denied")
    why = sniff_non_hdf5(p)
    if why:
        raise error(p, why)
    last: Exception | None = None
    for locking in ("best-effort", False):
        try:
            return h5py.File(p, "r", locking=locking)
        except ValueError as e:  # HDF5 build without best-effort locking
            last = e
            continue
        except OSError as e:
            last = e
            if "lock" in str(e).lower():
                continue
            break
    msg = one_line(last)
    m = _TRUNC.search(msg)
    if m:
        raise error(p, f"truncated HDF5 file: only {m.group(1)} of {m.group(2)} bytes present")
    msg = re.sub(r"^Unable to (synchronously )?open file \((.*)\)$", r"\2", msg)
    raise error(p, f"cannot open HDF5 file: {msg}")


class H5Store:
    """One HDF5 file's handle for the tensors that read from it.

    The checkpoint's own store is created with the already-open file; an external store opens its
    file on first use and reports a missing/unreadable target as ``TensorReadError`` naming the
    checkpoint. ``close`` is registered in ``Checkpoint._closers``.
    """

    def __init__(self, path: Path, checkpoint_path: Path, file: h5py.File | None = None, referenced_as: str | None = None):
        self.path = Path(path)
        self.checkpoint_path = Path(checkpoint_path)
        self.referenced_as = referenced_as
        self._file = file
        self._lock = threading.Lock()
        self._closed = False

    def file(self, what: str) -> h5py.File:
        """The open file; ``what`` names the tensor for the error message."""
        f = self._file
        if f is not None:
            return f
        with self._lock:
            if self._file is None:
                if self._closed:
                    raise TensorReadError(self.checkpoint_path, f"{what}: checkpoint is closed")
                ref = f" (referenced as {self.referenced_as!r})" if self.referenced_as else ""
                if not self.path.exists():
                    raise TensorReadError(self.checkpoint_path, f"{what}: external file {self.path} not found{ref}")
                try:
                    self._file = open_h5(self.path)
                except CheckpointError as e:
                    raise TensorReadError(self.checkpoint_path, f"{what}: external file {e}") from None
            return self._file

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._file is not None:
                try:
                    self._file.close()
                finally:
                    self._file = None


class ExternalFiles:
    """External stores of one checkpoint, one per resolved path; closes them all with the checkpoint."""

    def __init__(self, checkpoint_path: Path):
        self.checkpoint_path = Path(checkpoint_path)
        self._stores: dict[Path, H5Store] = {}

    def resolve(self, ref: str) -> Path:
        """A referenced path: absolute as is, relative against the checkpoint's folder; if that does not
        exist but a file of the same name sits next to the checkpoint, that one."""
        p = Path(ref)
        folder = self.checkpoint_path.parent
        cand = p if p.is_absolute() else folder / p
        if not cand.exists() and (folder / p.name).exists():
            return folder / p.name
        return cand

    def h5(self, ref: str) -> H5Store:
        path = self.resolve(ref)
        key = path.resolve() if path.exists() else path
        st = self._stores.get(key)
        if st is None:
            st = self._stores[key] = H5Store(path, self.checkpoint_path, referenced_as=ref)
        return st

    def close(self) -> None:
        for st in self._stores.values():
            st.close()
        self._stores.clear()
