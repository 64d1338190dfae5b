"""An HF folder served as a Cerebras checkpoint, without FUSE: checkpoint.mdl is a format-0.5 file that h5py and
ckptfs's own reader read back as the HF tensors (under an identity mapping here; the families' mappings have
their own conformance test), sizes are exact before any tensor is read, and export, info, ls, load, convert-config
and the API take an HF folder (with the real mapping: a tiny Llama)."""
from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch
import yaml

import ckptfs
from ckptfs.errors import UsageError
from ckptfs.tree.hf_source import build_hf_tree
from ckptfs.views.options import MountOptions
from ckptfs.readers import open_checkpoint
from ckptfs.tensor.regions import BlobRegionTensor
from helpers import run_ckptfs
from ckptfs.mapping.hf_checkpoint import open_hf_checkpoint
from helpers.hf import hf_env, identity_plan, llama_state, save_hf, save_llama

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def check_mdl(path, state: dict, prefix: str = "model."):
    """Every tensor of the .mdl at ``path``, read by h5py and by ckptfs's reader, is the HF tensor."""
    with h5py.File(path, "r") as f:
        assert f.attrs["__version__"] == 0.5 and f.attrs["__cstorch_version__"] == "2.10.0"
        for name, t in state.items():
            d = f[prefix + name]
            assert d.shape == tuple(t.shape), name
            assert np.ascontiguousarray(d[()]).tobytes() == raw(t), name
    with open_checkpoint(path) as c:
        assert set(c.tensors()) == {prefix + n for n in state}
        for name, t in state.items():
            leaf = c.leaves[prefix + name]
            assert leaf.tensor.dtype.name == str(t.dtype).removeprefix("torch.")
            assert leaf.tensor.read_all().tobytes() == raw(t), name


@pytest.mark.parametrize("fmt, shards, dtype", [("safetensors", 1, torch.float32), ("safetensors", 3, torch.bfloat16),
                                                ("bin", 2, torch.bfloat16), ("bin", 1, torch.float16)])
def test_checkpoint_mdl_holds_the_hf_tensors(tmp_path, fmt, shards, dtype):
    st = llama_state(dtype=dtype)
    save_hf(tmp_path / "m", st, CONFIG, fmt=fmt, shards=shards)
    tree = build_hf_tree(tmp_path / "m", MountOptions(), planner=identity_plan)
    assert sorted(tree.listdir("")) == ["README.txt", "checkpoint.mdl", "params.yaml", "tensors"]
    out = tmp_path / "out.mdl"
    out.write_bytes(b"".join(tree.iter_blocks("checkpoint.mdl")))
    assert out.stat().st_size == tree.attr("checkpoint.mdl").size
    check_mdl(out, st)
    assert yaml.safe_load(tree.read("params.yaml", 0, 1 << 20)) == {"model": {"name": "identity"}}
    npy = tree.read("tensors/model/lm_head/weight" + (".bf16.npy" if dtype == torch.bfloat16 else ".npy"), 0, 1 << 20)
    assert npy.endswith(raw(st["lm_head.weight"]))
    readme = tree.read("README.txt", 0, 1 << 20).decode()
    assert "checkpoint.mdl" in readme and str(tmp_path / "m") in readme and "identity mapping (test)" in readme


def test_sizes_are_exact_before_any_tensor_is_read(tmp_path, monkeypatch):
    st = llama_state()
    save_hf(tmp_path / "m", st, CONFIG)
    reads = []
    orig = BlobRegionTensor.read
    monkeypatch.setattr(BlobRegionTensor, "read", lambda self, box: reads.append(self.key) or orig(self, box))
    tree = build_hf_tree(tmp_path / "m", MountOptions(), planner=identity_plan)
    sizes = {p: tree.attr(p).size for p in tree.file_paths()}
    assert reads == [] and sizes["checkpoint.mdl"] > sum(t.numel() * 4 for t in st.values())
    head = tree.read("checkpoint.mdl", 0, 4096)
    assert head[:8] == b"\x89HDF\r\n\x1a\n" and reads == []  # the HDF5 metadata is not tensor data
    whole = b"".join(tree.iter_blocks("checkpoint.mdl"))
    assert len(whole) == sizes["checkpoint.mdl"] and set(reads) == set(st)


def test_multi_folder_model_keys(tmp_path):
    text = llama_state(seed=1)
    image = {"vision.w": torch.randn(4, 4), "vision.b": torch.randn(4)}
    save_hf(tmp_path / "m" / "text_model", text, CONFIG)
    save_hf(tmp_path / "m" / "image_model", image, {"architectures": ["CLIPVisionModel"]})
    tree = build_hf_tree(tmp_path / "m", MountOptions(), planner=identity_plan)
    out = tmp_path / "out.mdl"
    out.write_bytes(b"".join(tree.iter_blocks("checkpoint.mdl")))
    check_mdl(out, {f"image_model.{k}": v for k, v in image.items()} | {f"text_model.{k}": v for k, v in text.items()})


