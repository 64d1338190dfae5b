"""The catalog of an open HDF5 checkpoint (format 0.1–0.5), whatever storage its bytes come from (a local file:
``open``; an object in S3: ``s3open``): the format version told apart, partial files refused unless asked to
salvage them, the release that wrote the file worked out. No tensor data is read here.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ...errors import CheckpointError, SourceChangedError
from ...catalog.model import CEREBRAS, TF_H5, Checkpoint, Container, ValueLeaf
from .h5store import ExternalFiles, H5Store, read_large_attr, release_hdf5_free_lists
from ...errors import one_line
from .format_legacy import LegacyReader
from .format_v05 import V05Reader
from ckptfs.readers.cerebras.tf_h5 import is_tf_h5, read_tf_h5

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


def _success_flag(f, path) -> bool:
    """The ``__SUCCESS__`` attribute as a flag (False when absent); ``CheckpointError`` when it is not one value."""
    if "__SUCCESS__" not in f.attrs:
        return False
    flag = np.asarray(f.attrs["__SUCCESS__"])
    if flag.size != 1:
        raise CheckpointError(path, f"__SUCCESS__ attribute is not a flag (a {flag.dtype} array of shape "
                                    f"{list(flag.shape)})")
    return bool(flag.item())


def _check_cerebras(f, path: Path) -> str:
    """The kind of Cerebras checkpoint ``f`` is (``catalog.CEREBRAS``, or ``catalog.TF_H5`` for a TensorFlow-era H5
    file: ``tf_h5.is_tf_h5``); ``CheckpointError`` when it is neither."""
    attrs = f.attrs
    if "__spec__" in attrs:
        return CEREBRAS
    if "ckpt_info" in attrs:
        raise CheckpointError(path, "is a Cerebras ckpt_info index file, not a checkpoint")
    if is_tf_h5(f):
        return TF_H5
    raise CheckpointError(path, "HDF5 file without a Cerebras __spec__ attribute, nor a TensorFlow-era H5 file "
                                "(root datasets with an __H5_TYPE__ attribute): not a Cerebras checkpoint")


def _partial_problem(path: Path) -> str:
    if _TMP_NAME.search(path.name):
        return ("leftover temporary file of a failed cstorch.save (no __SUCCESS__ flag, never renamed to .mdl); "
                "use --allow-partial to salvage what was written")
    return "partial checkpoint: the __SUCCESS__ flag is missing (the save did not finish); use --allow-partial to salvage what was written"


def read_hdf5_catalog(file_path, f, store: H5Store, externals: ExternalFiles, *, allow_partial: bool) -> Checkpoint:
    """The catalog of the open HDF5 checkpoint ``f`` (whatever storage it is read from: ``store`` serves its
    tensors, ``externals`` the files it refers to); both are closed with the checkpoint, or here on failure."""
    try:
        kind = _check_cerebras(f, file_path)
        store.will_read_headers(f)
        if kind == TF_H5:  # a flat state of TF variables: no format version, no writing release
            version, success, release = 0.0, True, None
            result = read_tf_h5(file_path, f, store, externals)
        else:
            version = _format_version(f, file_path)
            spec = _attr_str(read_large_attr(f, "__spec__")) or ""  # read once, handed to the reader
            if version >= 0.5:
                if not spec.lstrip().startswith("["):
                    raise CheckpointError(file_path, f"format {version} file whose __spec__ is not JSON")
                success = _success_flag(f, file_path)
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
                      leaves=result.leaves, links=result.links, warnings=result.warnings, kind=kind)
    ckpt._closers.extend([externals.close, store.close])
    return ckpt
