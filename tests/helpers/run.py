"""Test helpers for training runs: a model_dir built from the llama fixture, checkpoints told apart by content.

Every checkpoint written by ``save`` is a copy of tests/fixtures/llama/cs/checkpoint.mdl whose final norm weight
(``model.transformer_decoder.norm.weight``, HF ``model.norm.weight``) is filled with its step, so that bytes read from a folder show which
checkpoint they came from. ``save`` writes the way cstorch does (``<name>.<8 hex>.tmp``, then rename);
``save_partial`` leaves a file without ``__SUCCESS__``.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import h5py
import hdf5plugin  # noqa: F401  (the LZ4 filter, to write the fixture's compressed datasets)
import numpy as np

from helpers import FIXTURES

TESTS = Path(__file__).resolve().parent.parent
LLAMA = FIXTURES / "llama" / "cs"
NORM_CS = "model.transformer_decoder.norm.weight"
NORM_HF = "model.norm.weight"


def model_dir(path: Path) -> Path:
    """An empty model_dir with the llama params (found for every checkpoint in it)."""
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(LLAMA / "params.yaml", path / "params.yaml")
    return path


def write_copy(dest: Path, step: int | None, *, success: bool = True) -> Path:
    """The fixture at ``dest`` (norm weight = ``step`` unless None; ``__SUCCESS__`` removed unless ``success``)."""
    shutil.copy(LLAMA / "checkpoint.mdl", dest)
    if step is not None or not success:
        with h5py.File(dest, "r+") as f:
            if step is not None:
                ds = f[NORM_CS]
                ds[...] = np.full(ds.shape, float(step), ds.dtype)
            if not success:
                del f.attrs["__SUCCESS__"]
    return dest


def save(d: Path, step: int, name: str | None = None) -> Path:
    """A complete checkpoint, written as ``<name>.<hex>.tmp`` then renamed (as cstorch saves)."""
    final = d / (name or f"checkpoint_{step}.mdl")
    tmp = d / f"{final.name}.0badcafe.tmp"
    write_copy(tmp, step)
    os.replace(tmp, final)
    return final


def save_partial(d: Path, step: int) -> Path:
    """A checkpoint file without ``__SUCCESS__`` (a save that has not finished)."""
    return write_copy(d / f"checkpoint_{step}.mdl", step, success=False)


def set_success(path: Path) -> None:
    with h5py.File(path, "r+") as f:
        f.attrs["__SUCCESS__"] = np.bool_(True)


def norm_of(safetensors_bytes: bytes) -> np.ndarray:
    """The HF norm weight inside a model.safetensors file's bytes."""
    from safetensors.numpy import load

    return load(safetensors_bytes)[NORM_HF]
