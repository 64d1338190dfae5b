"""A legacy-mode Cerebras checkpoint: the state ``torch.save`` wrote (``{"model": …, "optimizer": …, …}`` in Model
Zoo's names; files often called ``.mdl`` or ``.pt``) opened as the same ``Checkpoint`` catalog an HDF5 ``.mdl`` of
that state gives, so that every view, ``info``, ``diff`` and ``export`` serve it alike.

Nothing is unpickled: ``torch_bin.read_archive`` decodes the zip's directory (``zipdir``) and its ``data.pkl``
(``safepickle.loads_torch``: dicts, OrderedDicts, lists, tuples, scalars and tensors; any other global is refused
in one line naming it), every storage a stored (uncompressed) member holding exactly its bytes. Each tensor is a
``BlobRegionTensor``: byte ranges of its member, read through the storage layer when a view needs them (a local
file: ``storage.local.LocalFile``, ``open_legacy_torch``; an object in S3: ``S3Object``, ``open_legacy_torch_blob``). Leaves are named as cstorch names them (``model.<name>``, ``optimizer.state.0.exp_avg``); a
tensor the pickle names twice (the same object, e.g. tied weights) is one leaf under both keys, as HDF5 links are.

The format before torch 1.6 (a bare pickle stream, or a tar archive) is refused in one line saying what would
work. ``is_legacy_torch`` tells such a file from its first bytes.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

from ...dtypes import DType
from ...errors import CheckpointError, StorageError
from ...storage.base import Blob
from ...storage.local import LocalFile
from ...catalog.model import Checkpoint, Container, TensorLeaf, UnreadableLeaf, ValueLeaf
from ...tensor.regions import BlobRegionTensor
from ...guard.confine import non_regular_kind
from ..cerebras.catalog import metadata_release
from ..cerebras.format_v05 import check_collisions
from ...guard.safepickle import PickleRefused, StorageType, TorchStorage, TorchTensor
from ..hf.torch_bin import TorchZipError, check_view, contiguous, read_archive
from ..hf.zipdir import ZipFormatError

#: bytes ``is_legacy_torch`` looks at (a tar header is 512 bytes; its magic is at 257)
HEAD_BYTES = 512
ZIP_MAGIC = b"PK\x03\x04"
#: what torch < 1.6 wrote first: ``pickle.dump(MAGIC_NUMBER, f, protocol=2)`` (0x1950a86a20f9469cfc6c as LONG1)
LEGACY_PICKLE_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
#: leaves a torch state may hold (a 100,000-tensor model with its optimizer state has ~400,000)
MAX_LEAVES = 4_000_000
#: what the format is called in messages, README.txt and ``info``
FORMAT_NAME = "torch.save zip (legacy mode)"

_PRE_16 = ("torch's serialization from before torch 1.6 ({what}), which ckptfs does not read; re-save it with "
           "torch>=1.6 (torch.save(torch.load(path), new_path), which writes the zip format), or load it with "
           "cstorch.load and save it with cstorch.save")


def is_legacy_torch(head: bytes) -> bool:
    """Whether a file starting with ``head`` (its first ``HEAD_BYTES`` bytes, fewer for a smaller file) is a
    ``torch.save`` file: the zip format (torch >= 1.6), or the pickle-stream and tar formats before it (which
    ``open_legacy_torch`` refuses with a reason)."""
    return (head.startswith(ZIP_MAGIC) or head.startswith(LEGACY_PICKLE_MAGIC)
            or (len(head) >= 262 and head[257:262] == b"ustar"))


def open_legacy_torch(path) -> Checkpoint:
    """The catalog of the ``torch.save`` checkpoint at ``path`` (nothing of its tensors read); ``CheckpointError``
    with one line for anything that is not a state of tensors, containers and scalars in torch's zip format."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as e:
        raise CheckpointError(path, f"cannot stat the checkpoint ({e.strerror or e})") from None
    kind = non_regular_kind(st)
    if kind is not None:  # refused before any open: opening a FIFO would block
        raise CheckpointError(path, f"is {kind}, not a regular file")
    try:  # its real path: what every read checks the file against (a relative path would not survive a chdir)
        blob = LocalFile(os.path.realpath(path))
    except OSError as e:
        raise CheckpointError(path, f"cannot open the checkpoint ({e.strerror or e})") from None
    try:
        ckpt = _catalog(path, blob)
    except BaseException:
        blob.close()
        raise
    ckpt._closers.append(blob.close)
    return ckpt


