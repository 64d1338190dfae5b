"""Checks of tensor metadata made when the catalog is built, so that a crafted or corrupt entry makes that one
tensor unreadable with a reason instead of reaching the read path (a negative dimension once made a read loop
spin forever; an overflowing one makes sizes and offsets meaningless).

``shape_problem`` checks a shape on its own; ``dataset_problem`` checks it against the dataset that holds the data,
and its chunking (``chunking_problem``): every chunk costs an entry in the chunk index and per-chunk work on every
read, so a tensor may be cut into at most one chunk per ``MIN_MEAN_CHUNK_BYTES`` of its data (at least
``CHUNK_COUNT_FLOOR`` chunks, at most ``MAX_CHUNKS``). A tensor of one small tensor's bytes cut into 262,144
one-element chunks would otherwise cost a reader gigabytes of memory for one 1 MiB read; h5py's and cstorch's
chunking (chunks of 8 KiB to 1 MiB) stays far inside the bound.
"""
from __future__ import annotations

import math

#: the largest tensor ckptfs serves: far beyond any real checkpoint, and small enough that the sum of a few
#: thousand of them still fits the 63-bit file sizes and offsets of every output format
MAX_TENSOR_BYTES = 1 << 50
#: numpy's own limit on dimensions
MAX_DIMS = 64
#: a chunked tensor may have one chunk per this many bytes of its data ...
MIN_MEAN_CHUNK_BYTES = 4096
#: ... or this many chunks, whichever is more (small tensors cut small) ...
CHUNK_COUNT_FLOOR = 4096
#: ... and never more than this many (a chunk index of 20 bytes an entry: 80 MiB)
MAX_CHUNKS = 4 << 20


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
    chunks = getattr(info, "chunks", None)
    return None if not chunks else chunking_problem(tuple(info.shape), tuple(chunks), int(itemsize), name)


def chunking_problem(shape: tuple, chunks: tuple, itemsize: int, name: str) -> str | None:
    """Why a dataset of ``shape`` cut into ``chunks`` has too many chunks for its bytes (see the module docstring);
    None when it has not."""
    if len(chunks) != len(shape) or any(not isinstance(c, int) or c < 1 for c in chunks):
        return f"dataset {name!r} has chunk shape {list(chunks)} for shape {list(shape)}"
    count = math.prod(-(-n // c) for n, c in zip(shape, chunks))
    allowed = min(MAX_CHUNKS, max(CHUNK_COUNT_FLOOR, math.prod(shape) * itemsize // MIN_MEAN_CHUNK_BYTES))
    if count > allowed:
        return (f"dataset {name!r} ({math.prod(shape) * itemsize} bytes) is cut into {count} chunks of "
                f"{list(chunks)}, more than the {allowed} ckptfs reads for its size (one per "
                f"{MIN_MEAN_CHUNK_BYTES} bytes, at least {CHUNK_COUNT_FLOOR})")
    return None
