"""LoRA adapters of fused HF layers (``--lora keep``): several CS modules' low-rank factors as one HF adapter.

GPT-2's ``c_attn`` fuses the CS q, k and v projections. Their LoRA updates ``B_q A_q``, ``B_k A_k``, ``B_v A_v``
stacked row-wise are one update of rank ``r_q + r_k + r_v``: ``A`` = the three ``A`` stacked, ``B`` = the three
``B`` on a block diagonal (``block_diag``). Each element of that product adds only zero products to the
per-module ones.
"""
from __future__ import annotations

from ...errors import MappingError
from ...tensor.base import VirtualTensor
from ...tensor import ops


def block_diag(*ts: VirtualTensor) -> VirtualTensor:
    """2-D tensors on the diagonal of one ``[sum rows, sum cols]`` tensor, zeros elsewhere."""
    if not ts:
        raise MappingError(None, "block_diag: no inputs")
    for t in ts:
        if not isinstance(t, VirtualTensor) or t.ndim != 2:
            raise MappingError(None, f"block_diag: {t!r} is not a 2-D tensor")
        if t.dtype != ts[0].dtype:
            raise MappingError(None, f"block_diag: {t.describe()} has another dtype than {ts[0].describe()}")
    cols = [t.shape[1] for t in ts]
    rows = []
    for n, t in enumerate(ts):
        parts = [t if m == n else ops.Constant(0.0, t.dtype, (t.shape[0], c)) for m, c in enumerate(cols) if c]
        rows.append(ops.Concat(parts, 1) if len(parts) > 1 else parts[0])
    return ops.Concat(rows, 0)


FUNCTIONS = {"block_diag": block_diag}
