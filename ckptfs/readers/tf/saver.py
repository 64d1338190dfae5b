"""Opening a TensorFlow saver checkpoint (TF1 name-based or TF2 object-based, sharded or not) without TensorFlow:
``open_tf_saver(index_path) -> Checkpoint``, a flat state keyed by the variables' names.

The ``.index`` file is read whole (at most ``MAX_INDEX_BYTES``) and parsed by the tensor-bundle codec
(``ckptfs.tfbundle.parse_index``: every varint, count, offset, block and checksum checked). Each data shard
``<prefix>.data-0000i-of-0000N`` must be a regular file inside the checkpoint's folder (symbolic links resolved);
a missing or refused one is a one-line error. Each numeric entry becomes a ``TfBundleTensor`` over its byte
range (``tf_tensor``: CRC-checked, read through ``ckptfs.storage``), a variable saved as slices (TF splits one
across shards) a ``TfSlicedTensor`` over its slices' ranges; an entry whose range does not lie inside its shard,
slices that do not tile their variable, and string tensors (TF2's ``_CHECKPOINTABLE_OBJECT_GRAPH`` among
them) are unreadable leaves saying why. No tensor data is read here.
"""
from __future__ import annotations

import math
import os
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from ckptfs import dtypes
from ckptfs.errors import CheckpointError
from ckptfs.catalog.model import TF_SAVER, Checkpoint, Container, TensorLeaf, UnreadableLeaf
from ckptfs.guard.confine import Confinement, RefusedReference, open_regular_file
from ckptfs.readers.tf.locate import prefix_of
from ckptfs.readers.tf.tensor import TfBundleTensor, TfShard, TfSlicedTensor, tiling_problem
from ckptfs.catalog.validate import shape_problem
from ckptfs.tfbundle import BundleFormatError, data_file_name, encode_slice_key, parse_index

@dataclass(eq=False)
class TfFiles:
    """The checkpoint's own files, to serve as they are: the ``.index`` (``index``: a ``TfShard`` over it, so its
    reads are checked against the version parsed), and for each data shard its tensors' byte ranges
    (``regions[i]``: ``(offset, size, TfBundleTensor or None)`` sorted by offset; None: bytes with no numeric tensor,
    a string tensor's, served raw)."""

    prefix: str  # the prefix's file name (``model.ckpt-100``)
    index: TfShard
    shards: list
    regions: list


#: the largest ``.index`` read (100,000 variables take about 10 MB)
MAX_INDEX_BYTES = 1 << 30


def _read_index(index: Path) -> tuple:
    """``(bytes, FileIdentity)`` of the ``.index`` file, read as a regular file of at most ``MAX_INDEX_BYTES``."""
    try:
        blob = open_regular_file(index)
    except RefusedReference as e:
        raise CheckpointError(index, e.problem) from None
    except OSError as e:
        raise CheckpointError(index, f"cannot open ({e.strerror or e})") from None
    with closing(blob):
        if blob.size > MAX_INDEX_BYTES:
            raise CheckpointError(index, f"TensorFlow index of {blob.size:,} bytes, more than {MAX_INDEX_BYTES:,}")
        try:
            return blob.read(0, blob.size), blob.version  # OSError when it shrank while read
        except OSError as e:
            raise CheckpointError(index, f"cannot read ({e.strerror or e})") from None


def _shards(index: Path, num_shards: int, confinement: Confinement) -> list:
    """The ``TfShard`` of each data file, each a regular file inside the checkpoint's folder."""
    prefix = prefix_of(index)
    shards = []
    for i in range(num_shards):
        path = Path(data_file_name(str(prefix), i, num_shards))
        if not os.path.lexists(path):
            raise CheckpointError(index, f"data shard {i} of {num_shards} ({path.name}) is missing")
        try:
            real = confinement.resolve(path.name)  # a sibling of the .index, in its folder
            with closing(open_regular_file(real)) as blob:
                ident = blob.version
        except RefusedReference as e:
            raise CheckpointError(index, f"data shard {path.name}: {e.problem}") from None
        except OSError as e:
            raise CheckpointError(index, f"data shard {path.name} cannot be opened ({e.strerror or e})") from None
        shards.append(TfShard(Path(real), ident, index, confinement))
    return shards


#: slices a variable may be saved as (TF splits one per shard it crosses)
MAX_SLICES = 1024


def _sliced(name: str, e, dt, shape: tuple, shards: list, by_key: dict):
    """The leaf of a variable saved as slices: each slice's entry found by its key (``encode_slice_key``)."""
    if len(e.slices) > MAX_SLICES:
        return UnreadableLeaf(name, f"saved as {len(e.slices):,} slices, more than {MAX_SLICES:,}", shape=shape,
                              dtype=dt.name)
    parts = []
    for extents in e.slices:
        if len(extents) != len(shape):
            return UnreadableLeaf(name, f"a slice of rank {len(extents)} of a rank-{len(shape)} tensor", shape=shape,
                                  dtype=dt.name)
        box = tuple((0, n) if length is None or length < 0 else (start, start + length)
                    for (start, length), n in zip(extents, shape))
        se = by_key.get(encode_slice_key(name, extents))
        if se is None:
            return UnreadableLeaf(name, f"slice {list(box)} has no entry in the index", shape=shape, dtype=dt.name)
        sub = tuple(hi - lo for lo, hi in box)
        leaf = _whole(f"{name}[{', '.join(f'{lo}:{hi}' for lo, hi in box)}]", se, dt, sub, shards)
        if isinstance(leaf, UnreadableLeaf):
            return UnreadableLeaf(name, leaf.reason, shape=shape, dtype=dt.name)
        if tuple(se.dims) != sub:
            return UnreadableLeaf(name, f"slice {list(box)} is stored as shape {list(se.dims)}", shape=shape,
                                  dtype=dt.name)
        parts.append((box, leaf.tensor))
    why = tiling_problem(shape, [b for b, _ in parts])
    if why:
        return UnreadableLeaf(name, f"saved slices: {why}", shape=shape, dtype=dt.name)
    return TensorLeaf(name, TfSlicedTensor(shape, dt, name, parts), numpy=dt.npy_native)


