"""``open_checkpoint``: any Cerebras checkpoint file (format 0.1–0.5) -> a ``Checkpoint`` catalog.

Opens the HDF5 file once (kept open for the tensors' lazy reads, closed by ``Checkpoint.close``),
tells the format version apart, refuses partial files unless asked to salvage them, and works out
the release that wrote the file. No tensor data is read here. A file opened before in the same version reads its
catalog from the index that open wrote (``catalog_index``), and the HDF5 file opens on the first tensor read.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, SourceChangedError
from ..statedirs import cache_dir
from ..storage.local import FileIdentity
from ..storage.s3url import is_s3_url
from . import catalog_index
from .catalog import Checkpoint, Container, ValueLeaf
from .confine import Confinement
from .h5store import (ExternalFiles, H5Store, identity_of_open, one_line, open_h5, read_large_attr,
                      release_hdf5_free_lists)
from .reader_legacy import LegacyReader
from .reader_v05 import V05Reader
from .resolve import resolve_checkpoint

#: release assumed for a legacy format version without ``__cstorch_version__`` (cstorch 2.10's own map)
VERSION_RELEASES = {0.1: "1.7", 0.2: "1.8", 0.3: "1.9", 0.4: "2.0"}

_TMP_NAME = re.compile(r"\.mdl\.[0-9a-fA-F]{8}\.tmp$")


def _attr_str(v) -> str | None:
    if v is None:
        return None
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, np.ndarray) and v.shape == ():
        v = v[()]
    return str(v.decode() if isinstance(v, bytes) else v)


def metadata_release(root) -> str | None:
    """The last ``version`` in a top-level ``__metadata__`` history list (Model Zoo trainer state)."""
    if not (isinstance(root, Container) and root.keys is not None and "__metadata__" in root.keys):
        return None
    hist = root.children[root.keys.index("__metadata__")]
    if not isinstance(hist, Container):
        return None
    for entry in reversed(hist.children):
        if isinstance(entry, Container) and entry.keys is not None and "version" in entry.keys:
            v = entry.children[entry.keys.index("version")]
            if isinstance(v, ValueLeaf) and isinstance(v.value, str) and v.value:
                return v.value
    return None


def _format_version(f, path) -> float:
    if "__version__" not in f.attrs:
        return 0.1
    try:
        return float(np.asarray(f.attrs["__version__"]).item())
    except (TypeError, ValueError):
        raise CheckpointError(path, f"__version__ attribute {f.attrs['__version__']!r} is not a number") from None


def _check_cerebras(f, path: Path) -> None:
    attrs = f.attrs
    if "__spec__" in attrs:
        return
    if "ckpt_info" in attrs:
        raise CheckpointError(path, "is a Cerebras ckpt_info index file, not a checkpoint")
    raise CheckpointError(path, "HDF5 file without a Cerebras __spec__ attribute: not a Cerebras checkpoint")


def _partial_problem(path: Path) -> str:
    if _TMP_NAME.search(path.name):
        return ("leftover temporary file of a failed cstorch.save (no __SUCCESS__ flag, never renamed to .mdl); "
                "use --allow-partial to salvage what was written")
    return "partial checkpoint: the __SUCCESS__ flag is missing (the save did not finish); use --allow-partial to salvage what was written"


def open_checkpoint(path, *, allow_partial: bool = False, allow_external=()) -> Checkpoint:
    """Open a Cerebras checkpoint (a file, or a model_dir meaning its latest checkpoint).

    Files the checkpoint refers to are read only from its own folder and the ``allow_external`` folders
    (``confine``); the file's version is remembered so that reads fail once it changes (``watch``). An S3 location
    (``s3://…``) is opened by ``s3open``: nothing outside its bucket and prefix is read."""
    if is_s3_url(path):
        from .s3open import open_s3_checkpoint

        return open_s3_checkpoint(path, allow_partial=allow_partial)
    file_path = resolve_checkpoint(path)
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


def read_hdf5_catalog(file_path, f, store: H5Store, externals: ExternalFiles, *, allow_partial: bool) -> Checkpoint:
    """The catalog of the open HDF5 checkpoint ``f`` (whatever storage it is read from: ``store`` serves its
    tensors, ``externals`` the files it refers to); both are closed with the checkpoint, or here on failure."""
    try:
        _check_cerebras(f, file_path)
        version = _format_version(f, file_path)
        spec = _attr_str(read_large_attr(f, "__spec__")) or ""  # read once, handed to the reader
        if version >= 0.5:
            if not spec.lstrip().startswith("["):
                raise CheckpointError(file_path, f"format {version} file whose __spec__ is not JSON")
            success = bool(np.asarray(f.attrs["__SUCCESS__"]).item()) if "__SUCCESS__" in f.attrs else False
            if not success and not allow_partial:
                raise CheckpointError(file_path, _partial_problem(file_path))
            result = V05Reader(f, store, externals, file_path, partial=not success).read(spec)
        else:
            success = True
            result = LegacyReader(f, store, externals, file_path, version).read(spec)
        release = (_attr_str(f.attrs.get("__cstorch_version__")) or metadata_release(result.root)
                   or VERSION_RELEASES.get(round(version, 1)))
        store.verify("catalog")  # the metadata just read belongs to one version of the file
        store.reopen()  # serve from a fresh handle: the catalog's left HDF5 holding memory for every dataset
        externals.release()
        release_hdf5_free_lists()  # what HDF5 kept for reuse after reading the catalog
    except SourceChangedError as e:
        externals.close()
        store.close()
        raise CheckpointError(file_path, f"changed while its metadata was read: {e.problem}") from None
    except CheckpointError:
        externals.close()
        store.close()
        raise
    except (OSError, RuntimeError) as e:  # an HDF5 failure while reading the catalog itself
        externals.close()
        store.close()
        raise CheckpointError(file_path, f"cannot read the checkpoint's metadata: {one_line(e)}") from None
    ckpt = Checkpoint(path=file_path, format_version=version, release=release, success=success, root=result.root,
                      leaves=result.leaves, links=result.links, warnings=result.warnings)
    ckpt._closers.extend([externals.close, store.close])
    return ckpt


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
