"""A ``torch.save`` zip (``pytorch_model.bin``) read as tensors without unpickling it.

The archive's directory is decoded by ``zipdir``, its ``data.pkl`` by ``safepickle.loads_torch`` (nothing runs;
only what a state dict of tensors needs is accepted). Each tensor becomes a byte range of the stored member
``<archive>/data/<key>`` of its storage: a ``BlobRegionTensor``, C-order when its view is C-contiguous (every
tensor ``save_pretrained`` writes), strided otherwise. Every member must be stored uncompressed (torch
never compresses), lie inside the file, hold exactly its storage's bytes, and every view must fit in its storage.
The legacy (before torch 1.6) non-zip format is refused in one line.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ...guard.confine import Confinement
from ...guard.safepickle import PickleRefused, TorchStorage, TorchTensor, loads_torch, tensor_extent, torch_storage
from ...tensor.regions import BlobRegionTensor, RegionFile
from . import zipdir

#: the largest ``data.pkl`` read (a 100,000-tensor state dict pickles to ~10 MB)
MAX_PICKLE_BYTES = 256 << 20


class TorchZipError(ValueError):
    """A ``.bin`` that is not a state dict of tensors in torch's zip format; one line."""


@dataclass
class TorchZipTensors:
    tensors: dict  # name -> VirtualTensor, in the pickle's order
    notes: list = field(default_factory=list)


def contiguous(shape: tuple, stride: tuple) -> bool:
    """Whether a view of ``shape``/``stride`` is C-contiguous (dimensions of size 1 may have any stride)."""
    if math.prod(shape) == 0:
        return True
    expected = 1
    for n, s in zip(reversed(shape), reversed(stride)):
        if n != 1:
            if s != expected:
                return False
            expected *= n
    return True


@dataclass(frozen=True)
class Member:
    """A stored member of the archive: where its data starts in the file, and its size."""

    offset: int
    size: int


