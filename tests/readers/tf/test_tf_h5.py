"""Cerebras' TensorFlow-era H5 files (the appliance's H5Saver layout: quoted variable names at the root,
``__H5_TYPE__``, LZ4 chunks, no ``__spec__``) open as a flat state of TF variables: in-process, through the CLI
(info, ls, export, diff) and through a real FUSE mount (tensors/, README.txt); an HDF5 file that is neither this
nor a Cerebras checkpoint stays a one-line error; the reader's bounds hold."""
from __future__ import annotations

import json
import os
import shutil

import h5py
import numpy as np
import pytest

import ckptfs
from ckptfs.errors import CheckpointError
from ckptfs.readers import open_checkpoint
from ckptfs.readers.cerebras import tf_h5
from ckptfs.catalog.model import TF_H5, TensorLeaf
from ckptfs.readers.cerebras.dataset_tensor import H5DatasetTensor
from helpers import needs_fuse, run_ckptfs
from helpers.fuse import mounted
from helpers.tf_source import CASES, case_dir, check_tensors_folder, manifest, prefix, reference

pytestmark = pytest.mark.slow  # processes: the CLI, a server, TensorFlow

H5_CASES = [pytest.param(c, id=c) for c in CASES]


def h5_of(case):
    return case_dir(case) / "h5" / "model.h5"


@pytest.mark.parametrize("case", H5_CASES)
def test_a_tf_era_h5_file_is_a_flat_state_of_its_variables(case):
    ref = reference(case)
    left_out = set(manifest(case)["h5"]["left_out"])
    with open_checkpoint(h5_of(case)) as c:
        assert c.kind == TF_H5 and c.format_name.startswith("TensorFlow-era")
        assert list(c.leaves) == sorted(set(ref) - left_out)  # the file's (alphabetical) order, names unquoted
        for name, leaf in c.leaves.items():
            assert isinstance(leaf, TensorLeaf) and isinstance(leaf.tensor, H5DatasetTensor), name
            got = leaf.tensor.read_all()
            want = ref[name][1]
            assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), name


def test_its_lz4_chunks_are_read_chunk_by_chunk_not_whole():
    """A box of a chunked variable goes through the LZ4 chunk reader (``lz4chunks``), not an h5py read of it."""
    name = "model/bert/embeddings/word_embeddings/.ATTRIBUTES/VARIABLE_VALUE"  # [100, 32], chunks (50, 32)
    want = reference("tf2_bert_sharded")[name][1]
    with open_checkpoint(h5_of("tf2_bert_sharded")) as c:
        t = c.leaves[name].tensor
        _, reader = t._opened()
        assert reader is not None and t.chunk_shape() == (50, 32)
        assert t.read(((60, 70), (0, 32))).tobytes() == want[60:70].tobytes()


def test_the_python_api_loads_and_opens_it():
    ref = reference("tf1_dtypes")
    state = ckptfs.load(h5_of("tf1_dtypes"))
    assert set(state) == set(ref) - set(manifest("tf1_dtypes")["h5"]["left_out"])
    assert np.asarray(state["dtypes/f32_matrix"]).tobytes() == ref["dtypes/f32_matrix"][1].tobytes()
    tree = ckptfs.open(h5_of("tf1_dtypes"))
    try:
        readme = tree.read("README.txt", 0, 1 << 20).decode()
        assert "format:         TensorFlow-era Cerebras H5" in readme
        hf = [line for line in readme.splitlines() if line.strip().startswith("(root)")]
        assert len(hf) == 1 and "hf:" in hf[0] and "not applicable" in hf[0]
        data = tree.read("tensors/dtypes/i32_tensor.npy", 0, 1 << 20)
        assert data.endswith(ref["dtypes/i32_tensor"][1].tobytes())
    finally:
        tree.close()


