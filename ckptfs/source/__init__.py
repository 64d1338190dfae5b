"""Source layer: read Cerebras checkpoints (HDF5 ``.mdl``, format 0.1–0.5) lazily into a catalog.

``open_checkpoint(path)`` gives a ``Checkpoint`` (leaves + nesting, tensors read by region on
demand); ``resolve_checkpoint(path)`` finds the checkpoint a file or model_dir designates;
``ckptfs.source.materialize.to_torch`` turns a catalog into plain Python/torch objects.
"""
from .catalog import Checkpoint, Container, Leaf, Node, OpaqueLeaf, TensorLeaf, UnreadableLeaf, ValueLeaf
from .open import open_checkpoint
from .resolve import resolve_checkpoint

__all__ = ["Checkpoint", "Container", "Leaf", "Node", "OpaqueLeaf", "TensorLeaf", "UnreadableLeaf", "ValueLeaf",
           "open_checkpoint", "resolve_checkpoint"]
