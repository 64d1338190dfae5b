"""Cerebras' TensorFlow-era H5 files: the appliance's ``H5Saver`` layout, as ``tensorflow-to-h5`` writes it.

One dataset per variable at the file's root, named ``urllib.parse.quote(name, safe='')`` (``bert/encoder/…`` is
``bert%2Fencoder%2F…``), with the attribute ``__H5_TYPE__`` (``NumpyArrayH5Type`` for a tensor; H5Saver also knows
``ScalarH5Type``, ``StringH5Type``, ``NoneH5Type`` and ``ObjectH5Type``), LZ4-chunked (scalars and empty tensors
plain). No ``__spec__`` and no ``__version__``: the state is flat, its keys the unquoted names, in the file's
(alphabetical) order of datasets, as ``H5Saver.load`` lists them.

``is_tf_h5(f)`` tells such a file from anything else from a few root objects; ``read_tf_h5`` reads its catalog with
the legacy reader's per-dataset rules (``reader_legacy``), so tensors are ``H5DatasetTensor`` read chunk by chunk
(``lz4chunks``), never whole. Bounded: the number of datasets, each name's length, each shape against the bytes
the dataset stores.
"""
from __future__ import annotations

from urllib.parse import unquote

import h5py
import numpy as np
from h5py import h5d

from ckptfs.errors import CheckpointError
from ckptfs.catalog.model import Container, TensorLeaf, UnreadableLeaf
from ckptfs.readers.cerebras.h5safe import H5Refused, dataset_info
from ckptfs.readers.cerebras.h5store import ExternalFiles, H5Store
from ckptfs.errors import one_line
from ckptfs.readers.cerebras.format_legacy import LegacyReader, _object_address
from ckptfs.readers.cerebras.format_v05 import ReadResult, resolve_links
from ckptfs.readers.cerebras.serializers import Link

#: the ``__H5_TYPE__`` values of the appliance's H5Saver (its ``H5_TYPES_MAP``)
H5SAVER_TYPES = ("NumpyArrayH5Type", "ScalarH5Type", "StringH5Type", "NoneH5Type", "ObjectH5Type")
#: root objects looked at by ``is_tf_h5`` (the first ones, in the file's order)
SNIFF_OBJECTS = 4
#: datasets a file may hold (far beyond a real model: 100,000 variables)
MAX_DATASETS = 1_000_000
#: longest dataset name (bytes, quoted): a TF variable name is at most a few hundred characters
MAX_NAME_BYTES = 16 << 10


def _text(v) -> str | None:
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, np.ndarray) and v.shape == ():
        return _text(v[()])
    return v if isinstance(v, str) else None


def _h5type(oid) -> str | None:
    """The ``__H5_TYPE__`` of the object ``oid`` (a text), or None."""
    try:
        if not h5py.h5a.exists(oid, b"__H5_TYPE__"):
            return None
        return _text(h5py.AttributeManager(h5py.Dataset(oid))["__H5_TYPE__"])
    except (OSError, KeyError, ValueError, TypeError, RuntimeError):
        return None


def _root_names(f: h5py.File, limit: int) -> list:
    """The first ``limit`` link names of the root group, as bytes, in the file's order."""
    names: list = []

    def collect(name):
        names.append(name)
        return 1 if len(names) >= limit else None  # non-None stops the iteration

    try:
        f.id.links.iterate(collect)
    except (OSError, RuntimeError, ValueError):
        pass
    return names


def is_tf_h5(f: h5py.File) -> bool:
    """Whether the open HDF5 file ``f`` is a TensorFlow-era Cerebras H5 file (H5Saver layout): no ``__spec__``,
    ``__version__`` or ``ckpt_info`` attribute, and its first root objects are datasets (hard links, no slash in
    their names) whose ``__H5_TYPE__`` is one of H5Saver's."""
    attrs = f.attrs
    if any(a in attrs for a in ("__spec__", "__version__", "ckpt_info")):
        return False
    names = _root_names(f, SNIFF_OBJECTS)
    if not names:
        return False
    for raw in names:
        try:
            info = f.id.links.get_info(raw)
            if info.type != h5py.h5l.TYPE_HARD:
                return False
            oid = h5py.h5o.open(f.id, raw)
        except (KeyError, OSError, RuntimeError, ValueError):
            return False
        if not isinstance(oid, h5d.DatasetID) or _h5type(oid) not in H5SAVER_TYPES:
            return False
    return True