def open_legacy_torch_blob(location, blob: Blob) -> Checkpoint:
    """The catalog of a ``torch.save`` checkpoint stored as one object (``blob``, an ``S3Object`` at ``location``),
    read by ranges; every read names the object's ETag, so a replaced object fails the reads that need it."""
    ckpt = _catalog(location, blob, verify=False)
    ckpt.version, ckpt.mtime_ns = f"{blob.size}:{blob.version}", getattr(blob, "mtime_ns", None)
    return ckpt


def _catalog(path, blob: Blob, *, verify: bool = True) -> Checkpoint:
    read = blob.read  # fewer bytes only at the end of the blob; OSError when it ends before its size
    head = read(0, HEAD_BYTES)
    if head.startswith(LEGACY_PICKLE_MAGIC):
        raise CheckpointError(path, _PRE_16.format(what="a pickle stream"))
    if not head.startswith(ZIP_MAGIC) and head[257:262] == b"ustar":
        raise CheckpointError(path, _PRE_16.format(what="a tar archive"))
    try:
        state, storages = read_archive(read, blob.size)
    except PickleRefused as e:
        raise CheckpointError(path, f"torch.save zip refused: data.pkl: {e}") from None
    except (TorchZipError, ZipFormatError) as e:
        raise CheckpointError(path, f"torch.save zip refused: {e}") from None
    except StorageError as e:
        raise CheckpointError(e.path, e.problem) from None
    except OSError as e:
        raise CheckpointError(path, f"cannot read the checkpoint ({e.strerror or e})") from None
    if not isinstance(state, (dict, list, tuple)):
        raise CheckpointError(path, f"torch.save zip of a single {_what(state)}, not a state (a dict of its parts)")
    builder = _Builder(path, blob, storages, verify)
    root = builder.node(state, "", ())
    check_collisions(path, builder.keys)
    return Checkpoint(path=path, format_version=None, release=metadata_release(root), success=True, root=root,
                      leaves=builder.leaves, links=builder.links, warnings=[], format_name=FORMAT_NAME)


class _Builder:
    """The decoded state as ``Container`` nodes and leaves named as cstorch names them."""

    def __init__(self, path, blob: Blob, storages: dict, verify: bool):
        self.path, self.blob, self.storages, self.verify = path, blob, storages, verify
        self.leaves: dict = {}
        self.links: dict = {}
        self.keys: list = []  # (flat key, path of real keys), for the collision check
        self._by_object: dict = {}  # id(TorchTensor) -> its leaf (the same object under two keys: one leaf)

    def node(self, value, key: str, where: tuple):
        if isinstance(value, dict):
            keys = list(value)
            kind = "OrderedDict" if isinstance(value, OrderedDict) else "dict"
            children = [self.node(value[k], _child(key, str(k)), where + (k,)) for k in keys]
            return Container(kind, keys, children)
        if isinstance(value, (list, tuple)):
            children = [self.node(v, _child(key, str(i)), where + (i,)) for i, v in enumerate(value)]
            return Container("list" if isinstance(value, list) else "tuple", None, children)
        return self.leaf(value, key, where)

    def leaf(self, value, key: str, where: tuple):
        if len(self.leaves) >= MAX_LEAVES:
            raise CheckpointError(self.path, f"more than {MAX_LEAVES} leaves")
        self.keys.append((key, where))
        if isinstance(value, TorchTensor):
            leaf = self._by_object.get(id(value))
            if leaf is not None:
                self.links[key] = leaf.key
            else:
                leaf = self._by_object[id(value)] = self._tensor(value, key)
        elif value is None or isinstance(value, (bool, int, float, str)):
            leaf = ValueLeaf(key, value)
        else:
            leaf = UnreadableLeaf(key, f"a {_what(value)} value, which a Cerebras state does not hold")
        self.leaves[key] = leaf
        return leaf

    def _tensor(self, d: TorchTensor, key: str):
        member = self.storages[d.storage.key][1]
        try:
            check_view(d, member, key)
        except TorchZipError as e:
            raise CheckpointError(self.path, f"torch.save zip refused: {e}") from None
        stride = None if contiguous(d.shape, d.stride) else d.stride
        tensor = BlobRegionTensor(self.blob, member.offset + d.offset * d.dtype.itemsize, d.shape, d.dtype, key,
                                  self.path, stride=stride, what=f"torch.save member data/{d.storage.key}",
                                  verify=self.verify)
        return TensorLeaf(key, tensor)


def _child(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _what(value) -> str:
    if isinstance(value, TorchTensor):
        return "tensor"
    if isinstance(value, DType):
        return f"torch dtype ({value.name})"
    if isinstance(value, (StorageType, TorchStorage)):
        return "bare torch storage"
    return type(value).__name__
