"""Multi-component checkpoints through the Python API (no FUSE): each component is a complete HF model directory in
its own sub-folder (config.json, weights, indexes, extra files), the root README.txt says which folder is which,
the folders load with transformers, and a single-component checkpoint's tree keeps its old shape (issues 11, 12)."""
from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptfs
from helpers import FIXTURES

# one shard each (no index, as save_pretrained writes it); the .bin format in the folder's complete HF folder bin/
WEIGHTS = {"model.safetensors", "bin"}
BIN_FOLDER = {"config.json", "pytorch_model.bin"}

# case, --model, {sub-folder: HF class}, whether the root is a model itself
CASES = [
    ("dpo_llama", "dpo", {"ref_model": "LlamaForCausalLM"}, True),
    ("dpr", "dpr", {"q_encoder": "DPRQuestionEncoder", "ctx_encoder": "DPRContextEncoder"}, False),
    ("dragon", "dragon", {"q_encoder": "BertModel", "ctx_encoder": "BertModel"}, False),
    ("llava", "llava", {"image_model": "CLIPVisionModel", "text_model": "LlavaLlamaForCausalLM"}, False),
    ("mmsimple_llava", "mmsimple-llava", {"image_model": "CLIPVisionModel", "text_model": "LlavaLlamaForCausalLM"},
     False),
]


def open_case(case: str, model: str):
    return ckptfs.open(FIXTURES / case / "cs" / "checkpoint.mdl", model=model)