def _count_problem(f: h5py.File) -> str | None:
    try:
        n = f.id.get_num_objs()
    except (OSError, RuntimeError, ValueError) as e:
        return f"its root group cannot be listed ({one_line(e)})"
    if n > MAX_DATASETS:
        return f"holds {n:,} root objects, more than the {MAX_DATASETS:,} a TensorFlow-era H5 file may have"
    return None


def _storage_problem(d: h5py.Dataset, name: str, nbytes: int, file_size: int) -> str | None:
    """Why the bytes dataset ``d`` stores cannot hold ``nbytes`` (None when they can): a contiguous dataset must
    lie inside the file; a chunked one's chunks are checked one by one when read (``lz4chunks``)."""
    try:
        dcpl = d.id.get_create_plist()
        if dcpl.get_layout() != h5d.CONTIGUOUS or nbytes == 0:
            return None
        off = d.id.get_offset()
        stored = d.id.get_storage_size()
    except (OSError, RuntimeError, ValueError) as e:
        return f"dataset {name!r}: its storage cannot be read ({one_line(e)})"
    if off is None or stored < nbytes:
        return f"dataset {name!r} stores {stored} bytes, its shape needs {nbytes}"
    if off + nbytes > file_size:
        return f"dataset {name!r} lies at bytes [{off}, {off + nbytes}) of a {file_size}-byte file"
    return None


def read_tf_h5(file_path, f: h5py.File, store: H5Store, externals: ExternalFiles) -> ReadResult:
    """The flat catalog of the TensorFlow-era H5 file ``f``: ``{unquoted name: leaf}`` in the file's order; a
    dataset hard-linked under two names is one leaf (the second name an alias). ``CheckpointError`` when the file
    holds too many objects; a dataset that cannot be read is an unreadable leaf saying why."""
    why = _count_problem(f)
    if why:
        raise CheckpointError(file_path, why)
    try:
        file_size = f.id.get_filesize()
    except (OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(file_path, f"cannot read the file's size ({one_line(e)})") from None
    legacy = LegacyReader(f, store, externals, file_path, 0.4)  # NumpyArrayH5Type as a numpy array, as H5Saver
    names = _root_names(f, MAX_DATASETS + 1)
    values: dict = {}
    first_name_of: dict = {}
    warnings: list = []
    for raw in names:
        if len(raw) > MAX_NAME_BYTES:
            warnings.append(f"a dataset name of {len(raw):,} bytes (more than {MAX_NAME_BYTES:,}) was skipped")
            continue
        name = raw.decode("utf-8", "surrogateescape")
        key = unquote(name, errors="surrogateescape")
        if key in values:
            warnings.append(f"datasets {name!r} and another both unquote to {key!r}: the later one was skipped")
            continue
        d, problem = legacy._get(name)
        if d is None:
            values[key] = UnreadableLeaf(key, problem or f"{name!r} is not a dataset")
            continue
        where = _object_address(d)
        if where in first_name_of:
            values[key] = Link(first_name_of[where])
            continue
        first_name_of[where] = key
        values[key] = _leaf(legacy, key, name, d, file_size)
    legacy.warnings.extend(warnings)
    leaves, links = resolve_links(values)
    root = Container("dict", list(leaves), list(leaves.values()))
    return ReadResult(root, leaves, links, legacy.warnings)


def _leaf(legacy: LegacyReader, key: str, name: str, d: h5py.Dataset, file_size: int):
    h5type = _h5type(d.id)
    if h5type not in H5SAVER_TYPES:
        shown = "no __H5_TYPE__ attribute" if h5type is None else f"__H5_TYPE__ {h5type!r}"
        return UnreadableLeaf(key, f"dataset {name!r} has {shown}, not one of H5Saver's")
    leaf = legacy._leaf(key, name, d, set())
    if isinstance(leaf, TensorLeaf):
        try:
            dataset_info(d, name)
        except H5Refused as e:
            return UnreadableLeaf(key, e.problem)
        t = leaf.tensor
        why = _storage_problem(d, name, t.nbytes, file_size)
        if why:
            return UnreadableLeaf(key, why, shape=tuple(t.shape), dtype=t.dtype.name)
    return leaf
