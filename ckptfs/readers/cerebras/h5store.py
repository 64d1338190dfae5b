"""Opening HDF5 files: the checkpoint itself (with a clear error for every kind of bad input) and
the external files its tensors refer to (confined to the checkpoint's folder, see ``confine``; opened on first
use, one handle per file, closed with the checkpoint). Every store remembers the ``FileIdentity`` of the version
it opened, and ``verify`` tells whether the file changed since (``watch``)."""
from __future__ import annotations

import ctypes
import os
import struct
import threading
from collections import OrderedDict
from contextlib import closing
from dataclasses import replace
from pathlib import Path

import h5py
import numpy as np
from h5py import h5a, h5t

from ckptfs.readers.cerebras.h5errors import open_problem

from ...errors import CheckpointError, TensorReadError
from ...storage.base import Blob
from ...storage.local import FileIdentity, LocalFile
from ...guard.confine import Confinement, RefusedReference, non_regular_kind
from . import lz4chunks
from .lz4filter import register_lz4
from ...guard.watch import check_unchanged

register_lz4()  # the LZ4 filter (id 32004) that every Cerebras dataset uses, before any file is opened
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_SIGNATURE_OFFSETS = (0, 512, 1024, 2048, 4096, 8192)


def sniff_non_hdf5(path: Path) -> str | None:
    """Why the file ``path`` is not an HDF5 file (naming what it looks like), or None if it has the HDF5 signature."""
    with closing(LocalFile(path)) as blob:
        return what_blob_is(blob)


def what_blob_is(blob: Blob) -> str | None:
    """``what_bytes_are`` of a blob: why it is not an HDF5 file, or None when it has the HDF5 signature."""
    return what_bytes_are(blob.read(0, 16), blob.size, lambda off: blob.read(off, 8) == HDF5_SIGNATURE)


def what_bytes_are(head: bytes, size: int, signature_at) -> str | None:
    """Why a file of ``size`` bytes starting with ``head`` (its first 16 bytes) is not an HDF5 file, or None when
    ``signature_at(offset)`` finds the HDF5 signature at one of the offsets HDF5 looks at."""
    if size == 0:
        return "empty file (0 bytes), not a Cerebras checkpoint"
    for off in _SIGNATURE_OFFSETS:
        if off + 8 > size:
            break
        if (head[:8] == HDF5_SIGNATURE) if off == 0 else signature_at(off):
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


def read_text_attr(f: h5py.File, name: str):
    """Attribute ``name`` of ``f``'s root (KeyError if absent): a scalar variable-length string is read with
    h5py's low-level API (a fifth of the cost of ``f.attrs[name]``, which counts for 100,000 keys); anything
    else as ``f.attrs`` gives it."""
    try:
        aid = h5a.open(f.id, name.encode("utf-8", "surrogateescape"))
    except (KeyError, RuntimeError, ValueError):
        raise KeyError(name) from None
    tid = aid.get_type()
    if aid.shape == () and tid.get_class() == h5t.STRING and tid.is_variable_str():
        arr = np.empty((), dtype=_VLEN_STR)
        aid.read(arr, mtype=_VLEN_STR_MEMORY)
        v = arr[()]
        return v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else v
    return f.attrs[name]


def read_large_attr(f: h5py.File, name: str):
    """``f.attrs[name]`` for an attribute that can be megabytes (the ``__spec__`` of a 100,000-key checkpoint is
    21 MB), leaving HDF5's metadata cache at the size it had before.

    HDF5 grows the cache of ``f`` to hold such an attribute, and a cache left that large keeps decoded headers of
    everything looked up afterwards: ~1 KB per key (190 MB while the catalog of a 100,000-key file is read, and
    slower than the small cache). KeyError if absent."""
    cfg = f.id.get_mdc_config()
    try:
        return f.attrs[name]
    finally:
        cfg.set_initial_size = True  # back to the size it had (evicting the attribute's entry)
        try:
            f.id.set_mdc_config(cfg)
        except (RuntimeError, ValueError):
            pass  # only memory is at stake


