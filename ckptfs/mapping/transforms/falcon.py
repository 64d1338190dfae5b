"""Fused query/key/value projections laid out by KV group (Falcon; BLOOM reuses it with one group per head).

HF Falcon's ``query_key_value`` rows are ``groups`` blocks, one per KV head, each holding that group's query
heads followed by its one key head and its one value head. The layouts the HF class reads are all this
shape: multi-query (7B, ``groups=1``: every query head, then k, then v), grouped KV heads
(``new_decoder_architecture``, 40B/180B) and plain multi-head (``groups=heads``: per head q, k, v — also
BLOOM's interleave). The result is a concatenation of row slices, so reading a row block touches only the
source rows it covers.
"""
from __future__ import annotations

from ...errors import MappingError
from ...tensor.base import VirtualTensor
from ...tensor import ops


def fuse_qkv_groups(q: VirtualTensor, k: VirtualTensor, v: VirtualTensor, groups: int,
                    heads: int | None = None) -> VirtualTensor:
    """Rows ``[q_g, k_g, v_g]`` for g in 0..groups-1 (q_g: 1/groups of q's rows, k_g / v_g likewise). ``heads``
    (the query heads) is only checked here: the inverse needs it to find the head size."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, VirtualTensor):
            raise MappingError(None, f"fuse_qkv_groups: {name} is not a tensor ({t!r})")
    groups = int(groups)
    if groups <= 0:
        raise MappingError(None, f"fuse_qkv_groups: groups must be positive, got {groups}")
    if k.shape != v.shape:
        raise MappingError(None, f"fuse_qkv_groups: k {k.describe()} and v {v.describe()} differ in shape")
    if q.shape[1:] != k.shape[1:]:
        raise MappingError(None, f"fuse_qkv_groups: q {q.describe()} and k {k.describe()} differ beyond dim 0")
    for name, t in (("q", q), ("k", k)):
        if t.shape[0] % groups:
            raise MappingError(None, f"fuse_qkv_groups: {name} rows ({t.shape[0]}) are not {groups} groups")
    q_rows, kv_rows = q.shape[0] // groups, k.shape[0] // groups
    if heads is not None and (int(heads) <= 0 or int(heads) % groups or q.shape[0] != int(heads) * kv_rows):
        raise MappingError(None, f"fuse_qkv_groups: q {q.describe()} is not {heads} heads of the size of k's "
                                 f"{groups} ({k.describe()})")
    parts = []
    for g in range(groups):
        parts.append(ops.Slice(q, 0, g * q_rows, (g + 1) * q_rows))
        parts.append(ops.Slice(k, 0, g * kv_rows, (g + 1) * kv_rows))
        parts.append(ops.Slice(v, 0, g * kv_rows, (g + 1) * kv_rows))
    return ops.Concat(parts, 0)


def split_qkv_groups(y: VirtualTensor, groups: int, heads: int | None = None) -> list:
    """[q, k, v] of a fused ``query_key_value`` (the inverse of ``fuse_qkv_groups``)."""
    groups = int(groups)
    heads = groups if heads is None else int(heads)
    rows = y.shape[0]
    if groups <= 0 or heads % groups or rows % (heads + 2 * groups):
        raise MappingError(None, f"split_qkv_groups: {rows} rows of {y.describe()} are not {heads} query heads and "
                                 f"{groups} key and value heads")
    d = rows // (heads + 2 * groups)
    per = heads // groups * d
    step = per + 2 * d
    q = [ops.Slice(y, 0, g * step, g * step + per) for g in range(groups)]
    k = [ops.Slice(y, 0, g * step + per, g * step + per + d) for g in range(groups)]
    v = [ops.Slice(y, 0, g * step + per + d, (g + 1) * step) for g in range(groups)]
    return [p[0] if len(p) == 1 else ops.Concat(p, 0) for p in (q, k, v)]


FUNCTIONS = {"fuse_qkv_groups": fuse_qkv_groups}
INVERSES = {"fuse_qkv_groups": split_qkv_groups}
