"""How a TF2 checkpoint is split into data shards: TensorFlow's ``tf.train.experimental.MaxShardSizePolicy``
(python/checkpoint/sharding/sharding_policies.py) as a pure function of names, shapes and element sizes.

``max_shard_size_shards(tensors, max_shard_size)`` takes ``(name, shape, itemsize)`` in the order the tensors are
saved and returns the shards, each a list of ``(name, extents)``: ``extents`` None for the whole tensor, else a
slice ``((start, length), ...)`` per dimension (saved under its slice key, the whole tensor's entry listing its
slices). As TF does: tensors fill the current shard in order; one that does not fit is cut along the axis that
needs the fewest parts to fill what remains (slices of whole rows along axis 0 first), the shard is closed when it
is exactly full, and the rest goes on in the next shard; a scalar that does not fit starts a new shard; a scalar or a
minimal slice larger than the limit gets a shard of its own, after all the others.

Two cases TF does not handle are handled here: an empty tensor (TF's policy drops it) stays whole in the current
shard, and a tensor none of whose single rows fits an empty shard (TF loops forever) becomes one oversized slice in a
shard of its own. Empty shards are dropped.
"""
from __future__ import annotations

import math
from typing import Sequence

__all__ = ["max_shard_size_shards", "prefix_groups"]


def _next_partition(shape: list, itemsize: int, remaining: int) -> tuple[int, int]:
    """``_get_next_partition``: ``(axis, part size)``; a part size 0 means "start a new shard"."""
    rank = len(shape)
    num_elems = math.prod(shape)

    def num_partitions(axis: int) -> float:
        axis_len = shape[axis]
        slice_elems = num_elems // axis_len
        bytes_per_slice = slice_elems * itemsize
        slices_per_shard = remaining // bytes_per_slice
        if slices_per_shard == 0:
            return math.inf
        return math.ceil(axis_len / slices_per_shard)

    min_parts = num_partitions(0)
    min_axis = 0
    for axis in range(1, rank):
        parts = num_partitions(axis)
        part_size = num_elems * itemsize / parts
        if parts < min_parts and part_size <= remaining:
            min_axis, min_parts = axis, int(parts)
    return min_axis, math.ceil(int(shape[min_axis]) / min_parts)


def max_shard_size_shards(tensors: Sequence[tuple], max_shard_size: int) -> list:
    """The shards of ``tensors`` (``(name, shape, itemsize)``) under ``MaxShardSizePolicy(max_shard_size)``."""
    if max_shard_size <= 0:
        raise ValueError(f"max shard size must be positive, got {max_shard_size}")
    shards: list = [[]]
    large: list = []
    remaining = max_shard_size
    for name, shape, itemsize in tensors:
        shape = [int(d) for d in shape]
        rank = len(shape)
        total = math.prod(shape) * itemsize
        if rank == 0:
            if total > max_shard_size:
                large.append([(name, None)])
            else:
                if total > remaining:
                    shards.append([])
                    remaining = max_shard_size
                shards[-1].append((name, None))
                remaining -= total
            continue
        if total == 0:
            shards[-1].append((name, None))
            continue
        offset = [0] * rank
        working = list(shape)
        size = total
        while size > remaining:
            axis, part = _next_partition(working, itemsize, remaining)
            if part == 0:
                if remaining == max_shard_size:  # not one row fits even an empty shard
                    large.append([(name, tuple(zip(offset, working)))])
                    working = [0] * rank
                    size = 0
                    break
                shards.append([])
                remaining = max_shard_size
                continue
            piece = list(working)
            piece[axis] = part
            piece_bytes = math.prod(piece) * itemsize
            extents = tuple(zip(offset, piece))
            if piece_bytes > max_shard_size:
                large.append([(name, extents)])
            elif piece_bytes > remaining:  # pragma: no cover - TF raises here too
                raise RuntimeError(f"{name}: a slice of {piece_bytes} bytes does not fit {remaining}")
            else:
                shards[-1].append((name, extents))
                remaining -= piece_bytes
                if remaining == 0:
                    shards.append([])
                    remaining = max_shard_size
            offset[axis] += part
            working = [d - o for d, o in zip(shape, offset)]
            size = math.prod(working) * itemsize
        if math.prod(working) > 0:
            whole = not any(offset)
            shards[-1].append((name, None if whole else tuple(zip(offset, working))))
        remaining -= size
    return [s for s in shards + large if s]


def prefix_groups(names: Sequence[str], depth: int) -> list:
    """``names`` grouped by their first ``depth`` components (separated by ``/`` or ``.``), groups in the order of
    their first name, names in their given order within a group."""
    if depth <= 0:
        raise ValueError(f"prefix depth must be at least 1, got {depth}")
    groups: dict = {}
    for name in names:
        parts = name.replace("/", ".").split(".")
        groups.setdefault(".".join(parts[:depth]), []).append(name)
    return list(groups.values())
