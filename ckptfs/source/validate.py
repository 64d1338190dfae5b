"""Checks of tensor metadata made when the catalog is built, so that a crafted or corrupt entry makes that one
tensor unreadable with a reason instead of reaching the read path (a negative dimension once made a read loop
spin forever; an overflowing one makes sizes and offsets meaningless).

``shape_problem`` checks a shape on its own; ``dataset_problem`` checks it against the dataset that holds the data.
"""
from __future__ import annotations

import math

#: the largest tensor ckptfs serves: far beyond any real checkpoint, and small enough that the sum of a few
#: thousand of them still fits the 63-bit file sizes and offsets of every output format
MAX_TENSOR_BYTES = 1 << 50
#: numpy's own limit on dimensions
MAX_DIMS = 64


def shape_problem(shape, itemsize: int) -> str | None:
    """Why ``shape`` cannot be a tensor of ``itemsize``-byte elements (None when it can)."""
    if shape is None:
        return "no shape"
    try:
        dims = list(shape)
    except TypeError:
        return f"shape {shape!r} is not a list of dimensions"
    if len(dims) > MAX_DIMS:
        return f"{len(dims)} dimensions (at most {MAX_DIMS})"
    for n in dims:
        if isinstance(n, bool) or not isinstance(n, int):
            return f"dimension {n!r} of shape {dims} is not an integer"
        if n < 0:
            return f"negative dimension in shape {dims}"
    nbytes = math.prod(dims) * int(itemsize)
    if nbytes > MAX_TENSOR_BYTES:
        return f"shape {dims} overflows: {nbytes} bytes (at most {MAX_TENSOR_BYTES})"
    return None


def dataset_problem(info, shape, itemsize: int, name: str) -> str | None:
    """Why the dataset described by ``info`` (``h5safe.DatasetInfo``) cannot hold a tensor of ``shape`` with
    ``itemsize``-byte elements (None when it can)."""
    if info.shape is None:
        return f"dataset {name!r} holds no data (null dataspace)"
    if tuple(info.shape) != tuple(shape):
        return f"dataset {name!r} is {list(info.shape)} but the metadata says {list(shape)}"
    if info.itemsize != int(itemsize) or info.kind not in "biufc":
        return f"dataset {name!r} has {info.itemsize}-byte {info.kind!r} elements, the metadata {itemsize}-byte ones"
    return None
