"""Helpers of the TensorFlow-source tests: the fixture cases (tests/fixtures/tf, README.md there), their reference
values, copies of a case to tamper with, and the checks of an H5Saver file by H5Saver's reading rule."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from urllib.parse import unquote

import h5py
import numpy as np

from helpers import FIXTURES

TF_FIXTURES = FIXTURES / "tf"
CASES = ("tf1_bert_adam", "tf1_dtypes", "tf2_bert_sharded")


def case_dir(case: str) -> Path:
    return TF_FIXTURES / case


def prefix(case: str) -> Path:
    """The case's checkpoint prefix (``tf/model.ckpt-100``), as MANIFEST.json names it."""
    m = json.loads((case_dir(case) / "MANIFEST.json").read_text())
    return case_dir(case) / m["checkpoint_prefix"]


def manifest(case: str) -> dict:
    return json.loads((case_dir(case) / "MANIFEST.json").read_text())


def reference(case: str) -> dict:
    """``{variable: (dtype name, numpy array or None)}`` as ``tf.train.load_checkpoint`` read them (bfloat16 as its
    uint16 bits; a string variable's array is None)."""
    ref = json.loads((case_dir(case) / "ref.json").read_text())
    out = {}
    for name, r in ref.items():
        arr = None if r["file"] is None else np.load(case_dir(case) / r["file"])
        out[name] = (r["dtype"], arr)
    return out


def copy_case(case: str, dest: Path) -> Path:
    """A writable copy of the case's ``tf/`` folder; returns the copy's prefix."""
    src = prefix(case)
    shutil.copytree(src.parent, dest, dirs_exist_ok=True)
    for p in dest.iterdir():
        p.chmod(0o644)
    return dest / src.name


def h5saver_load(path) -> dict:
    """What ``H5Saver().load()`` gives for the file: every root dataset, unquoted, read whole with h5py (each must
    carry ``__H5_TYPE__`` = ``NumpyArrayH5Type``)."""
    out = {}
    with h5py.File(path, "r") as f:
        for name in f.keys():
            d = f[name]
            assert d.attrs["__H5_TYPE__"] == "NumpyArrayH5Type", name
            out[unquote(name)] = np.asarray(d[...])
    return out


def check_h5saver_file(path, case: str) -> None:
    """The H5Saver file at ``path`` holds every variable of ``case`` but those MANIFEST.json leaves out, each equal
    to the reference (dtype, shape, bytes), and equals the case's own ``h5/model.h5`` variable by variable."""
    ref = reference(case)
    left_out = set(manifest(case)["h5"]["left_out"])
    got = h5saver_load(path)
    assert set(got) == set(ref) - left_out
    for name, arr in got.items():
        want = ref[name][1]
        assert arr.dtype == want.dtype and arr.shape == want.shape and arr.tobytes() == want.tobytes(), name
    theirs = h5saver_load(case_dir(case) / "h5" / "model.h5")
    assert set(theirs) == set(got)
    for name, arr in theirs.items():
        assert arr.dtype == got[name].dtype and arr.shape == got[name].shape, name
        assert arr.tobytes() == got[name].tobytes(), name


def tensors_paths(ref: dict) -> dict:
    """``{variable: path under tensors/}`` by the tensors view's rules for TF names (scopes as folders, a name that
    is also a scope gets ``@``; ckptfs/views/tensors.py), for the numeric variables of ``ref``."""
    from ckptfs.views.tensors import plan_paths

    keys = [(k, ".bf16.npy" if dt == "bfloat16" else ".npy") for k, (dt, arr) in ref.items() if arr is not None]
    return plan_paths(keys, sep="/")[0]


def check_tensors_folder(folder: Path, ref: dict) -> None:
    """``folder`` (a mount's ``tensors/``) serves every numeric variable of ``ref`` as .npy, bytes equal, and nothing
    else."""
    paths = tensors_paths(ref)
    served = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert served == sorted(paths.values())
    for name, path in paths.items():
        arr = np.load(folder / path)
        want = ref[name][1]
        assert arr.shape == want.shape and arr.tobytes() == want.tobytes(), name
        if ref[name][0] != "bfloat16":
            assert arr.dtype == want.dtype, name
