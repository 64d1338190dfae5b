"""CodeGen fused ``qkv_proj``: four model-parallel row blocks, each holding q, then v, then k.

HF CodeGen splits its fused projection into ``mp_num = 4`` blocks (a fixed TPU layout of the original
checkpoints) and each block into q, v, k parts of ``hidden / 4`` rows, in that order. From the separate
CS q, k, v: block ``b`` = rows ``b`` quarter of q, then of v, then of k.
"""
from __future__ import annotations

from ...tensor.base import VirtualTensor
from .gpt_neox import deinterleave_blocks, interleave_blocks

# HF CodeGenAttention hard-codes this block count
CODEGEN_MP_NUM = 4


def codegen_fused_qkv(q: VirtualTensor, k: VirtualTensor, v: VirtualTensor) -> VirtualTensor:
    """HF ``attn.qkv_proj.weight`` from CS q, k, v (CodeGen's RoPE is interleaved like CS: no row permutation)."""
    return interleave_blocks([q, v, k], CODEGEN_MP_NUM)


def codegen_split_qkv(y: VirtualTensor) -> list:
    """[q, k, v] of HF ``attn.qkv_proj.weight`` (the inverse of ``codegen_fused_qkv``)."""
    q, v, k = deinterleave_blocks(y, 3, CODEGEN_MP_NUM)
    return [q, k, v]


FUNCTIONS = {"codegen_fused_qkv": codegen_fused_qkv}
INVERSES = {"codegen_fused_qkv": codegen_split_qkv}
