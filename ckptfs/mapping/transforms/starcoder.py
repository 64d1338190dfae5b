"""StarCoder (HF GPTBigCode) fused attention for multi-head (not multi-query) checkpoints.

With ``multi_query: false`` GPTBigCode splits its ``c_attn`` output per head as ``[q_h, k_h, v_h]`` blocks of
``head_dim`` rows each, so CS's separate q, k and v projections are interleaved head by head rather than
concatenated. (The multi-query layout is a plain concatenation q | k | v and needs no transform.)
"""
from __future__ import annotations

from ...errors import MappingError
from ...virtual_tensor import VirtualTensor
from .. import ops
from .gpt_neox import deinterleave_blocks


def bigcode_interleaved_qkv(q: VirtualTensor, k: VirtualTensor, v: VirtualTensor, heads: int) -> VirtualTensor:
    """Rows of ``q``, ``k``, ``v`` (weights ``[H, in]`` or biases ``[H]``) as per-head ``[q_h; k_h; v_h]`` blocks."""
    heads = int(heads)
    for t in (q, k, v):
        if not isinstance(t, VirtualTensor):
            raise MappingError(None, f"bigcode_interleaved_qkv: {t!r} is not a tensor")
        if t.shape != q.shape:
            raise MappingError(None, f"bigcode_interleaved_qkv: {t.describe()} does not match {q.describe()}")
    rows = q.shape[0]
    if heads <= 0 or rows % heads:
        raise MappingError(None, f"bigcode_interleaved_qkv: {rows} rows of {q.describe()} do not split into "
                                 f"{heads} heads")
    d = rows // heads
    parts = [ops.Slice(t, 0, h * d, (h + 1) * d) for h in range(heads) for t in (q, k, v)]
    return ops.Concat(parts, 0)


def bigcode_split_qkv(y: VirtualTensor, heads: int) -> list:
    """[q, k, v] of a multi-head ``c_attn`` (the inverse of ``bigcode_interleaved_qkv``)."""
    return deinterleave_blocks(y, 3, heads)


FUNCTIONS = {"bigcode_interleaved_qkv": bigcode_interleaved_qkv}
INVERSES = {"bigcode_interleaved_qkv": bigcode_split_qkv}