def _whole(name: str, e, dt, shape: tuple, shards: list):
    """The leaf of an entry holding a whole tensor (or one slice) in one byte range of its shard."""
    if e.size != math.prod(shape) * dt.itemsize:
        return UnreadableLeaf(name, f"its entry holds {e.size} bytes, shape {list(shape)} {dt.name} needs "
                                    f"{math.prod(shape) * dt.itemsize}", shape=shape, dtype=dt.name)
    shard = shards[e.shard_id]
    end = e.offset + e.size
    if end > shard.identity.size:
        return UnreadableLeaf(name, f"its bytes [{e.offset}, {end}) lie beyond the end of {shard.path.name} "
                                    f"({shard.identity.size} bytes): the data file is truncated or the index lies",
                              shape=shape, dtype=dt.name)
    return TensorLeaf(name, TfBundleTensor(shard, e.offset, shape, dt, name, e.crc32c), numpy=dt.npy_native)


def _leaf(name: str, e, shards: list, by_key: dict):
    """The leaf of index entry ``e`` (a ``tfbundle.BundleEntry``)."""
    shape = tuple(int(n) for n in e.dims)
    dt_name = e.dtype_name
    if dt_name == "string":
        return UnreadableLeaf(name, f"string tensor ({e.size:,} bytes in the data file): no numeric representation",
                              shape=shape, dtype="string")
    try:
        dt = dtypes.by_name(dt_name)
    except KeyError:
        return UnreadableLeaf(name, f"element type {dt_name}: not read", shape=shape, dtype=dt_name)
    why = shape_problem(shape, dt.itemsize)
    if why:
        return UnreadableLeaf(name, f"bad tensor: {why}", dtype=dt.name)
    if e.slices:
        return _sliced(name, e, dt, shape, shards, by_key)
    return _whole(name, e, dt, shape, shards)


def _regions(bundle, leaves: dict, shards: list) -> list:
    """Per shard, the byte ranges of its entries (``TfFiles.regions``): a numeric tensor's (or slice's) with its
    tensor, any other entry's raw; ranges beyond the shard's end or overlapping another are left raw."""
    tensors: dict = {}  # (shard, offset, size) -> TfBundleTensor
    for leaf in leaves.values():
        if isinstance(leaf, TensorLeaf):
            t = leaf.tensor
            for part in ([p for _, p in t.parts] if isinstance(t, TfSlicedTensor) else [t]):
                tensors[(id(part.shard), part.offset, part.nbytes)] = part
    out = []
    for i, shard in enumerate(shards):
        spans = sorted((e.offset, e.size) for _, e in bundle.entries if e.shard_id == i and e.size)
        regions, end = [], 0
        for off, size in spans:
            if off < end or off + size > shard.identity.size:
                continue  # raw bytes serve it as the file holds them
            regions.append((off, size, tensors.get((id(shard), off, size))))
            end = off + size
        out.append(regions)
    return out


def open_tf_saver(index) -> Checkpoint:
    """The TF checkpoint whose ``.index`` file is ``index`` (``tf_locate.resolve_tf_index``), as a flat state."""
    index = Path(index)
    data, index_identity = _read_index(index)
    try:
        bundle = parse_index(data, index)
    except BundleFormatError as e:
        raise CheckpointError(index, getattr(e, "problem", None) or str(e)) from None
    del data
    confinement = Confinement.of(index)
    shards = _shards(index, bundle.header.num_shards, confinement)
    leaves: dict = {}
    warnings: list = []
    by_key = dict(bundle.entries)
    for key, e in bundle.entries:
        if key[:1] == b"\0":
            continue  # a slice of a partitioned variable: its full entry says so
        try:
            name = key.decode("utf-8")
        except UnicodeDecodeError:
            warnings.append(f"an index key that is not UTF-8 ({key[:40]!r}…) was skipped")
            continue
        leaves[name] = _leaf(name, e, shards, by_key)
    bad = [k for k, v in leaves.items() if isinstance(v, UnreadableLeaf) and v.dtype != "string"]
    if bad:
        warnings.append(f"{len(bad)} variable(s) cannot be read: " + ", ".join(bad[:5]) + (" …" if len(bad) > 5 else ""))
    root = Container("dict", list(leaves), list(leaves.values()))
    files = TfFiles(prefix_of(index).name, TfShard(index, index_identity, index, confinement), shards,
                    _regions(bundle, leaves, shards))
    ckpt = Checkpoint(path=index, format_version=0.0, release=None, success=True, root=root, leaves=leaves,
                      warnings=warnings, mtime_ns=None, kind=TF_SAVER, source_files=files)
    ckpt._closers.extend(s.close for s in [*shards, files.index])
    return ckpt
