"""GPT-NeoX fused ``query_key_value``: q, k and v interleaved head by head.

HF GPT-NeoX reads its fused projection as ``view(heads, 3 * head_dim, ...)``: the rows of head ``h`` are
that head's q rows, then its k rows, then its v rows. CS keeps q, k and v apart, so the fused tensor is
the concatenation, head after head, of one head-sized row block of each. The same block interleave (with
a different block count and order) also gives CodeGen's ``qkv_proj``, see ``codegen.py``.
"""
from __future__ import annotations

from typing import Sequence

from ...errors import MappingError
from ...tensor.base import VirtualTensor
from ...tensor import ops


def interleave_blocks(tensors: Sequence[VirtualTensor], blocks: int) -> VirtualTensor:
    """Cut each tensor into ``blocks`` equal row blocks (dim 0); output block ``b`` of every tensor in turn.

    ``interleave_blocks([a, b], 2)`` = ``concat(a[0:n/2], b[0:n/2], a[n/2:n], b[n/2:n])``. Works for
    weights (2-D) and biases (1-D); nothing is read until the result is.
    """
    tensors = list(tensors)
    blocks = int(blocks)
    if not tensors:
        raise MappingError(None, "interleave_blocks: no inputs")
    for t in tensors:
        if not isinstance(t, VirtualTensor):
            raise MappingError(None, f"interleave_blocks: input {t!r} is not a tensor")
        if blocks <= 0 or t.shape[0] % blocks:
            raise MappingError(None, f"interleave_blocks: {t.shape[0]} rows of {t.describe()} do not split "
                                     f"into {blocks} equal blocks")
    parts = []
    for b in range(blocks):
        for t in tensors:
            size = t.shape[0] // blocks
            parts.append(ops.Slice(t, 0, b * size, (b + 1) * size))
    return parts[0] if len(parts) == 1 else ops.Concat(parts, 0)


def deinterleave_blocks(y: VirtualTensor, count: int, blocks: int) -> list:
    """The inverse of ``interleave_blocks`` of ``count`` tensors with equal rows: each one's ``blocks`` row blocks
    taken back out of ``y`` and joined."""
    count, blocks = int(count), int(blocks)
    if count <= 0 or blocks <= 0 or y.shape[0] % (count * blocks):
        raise MappingError(None, f"deinterleave_blocks: {y.shape[0]} rows of {y.describe()} are not {blocks} "
                                 f"blocks of {count} equal parts")
    size = y.shape[0] // (count * blocks)
    out = []
    for i in range(count):
        parts = [ops.Slice(y, 0, (b * count + i) * size, (b * count + i + 1) * size) for b in range(blocks)]
        out.append(parts[0] if len(parts) == 1 else ops.Concat(parts, 0))
    return out


def neox_fused_qkv(q: VirtualTensor, k: VirtualTensor, v: VirtualTensor, heads: int) -> VirtualTensor:
    """HF ``attention.query_key_value`` (weight or bias) from CS q, k, v (q and k already in HF RoPE layout)."""
    return interleave_blocks([q, k, v], heads)


def neox_split_qkv(y: VirtualTensor, heads: int) -> list:
    """[q, k, v] of a fused ``query_key_value`` (the inverse of ``neox_fused_qkv``)."""
    return deinterleave_blocks(y, 3, heads)


FUNCTIONS = {"neox_fused_qkv": neox_fused_qkv}
INVERSES = {"neox_fused_qkv": neox_split_qkv}
