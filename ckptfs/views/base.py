"""What every view (hf, cs, torch, tensors) receives and returns.

A view turns one opened checkpoint into virtual files (``ckptfs.layouts.file.VirtualFile``): relative paths
(``/``-separated) mapped to files with an exact ``size`` and ``readinto(offset, out)``. Layouts (safetensors, torch
zip, npy, hdf5) are such files; ``BytesFile`` wraps small generated texts, ``DeferredFile`` a layout built on first
use.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..tensor.cache import BlockCache
from .options import MountOptions
from ..layouts.file import VirtualFile

#: the file at the root of every mount that says what was mounted (views must not put a file there)
README_NAME = "README.txt"


class BytesFile(VirtualFile):
    """A small file whose whole content is known up front (config.json, index JSON, README.txt)."""

    def __init__(self, data: bytes | str):
        self.data = data.encode() if isinstance(data, str) else bytes(data)
        self.size = len(self.data)

    def readinto(self, offset: int, out: memoryview, cursor=None) -> int:
        out[:] = self.data[offset:offset + len(out)]
        return len(out)


class DeferredFile(VirtualFile):
    """A file whose layout is built on first use (``size`` or ``read``) — or earlier by ``start()`` in a background
    thread — so that a mount answers before an expensive layout (the cs view's HDF5 skeleton) is ready. Its size is
    exact from the first ``stat``: that call waits for the build. A build error is raised on every use."""

    deferred = True

    def __init__(self, factory):
        self._factory = factory
        self._lock = threading.Lock()
        self._file = None
        self._error: BaseException | None = None

    def resolve(self):
        with self._lock:
            if self._file is None and self._error is None:
                try:
                    self._file = self._factory()
                except BaseException as e:  # kept and re-raised to every caller
                    self._error = e
                self._factory = None
        if self._error is not None:
            raise self._error
        return self._file

    def start(self) -> threading.Thread:
        """Build in a background thread (the caller joins it before closing the sources it reads)."""
        def warm():
            try:
                self.resolve()
            except BaseException:
                pass  # reported when the file is used

        th = threading.Thread(target=warm, name="ckptfs-deferred-layout", daemon=True)
        th.start()
        return th

    @property
    def size(self) -> int:
        return self.resolve().size

    def readinto(self, offset: int, out: memoryview, cursor=None) -> int:
        return self.resolve().readinto(offset, out, cursor)


@dataclass
class ViewResult:
    files: dict = field(default_factory=dict)  # relative path -> VirtualFile
    missing: str | None = None  # why the view (or part of it) is absent
    notes: list = field(default_factory=list)  # lines for README.txt (dropped keys, opaque objects…)


@dataclass
class ViewContext:
    """What a view's ``build(ctx) -> ViewResult`` receives (built once per mount by ``tree/assemble.py``; the views are
    registered in ``ckptfs.views.registry``).

    A view's ``ViewResult.files`` paths are relative to the view's own directory ``<name>/`` in the mount
    (``hf`` returning ``config.json`` appears as ``hf/config.json``); a path that already starts with
    ``<name>/`` is taken as is.
    """

    checkpoint: Any  # ckptfs.catalog.model.Checkpoint (from ckptfs.readers.open_checkpoint)
    ckpt_path: Path  # the resolved .mdl file
    stem: str  # ckpt_path's name without suffix ("checkpoint" for checkpoint.mdl)
    options: MountOptions
    crc_store: Any = None  # ckptfs.layouts.torchzip.crc_store.CrcStore persisting zip CRCs across mounts (None: not persisted)
    identity: str | None = None  # the checkpoint file (realpath, size, mtime, inode) + content-shaping options
    cache: BlockCache | None = None  # the mount's block cache, handed to every layout (default: one sized by options)
    parts: Any = None  # the tree's pool of parts fetched from object storage (``storage.s3object.PartPool``), or None
    # the mount server, still single-threaded: expensive layouts may start building in a forked process (cs view)
    fork_builds: bool = False

    def __post_init__(self):
        if self.cache is None:
            self.cache = BlockCache(self.options.cache_size)