def test_views_choose_the_files(tmp_path):
    save_hf(tmp_path / "m", llama_state(), CONFIG)
    t = build_hf_tree(tmp_path / "m", MountOptions(views=("tensors",)), planner=identity_plan)
    assert sorted(t.listdir("")) == ["README.txt", "tensors"]
    t = build_hf_tree(tmp_path / "m", MountOptions(views=("hf", "cs")), planner=identity_plan)
    assert sorted(t.listdir("")) == ["README.txt", "checkpoint.mdl", "params.yaml"]
    with pytest.raises(UsageError, match="serves cs, tensors and tf"):
        build_hf_tree(tmp_path / "m", MountOptions(views=("hf",)), planner=identity_plan)


def _planned(src) -> dict:
    hc = open_hf_checkpoint(src, MountOptions())
    return {k: leaf.tensor.read_all().tobytes() for k, leaf in hc.checkpoint.tensors().items()}


def _mdl_bytes(path) -> dict:
    with open_checkpoint(path) as c:
        return {k: leaf.tensor.read_all().tobytes() for k, leaf in c.tensors().items()}


def test_api_open_load_and_export(tmp_path):
    src = save_llama(tmp_path / "m", dtype=torch.bfloat16)
    tree = ckptfs.open(src)
    assert "checkpoint.mdl" in tree.listdir("")
    state = ckptfs.load(src)
    assert list(state) == ["model"]
    emb = state["model"]["embedding_layer.word_embeddings.weight"]
    assert emb.dtype == torch.bfloat16 and emb.shape == (256, 64)
    n = ckptfs.export(src, "checkpoint.mdl", tmp_path / "x.mdl")
    assert n == (tmp_path / "x.mdl").stat().st_size
    assert _mdl_bytes(tmp_path / "x.mdl") == _planned(src)


@pytest.mark.slow  # runs the CLI
def test_cli_export_info_ls_and_errors(tmp_path):
    src = save_llama(tmp_path / "m", fmt="bin")
    env = hf_env()
    run_ckptfs("export", src, tmp_path / "out", env=env, check=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["README.txt", "checkpoint.mdl", "params.yaml",
                                                                   "tensors"]
    assert _mdl_bytes(tmp_path / "out" / "checkpoint.mdl") == _planned(src)
    r = run_ckptfs("info", src, env=env, text=True, check=True)
    assert "Hugging Face model: " in r.stdout and "pytorch_model.bin" in r.stdout and "family: llama (llama)" in r.stdout
    info = json.loads(run_ckptfs("info", "--json", src, env=env, text=True, check=True).stdout)
    assert info["hugging_face"]["folders"][""]["format"] == "bin"
    assert info["checkpoint"]["tensors"] == len(_planned(src))
    r = run_ckptfs("ls", "-l", src, env=env, text=True, check=True)
    assert r.stdout.splitlines()[0].startswith("model/")
    assert "embedding_layer.word_embeddings.weight  [256, 64] float32" in r.stdout
    (src / "pytorch_model.bin").write_bytes(b"PK\x03\x04garbage")
    for cmd in (["info"], ["ls"], ["export"]):
        r = run_ckptfs(*cmd, src, *([tmp_path / "o2"] if cmd == ["export"] else []), env=env, text=True)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (cmd, r.stderr)
        assert "pytorch_model.bin" in r.stderr and "zip" in r.stderr, r.stderr


@pytest.mark.slow  # runs the CLI
def test_convert_config_of_an_hf_config(tmp_path, fixtures):
    want = yaml.safe_load((fixtures / "llama" / "cs" / "params.yaml").read_text())
    r = run_ckptfs("convert-config", fixtures / "llama" / "hf" / "config.json", env=hf_env(), text=True, check=True)
    assert yaml.safe_load(r.stdout) == want
    r = run_ckptfs("convert-config", fixtures / "llama" / "hf", "-o", tmp_path, env=hf_env(), text=True, check=True)
    assert yaml.safe_load((tmp_path / "params.yaml").read_text()) == want
    cfg = json.loads((fixtures / "llama" / "hf" / "config.json").read_text())
    cfg["hidden_act"] = "tanh"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = run_ckptfs("convert-config", tmp_path / "config.json", env=hf_env(), text=True)
    assert r.returncode == 2 and "error:" in r.stderr and "hidden_act" in r.stderr, r.stderr
