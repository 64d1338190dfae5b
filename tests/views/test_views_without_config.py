"""Unknown model or missing params: the HF files are absent with a clear reason in README.txt and `ckptfs info`,
while the cs/, torch/ and tensors/ views still work (issue #3)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import ckptfs
from helpers import FIXTURES, run_ckptfs



def _lonely_checkpoint(tmp_path) -> Path:
    ckpt = tmp_path / "checkpoint.mdl"
    shutil.copy(FIXTURES / "llama" / "cs" / "checkpoint.mdl", ckpt)  # no params YAML beside it
    return ckpt


@pytest.mark.slow  # runs the CLI
def test_missing_params_leave_hf_out_with_the_reason_and_keep_other_views(tmp_path):
    ckpt = _lonely_checkpoint(tmp_path)
    tree = ckptfs.open(ckpt)
    try:
        top = tree.listdir("")
        assert "config.json" not in top and "model.safetensors" not in top
        assert {"cs", "torch", "tensors"} <= set(top)
        readme = tree.read("README.txt", 0, 1 << 20).decode()
        assert "Hugging Face files not generated" in readme and "--config" in readme
        data = b"".join(tree.iter_blocks("torch/checkpoint.pt"))
    finally:
        tree.close()
    out = tmp_path / "c.pt"
    out.write_bytes(data)
    state = torch.load(out, weights_only=True)
    assert "embedding_layer.word_embeddings.weight" in state["model"]
    r = run_ckptfs("info", ckpt, text=True)
    assert r.returncode == 0 and "no Cerebras params YAML found" in r.stdout


def test_unknown_model_name_is_explained(tmp_path):
    ckpt = _lonely_checkpoint(tmp_path)
    shutil.copy(FIXTURES / "llama" / "cs" / "params.yaml", tmp_path / "params.yaml")
    tree = ckptfs.open(ckpt, model="no-such-model")
    try:
        assert "config.json" not in tree.listdir("")
        readme = tree.read("README.txt", 0, 1 << 20).decode()
        assert "no-such-model" in readme and "ckptfs models" in readme
        assert "tensors" in tree.listdir("")
    finally:
        tree.close()
