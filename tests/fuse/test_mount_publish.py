"""What real clients do with a mount (issue 34), through one real FUSE mount of the llama fixture with every view and
an overlay that brings a tokenizer and a config.json whose token ids differ from the tokenizer's:

- token ids: transformers' AutoConfig and GenerationConfig of the root and of bin/ give one set of ids (the
  overlay config.json's), and README.txt says where each came from;
- publishing: huggingface_hub's own upload planning (``upload_folder``'s, no network) of the documented folder,
  MOUNT/hub, sends the HF model and its tokenizer only — where the mount root would send every view — and
  ``cp -r MOUNT/hub`` is a folder that loads as the original model; README.txt says what to publish;
- the .bin files: ``from_pretrained(MOUNT/bin, use_safetensors=False)``, as README.txt says.
"""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

from helpers import FIXTURES, needs_fuse, real_env
from helpers.fuse import mounted
from helpers.tokens import make_tokenizer

pytestmark = [needs_fuse, pytest.mark.timeout(900)]

LLAMA = FIXTURES / "llama" / "cs" / "checkpoint.mdl"
IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def upload_plan(folder) -> set:
    """The paths in the repository that ``HfApi.upload_folder(folder_path=folder)`` would commit: its own planning
    step with its default ignore patterns (``hf upload ORG/NAME folder`` runs the same)."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS

    ops = HfApi()._prepare_upload_folder_additions(folder, "", ignore_patterns=list(DEFAULT_IGNORE_PATTERNS))
    return {op.path_in_repo for op in ops}


def test_ids_publishing_and_bin_through_a_real_mount(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    over = make_tokenizer(tmp_path / "over", pad=0, bos=1, eos=2)
    original_config = json.loads((FIXTURES / "llama" / "hf" / "config.json").read_text())
    (over / "config.json").write_text(json.dumps({**original_config, "bos_token_id": 1, "eos_token_id": 5}))
    original = AutoModelForCausalLM.from_pretrained(FIXTURES / "llama" / "hf").state_dict()
    with mounted(LLAMA, "--overlay", over, env=real_env()) as mnt:
        # one set of token ids in the four files, as transformers reads them
        for folder in (mnt, mnt / "bin"):
            cfg, gen = AutoConfig.from_pretrained(str(folder)), GenerationConfig.from_pretrained(str(folder))
            assert [getattr(cfg, k) for k in IDS] == [1, 5, None] == [getattr(gen, k) for k in IDS], folder
        readme = (mnt / "README.txt").read_text()
        assert f"eos_token_id 5 (config.json in {over})" in readme

        # publishing: the documented folder is the model and its tokenizer, nothing else
        repo = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja"}
        assert upload_plan(mnt / "hub") == repo
        root = upload_plan(mnt)
        assert repo < root and {"README.txt", "bin/pytorch_model.bin", "torch/model.pt"} < root
        assert any(p.startswith("cs/") for p in root) and any(p.startswith("tensors/") for p in root)
        head = " ".join(readme.split("\n\nviews:")[0].split())
        assert "publish: hub/ is exactly the model's Hugging Face repository" in head
        assert "(hf upload ORG/NAME MOUNT/hub; cp -r MOUNT/hub DEST)" in head
        r = subprocess.run(["cp", "-r", str(mnt / "hub"), str(tmp_path / "copy")], capture_output=True, timeout=300)
        assert r.returncode == 0, r.stderr

        # the .bin files where README.txt says
        assert "from_pretrained(MOUNT/bin, use_safetensors=False)" in readme
        from_bin = AutoModelForCausalLM.from_pretrained(str(mnt / "bin"), use_safetensors=False).state_dict()
    assert {p.name for p in (tmp_path / "copy").iterdir()} == repo
    copied = AutoModelForCausalLM.from_pretrained(tmp_path / "copy").state_dict()
    for state in (copied, from_bin):
        assert state.keys() == original.keys() and all(torch.equal(state[k], v) for k, v in original.items())
    assert AutoTokenizer.from_pretrained(tmp_path / "copy").eos_token_id == 2