_VLEN_STR = h5py.string_dtype()
_VLEN_STR_MEMORY = h5t.py_create(_VLEN_STR)  # its HDF5 memory type, made once
#: HDF5's chunk cache of each open dataset (its classic defaults). HDF5 2.0 defaults to 8,191 slots, 8 MiB: 64 KB
#: of slot table allocated for every open dataset, although LZ4 datasets are read around HDF5 (``lz4chunks``) and
#: the cache only serves the plain h5py reads of other datasets
CHUNK_CACHE_SLOTS = 521
CHUNK_CACHE_BYTES = 1 << 20


def open_h5(path, *, error=CheckpointError) -> h5py.File:
    """Open ``path`` read-only with ``locking="best-effort"`` (falling back to no locking) and a small chunk cache
    per dataset (``CHUNK_CACHE_SLOTS``).

    Raises ``error(path, problem)`` with a one-line problem for a missing file, a directory, a non-HDF5
    file (saying if it looks like safetensors or a torch zip), a truncated or otherwise unreadable HDF5 file.
    """
    p = Path(path)
    if not p.exists():
        raise error(p, "no such file")
    if p.is_dir():
        raise error(p, "is a directory, not a checkpoint file")
    kind = non_regular_kind(p.stat())
    if kind is not None:  # refused before any open: opening a FIFO would block
        raise error(p, f"is {kind}, not a regular file")
    if not os.access(p, os.R_OK):
        raise error(p, "permission denied")
    why = sniff_non_hdf5(p)
    if why:
        raise error(p, why)
    last: Exception | None = None
    for locking in ("best-effort", False):
        try:
            return h5py.File(p, "r", locking=locking, rdcc_nslots=CHUNK_CACHE_SLOTS, rdcc_nbytes=CHUNK_CACHE_BYTES)
        except ValueError as e:  # HDF5 build without best-effort locking
            last = e
            continue
        except OSError as e:
            last = e
            if "lock" in str(e).lower():
                continue
            break
    raise error(p, open_problem(last, "file"))


def release_hdf5_free_lists() -> bool:
    """Hand the blocks on HDF5's internal free lists back to the C allocator (``H5garbage_collect``).

    HDF5 keeps every block it frees on a free list of its own for reuse, with no bound by default, so the memory
    used to read the catalog (13 MB for an 18,000-key file) would stay with the process after the catalog's handle
    is closed. h5py does not wrap the call; it is looked up through h5py's own extension module,
    whose dependencies are the HDF5 library h5py uses, and made under h5py's lock like every HDF5 call. Best
    effort: False when the function cannot be found."""
    try:
        from h5py import _objects, h5

        fn = ctypes.CDLL(h5.__file__).H5garbage_collect
    except (OSError, AttributeError, ImportError):
        return False
    fn.restype = ctypes.c_int
    fn.argtypes = ()
    with _objects.phil:
        return fn() >= 0


def identity_of_open(path: Path, f: h5py.File) -> FileIdentity:
    """The identity of the file an open HDF5 handle reads (its descriptor when HDF5 exposes one, else ``path``)."""
    try:
        return FileIdentity.of_stat(os.fstat(f.id.get_vfd_handle()))
    except (OSError, ValueError, TypeError, AttributeError, RuntimeError):
        return FileIdentity.of_path(path)


#: datasets one store keeps open at once: HDF5 holds ~20 KB for each open dataset (more while many are open at
#: once), so reading every tensor of a 100,000-key checkpoint must not leave them all open
MAX_OPEN_DATASETS = 256


