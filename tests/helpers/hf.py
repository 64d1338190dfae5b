"""Test helpers for Hugging Face sources: HF folders (safetensors, sharded, .bin, Hub-cache-shaped) from tensors or
from a tiny real Llama (``save_llama``), and the environment of a ckptfs subprocess over them."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from helpers import real_env
from helpers.hfplan import IdentityPlan, identity_plan  # noqa: F401 - re-exported for the tests


def save_hf(folder: Path, state: dict, config: dict, *, fmt: str = "safetensors", shards: int = 1) -> Path:
    """Write ``state`` ({name: torch tensor}) as save_pretrained would: one file or ``shards`` shards + index."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    names = list(state)
    if shards == 1:
        if fmt == "safetensors":
            save_file({n: state[n].contiguous() for n in names}, folder / "model.safetensors", {"format": "pt"})
        else:
            torch.save(state, folder / "pytorch_model.bin")
        return folder
    groups = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for i, group in enumerate(groups, 1):
        if fmt == "safetensors":
            shard = f"model-{i:05d}-of-{shards:05d}.safetensors"
            save_file({n: state[n].contiguous() for n in group}, folder / shard, {"format": "pt"})
        else:
            shard = f"pytorch_model-{i:05d}-of-{shards:05d}.bin"
            torch.save({n: state[n] for n in group}, folder / shard)
        weight_map.update({n: shard for n in group})
    index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    (folder / index).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": dict(sorted(weight_map.items()))}))
    return folder


def as_hub_cache(src: Path, cache: Path, repo_id: str = "org/tiny-model", revision: str = "0" * 40) -> Path:
    """Copy the files of ``src`` into a Hub-cache-shaped repository (blobs/ + snapshots/<rev>/ links + refs/main);
    returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    for f in sorted(src.rglob("*")):
        if not f.is_file():
            continue
        rel = f.relative_to(src)
        blob = repo / "blobs" / f"blob{abs(hash(str(rel))):x}"
        shutil.copyfile(f, blob)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    return snap


def llama_state(seed: int = 0, dtype=torch.float32, hidden: int = 16, layers: int = 2, vocab: int = 64) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(layers):
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"model.layers.{i}.self_attn.{p}.weight"] = torch.randn(hidden, hidden, generator=g)
        out[f"model.layers.{i}.input_layernorm.weight"] = torch.randn(hidden, generator=g)
    out["model.norm.weight"] = torch.randn(hidden, generator=g)
    out["lm_head.weight"] = torch.randn(vocab, hidden, generator=g)
    return {k: v.to(dtype) for k, v in out.items()}


def hf_env(**extra) -> dict:
    """Environment for a ckptfs subprocess (conftest's, with ``extra``)."""
    return real_env(**extra)


def save_llama(folder: Path, *, dtype=torch.float32, fmt: str = "safetensors", shard: str | None = None,
               seed: int = 0, hidden: int = 64, vocab: int = 256) -> Path:
    """A tiny LlamaForCausalLM (random weights, GQA) written by save_pretrained: safetensors (one file, or shards of
    at most ``shard``, e.g. "40KB"), or a ``pytorch_model.bin``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=128, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(dtype)
    if fmt == "bin":  # transformers writes safetensors whatever it is asked; a .bin as torch.save of the state dict
        model.config.architectures = ["LlamaForCausalLM"]
        model.config.save_pretrained(folder)
        torch.save(model.state_dict(), Path(folder) / "pytorch_model.bin")
        return folder
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return folder
