"""Reading the header of a .safetensors file (a Hugging Face model's weights, or one a checkpoint refers to as
DeferredSafeTensor), so each tensor becomes a ``BlobRegionTensor`` over the file's data block. The header is read
through the storage layer (``read_safetensors_header(blob)``); a local file is opened as a regular file only
(``confine.open_regular_file``: never blocks on a FIFO). Every entry is checked: a valid shape whose byte size equals its
data range, inside the file.

The header is untrusted JSON, so it is bounded before it is parsed and parsed in linear time: at most
``MAX_HEADER_BYTES`` (safetensors itself takes up to 100 MB; a genuine header is about 150 bytes a tensor), nested
at most ``MAX_HEADER_DEPTH`` deep (a genuine one nests three: the header, an entry, its shape), with at most
``MAX_HEADER_ENTRIES`` tensors. Anything else is a ``ValueError`` of one line.
"""
from __future__ import annotations

import json
import math
import re
import struct
from contextlib import closing

import numpy as np
from dataclasses import dataclass
from pathlib import Path

from ..dtypes import BY_NAME, DType
from ..guard.confine import open_regular_file
from ..storage.base import Blob
from ..catalog.validate import shape_problem

_BY_CODE = {d.safetensors: d for d in BY_NAME.values()}
#: the largest header read (JSON bytes); safetensors' own limit is 100 MB, a genuine header ~150 bytes a tensor
MAX_HEADER_BYTES = 16 << 20
#: the deepest nesting of objects and arrays taken (a genuine header: 3, or 2 for ``__metadata__``)
MAX_HEADER_DEPTH = 8
#: the most tensors one file may declare (a genuine shard holds hundreds to a few thousand)
MAX_HEADER_ENTRIES = 100_000
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_DEPTH_PIECE = 1 << 20
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(text: bytes) -> int:
    """How deep the objects and arrays of the JSON ``text`` nest (strings skipped), in linear time."""
    brackets = _STRING.sub(b"", text).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for start in range(0, len(brackets), _DEPTH_PIECE):  # in pieces: a few MB of work memory whatever the size
        piece = np.frombuffer(brackets, np.uint8, min(_DEPTH_PIECE, len(brackets) - start), start)
        steps = ((piece == ord("[")) | (piece == ord("{"))).astype(np.int32) * 2 - 1
        levels = np.cumsum(steps, dtype=np.int64) + depth
        deepest = max(deepest, int(levels.max()))
        depth = int(levels[-1])
    return deepest


def parse_header(text: bytes) -> dict:
    """The header JSON object of ``text``, bounded in depth and entries; ValueError of one line otherwise."""
    depth = json_depth(text)
    if depth > MAX_HEADER_DEPTH:
        raise ValueError(f"safetensors header nests {depth} deep, more than the {MAX_HEADER_DEPTH} a header may")
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"safetensors header is not JSON ({str(e).splitlines()[0][:200]})") from None
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    entries = len(header) - ("__metadata__" in header)
    if entries > MAX_HEADER_ENTRIES:
        raise ValueError(f"safetensors header declares {entries} tensors, more than the {MAX_HEADER_ENTRIES} a file "
                         f"may")
    return header


@dataclass(frozen=True)
class SafetensorsEntry:
    dtype: DType
    shape: tuple
    offset: int  # absolute byte offset of the tensor's data in the file


def read_safetensors_file_header(path: Path) -> dict:
    """``read_safetensors_header`` of the regular file at ``path``, opened for this read only (``RefusedReference``
    if it is not a regular file)."""
    with closing(open_regular_file(path)) as blob:
        return read_safetensors_header(blob)


def read_safetensors_header(blob: Blob) -> dict:
    """name -> SafetensorsEntry of the .safetensors file ``blob``; ValueError with a one-line reason if the header is
    unusable."""
    size = blob.size
    raw = blob.read(0, 8)
    if len(raw) != 8:
        raise ValueError("file too short for a safetensors header")
    (n,) = struct.unpack("<Q", raw)
    if n > size - 8:
        raise ValueError(f"safetensors header length {n} is implausible for a {size}-byte file")
    if n > MAX_HEADER_BYTES:
        raise ValueError(f"safetensors header is {n} bytes, more than the {MAX_HEADER_BYTES} ckptfs reads")
    text = blob.read(8, n)
    if len(text) != n:
        raise ValueError("safetensors header is truncated")
    header = parse_header(text)
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dt = _BY_CODE[info["dtype"]]
            start, stop = (int(x) for x in info["data_offsets"])
            shape = tuple(int(x) for x in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"safetensors header entry {name!r} is malformed or has an unknown dtype") from None
        why = shape_problem(shape, dt.itemsize)
        if why is None and not (0 <= start <= stop and base + stop <= size):
            why = f"data range [{start}, {stop}) lies outside the {size - base}-byte data block"
        if why is None and stop - start != math.prod(shape) * dt.itemsize:
            why = f"data range holds {stop - start} bytes but shape {list(shape)} {dt.name} needs " \
                  f"{math.prod(shape) * dt.itemsize}"
        if why:
            raise ValueError(f"safetensors header entry {name!r}: {why}")
        out[name] = SafetensorsEntry(dt, shape, base + start)
    return out