class H5Store:
    """One HDF5 file's handle for the tensors that read from it.

    The checkpoint's own store is created with the already-open file (for a catalog from its index, it opens the
    file on the first read, as an external store does) and reports a missing/unreadable/refused target as
    ``TensorReadError`` naming the checkpoint. ``identity`` is the version of the file the tensors were planned
    from (None: not known yet, taken when the file is first opened); ``verify`` raises ``SourceChangedError`` once
    the file at ``path`` is another version. ``close`` is registered in ``Checkpoint._closers``.

    The tensors that keep a dataset of the file open (``H5DatasetTensor``) report each read (``used``): past
    ``MAX_OPEN_DATASETS``, the least recently read one closes its dataset (``close_dataset``) and opens it again
    when read next.
    """

    def __init__(self, path: Path, checkpoint_path: Path, file: h5py.File | None = None, referenced_as: str | None = None,
                 *, identity: FileIdentity | None = None, confinement: Confinement | None = None):
        self.path = Path(path)
        self.checkpoint_path = Path(checkpoint_path)
        self.watch_path = Path(os.path.realpath(self.path))  # the file itself, not a symlink someone may re-point
        self.referenced_as = referenced_as
        self.identity = identity
        self.confinement = confinement
        self._file = file
        self._lock = threading.Lock()
        self._closed = False
        self._open: OrderedDict = OrderedDict()  # id(tensor) -> tensor with an open dataset, least recently read first
        self._open_lock = threading.Lock()

    def chunk_file(self, dset, coords: tuple, offset: int, size: int):
        """Where the LZ4 chunk reader fetches this file's stored chunks from (an ``OpenChunkFile``): a ``LocalFile``
        on a plain local file, or None (chunks then come through HDF5)."""
        return lz4chunks.local_chunk_files.open(dset, coords, offset, size)

    def will_read_headers(self, f: h5py.File) -> None:
        """The catalog is about to open the objects of ``f``: a store whose every read is a round trip fetches their
        headers ahead, together (``BlobH5Store``); a local file's reads cost little, so nothing here."""

    def will_index(self, name: str | None = None) -> None:
        """Dataset ``name``'s chunk index (None: every dataset's) is about to be read: a store whose every read is a
        round trip fetches the chunk indexes' nodes ahead, together (``BlobH5Store``); nothing here."""

    def file(self, what: str) -> h5py.File:
        """The open file; ``what`` names the tensor for the error message."""
        f = self._file
        if f is not None:
            return f
        with self._lock:
            if self._file is None:
                if self._closed:
                    raise TensorReadError(self.checkpoint_path, f"{what}: checkpoint is closed")
                self._file = self._open_file(what)
            return self._file

    def _open_file(self, what: str) -> h5py.File:
        """Open the file (under the lock, once): a local path, checked against its confinement and identity."""
        ref = f" (referenced as {self.referenced_as!r})" if self.referenced_as else ""
        own = self.path == self.checkpoint_path  # opened on first read (a catalog from its index)
        if not self.path.exists():
            where = "the checkpoint file is gone" if own else f"external file {self.path} not found{ref}"
            raise TensorReadError(self.checkpoint_path, f"{what}: {where}")
        try:
            if self.confinement is not None:
                self.confinement.recheck(self.path)
            f = open_h5(self.path)
        except RefusedReference as e:
            raise TensorReadError(self.checkpoint_path, f"{what}: external reference refused: {e.problem}") from None
        except CheckpointError as e:
            where = f"cannot open the checkpoint ({e.problem})" if own else f"external file {e}"
            raise TensorReadError(self.checkpoint_path, f"{what}: {where}") from None
        opened = identity_of_open(self.path, f)
        if self.identity is None:
            self.identity = opened
        elif self.identity.difference(opened) is not None:
            f.close()
            self.verify(what)  # raises SourceChangedError saying how it changed
        return f

    def reopen(self) -> None:
        """Replace the open handle by a fresh one of the same file version (``SourceChangedError`` if the file is
        another version now). HDF5 keeps memory for what a handle has read (metadata cache, open-object state) until
        that handle is closed; the catalog is read with one handle and the tensors are served with a fresh one
        (``open_checkpoint``)."""
        self.release()
        self.file("reopening")

    def used(self, tensor) -> None:
        """``tensor`` has its dataset open and is being read: it becomes the most recently used; the least recently
        used ones beyond ``MAX_OPEN_DATASETS`` close theirs (a read under way keeps its own reference meanwhile)."""
        with self._open_lock:
            key = id(tensor)
            if key in self._open:
                self._open.move_to_end(key)
                return
            self._open[key] = tensor
            while len(self._open) > MAX_OPEN_DATASETS:
                self._open.popitem(last=False)[1].close_dataset()

    def open_datasets(self) -> int:
        """How many tensors keep a dataset of this file open."""
        return len(self._open)

    def _forget_datasets(self) -> None:
        with self._open_lock:
            tensors = list(self._open.values())
            self._open.clear()
        for t in tensors:
            t.close_dataset()

    def release(self) -> None:
        """Close the handle; the next ``file()`` opens the file again (checking it is still the same version)."""
        self._forget_datasets()  # their datasets belong to this handle
        with self._lock:
            old, self._file = self._file, None
            if old is not None:
                old.close()

    def verify(self, what: str) -> None:
        """``SourceChangedError`` if the file at ``path`` is no longer the version the tensors were planned from.

        While the file is open and still that version, its path is not consulted: a file removed or renamed over
        keeps its bytes for whoever holds it open, so reads stay whole and consistent (a run mount serves a
        checkpoint that training deleted to the readers that opened it, ``tree/run.py``)."""
        if self.identity is not None:
            if self._open_identity() == self.identity:
                return
            role = "the checkpoint" if self.path == self.checkpoint_path else f"external file {self.path}"
            check_unchanged(self.checkpoint_path, self.watch_path, self.identity, what, role)

    def _open_identity(self) -> FileIdentity | None:
        """The identity of the open file (``fstat`` of its descriptor), None if not open. Unlinking a file moves its
        ctime without touching its content, so an unlinked file's ctime is not compared."""
        f = self._file
        if f is None or self.identity is None:
            return None
        try:
            st = os.fstat(f.id.get_vfd_handle())
        except (OSError, ValueError, TypeError, AttributeError, RuntimeError):
            return None
        now = FileIdentity.of_stat(st)
        return replace(now, ctime_ns=self.identity.ctime_ns) if st.st_nlink == 0 else now

    def close(self) -> None:
        self._forget_datasets()
        with self._lock:
            self._closed = True
            if self._file is not None:
                try:
                    self._file.close()
                finally:
                    self._file = None


