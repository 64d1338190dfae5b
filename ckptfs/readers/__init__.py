"""Readers: open any checkpoint lazily into a catalog, one folder per backend behind ``open_checkpoint``.

``open_checkpoint(path)`` gives a ``Checkpoint`` (leaves + nesting, tensors read by region on demand);
``resolve_checkpoint(path)`` finds the checkpoint a file or model_dir designates; ``kind.classify`` says what a path
is. The names are imported on first use: deciding what a path is (``kind``) must not import h5py and numpy, which a
mount's start does not need.
"""
from __future__ import annotations

import importlib

_NAMES = {"open_checkpoint": "ckptfs.readers.open", "resolve_checkpoint": "ckptfs.readers.run.resolve"}  # full names: the layer test reads them

__all__ = ["open_checkpoint", "resolve_checkpoint"]


def __getattr__(name: str):
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
