"""Reading the header of a .safetensors file a checkpoint refers to (DeferredSafeTensor), so the
tensor becomes a ``FileRegionTensor`` over the file's data block."""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from ..dtypes import BY_NAME, DType

_BY_CODE = {d.safetensors: d for d in BY_NAME.values()}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class SafetensorsEntry:
    dtype: DType
    shape: tuple
    offset: int  # absolute byte offset of the tensor's data in the file


def read_safetensors_header(path: Path) -> dict:
    """name -> SafetensorsEntry; ValueError with a one-line reason if the header is unusable."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError("file too short for a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise ValueError(f"safetensors header length {n} is implausible")
        text = fh.read(n)
    if len(text) != n:
        raise ValueError("safetensors header is truncated")
    try:
        header = json.loads(text)
    except ValueError as e:
        raise ValueError(f"safetensors header is not JSON ({e})") from None
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dt = _BY_CODE[info["dtype"]]
            start, _stop = info["data_offsets"]
            out[name] = SafetensorsEntry(dt, tuple(int(x) for x in info["shape"]), base + int(start))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"safetensors header entry {name!r} is malformed or has an unknown dtype") from None
    return out
