"""A Hugging Face model as the Cerebras checkpoint Model Zoo's converter makes of it, planned from metadata.

``open_hf_checkpoint(path, options)`` opens the HF folder (``ckptfs.readers.hf.folder``: configs, tensors read by
region), maps it with the mapping core's HF → CS direction (``ckptfs.mapping.to_cs.to_cs``: the family's rules read
the other way, the params the converter writes) and returns an ``HFCheckpoint``: the plan, and a ``Checkpoint``
catalog of the state ``cstorch.save`` would write (``{"model": {key: tensor}}``), which the ``.mdl`` layout, the
``tensors/`` view, ``ckptfs info`` and ``ckptfs ls`` read like any opened checkpoint. Nothing is converted here:
every tensor is a lazy operation over the HF files.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import CheckpointError, CkptfsError
from ..catalog.model import Checkpoint, Container, TensorLeaf
from ..readers.hf.folder import HFFolder, open_hf_model
from ..upgrade.releases import CURRENT_VERSION

#: what a mounted HF model's files are called: what a Model Zoo run's --checkpoint_path and --params point at
MDL_NAME = "checkpoint.mdl"
PARAMS_NAME = "params.yaml"
#: the format and release of the checkpoint served (what cstorch 2.10's save writes)
FORMAT_VERSION = 0.5
RELEASE = CURRENT_VERSION  # the release whose converter output this checkpoint is



@dataclass
class HFCheckpoint:
    """An HF model and the Cerebras checkpoint planned from it."""

    model: HFFolder
    plan: Any  # mapping.tocs.CSModel: family, model_name, tensors [(key, tensor)], params, notes, added
    checkpoint: Checkpoint  # the state tree as a catalog (root {"model": {...}}, flat keys "model.<key>")
    notes: list = field(default_factory=list)  # the source's notes, then the plan's

    def close(self) -> None:
        self.model.close()


def plan_model(model: HFFolder, options, planner: Callable | None = None):
    """The mapping core's plan for ``model`` (``--model``, ``--added-tensors`` and ``--allow-unused-weights`` from
    ``options``)."""
    folders = {f: (c.config, c.tensors) for f, c in model.components.items()}
    if planner is None:
        from .to_cs import to_cs as planner
    try:
        return planner(folders, model=getattr(options, "model", None),
                       added=getattr(options, "added_tensors", "keep") != "omit",
                       allow_unused=bool(getattr(options, "allow_unused_weights", False)))
    except CkptfsError as e:
        raise CheckpointError(model.path, e.problem) from None


def state_catalog(path, plan) -> Checkpoint:
    """The catalog of ``{"model": {key: tensor}}`` in the plan's order (one leaf per tensor object, so a tensor
    planned under two keys is written once and linked, as cstorch writes a tied tensor)."""
    leaves: dict = {}
    by_tensor: dict = {}
    keys, children = [], []
    links: dict = {}
    for key, tensor in plan.tensors:
        flat = f"model.{key}"
        leaf = by_tensor.get(id(tensor))
        if leaf is None:
            leaf = by_tensor[id(tensor)] = TensorLeaf(flat, tensor)
        else:
            links[flat] = leaf.key
        keys.append(key)
        children.append(leaf)
        leaves[flat] = leaf
    root = Container("dict", ["model"], [Container("dict", keys, children)])
    return Checkpoint(path, FORMAT_VERSION, RELEASE, True, root, leaves, links)


def open_hf_checkpoint(path, options, planner: Callable | None = None) -> HFCheckpoint:
    """Open the HF model at ``path`` and plan its Cerebras checkpoint (``CheckpointError`` naming the folder or the
    file and the problem when it cannot)."""
    model = open_hf_model(path, allow_external=getattr(options, "allow_external", ()) or ())
    plan = plan_model(model, options, planner)
    return HFCheckpoint(model, plan, state_catalog(model.path, plan), list(model.notes) + list(plan.notes))
