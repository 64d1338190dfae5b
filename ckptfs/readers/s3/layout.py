"""Cerebras' S3 layout (``cstorch.save("s3://bucket/…/checkpoint_<step>.mdl")``, format 0.5): a checkpoint that is a
prefix of objects, read into the same catalog as an HDF5 checkpoint.

* ``<prefix>/__METADATA__``, written last: a pickle of a plain dict holding what an HDF5 checkpoint keeps on its root
  (``__spec__``, ``__version__``, ``__cstorch_version__``, ``__SUCCESS__``) and every key's ``<key>.__metadata__``
  JSON. It is decoded by ``safepickle.loads_plain`` (plain containers and scalars; anything else is refused with one
  line naming the object) — never unpickled.
* ``<prefix>/<name>``: one object per serialized tensor (or pickled object), named as the dataset of an HDF5
  checkpoint would be; its metadata (shape, dtype, ``compressed``, ``data_sizes``, ``boundaries``) is the key's entry
  in ``__METADATA__`` (repeated in the object's own user metadata, checked on first read: ``s3tensor``).

The keys' metadata is interpreted by the format 0.5 reader (``reader_v05``: the spec, nesting, links, scalars); only
where the bytes of a serialized object live differs (``S3LeafFactory``). The catalog costs the listing of the prefix
(one request per 1,000 objects: sizes and ETags) and one GET of ``__METADATA__``; no request per key. An object is
read only if the listing holds it under the prefix, by a name without ``.``/``..`` segments; a reference to a file
(``DeferredSafeTensor``, external objects) is not followed: nothing of a checkpoint makes ckptfs read outside its
bucket and prefix.
"""
from __future__ import annotations

import hashlib

from ... import dtypes
from ...dtypes import BFLOAT16
from ...errors import CheckpointError, StorageError
from ...storage.s3client import ObjectInfo, S3Client
from ...storage.s3object import PartPool, S3Object
from ...storage.s3url import S3Location
from ...catalog.model import Checkpoint, OpaqueLeaf, TensorLeaf, UnreadableLeaf
from ..cerebras.format_v05 import V05Reader
from .object_tensor import S3ObjectTensor, metadata_fingerprint, object_problem
from ...guard.safepickle import Limits, PickleRefused, loads_plain
from ..cerebras.serializers import LeafFactory, tensor_dtype, tensor_shape
from ...catalog.validate import shape_problem
from ckptfs.guard.zstd_bound import ZstdRefused, decompress_bounded
from .target import METADATA

#: largest ``__METADATA__`` read (a 100,000-key checkpoint's is tens of MB)
MAX_METADATA_BYTES = 256 << 20
#: largest pickled object (kept opaque) read at catalog time, stored or decompressed
MAX_OPAQUE_BYTES = 64 << 20
#: pickled objects' bytes one checkpoint's catalog holds in all (optimizer scalars, scheduler states: kilobytes)
MAX_OPAQUE_TOTAL = 256 << 20
#: what ``__METADATA__``'s pickle may make the decoder build: a plain dict of one JSON text per key (a 100,000-key
#: checkpoint's: 200,000 strings and a 20 MB ``__spec__``), nothing deeper or larger
METADATA_LIMITS = Limits(max_bytes=MAX_METADATA_BYTES, max_items=1_000_000, max_container=500_000,
                         max_memo=1_000_000, max_depth=32, max_expanded=1_000_000, max_str_bytes=64 << 20)
_REFERENCES = ("DeferredSafeTensor", "DeferredNumpyArray", "DeferredObject")
_VALUES = ("LinkedObject", "ScalarSerializer", "StringSerializer", "NoneSerializer", "DeferredFullTensor",
           "FullTensor")


def name_problem(name: str) -> str | None:
    """Why an object name taken from ``__METADATA__`` is not read (None: it may be)."""
    if not name or name.startswith("/") or any(ord(c) < 32 for c in name):
        return f"object name {name!r} is not a plain key"
    if any(seg in ("", ".", "..") for seg in name.split("/")):
        return f"object name {name!r} has an empty, '.' or '..' segment"
    return None


