"""``open_checkpoint``: any Cerebras checkpoint file (format 0.1–0.5), or one in S3, -> a ``Checkpoint`` catalog.

Opens the HDF5 file once (kept open for the tensors' lazy reads, closed by ``Checkpoint.close``) and reads its
catalog (``hdf5_catalog``: the format version, partial files, the release that wrote it). No tensor data is read
here. A file opened before in the same version reads its
catalog from the index that open wrote (``catalog_index``), and the HDF5 file opens on the first tensor read.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import CheckpointError
from ..state.dirs import cache_dir
from ..storage.local import FileIdentity, open_if_regular
from ..storage.s3url import is_s3_url
from .cerebras import catalog_cache as catalog_index
from ..catalog.model import Checkpoint
from ..guard.confine import Confinement
from .cerebras.h5store import ExternalFiles, H5Store, identity_of_open, open_h5
from .cerebras.catalog import read_hdf5_catalog
from .legacy_torch.reader import HEAD_BYTES, is_legacy_torch, open_legacy_torch
from .run.resolve import resolve_checkpoint
from ckptfs.readers.tf.locate import is_index_file as is_tf_index

def open_checkpoint(path, *, allow_partial: bool = False, allow_external=()) -> Checkpoint:
    """Open a Cerebras checkpoint (a file, or a model_dir meaning its latest checkpoint).

    Files the checkpoint refers to are read only from its own folder and the ``allow_external`` folders
    (``confine``); the file's version is remembered so that reads fail once it changes (``watch``). An S3 location
    (``s3://…``) is opened by ``s3open``: nothing outside its bucket and prefix is read."""
    if is_s3_url(path):
        from .s3.open import open_s3_checkpoint

        return open_s3_checkpoint(path, allow_partial=allow_partial)
    file_path = resolve_checkpoint(path, allow_external)
    if is_tf_index(file_path):  # a TensorFlow saver checkpoint (its .index file): read without TensorFlow
        from ckptfs.readers.tf.saver import open_tf_saver

        return open_tf_saver(file_path)
    legacy = _open_legacy_torch(file_path)
    if legacy is not None:
        return legacy
    indexed = _open_indexed(file_path, allow_external)
    if indexed is not None:
        return indexed
    f = open_h5(file_path)
    try:
        identity = identity_of_open(file_path, f)
    except OSError as e:
        f.close()
        raise CheckpointError(file_path, f"cannot stat the checkpoint ({e.strerror or e})") from None
    store = H5Store(file_path, file_path, file=f, identity=identity)
    externals = ExternalFiles(file_path, Confinement.of(file_path, allow_external))
    ckpt = read_hdf5_catalog(file_path, f, store, externals, allow_partial=allow_partial)
    folder = _index_folder(allow_external)
    if folder is not None:
        catalog_index.save(folder, os.path.realpath(file_path), identity, ckpt, store)
    return ckpt


def _open_legacy_torch(file_path: Path) -> Checkpoint | None:
    """The catalog of a legacy-mode checkpoint (a ``torch.save`` file, ``legacy_torch``), or None for any other
    file (an HDF5 checkpoint; opening it says what anything else is)."""
    try:
        blob = open_if_regular(file_path)
    except OSError:
        return None  # opening it as HDF5 says why
    if blob is None:
        return None
    try:
        if not is_legacy_torch(blob.read(0, HEAD_BYTES)):
            return None
    except OSError:
        return None
    finally:
        blob.close()
    return open_legacy_torch(file_path)


def _index_folder(allow_external) -> Path | None:
    """The cache directory the catalog index lives in, or None when it is not used: indexes turned off, or
    ``allow_external`` given (a checkpoint that refers to other files is read, and confined, every time)."""
    if allow_external or not catalog_index.enabled():
        return None
    return cache_dir()


def _open_indexed(file_path: Path, allow_external) -> Checkpoint | None:
    """The checkpoint from its catalog index (``catalog_index``), its HDF5 file opened by the first tensor read;
    None when there is no index for this version of the file, or the index is not used (``_index_folder``)."""
    folder = _index_folder(allow_external)
    if folder is None:
        return None
    real = os.path.realpath(file_path)
    try:
        identity = FileIdentity.of_path(real)
    except OSError:
        return None  # opening the file says why
    store = H5Store(file_path, file_path, identity=identity)
    ckpt = catalog_index.load(folder, real, identity, file_path, store)
    if ckpt is None:
        return None
    ckpt._closers.append(store.close)
    return ckpt