def test_cli_info_ls_export_and_diff(tmp_path):
    h5 = h5_of("tf1_bert_adam")
    r = run_ckptfs("info", h5, text=True, check=True)
    assert "format: TensorFlow-era Cerebras H5" in r.stdout and "variables: 121" in r.stdout
    assert "tensors: 121" in r.stdout
    j = json.loads(run_ckptfs("info", "--json", h5, text=True, check=True).stdout)
    assert j["tensors"] == 121 and j["format_name"].startswith("TensorFlow-era")
    r = run_ckptfs("ls", "-l", h5, text=True, check=True)
    assert "bert/encoder/layer_0/attention/self/query/kernel/adam_m  [32, 32] float32" in r.stdout
    assert "global_step  [] int64" in r.stdout
    out = tmp_path / "k.npy"
    run_ckptfs("export", h5, "tensors/bert/pooler/dense/kernel@.npy", out, check=True)
    assert np.load(out).tobytes() == reference("tf1_bert_adam")["bert/pooler/dense/kernel"][1].tobytes()
    # the same variables as the TF checkpoint tensorflow-to-h5 read: diff finds them equal
    r = run_ckptfs("diff", h5, prefix("tf1_bert_adam"), text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    other = tmp_path / "other.h5"
    shutil.copy(h5, other)
    other.chmod(0o644)
    with h5py.File(other, "r+") as f:
        f["global_step"][()] = 7
    r = run_ckptfs("diff", h5, other, text=True)
    assert r.returncode == 1 and "global_step" in r.stdout


@pytest.mark.parametrize("command", [["info"], ["ls"], ["export", "tensors/x.npy", "-"]])
def test_an_hdf5_file_neither_cerebras_nor_tf_era_is_one_line(tmp_path, command):
    bad = tmp_path / "plain.h5"
    with h5py.File(bad, "w") as f:
        f["weights"] = np.zeros(3)  # no __H5_TYPE__, no __spec__
    r = run_ckptfs(*command[:1], bad, *command[1:], text=True)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "not a Cerebras checkpoint" in lines[0]
    empty = tmp_path / "empty.h5"
    h5py.File(empty, "w").close()
    r = run_ckptfs(*command[:1], empty, *command[1:], text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_too_many_datasets_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(tf_h5, "MAX_DATASETS", 5)
    with pytest.raises(CheckpointError, match="more than the 5"):
        open_checkpoint(h5_of("tf1_dtypes"))


def test_an_overlong_name_is_skipped_with_a_warning(monkeypatch):
    monkeypatch.setattr(tf_h5, "MAX_NAME_BYTES", 20)
    with open_checkpoint(h5_of("tf1_dtypes")) as c:
        assert "dtypes/f32_matrix" in c.leaves  # 19 bytes once quoted
        assert "odd-names/with.dots/and>gt_9" not in c.leaves  # 34 bytes once quoted
        assert any("was skipped" in w for w in c.warnings)


def test_a_dataset_whose_storage_is_short_of_its_shape_is_unreadable(tmp_path):
    """A contiguous dataset whose bytes lie beyond the end of the file (a lying header) is unreadable with the
    reason; the other variables still read."""
    path = tmp_path / "lying.h5"
    with h5py.File(path, "w") as f:
        f["a"] = np.arange(4, dtype=np.float32)
        f["a"].attrs["__H5_TYPE__"] = "NumpyArrayH5Type"
        d = f.create_dataset("b", shape=(1000,), dtype=np.float64)  # contiguous, never written: not allocated
        d.attrs["__H5_TYPE__"] = "NumpyArrayH5Type"
    with open_checkpoint(path) as c:
        assert c.leaves["a"].tensor.read_all().tolist() == [0, 1, 2, 3]
        assert "stores 0 bytes, its shape needs 8000" in c.leaves["b"].reason


def test_a_dataset_that_is_not_an_h5saver_type_is_unreadable(tmp_path):
    path = tmp_path / "mixed.h5"
    with h5py.File(path, "w") as f:
        for name in ("a", "b", "c", "d"):
            f[name] = np.ones(2, np.float32)
            f[name].attrs["__H5_TYPE__"] = "NumpyArrayH5Type"
        f["e"] = np.ones(2, np.float32)
        f["e"].attrs["__H5_TYPE__"] = "DeferredFileTensor"  # a PyTorch-era type that points at another file
    with open_checkpoint(path) as c:
        assert "not one of H5Saver's" in c.leaves["e"].reason


@needs_fuse
@pytest.mark.timeout(300)
def test_mount_a_tf_era_h5_file():
    case = "tf2_bert_sharded"
    ref = {k: v for k, v in reference(case).items() if k not in manifest(case)["h5"]["left_out"]}
    with mounted(h5_of(case)) as mnt:
        assert sorted(p.name for p in mnt.iterdir()) == ["README.txt", "tensors", "tf"]
        readme = (mnt / "README.txt").read_text()
        assert "not applicable: TensorFlow variable names" in readme
        check_tensors_folder(mnt / "tensors", ref)
        assert sorted(os.listdir(mnt / "tf")) == ["checkpoint", "model.ckpt.data-00000-of-00001", "model.ckpt.index"]
