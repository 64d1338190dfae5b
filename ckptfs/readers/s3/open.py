"""Opening a checkpoint in S3: what an ``s3://bucket/key`` location is, and its catalog.

``classify`` (``target.py``) tells the three things a location can be apart by what is there, at the cost of one
HEAD and one listing at most:

* an **object** (``HEAD`` finds it): an HDF5 ``.mdl`` stored whole (a local run copied into a bucket). h5py reads
  it through ``RangedFile`` — its metadata by range, a few blocks — and its tensors are served by ``BlobH5Store``;
  the object is never fetched whole;
* a **checkpoint in Cerebras' S3 layout**: a prefix holding ``__METADATA__`` (``s3layout``);
* a **run** (a model_dir): a prefix holding ``checkpoint_<step>.mdl`` objects or prefixes.

Every read names the ETag the object had when it was listed, so a checkpoint replaced during a mount fails the reads
that need it (``SourceChangedError``) rather than mixing versions. A checkpoint in S3 never refers to anything
outside itself: external references are refused (``NoExternalFiles``).
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import h5py
from h5py import h5l

from ...errors import CheckpointError, CkptfsError, StorageError, TensorReadError
from ...storage.rangedfile import RangedFile
from ...storage.s3client import client_for
from ...storage.s3object import PartPool, S3Object
from ...storage.s3url import S3Location
from ...catalog.model import Checkpoint
from ...guard.confine import RefusedReference
from ..cerebras.h5store import CHUNK_CACHE_BYTES, CHUNK_CACHE_SLOTS, MAX_OPEN_DATASETS, H5Store, what_blob_is
from ..cerebras import h5meta
from ..cerebras.catalog import read_hdf5_catalog
from ..legacy_torch.reader import HEAD_BYTES, is_legacy_torch, open_legacy_torch_blob
from ..run.scan import RunScanner
from .index_ahead import IndexAhead
from .layout import open_layout
from .target import LAYOUT, OBJECT, RUN, S3Target, as_location, classify  # noqa: F401 - also this module's names

from ckptfs.readers.cerebras.h5errors import open_problem

log = logging.getLogger(__name__)

#: object headers fetched ahead when the catalog is read (the root group's links, in its order): 8 KiB each, half of
#: what the ranged file keeps (``KEEP_BYTES``); a checkpoint of more keys has the rest read as HDF5 asks
MAX_HEADERS_AHEAD = 1024
#: bytes of chunk index nodes fetched ahead for one object in all (about 3,000 nodes of a 2-d tensor)
INDEX_AHEAD_BYTES = 8 << 20


def open_s3_checkpoint(path, *, allow_partial: bool = False, parts: PartPool | None = None) -> Checkpoint:
    """The catalog of the checkpoint at an ``s3://`` location (a run means its latest checkpoint); ``path`` may be
    the ``S3Target`` a classification already found (nothing is listed again). Its objects read through ``parts``,
    the pool of the tree opening it; without one, through a pool of the checkpoint's own (default budget), closed
    with it."""
    own = parts is None
    parts = PartPool() if own else parts
    try:
        ckpt = _open(path, allow_partial, parts)
    except BaseException:
        if own:
            parts.close()
        raise
    if own:
        ckpt._closers.append(parts.close)
    return ckpt


def _open(path, allow_partial: bool, parts: PartPool) -> Checkpoint:
    target = path if isinstance(path, S3Target) else classify(path)
    if target.kind == RUN:
        listing = RunScanner(target.location).scan()
        if listing.latest is None:
            raise CheckpointError(target.location, f"a run with no complete checkpoint ({listing.latest_reason})")
        target = classify(listing.latest.path)
    client = client_for(target.location.settings)
    if target.kind == LAYOUT:
        return open_layout(client, target.location, target.objects, allow_partial=allow_partial, parts=parts)
    blob = S3Object(client, target.location.bucket, target.location.key, target.info.size, target.info.etag,
                    target.info.mtime_ns, pool=parts)
    try:
        legacy = is_legacy_torch(blob.read(0, HEAD_BYTES))
    except StorageError as e:
        raise CheckpointError(e.path, e.problem) from None
    if legacy:  # a legacy-mode checkpoint: a torch.save zip of the state
        return open_legacy_torch_blob(target.location, blob)
    return open_hdf5_object(target.location, blob, allow_partial=allow_partial)


def open_hdf5_object(location: S3Location, blob: S3Object, *, allow_partial: bool = False) -> Checkpoint:
    """The catalog of an HDF5 checkpoint stored as one object, read by ranges."""
    store = BlobH5Store(location, blob)
    try:
        why = what_blob_is(blob)
        if why:
            raise CheckpointError(location, why)
        f = store.file("the checkpoint")
    except StorageError as e:
        store.close()
        raise CheckpointError(e.path, e.problem) from None
    except TensorReadError as e:
        store.close()
        raise CheckpointError(location, e.problem.removeprefix("the checkpoint: ")) from None
    except CheckpointError:
        store.close()
        raise
    ckpt = read_hdf5_catalog(location, f, store, NoExternalFiles(location), allow_partial=allow_partial)
    ckpt.version, ckpt.mtime_ns = f"{blob.size}:{blob.etag}", blob.mtime_ns
    ckpt._warmers.append(lambda stopped: _index_datasets(ckpt, store, stopped))
    return ckpt


def _index_datasets(ckpt: Checkpoint, store: "BlobH5Store", stopped) -> None:
    """A mount's background work: read the chunk index of every dataset of the object (``MAX_OPEN_DATASETS`` at
    most), their nodes fetched ahead together, so that a loader's first open or a copy finds them read — over HTTP
    they are a few hundred round trips that a reader would otherwise wait for (docs/measurements.md, "S3: an .mdl
    object's metadata"). Stops when the tree closes."""
    store.will_index()
    seen: set = set()
    for leaf in ckpt.tensors().values():
        t = leaf.tensor
        if stopped.is_set() or len(seen) >= MAX_OPEN_DATASETS:
            return
        if getattr(t, "store", None) is store and id(t) not in seen:
            seen.add(id(t))
            t.read_index()


class BlobH5Store(H5Store):
    """The HDF5 file of one object (``blob``), opened by h5py through a ``RangedFile``. Its version is the object's
    ETag, which every read names: nothing to compare afterwards (``verify`` has nothing to do)."""

    def __init__(self, location: S3Location, blob: S3Object):
        # not H5Store.__init__: it resolves local paths
        self.path = self.checkpoint_path = self.watch_path = location
        self.referenced_as = None
        self.identity = blob.version
        self.confinement = None
        self.blob = blob
        self.ranged = RangedFile(blob)  # kept across handles: its blocks stay warm
        self._file = None
        self._lock = threading.Lock()
        self._closed = False
        self._open = OrderedDict()
        self._open_lock = threading.Lock()
        self._chunks_checked: bool | None = None  # whether chunk addresses are offsets in the object (chunk_file)
        self._index: IndexAhead | None = None  # the chunk indexes to fetch ahead, once the headers are read

    def _open_file(self, what: str) -> h5py.File:
        self.ranged.seek(0)
        try:
            return h5py.File(self.ranged, "r", rdcc_nslots=CHUNK_CACHE_SLOTS, rdcc_nbytes=CHUNK_CACHE_BYTES)
        except (OSError, ValueError) as e:
            raise TensorReadError(self.checkpoint_path, f"{what}: {open_problem(e, 'object')}") from None

    def will_read_headers(self, f: h5py.File) -> None:
        """Fetch the headers of the objects the root group links to (``MAX_HEADERS_AHEAD`` at most), all together,
        and keep them for HDF5: the catalog opens every dataset, one round trip each otherwise. The chunk indexes
        their layout messages name are then fetched ahead as readers need them (``will_index``). Best effort: HDF5
        reads what this did not fetch."""
        head = bytearray(64)
        sizes = h5meta.superblock_sizes(bytes(head[:self.ranged.read_at(0, memoryview(head))]))
        if sizes is None:
            return
        links: list = []

        def take(name, info):
            if info.type == h5l.TYPE_HARD:
                links.append((name.decode("utf-8", "surrogateescape"), int(info.u)))
            return True if len(links) >= MAX_HEADERS_AHEAD else None

        try:
            f.id.links.iterate(take, info=True)
            layouts = h5meta.header_spans([at for _, at in links], self.ranged.keep, sizes, self.blob.size)
        except (CkptfsError, OSError, RuntimeError, ValueError, KeyError) as e:  # HDF5's, the endpoint's
            log.debug("fetching the object headers of %s ahead failed: %s", self.blob.name, e)
            return
        roots = {name: root for name, root in
                 ((name, h5meta.chunk_index_root(layouts.get(at) or b"", sizes)) for name, at in links) if root}

        def walk(batch: list, most_bytes: int) -> int:
            spent = 0

            def fetch(spans):
                nonlocal spent
                spent += sum(b - a for a, b in spans)
                return self.ranged.keep(spans)
            h5meta.chunk_index_spans(batch, fetch, sizes, self.blob.size, most_bytes)
            return spent
        self._index = IndexAhead(roots, walk, INDEX_AHEAD_BYTES, self.blob.name)

    def will_index(self, name: str | None = None) -> None:
        """Return once the chunk index of dataset ``name`` (None: of every dataset whose header ``will_read_headers``
        read) was fetched ahead, level by level, many nodes at once, the datasets readers wait for first
        (``IndexAhead``): a stream or a loader indexes the datasets one after another, one round trip per node
        otherwise. Best effort."""
        index = self._index
        if index is not None:
            index.need(None if name is None else name.lstrip("/"))

    def chunk_file(self, dset, coords: tuple, offset: int, size: int):
        """The object itself: its stored chunks are fetched with the blob's concurrent ranged reads (``read_spans``),
        like a local file's, once one chunk read both ways (through HDF5 and by range) shows that HDF5's chunk
        addresses are offsets in the object."""
        checked = self._chunks_checked
        if checked is None:
            with self._lock:
                if self._chunks_checked is None:
                    try:
                        _, want = dset.id.read_direct_chunk(coords)
                        self._chunks_checked = self.blob.read(offset, size) == bytes(want)
                    except (OSError, ValueError, RuntimeError, TypeError, KeyError):
                        self._chunks_checked = False
                checked = self._chunks_checked
        return self.blob if checked else None

    def verify(self, what: str) -> None:
        """Nothing to do: every ranged read of the object names its ETag (``If-Match``)."""

    def _open_identity(self):
        return self.identity


class NoExternalFiles:
    """The files a checkpoint in S3 may refer to: none (every reference is refused with a reason)."""

    def __init__(self, location: S3Location):
        self.checkpoint_path = location
        self.confinement = None

    def _refuse(self, ref: str):
        raise RefusedReference(f"reference {ref!r} not followed: a checkpoint in S3 is read from its own objects only")

    def resolve(self, ref: str):
        self._refuse(ref)

    def h5(self, ref: str):
        self._refuse(ref)

    def identity(self, path):
        return None

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass
