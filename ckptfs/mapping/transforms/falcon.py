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
from ...virtual_tensor import VirtualTensor
from .. import ops


def fuse_qkv_groups(q: VirtualTensor, k: VirtualTensor, v: VirtualTensor, groups: int) -> VirtualTensor:
    """Rows ``[q_g, k_g, v_g]`` for g in 0..groups-1 (q_g: 1/groups of q's rows, k_g / v_g likewise)."""
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
    parts = []
    for g in range(groups):
        parts.append(ops.Slice(q, 0, g * q_rows, (g + 1) * q_rows))
        parts.append(ops.Slice(k, 0, g * kv_rows, (g + 1) * kv_rows))
        parts.append(ops.Slice(v, 0, g * kv_rows, (g + 1) * kv_rows))
    return ops.Concat(parts, 0)


FUNCTIONS = {"fuse_qkv_groups": fuse_qkv_groups}
