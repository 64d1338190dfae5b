"""A Hugging Face folder and a Hub-cache-shaped folder through a real FUSE mount: checkpoint.mdl read by h5py and by
ckptfs's own reader gives the HF tensors (identity mapping here), params.yaml and tensors/ are served, and a crafted
folder is refused before anything is mounted."""
from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
import torch

from ckptfs.source import open_checkpoint
from conftest import needs_fuse, run_ckptfs
from fusehelp import is_mounted, mounted
from hfhelp import as_hub_cache, hf_env, llama_state, save_hf

pytestmark = [needs_fuse, pytest.mark.timeout(600)]

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def check_mounted(mnt, state: dict):
    names = sorted(os.listdir(mnt))
    assert names == ["README.txt", "checkpoint.mdl", "params.yaml", "tensors"]
    size = os.stat(mnt / "checkpoint.mdl").st_size
    with open(mnt / "checkpoint.mdl", "rb") as f:
        assert len(f.read()) == size  # exact from the first stat
    with h5py.File(mnt / "checkpoint.mdl", "r") as f:
        for name, t in state.items():
            assert np.ascontiguousarray(f["model." + name][()]).tobytes() == raw(t), name
    with open_checkpoint(mnt / "checkpoint.mdl") as c:
        for name, t in state.items():
            assert c.leaves["model." + name].tensor.read_all().tobytes() == raw(t), name
    assert (mnt / "params.yaml").read_text().startswith("model:")
    assert sorted(os.listdir(mnt / "tensors" / "model" / "model" / "layers" / "1" / "self_attn"))[0].startswith("k_proj")


def test_mount_an_hf_folder(tmp_path):
    st = llama_state(dtype=torch.bfloat16, hidden=64, vocab=512)
    save_hf(tmp_path / "m", st, CONFIG, shards=2)
    with mounted(tmp_path / "m", env=hf_env()) as mnt:
        check_mounted(mnt, st)
        assert str(tmp_path / "m") in (mnt / "README.txt").read_text()


def test_mount_a_hub_cache_snapshot_and_its_repository(tmp_path):
    st = llama_state(seed=3)
    save_hf(tmp_path / "src", st, CONFIG, fmt="bin")
    snap = as_hub_cache(tmp_path / "src", tmp_path / "hub", repo_id="acme/tiny-llama")
    for source in (snap, snap.parent.parent):
        with mounted(source, env=hf_env()) as mnt:
            check_mounted(mnt, st)
            assert "Hub cache snapshot of acme/tiny-llama" in (mnt / "README.txt").read_text()


def test_a_crafted_folder_is_refused_before_mounting(tmp_path):
    save_hf(tmp_path / "m", llama_state(), CONFIG)
    (tmp_path / "m" / "model.safetensors").unlink()
    os.symlink("/etc/passwd", tmp_path / "m" / "model.safetensors")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = run_ckptfs("mount", tmp_path / "m", mnt, env=hf_env(), text=True, timeout=120)
    assert r.returncode == 2 and not is_mounted(mnt)
    assert "model.safetensors: leads to /etc/passwd, outside the model folder" in r.stderr
