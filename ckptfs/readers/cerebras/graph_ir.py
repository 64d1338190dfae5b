"""Recognising the one TorchScript graph shape ckptfs can evaluate without running TorchScript.

A lazy tensor saved before its first step carries a ``DeferredGraphTensor``: TorchScript IR plus
argument tensors. ckptfs never executes the IR. It only recognises a graph that returns one of its
own inputs unchanged (``graph(%x : Tensor): return (%x)``), whose value is simply that argument;
every other graph stays unreadable.
"""
from __future__ import annotations

import re

_GRAPH = re.compile(r"^\s*graph\((?P<params>[^)]*)\)\s*:\s*return\s*\(?\s*(?P<out>%[\w.]+)\s*\)?\s*$", re.S)


def graph_inputs(ir: str) -> list[str] | None:
    """The input value names of a graph (``['%x']``), or None if the header cannot be parsed."""
    m = re.match(r"^\s*graph\((?P<params>[^)]*)\)\s*:", ir or "", re.S)
    if not m:
        return None
    return [p.split(":")[0].strip() for p in m.group("params").split(",") if p.strip()]


def identity_output_index(ir: str, nargs: int) -> int | None:
    """Index of the argument a pure pass-through graph returns, or None for any other graph.

    The graph must take exactly ``nargs`` inputs (the saved arguments) and its body must be a single
    ``return`` of one input.
    """
    m = _GRAPH.match(ir or "")
    if not m:
        return None
    params = graph_inputs(ir)
    if params is None or len(params) != nargs:
        return None
    out = m.group("out")
    return params.index(out) if out in params else None
