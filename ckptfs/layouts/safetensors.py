"""The safetensors file layout: exact bytes of ``safetensors.torch.save_file`` for virtual tensors.

File = ``[u64 LE header length N][N bytes JSON header, space-padded to a multiple of 8][data]``.
As the reference writer (safetensors 0.8) does, tensors are ordered by dtype size descending (the
library's dtype enum order, see ``DTYPE_ORDER``) then by name, their data laid out contiguously in
that order; the header holds ``__metadata__`` first (when given) and then the tensors in data order,
with compact JSON separators and non-ASCII characters written raw.

The size and the header come from metadata alone. The file is planned as two pieces (``ckptfs.layouts.pieces``):
the header, then the data section as one ``TensorRun``; a read touches only the tensors overlapping it, through
the mount's block cache. Per tensor the layout keeps its name and tensor (two list slots) and its end offset
(8 bytes of one array); the header is kept packed when large (``pieces.packed``: ~100 bytes of JSON per tensor).
"""
from __future__ import annotations

import json
import struct
from array import array
from dataclasses import dataclass
from typing import Sequence

from ..tensor.cache import BlockCache
from ..errors import CkptfsError
from ..tensor.base import VirtualTensor
from .pieces import Literal, PiecedFile, TensorRun, packed

#: safetensors 0.8 dtype codes, ascending: the writer sorts tensors by this rank, descending
DTYPE_ORDER = ("BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
               "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64",
               "F64", "I64", "U64")
_RANK = {code: i for i, code in enumerate(DTYPE_ORDER)}

#: what transformers / ``save_pretrained`` put in ``__metadata__``
PT_METADATA = {"format": "pt"}

_ALIGN = 8


@dataclass(frozen=True, slots=True)
class SafetensorsEntry:
    """One tensor of the file: ``begin``/``end`` are its ``data_offsets`` (relative to the data section).

    Made on demand (``SafetensorsLayout.entries``); the layout itself keeps lists and offsets."""

    name: str
    tensor: VirtualTensor
    begin: int
    end: int


def safetensors_order(named: Sequence[tuple[str, VirtualTensor]]) -> list[tuple[str, VirtualTensor]]:
    """The writer's data order: dtype rank descending, then name (code-point order = UTF-8 byte order)."""
    for name, t in named:
        if t.dtype.safetensors not in _RANK:
            raise CkptfsError(name, f"dtype {t.dtype.name} cannot be stored in safetensors")
    return sorted(named, key=lambda nt: (-_RANK[nt[1].dtype.safetensors], nt[0]))


def plan_entries(named: Sequence[tuple[str, VirtualTensor]]) -> list[SafetensorsEntry]:
    """Entries in data order with contiguous offsets; duplicate names are refused."""
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"tensor name {dup!r} appears twice in one safetensors file")
    if "__metadata__" in names:
        raise ValueError("a tensor cannot be named '__metadata__' in safetensors")
    out, pos = [], 0
    for name, t in safetensors_order(named):
        out.append(SafetensorsEntry(name, t, pos, pos + t.nbytes))
        pos += t.nbytes
    return out


def header_bytes_for(entries: Sequence[SafetensorsEntry], metadata: dict | None) -> bytes:
    """``u64 length + JSON + space padding`` for entries already in data order."""
    header: dict = {}
    if metadata is not None:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ValueError(f"safetensors metadata must map str to str, got {k!r}: {v!r}")
        header["__metadata__"] = dict(metadata)
    for e in entries:
        header[e.name] = {"dtype": e.tensor.dtype.safetensors, "shape": list(e.tensor.shape),
                          "data_offsets": [e.begin, e.end]}
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % _ALIGN)
    return struct.pack("<Q", len(text)) + text


class SafetensorsLayout(PiecedFile):
    """A virtual ``.safetensors`` file: exact ``size`` and ``read(offset, n)`` from virtual tensors.

    Kept: the names and tensors in data order (lists), the data offsets (one ``array('q')``), the header (packed
    when large)."""

    __slots__ = ("metadata", "_header", "data_start", "_run")

    def __init__(self, tensors: Sequence[tuple[str, VirtualTensor]], metadata: dict | None = PT_METADATA,
                 *, cache: BlockCache | None = None, name: str = "safetensors file"):
        entries = plan_entries(list(tensors))
        self.metadata = dict(metadata) if metadata is not None else None
        header = header_bytes_for(entries, self.metadata)
        self.data_start: int = len(header)
        self._header = packed(header)
        offsets = array("q", [0])
        offsets.extend(e.end for e in entries)
        self._run = TensorRun([e.name for e in entries], [e.tensor for e in entries], offsets,
                              "safetensors data section", name)
        super().__init__([Literal(self._header, "safetensors header"), self._run], name=name, cache=cache)

    @property
    def header_bytes(self) -> bytes:
        """``u64 length + JSON + padding``, the file's first ``data_start`` bytes."""
        return bytes(self._header)

    @property
    def data_size(self) -> int:
        """Bytes of the data section (every tensor's)."""
        return self._run.size

    @property
    def entries(self) -> list[SafetensorsEntry]:
        """The tensors in data order, with their data offsets."""
        run = self._run
        off = run.offsets
        return [SafetensorsEntry(n, t, off[i], off[i + 1]) for i, (n, t) in enumerate(zip(run.names, run.tensors))]

    @property
    def data_offsets(self) -> dict[str, tuple[int, int]]:
        """name → (begin, end) relative to the data section, as in the header."""
        return {e.name: (e.begin, e.end) for e in self.entries}
