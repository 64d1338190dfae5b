"""Reading the header of a .safetensors file a checkpoint refers to (DeferredSafeTensor), so the
tensor becomes a ``FileRegionTensor`` over the file's data block. The file is opened as a regular file only
(``confine.open_regular``: never blocks on a FIFO) and every entry is checked: a valid shape whose byte size equals
its data range, inside the file."""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ..dtypes import BY_NAME, DType
from .confine import open_regular
from .validate import shape_problem

_BY_CODE = {d.safetensors: d for d in BY_NAME.values()}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class SafetensorsEntry:
    dtype: DType
    shape: tuple
    offset: int  # absolute byte offset of the tensor's data in the file


def read_safetensors_header(path: Path) -> dict:
    """name -> SafetensorsEntry; ValueError with a one-line reason if the header is unusable (``RefusedReference``
    if ``path`` is not a regular file)."""
    fd = open_regular(path)
    with open(fd, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError("file too short for a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER or n > size - 8:
            raise ValueError(f"safetensors header length {n} is implausible for a {size}-byte file")
        text = fh.read(n)
    if len(text) != n:
        raise ValueError("safetensors header is truncated")
    try:
        header = json.loads(text)
    except ValueError as e:
        raise ValueError(f"safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
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
