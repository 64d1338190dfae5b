"""Legacy (0.1–0.4) leaf kinds beyond the fixtures, built by editing copies of the emulated legacy files
the way the old writers laid them out; plus the file-region reader used for raw external tensors."""
from __future__ import annotations

import pickle
import shutil

import h5py
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from ckptfs.errors import TensorReadError
from ckptfs.catalog.model import TensorLeaf, ValueLeaf
from ckptfs.readers import open_checkpoint
from ckptfs.catalog.materialize import to_torch
from ckptfs.tensor.regions import box_runs, float_to_bf16_bits
from helpers import FIXTURES

FIX = FIXTURES / "legacy_emulated"


def _replace_with_null_dataset(f: h5py.File, name: str, attrs: dict, dtype="f4"):
    del f[name]
    d = f.create_dataset(name, data=h5py.Empty(dtype))
    for k, v in attrs.items():
        d.attrs[k] = v


@pytest.mark.parametrize("legacy,typed", [("legacy04.mdl", True), ("legacy01.mdl", False)])
def test_raw_file_tensor(tmp_path, legacy, typed):
    ck = tmp_path / legacy
    shutil.copy(FIX / legacy, ck)
    data = (np.arange(15, dtype=np.float32) * 1.5).reshape(3, 5)
    (tmp_path / "raw.bin").write_bytes(data.tobytes())
    attrs = {"filepath": "raw.bin", "shape": np.array([3, 5]), "dtype": pickle.dumps(torch.float32).hex()}
    if typed:
        attrs["__H5_TYPE__"] = "DeferredFileTensor"
    with h5py.File(ck, "a") as f:
        _replace_with_null_dataset(f, "model.a%2Fb", attrs)
    with open_checkpoint(ck) as ckpt:
        t = ckpt.leaves["model.a/b"].tensor
        assert t.shape == (3, 5) and t.dtype.name == "float32"
        assert np.array_equal(t.read_all(), data)
        assert np.array_equal(t.read(((1, 3), (2, 4))), data[1:3, 2:4])
        assert t.read_bytes(7, 33) == data.tobytes()[7:33]
        (tmp_path / "raw.bin").unlink()
        with pytest.raises(TensorReadError, match="raw.bin"):
            t.read_all()


def test_deferred_h5_tensor_in_another_file(tmp_path):
    ck = tmp_path / "legacy04.mdl"
    shutil.copy(FIX / "legacy04.mdl", ck)
    shutil.copy(FIX / "legacy04.mdl", tmp_path / "other.mdl")
    with h5py.File(ck, "a") as f:
        _replace_with_null_dataset(f, "selflink", {"__H5_TYPE__": "DeferredH5Tensor", "key": "model.b",
                                                   "filepath": str(tmp_path / "other.mdl")})
    with open_checkpoint(ck) as ckpt, open_checkpoint(tmp_path / "other.mdl") as other:
        t = ckpt.leaves["selflink"].tensor
        ref = other.leaves["model.b"].tensor
        assert t.dtype.name == "bfloat16" and t.shape == ref.shape
        assert np.array_equal(t.read_all(), ref.read_all())
        assert ckpt.leaves["selflink"] is not ckpt.leaves["model.b"]


def test_missing_dataset_reads_as_none(tmp_path):
    ck = tmp_path / "legacy03.mdl"
    shutil.copy(FIX / "legacy03.mdl", ck)
    with h5py.File(ck, "a") as f:
        del f["optimizer.param_groups.0.lr"]
    with open_checkpoint(ck) as ckpt:
        leaf = ckpt.leaves["optimizer.param_groups.0.lr"]
        assert isinstance(leaf, ValueLeaf) and leaf.value is None
        assert any("optimizer.param_groups.0.lr" in w for w in ckpt.warnings)
        assert to_torch(ckpt)["optimizer"]["param_groups"][0]["lr"] is None


def test_full_tensor_bf16_fill_matches_torch():
    with open_checkpoint(FIX / "legacy04.mdl") as ckpt, h5py.File(FIX / "legacy04.mdl", "r") as f:
        leaf = ckpt.leaves["full"]
        assert isinstance(leaf, TensorLeaf)
        a = f["full"].attrs
        expect = torch.full(tuple(int(n) for n in a["shape"]), float(a["fill_value"]), dtype=torch.bfloat16)
        assert torch.equal(to_torch(ckpt)["full"], expect)


@given(st.floats(allow_nan=False, width=32))
def test_bf16_rounding_matches_torch(x):
    assert float_to_bf16_bits(x) == int(torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).view(torch.int16)) & 0xFFFF


@settings(max_examples=200)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4).flatmap(
    lambda shape: st.tuples(st.just(tuple(shape)),
                            st.tuples(*[st.tuples(st.integers(0, n), st.integers(0, n)).map(lambda ab: tuple(sorted(ab))) for n in shape]))))
def test_box_runs_cover_exactly_the_box(case):
    shape, box = case
    arr = np.arange(int(np.prod(shape))).reshape(shape)
    expect = arr[tuple(slice(a, b) for a, b in box)].ravel()
    flat = arr.ravel()
    got = np.concatenate([flat[s:s + n] for s, n in box_runs(shape, box)] or [np.empty(0, arr.dtype)])
    assert np.array_equal(got, expect)