class S3LeafFactory(LeafFactory):
    """Leaves whose bytes are objects of the checkpoint's prefix (``objects``: name -> ``ObjectInfo``)."""

    def __init__(self, client: S3Client, location: S3Location, objects: dict, warnings: list,
                 parts: PartPool | None = None):
        super().__init__(None, None, warnings)
        self.client = client
        self.parts = parts  # the pool every tensor object reads its parts through
        self.location = location
        self.objects = objects
        self.opaque_bytes = 0  # pickled objects' bytes held so far (``MAX_OPAQUE_TOTAL``)

    @property
    def checkpoint_path(self):
        return self.location

    def from_metadata(self, key: str, name: str, md: dict, store=None):
        if not isinstance(md, dict):
            return super().from_metadata(key, name, md, store)
        t = md.get("__TYPE__")
        if t in _REFERENCES:
            return UnreadableLeaf(key, f"{t} refers to {str(md.get('path'))!r}, outside the checkpoint: a checkpoint "
                                       "in S3 is read from its own objects only")
        if t in _VALUES or md.get("__RTFX__"):
            return super().from_metadata(key, name, md, store)
        try:
            if md.get("__NUMPY__"):
                return self._tensor(key, name, md, torch=t != "NumpyArraySerializer" and bool(md.get("__TORCH__")))
            if md.get("__BYTES__") or t == "ObjectSerializer":
                return self._opaque(key, name, md)
        except (KeyError, TypeError, ValueError) as e:
            return UnreadableLeaf(key, f"{t or 'object'} metadata is malformed ({' '.join(str(e).split())})")
        return super().from_metadata(key, name, md, store)

    def _object(self, key: str, name: str) -> ObjectInfo | UnreadableLeaf:
        why = name_problem(name)
        if why:
            return UnreadableLeaf(key, f"{why} (not read)")
        info = self.objects.get(name)
        if info is None:
            return UnreadableLeaf(key, f"object {self.location.child_key(name)} is missing from the checkpoint")
        return info

    def _tensor(self, key: str, name: str, md: dict, *, torch: bool):
        if torch:
            shape, dt = tensor_shape(md), tensor_dtype(md)
        else:
            numpy_md = md["__NUMPY__"]
            shape = tuple(int(n) for n in numpy_md["shape"])
            dt = BFLOAT16 if md.get("is_bfloat16") else dtypes.from_numpy(str(numpy_md["dtype"]))
        why = shape_problem(shape, dt.itemsize)
        if why:
            return UnreadableLeaf(key, f"bad tensor metadata: {why}", dtype=dt.name)
        info = self._object(key, name)
        if isinstance(info, UnreadableLeaf):
            info.shape, info.dtype = shape, dt.name
            return info
        why = object_problem(md, shape, dt, info.size)
        if why:
            return UnreadableLeaf(key, f"metadata disagrees with its object: {why}", shape=shape, dtype=dt.name)
        blob = S3Object(self.client, self.location.bucket, self.location.child_key(name), info.size, info.etag,
                        info.mtime_ns, pool=self.parts)
        tensor = S3ObjectTensor(blob, key, self.location, shape, dt, compressed=bool(md.get("compressed")),
                                expected=metadata_fingerprint(md))
        return TensorLeaf(key, tensor, numpy=not torch)

    def _opaque(self, key: str, name: str, md: dict):
        info = self._object(key, name)
        if isinstance(info, UnreadableLeaf):
            return info
        try:
            data = self.client.get(self.location.bucket, self.location.child_key(name), etag=info.etag,
                                   max_bytes=MAX_OPAQUE_BYTES).data
        except StorageError as e:
            return UnreadableLeaf(key, f"pickled object cannot be read ({e.problem})")
        if md.get("compressed"):
            try:
                data = decompress_bounded(data, MAX_OPAQUE_BYTES)
            except ZstdRefused as e:
                return UnreadableLeaf(key, f"pickled object not read: {e}")
        if self.opaque_bytes + len(data) > MAX_OPAQUE_TOTAL:
            return UnreadableLeaf(key, f"pickled object not read: the checkpoint's pickled objects pass "
                                       f"{MAX_OPAQUE_TOTAL} bytes in all")
        self.opaque_bytes += len(data)
        return OpaqueLeaf(key, data)