class ExternalFiles:
    """External stores of one checkpoint, one per resolved path; closes them all with the checkpoint.

    Every reference goes through ``confinement`` (``RefusedReference`` when it leads outside the allowed
    folders or to something other than a regular file)."""

    def __init__(self, checkpoint_path: Path, confinement: Confinement | None = None):
        self.checkpoint_path = Path(checkpoint_path)
        self.confinement = confinement or Confinement.of(checkpoint_path)
        self._stores: dict[Path, H5Store] = {}

    def resolve(self, ref: str) -> Path:
        """The real path a reference names (see ``Confinement.resolve``); ``RefusedReference`` when it is outside
        the allowed folders or exists but is not a regular file."""
        path = self.confinement.resolve(ref)
        try:
            st = path.stat()
        except OSError:
            return path  # missing: the caller says "not found"
        kind = non_regular_kind(st)
        if kind is not None:
            raise RefusedReference(f"reference {ref!r} names {path}, which is {kind}, not a regular file")
        return path

    def identity(self, path: Path) -> FileIdentity | None:
        """The version of an external file now (None if it does not exist)."""
        try:
            return FileIdentity.of_path(path)
        except OSError:
            return None

    def h5(self, ref: str) -> H5Store:
        path = self.resolve(ref)
        st = self._stores.get(path)
        if st is None:
            st = self._stores[path] = H5Store(path, self.checkpoint_path, referenced_as=ref,
                                              identity=self.identity(path), confinement=self.confinement)
        return st

    def release(self) -> None:
        """Close every handle opened while the catalog was read (each reopens on first use, see ``H5Store.reopen``)."""
        for st in self._stores.values():
            st.release()

    def close(self) -> None:
        for st in self._stores.values():
            st.close()
        self._stores.clear()