class _Archive:
    """The directory and members of one opened torch zip, read through ``read(offset, n) -> bytes`` (fewer bytes
    only at the end of the file) from a file of ``size`` bytes."""

    def __init__(self, read, size: int):
        self.read, self.size = read, size
        tail = read(size - min(zipdir.TAIL_SIZE, size), min(zipdir.TAIL_SIZE, size))
        loc = zipdir.locate_directory(tail, size)
        self.entries = {e.name: e for e in zipdir.parse_directory(read(loc.offset, loc.size), loc, size)}
        self.directory_offset = loc.offset
        pkls = [n for n in self.entries if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise TorchZipError("not a torch.save archive (no single <name>/data.pkl member)" if not pkls else
                                f"{len(pkls)} data.pkl members")
        self.prefix = pkls[0][:-len("data.pkl")]
        self._members: dict = {}

    def member(self, name: str) -> Member | None:
        m = self._members.get(name)
        if m is not None:
            return m
        e = self.entries.get(name)
        if e is None:
            return None
        if e.flags & 1:
            raise TorchZipError(f"member {name} is encrypted")
        if e.method != 0 or e.compressed_size != e.size:
            raise TorchZipError(f"member {name} is compressed (method {e.method}); torch stores members uncompressed")
        head = self.read(e.header_offset, zipdir.LOCAL_SIZE + len(e.name.encode("utf-8")))
        start = zipdir.local_data_offset(head, e)
        if start + e.size > self.directory_offset:
            raise TorchZipError(f"member {name}: its {e.size} bytes at {start} run into the central directory")
        m = self._members[name] = Member(start, e.size)
        return m

    def read_member(self, name: str, limit: int) -> bytes | None:
        m = self.member(name)
        if m is None:
            return None
        if m.size > limit:
            raise TorchZipError(f"member {name} of {m.size} bytes exceeds the {limit}-byte limit")
        raw = self.read(m.offset, m.size)
        if len(raw) != m.size:
            raise TorchZipError(f"member {name} is truncated")
        return raw


def _storage_bytes(s: TorchStorage) -> int:
    return s.numel * (s.dtype.itemsize if s.dtype is not None else 1)


def read_archive(read, size: int, *, max_pickle: int = MAX_PICKLE_BYTES) -> tuple:
    """The decoded ``data.pkl`` of the ``torch.save`` zip of ``size`` bytes that ``read(offset, n)`` reads, and
    ``{storage key: (TorchStorage, Member)}`` of every storage it names (each a stored member holding exactly the
    storage's bytes). ``TorchZipError`` / ``PickleRefused`` with one line otherwise; nothing runs."""
    head = read(0, 4)
    if head[:1] == b"\x80":  # a bare pickle (protocol 2+): the magic number of the legacy format
        raise TorchZipError("torch's legacy (before 1.6) serialization, which ckptfs does not read; "
                            "use the model's safetensors files, or re-save it with a recent torch")
    if head != b"PK\x03\x04":
        raise TorchZipError("not a torch.save zip archive")
    try:
        arch = _Archive(read, size)
        order = arch.read_member(arch.prefix + "byteorder", 64)
        if order is not None and order != b"little":
            raise TorchZipError(f"byte order {order[:16]!r}; only little-endian archives are read")
        pkl = arch.read_member(arch.prefix + "data.pkl", max_pickle)
        if pkl is None:
            raise TorchZipError(f"member {arch.prefix}data.pkl is missing")
        storages: dict = {}

        def load_storage(pid):
            s = torch_storage(pid)
            if s.key in storages:
                have = storages[s.key][0]
                if (have.dtype, have.numel) != (s.dtype, s.numel):
                    raise PickleRefused(f"storage {s.key} is described twice, differently")
                return have
            try:
                member = arch.member(f"{arch.prefix}data/{s.key}")
            except (TorchZipError, zipdir.ZipFormatError) as e:
                raise PickleRefused(str(e)) from None
            if member is None:
                raise PickleRefused(f"storage {s.key} has no member data/{s.key}")
            if member.size != _storage_bytes(s):
                raise PickleRefused(f"storage {s.key}: member holds {member.size} bytes, the pickle says "
                                    f"{_storage_bytes(s)}")
            storages[s.key] = (s, member)
            return s

        state = loads_torch(pkl, load_storage)
    except zipdir.ZipFormatError as e:
        raise TorchZipError(str(e)) from None
    return state, storages


def check_view(d: TorchTensor, member: Member, key: str) -> None:
    """``TorchZipError`` when the tensor ``d`` does not fit its storage's stored ``member`` (dtype or extent)."""
    item = d.dtype.itemsize
    if d.storage.dtype is not None and d.storage.dtype.itemsize != item:
        raise TorchZipError(f"tensor {key}: dtype {d.dtype.name} does not match its storage")
    extent = tensor_extent(d)
    if extent * item > member.size:
        raise TorchZipError(f"tensor {key}: shape {list(d.shape)} stride {list(d.stride)} offset {d.offset} reaches "
                            f"{extent * item} bytes of a {member.size}-byte storage")


def read_torch_zip(real: Path, *, key_prefix: str = "", root: Path, confinement: Confinement | None,
                   what: str = "pytorch .bin") -> TorchZipTensors:
    """The tensors of the ``torch.save`` zip at ``real`` (a confined, resolved path): ``{name: VirtualTensor}``
    reading the file by byte range on demand (nothing read beyond the directory and ``data.pkl`` here).
    ``TorchZipError`` / ``PickleRefused`` / ``OSError`` with one line otherwise."""
    file = RegionFile(real, confinement)  # opened once, kept for the archive's tensors
    blob = file.blob()
    try:
        identity = blob.version
        state, storages = read_archive(blob.read, blob.size)
    except BaseException:
        file.close()
        raise
    if not isinstance(state, dict):
        raise TorchZipError(f"holds a {type(state).__name__}, not a state dict")
    out = TorchZipTensors({})
    for name, desc in state.items():
        if not isinstance(name, str):
            raise TorchZipError(f"state dict key {name!r} is not a string")
        if not isinstance(desc, TorchTensor):
            out.notes.append(f"{real.name}: entry {name!r} is a {type(desc).__name__}, not a tensor: left out")
            continue
        out.tensors[name] = _tensor(desc, storages[desc.storage.key][1], f"{key_prefix}{name}", root, identity, what,
                                    file)
    return out


def _tensor(d: TorchTensor, member: Member, key: str, root: Path, identity, what: str, file: RegionFile):
    check_view(d, member, key)
    item = d.dtype.itemsize
    stride = None if contiguous(d.shape, d.stride) else d.stride
    return BlobRegionTensor(file, member.offset + d.offset * item, d.shape, d.dtype, key, root, stride=stride,
                            what=what, identity=identity)
