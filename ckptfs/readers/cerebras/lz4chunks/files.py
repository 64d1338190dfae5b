"""The file the chunk reader fetches stored chunks from, bypassing HDF5: the one seam between chunk reads and storage.

A reader asks its ``OpenChunkFile`` once for a ``Blob`` (``ckptfs.storage``) holding the dataset's file, naming one
stored chunk (its coordinates, offset and size) so that the opener can check that HDF5's chunk addresses are offsets
in the blob it opens; None means "no such blob": the reader then fetches each chunk through HDF5
(``read_direct_chunk``), which is always right, only slower. The reader uses the blob's ``read_spans`` (neighbouring
chunks) and ``read_scattered`` (a peek's rows in each of a row of chunks), and ``ShortRead`` when it ends early.

``local_chunk_files.open`` (the default) gives a ``LocalFile`` (page cache or ``O_DIRECT``) on a plain local file
(HDF5's sec2 driver) whose chunk addresses were checked against ``read_direct_chunk`` once per open file; the handles
are read-only, shared by the file's readers and closed with the last of them.
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Protocol

from ....storage.base import Blob
from ....storage.local import LocalFile


class OpenChunkFile(Protocol):
    """Where a reader's chunks are fetched from (``plan(dset, open_file=...)``): one per storage backend."""

    def __call__(self, dset, coords: tuple, offset: int, size: int) -> Blob | None:
        """The file holding ``dset`` (an h5py Dataset) whose chunk at ``coords`` is stored at ``[offset, offset +
        size)``, or None (chunks then come through HDF5)."""


class LocalChunkFiles:
    """``LocalFile`` handles on plain local HDF5 files, one per open file, shared by its readers (held weakly)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._files: "weakref.WeakValueDictionary[tuple, LocalFile]" = weakref.WeakValueDictionary()
        self._refused: set = set()

    def open(self, dset, coords: tuple, offset: int, size: int) -> LocalFile | None:
        """An ``OpenChunkFile``: a handle on the file holding ``dset`` if it is a plain file (sec2 driver) whose chunk
        addresses are file offsets, checked once per open file by reading one chunk (``coords``, at ``offset``) both
        ways."""
        from h5py import h5fd, h5i

        if not hasattr(os, "preadv"):
            return None
        try:
            fid = h5i.get_file_id(dset.id)
            st = os.fstat(fid.get_vfd_handle())
            key = (fid.fileno, st.st_dev, st.st_ino)
            with self._lock:
                rf = self._files.get(key)
                if rf is not None or key in self._refused:
                    return rf
                if fid.get_access_plist().get_driver() == h5fd.SEC2:
                    rf = LocalFile(os.fsdecode(fid.name))
                    mine = os.fstat(rf.fd)
                    _, want = dset.id.read_direct_chunk(coords)
                    if (mine.st_dev, mine.st_ino) == key[1:] and rf.read(offset, size) == bytes(want):
                        self._files[key] = rf
                        return rf
                self._refused.add(key)
                return None
        except (OSError, ValueError, RuntimeError, TypeError, AttributeError):
            return None

    def clear(self) -> None:
        """Forget every handle and refusal: the next reader of a file opens and checks it afresh (readers keep
        theirs)."""
        with self._lock:
            self._files.clear()
            self._refused.clear()


#: the handles of this process
local_chunk_files = LocalChunkFiles()
