"""Bad input -> CheckpointError(path, one clear line); partial files; missing external targets."""
from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from ckptfs.errors import CheckpointError, TensorReadError
from ckptfs.catalog.model import TensorLeaf, UnreadableLeaf
from ckptfs.readers import open_checkpoint
from ckptfs.catalog.materialize import to_torch
from helpers import FIXTURES as FIX

EDGE = FIX / "cstorch_edge_cases"
TMP_FIXTURES = sorted(EDGE.glob("*.mdl.*.tmp"))


def _problem(path) -> str:
    with pytest.raises(CheckpointError) as ei:
        open_checkpoint(path)
    err = ei.value
    assert "\n" not in str(err)
    assert Path(err.path).name == Path(path).name
    return err.problem


def test_missing_file(tmp_path):
    assert "no such file" in _problem(tmp_path / "nope.mdl")


def test_directory_without_checkpoints(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    assert "directory" in _problem(tmp_path)


def test_text_file(tmp_path):
    p = tmp_path / "x.mdl"
    p.write_text("hello, not a checkpoint\n")
    assert "not an HDF5 file" in _problem(p)


def test_empty_file(tmp_path):
    p = tmp_path / "x.mdl"
    p.write_bytes(b"")
    assert "empty" in _problem(p)


def test_safetensors_file_is_named(tmp_path):
    p = tmp_path / "model.mdl"
    save_file({"w": np.zeros((2, 2), np.float32)}, str(p))
    assert "safetensors" in _problem(p)


def test_zip_that_is_not_a_torch_save_is_named(tmp_path):
    """A torch.save zip is a legacy-mode checkpoint (tests/readers/legacy_torch/test_legacy_torch.py); any other zip is named as such."""
    p = tmp_path / "model.mdl"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("notes.txt", "hello")
    assert "not a torch.save archive" in _problem(p)


def test_truncated_hdf5(tmp_path):
    src = (FIX / "gpt2" / "cs" / "checkpoint.mdl").read_bytes()
    p = tmp_path / "checkpoint.mdl"
    p.write_bytes(src[: len(src) // 2])
    problem = _problem(p)
    assert "truncated" in problem and str(len(src) // 2) in problem


def test_hdf5_without_cerebras_attributes(tmp_path):
    p = tmp_path / "plain.h5"
    with h5py.File(p, "w") as f:
        f["x"] = np.arange(3)
    assert "not a Cerebras checkpoint" in _problem(p)


@pytest.mark.parametrize("tmpfile", TMP_FIXTURES, ids=lambda p: p.name)
def test_leftover_tmp_file_refused_then_salvaged(tmpfile):
    problem = _problem(tmpfile)
    assert "failed cstorch.save" in problem and "--allow-partial" in problem
    with open_checkpoint(tmpfile, allow_partial=True) as ckpt:
        assert not ckpt.success
        assert any("partial" in w and "lost" in w for w in ckpt.warnings)
        with h5py.File(tmpfile, "r") as f:
            spec_keys = json.loads(json.loads(f.attrs["__spec__"])[1])[1]["context"]
        assert list(ckpt.leaves) == json.loads(spec_keys)
        assert all(isinstance(v, UnreadableLeaf) for v in ckpt.leaves.values())


def test_partial_salvages_datasets_from_their_attributes(tmp_path):
    """A .mdl without __SUCCESS__ and per-key metadata: tensors and pickled objects come back from the
    datasets' own attributes, metadata-only leaves are reported lost."""
    ck = tmp_path / "adamw.mdl"
    shutil.copy(EDGE / "adamw.mdl", ck)
    with h5py.File(ck, "a") as f:
        for name in [a for a in f.attrs if a.endswith(".__metadata__")] + ["__SUCCESS__"]:
            del f.attrs[name]
        datasets = {k: f[k][()] for k in f.keys()}
    assert "__SUCCESS__" in _problem(ck)
    with open_checkpoint(ck, allow_partial=True) as ckpt:
        got = {k for k, v in ckpt.leaves.items() if isinstance(v, TensorLeaf)}
        assert got == set(datasets)
        for k in datasets:
            assert np.array_equal(ckpt.leaves[k].tensor.read_all(), datasets[k])
        lost = [k for k, v in ckpt.leaves.items() if isinstance(v, UnreadableLeaf)]
        assert "global_step" in lost and len(lost) == len(ckpt.leaves) - len(datasets)
        assert any(f"{len(lost)} lost" in w for w in ckpt.warnings)
        to_torch(ckpt)


def test_colliding_keys():
    problem = _problem(EDGE / "intkeys.mdl")
    assert "both flatten to '1'" in problem


def test_missing_external_mdl_fails_only_on_read(tmp_path):
    shutil.copy(EDGE / "external" / "ext.mdl", tmp_path / "ext.mdl")
    with open_checkpoint(tmp_path / "ext.mdl") as ckpt:
        a = ckpt.leaves["model.a"]
        assert isinstance(a, TensorLeaf) and a.tensor.shape == (3, 4) and a.tensor.dtype.name == "float32"
        with pytest.raises(TensorReadError) as ei:
            a.tensor.read_all()
        assert "src.mdl" in ei.value.problem and ei.value.problem.startswith("tensor model.a:")
        with h5py.File(EDGE / "external" / "ext.mdl", "r") as f:
            assert np.array_equal(ckpt.leaves["model.own"].tensor.read_all(), f["model.own"][()])
        assert any("src.mdl" in w for w in ckpt.warnings)


def test_missing_external_safetensors(tmp_path):
    shutil.copy(EDGE / "external" / "from_st.mdl", tmp_path / "from_st.mdl")
    with open_checkpoint(tmp_path / "from_st.mdl") as ckpt:
        v = ckpt.leaves["model.v"]
        # DeferredSafeTensor stores no shape: without its target nothing can be announced
        assert isinstance(v, UnreadableLeaf) and "m.safetensors" in v.reason
    # the target appearing later with other content is detected on read
    save_file({"v": np.zeros(3, np.float32), "w": np.zeros((4, 4), np.float32)}, str(tmp_path / "m.safetensors"))
    with open_checkpoint(tmp_path / "from_st.mdl") as ckpt:
        t = ckpt.leaves["model.v"].tensor
        assert t.shape == (3,)
        (tmp_path / "m.safetensors").unlink()
        with pytest.raises(TensorReadError, match="not found"):
            t.read_all()
