"""An identity planner standing in for the mapping core's ``to_cs`` (each HF tensor under its own name), handed to
``build_hf_tree(planner=...)`` so that the HF source and the tree are tested on their own."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IdentityPlan:
    family: str
    model_name: str
    tensors: list
    params: dict
    notes: list = field(default_factory=list)
    added: list = field(default_factory=list)


def identity_plan(folders: dict, *, model=None, added=True, allow_unused=False) -> IdentityPlan:
    """Every HF tensor as ``model.<folder>.<name>`` (test stand-in for mapping.tocs.to_cs)."""
    tensors = [((f + "." if f else "") + name, t) for f, (_, ts) in folders.items() for name, t in ts.items()]
    return IdentityPlan("identity", model or "identity", tensors, {"model": {"name": model or "identity"}},
                        ["identity mapping (test)"])
