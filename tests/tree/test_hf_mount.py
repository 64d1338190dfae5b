"""A Hugging Face folder and a Hub-cache-shaped folder through a real FUSE mount: checkpoint.mdl, read by h5py and
by ckptfs's own reader, holds exactly the tensors the mapping plans (the mapping's conformance to the converter is
tests/mapping/test_conformance_hf_to_cs.py), params.yaml and tensors/ are served, sizes are exact from the first stat, and
a crafted folder is refused before anything is mounted."""
from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
import torch
import yaml

from ckptfs.views.options import MountOptions
from ckptfs.readers import open_checkpoint
from ckptfs.mapping.hf_checkpoint import open_hf_checkpoint
from helpers import needs_fuse, run_ckptfs
from helpers.fuse import is_mounted, mounted
from helpers.hf import as_hub_cache, hf_env, save_llama

pytestmark = [needs_fuse, pytest.mark.timeout(600)]


def check_mounted(mnt, source):
    """The mount of ``source`` serves the checkpoint planned in-process from it, read two ways."""
    hc = open_hf_checkpoint(source, MountOptions())
    planned = {k: leaf.tensor for k, leaf in hc.checkpoint.tensors().items()}
    assert sorted(os.listdir(mnt)) == ["README.txt", "checkpoint.mdl", "params.yaml", "tensors"]
    size = os.stat(mnt / "checkpoint.mdl").st_size
    with open(mnt / "checkpoint.mdl", "rb") as f:
        assert len(f.read()) == size  # exact from the first stat
    with h5py.File(mnt / "checkpoint.mdl", "r") as f:
        keys = []
        f.visititems(lambda n, o: keys.append(n) if isinstance(o, h5py.Dataset) else None)
        assert set(keys) == set(planned) and f.attrs["__version__"] == 0.5
        for key, t in planned.items():
            assert np.ascontiguousarray(f[key][()]).tobytes() == t.read_all().tobytes(), key
    with open_checkpoint(mnt / "checkpoint.mdl") as c:
        assert set(c.tensors()) == set(planned)
        for key, t in planned.items():
            assert c.leaves[key].tensor.dtype == t.dtype and c.leaves[key].tensor.read_all().tobytes() == \
                t.read_all().tobytes(), key
    assert yaml.safe_load((mnt / "params.yaml").read_text()) == hc.plan.params
    assert (mnt / "tensors" / "model" / "transformer_decoder" / "layers" / "1").is_dir()


def test_mount_an_hf_folder(tmp_path):
    src = save_llama(tmp_path / "m", dtype=torch.bfloat16, shard="40KB")
    assert (src / "model.safetensors.index.json").exists()
    with mounted(src, env=hf_env()) as mnt:
        check_mounted(mnt, src)
        readme = (mnt / "README.txt").read_text()
        assert str(src) in readme and "model:       llama" in readme


def test_mount_a_hub_cache_snapshot_and_its_repository(tmp_path):
    save_llama(tmp_path / "src", fmt="bin", seed=3)
    snap = as_hub_cache(tmp_path / "src", tmp_path / "hub", repo_id="acme/tiny-llama")
    for source in (snap, snap.parent.parent):
        with mounted(source, env=hf_env()) as mnt:
            check_mounted(mnt, snap)
            assert "Hub cache snapshot of acme/tiny-llama" in (mnt / "README.txt").read_text()


def test_a_crafted_folder_is_refused_before_mounting(tmp_path):
    src = save_llama(tmp_path / "m")
    (src / "model.safetensors").unlink()
    os.symlink("/etc/passwd", src / "model.safetensors")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = run_ckptfs("mount", src, mnt, env=hf_env(), text=True, timeout=120)
    assert r.returncode == 2 and not is_mounted(mnt)
    assert "model.safetensors: leads to /etc/passwd, outside the model folder" in r.stderr