def copy_folder(tree, folder: str, dest: Path) -> Path:
    """The files of one served folder, written out (what `cp -r mnt/<folder>` gives)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in tree.listdir(folder):
        path = f"{folder}/{name}" if folder else name
        if stat.S_ISDIR(tree.attr(path).mode):
            continue
        (dest / name).write_bytes(b"".join(tree.iter_blocks(path)))
    return dest


@pytest.mark.parametrize("case, model, folders, root_model", CASES, ids=[c[0] for c in CASES])
def test_each_component_is_a_complete_model_folder(case, model, folders, root_model):
    tree = open_case(case, model)
    try:
        top = set(tree.listdir(""))
        assert set(folders) <= top and {"README.txt", "cs", "torch", "tensors"} <= top
        assert ("config.json" in top) == root_model and (WEIGHTS <= top) == root_model
        readme = tree.read("README.txt", 0, 1 << 20).decode()
        for folder, hf_class in folders.items():
            names = set(tree.listdir(folder))
            assert {"config.json"} | WEIGHTS <= names, folder
            config = json.loads(tree.read(f"{folder}/config.json", 0, 1 << 20))
            assert config["architectures"] == [hf_class]
            assert not any(n.endswith(".index.json") for n in names), folder
            assert BIN_FOLDER <= set(tree.listdir(f"{folder}/bin")), folder
            assert f"hf: {folder}/ holds {hf_class}" in readme, f"README.txt does not say what {folder}/ is"
    finally:
        tree.close()


def test_single_component_tree_is_unchanged():
    from ckptfs.mapping.to_hf import to_hf
    from ckptfs.readers import open_checkpoint

    with open_checkpoint(FIXTURES / "gpt2" / "cs" / "checkpoint.mdl") as ck:
        hf = to_hf(ck)
    assert hf.components == [] and list(hf.folders()) == [""]
    generation = {"generation_config.json"} if hf.generation_config else set()
    tree = open_case("gpt2", None)
    try:
        assert set(tree.listdir("")) == {"README.txt", "config.json", "cs", "torch", "tensors", "hub"} | WEIGHTS | generation
        dirs = {n for n in tree.listdir("") if stat.S_ISDIR(tree.attr(n).mode)}
        assert dirs == {"cs", "torch", "tensors", "bin", "hub"}
        assert " holds " not in tree.read("README.txt", 0, 1 << 20).decode()
    finally:
        tree.close()


@pytest.mark.parametrize("case, model", [("llava", "llava"), ("mmsimple_llava", "mmsimple-llava")])
def test_llava_folders_load_and_match_the_original(case, model, tmp_path):
    from transformers import CLIPVisionModel, LlamaForCausalLM

    tree = open_case(case, model)
    try:
        image = copy_folder(tree, "image_model", tmp_path / "image_model")
        text = copy_folder(tree, "text_model", tmp_path / "text_model")
    finally:
        tree.close()
    expected = FIXTURES / case / "expected_hf" / "image_model" / "preprocessor_config.json"
    assert json.loads((image / "preprocessor_config.json").read_text()) == json.loads(expected.read_text())

    g = torch.Generator().manual_seed(3)
    pixels = torch.randn(2, 3, 32, 32, generator=g)
    ours, original = (CLIPVisionModel.from_pretrained(p).eval() for p in (image, FIXTURES / case / "hf" / "image_model"))
    with torch.no_grad():
        assert torch.equal(ours(pixel_values=pixels).last_hidden_state,
                           original(pixel_values=pixels).last_hidden_state)

    # LLaVA's layout: transformers' LlamaForCausalLM loads it (leaving model.mm_projector aside)
    ids = torch.randint(3, 128, (2, 9), generator=g)
    ours = LlamaForCausalLM.from_pretrained(text, attn_implementation="eager").eval()
    original = LlamaForCausalLM.from_pretrained(FIXTURES / case / "hf" / "text_model", attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, original(ids).logits)
    ours_sd, original_sd = load_file(str(text / "model.safetensors")), load_file(
        str(FIXTURES / case / "hf" / "text_model" / "model.safetensors"))
    projector = sorted(k for k in original_sd if "mm_projector" in k)
    assert projector == ["model.mm_projector.0.bias", "model.mm_projector.0.weight", "model.mm_projector.2.bias",
                         "model.mm_projector.2.weight"]
    for k in projector:
        assert torch.equal(ours_sd[k], original_sd[k]), k
    config = json.loads((text / "config.json").read_text())
    assert config["mm_vision_tower"] == "../image_model" and config["mm_hidden_size"] == 32


def test_dragon_encoders_give_the_original_hidden_states(tmp_path):
    """Dragon+'s CS encoders have no pooler: everything else must reproduce the original BertModels."""
    from transformers import BertModel

    tree = open_case("dragon", "dragon")
    try:
        readme = tree.read("README.txt", 0, 1 << 20).decode()
        folders = {f: copy_folder(tree, f, tmp_path / f) for f in ("q_encoder", "ctx_encoder")}
    finally:
        tree.close()
    assert "no pooler" in readme
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(5))
    for folder, path in folders.items():
        ours = BertModel.from_pretrained(path, attn_implementation="eager").eval()
        original = BertModel.from_pretrained(FIXTURES / "dragon" / "hf" / folder, attn_implementation="eager").eval()
        with torch.no_grad():
            assert torch.equal(ours(ids).last_hidden_state, original(ids).last_hidden_state), folder


def test_dpo_reference_model_is_served_beside_the_policy(tmp_path):
    from transformers import LlamaForCausalLM

    tree = open_case("dpo_llama", "dpo")
    try:
        readme = tree.read("README.txt", 0, 1 << 20).decode()
        ref = copy_folder(tree, "ref_model", tmp_path / "ref_model")
        root_config = json.loads(tree.read("config.json", 0, 1 << 20))
    finally:
        tree.close()
    assert root_config["architectures"] == ["LlamaForCausalLM"]
    assert "(root)/ holds LlamaForCausalLM" in readme and "model.dpo.beta" in readme
    # the fixture's reference model is the policy's copy made by the converter: both equal the original
    ours = LlamaForCausalLM.from_pretrained(ref).state_dict()
    original = LlamaForCausalLM.from_pretrained(FIXTURES / "dpo_llama" / "hf").state_dict()
    assert ours.keys() == original.keys()
    for k, v in original.items():
        assert torch.equal(ours[k], v), k