class S3LayoutReader(V05Reader):
    """The format 0.5 reader over ``__METADATA__``'s entries instead of an HDF5 file's root attributes."""

    def __init__(self, meta: dict, factory: S3LeafFactory, location: S3Location, *, partial: bool):
        super().__init__(None, None, None, location, partial=partial)
        self.meta = meta
        self.factory = factory
        factory.warnings = self.warnings

    def _metadata_texts(self, keys: list):
        for k, _ in keys:
            yield k, self.meta.get(k + ".__metadata__")

    def _salvage(self, k: str):
        return UnreadableLeaf(k, "lost: no metadata for this leaf in __METADATA__")


def decode_metadata(location: S3Location, data: bytes) -> dict:
    """``__METADATA__`` as a dict of plain values; ``CheckpointError`` naming the object for anything else."""
    where = location / METADATA
    try:
        meta = loads_plain(data, limits=METADATA_LIMITS)
    except PickleRefused as e:
        raise CheckpointError(where, f"refused: {e}") from None
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise CheckpointError(where, "is not a dict of named entries (not Cerebras checkpoint metadata)")
    if not isinstance(meta.get("__spec__"), str):
        raise CheckpointError(where, "has no __spec__ text: not a Cerebras checkpoint's metadata")
    return meta


def open_layout(client: S3Client, location: S3Location, objects: dict, *, allow_partial: bool = False,
                parts: PartPool | None = None) -> Checkpoint:
    """The catalog of the checkpoint at prefix ``location`` whose objects (name inside the prefix -> ``ObjectInfo``,
    from one listing) are ``objects``, read through ``parts`` (``open_s3_checkpoint``'s pool; None: each object its
    own)."""
    info = objects.get(METADATA)
    if info is None:
        raise CheckpointError(location, "no __METADATA__ object: the save did not finish (cstorch writes it last) "
                                        "or this prefix is not a checkpoint")
    try:
        data = client.get(location.bucket, location.child_key(METADATA), etag=info.etag,
                          max_bytes=MAX_METADATA_BYTES).data
    except StorageError as e:
        raise CheckpointError(e.path, e.problem) from None
    meta = decode_metadata(location, data)
    version = meta.get("__version__", 0.5)
    if isinstance(version, bool) or not isinstance(version, (int, float)):
        raise CheckpointError(location / METADATA, f"__version__ {version!r} is not a number")
    if version < 0.5:
        raise CheckpointError(location, f"S3 layout of format version {version}: Cerebras writes it only as 0.5")
    success = meta.get("__SUCCESS__") is True
    if not success and not allow_partial:
        raise CheckpointError(location, "partial checkpoint: __METADATA__ has no __SUCCESS__ flag (the save did not "
                                        "finish); use --allow-partial to salvage what was written")
    spec = meta["__spec__"]
    if not spec.lstrip().startswith("["):
        raise CheckpointError(location / METADATA, f"format {version} metadata whose __spec__ is not JSON")
    warnings: list = []
    factory = S3LeafFactory(client, location, objects, warnings, parts)
    result = S3LayoutReader(meta, factory, location, partial=not success).read(spec)
    release = meta.get("__cstorch_version__")
    return Checkpoint(path=location, format_version=float(version),
                      release=release if isinstance(release, str) and release else None, success=success,
                      root=result.root, leaves=result.leaves, links=result.links, warnings=result.warnings,
                      version=objects_version(objects), mtime_ns=info.mtime_ns)


def objects_version(objects: dict) -> str:
    """One digest of every object's name, size and ETag: changes when any object of the checkpoint does."""
    h = hashlib.sha256()
    for name in sorted(objects):
        o = objects[name]
        h.update(f"{name}\0{o.size}\0{o.etag}\n".encode())
    return h.hexdigest()[:32]
