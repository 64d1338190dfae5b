"""Helpers for the mapping tests: open fixture checkpoints (with the real ``ckptfs.readers`` reader),
build small checkpoints from tensors, and a source tensor that records the regions asked of it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from ckptfs.readers import open_checkpoint
from ckptfs.catalog.model import Checkpoint, Container, TensorLeaf
from ckptfs.tensor.base import ArrayTensor, Box, VirtualTensor, box_shape
from helpers import FIXTURES  # noqa: F401 - re-exported to the mapping tests



def params_of(case) -> dict:
    """A fixture's params YAML."""
    return yaml.safe_load((FIXTURES / case / "cs" / "params.yaml").read_text())


def write_yaml(path, doc) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))
    return path


def to_torch(t):
    """A virtual tensor's bytes as a torch tensor of its real dtype."""
    import torch

    raw = t.read_all()
    dtype = getattr(torch, t.dtype.name)
    if raw.size == 0:
        return torch.empty(t.shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw.tobytes()), dtype=dtype).reshape(t.shape).clone()


def open_fixture(case: str) -> Checkpoint:
    return open_path(FIXTURES / case / "cs" / "checkpoint.mdl")


def open_path(path: Path) -> Checkpoint:
    return open_checkpoint(Path(path))


class RecordingTensor(VirtualTensor):
    """An in-memory source that records every box asked of it and the bytes it returned."""

    def __init__(self, array: np.ndarray, dtype=None):
        self.inner = ArrayTensor(array, dtype)
        super().__init__(self.inner.shape, self.inner.dtype)
        self.boxes: list = []
        self.bytes_read = 0

    def read(self, box: Box) -> np.ndarray:
        out = self.inner.read(box)
        assert out.shape == box_shape(box)
        self.boxes.append(tuple(box))
        self.bytes_read += out.nbytes
        return out

    def reset(self):
        self.boxes.clear()
        self.bytes_read = 0


def checkpoint_from_model(path: Path, model: dict) -> Checkpoint:
    """A checkpoint holding only ``{"model": {key: tensor}}`` (tensors are VirtualTensors)."""
    leaves = {f"model.{k}": TensorLeaf(f"model.{k}", t) for k, t in model.items()}
    inner = Container("dict", list(model), list(leaves.values()))
    root = Container("dict", ["model"], [inner])
    return Checkpoint(path=Path(path), format_version=0.5, release="2.10.0", success=True, root=root, leaves=leaves)


def model_tensors(checkpoint: Checkpoint) -> dict:
    """The checkpoint's CS model tensors by key without the ``model.`` prefix."""
    return {k[len("model."):]: leaf.tensor for k, leaf in checkpoint.leaves.items()
            if k.startswith("model.") and isinstance(leaf, TensorLeaf)}
