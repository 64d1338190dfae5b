"""Issue 15 acceptance through a real FUSE mount, with loaders nobody here wrote, as a user would run them:
transformers' pipeline + AutoTokenizer + chat template through a tokenizer overlay; greedy ``generate()`` equal to
the original model's ids (EOS respected: one prompt in eight stops early on the llama fixture); accelerate's
``load_checkpoint_and_dispatch(model, mount)`` on an unsharded and a sharded mount; peft LoRA on a model loaded from
the mount; and llama.cpp / vLLM / TGI-style consumers simulated without gguf (which files they pick, their names)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from helpers.cases import state_dicts_equal
from helpers import FIXTURES, needs_fuse, real_env
from helpers.fuse import mounted
from helpers.tokens import make_tokenizer, prompts

pytestmark = [needs_fuse, pytest.mark.timeout(900)]

GREEDY = {"max_new_tokens": 20, "do_sample": False}


def ckpt(case: str):
    return FIXTURES / case / "cs" / "checkpoint.mdl"


def original(case: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(FIXTURES / case / "hf", attn_implementation="eager").eval()


def prompt_ids(n: int = 8) -> torch.Tensor:
    return torch.randint(4, 128, (n, 6), generator=torch.Generator().manual_seed(11))


def generate_each(model, ids: torch.Tensor) -> list:
    with torch.no_grad():
        return [model.generate(ids[i:i + 1], **GREEDY)[0].tolist() for i in range(len(ids))]


# -- generation ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["llama", "gpt_neox", "falcon", "bloom", "gemma2"])
def test_greedy_generate_through_the_mount_equals_the_original(case):
    from transformers import AutoModelForCausalLM

    ids = prompt_ids()
    want = generate_each(original(case), ids)
    with mounted(ckpt(case), "--views", "hf", env=real_env()) as mnt:
        gen = json.loads((mnt / "generation_config.json").read_text())
        ours = AutoModelForCausalLM.from_pretrained(str(mnt), attn_implementation="eager").eval()
        got = generate_each(ours, ids)
    assert got == want
    assert "eos_token_id" in gen
    if case == "llama":  # the prompt set really exercises EOS: without the id one continuation would run on
        assert any(len(g) < 6 + GREEDY["max_new_tokens"] for g in want)


def test_an_overlay_generation_config_gives_the_originals_ids_where_the_converter_differs(tmp_path):
    """StarCoder: the converter writes StarCoder's tokenizer ids (0); the fixture model used the class defaults."""
    from transformers import AutoModelForCausalLM

    ref = json.loads((FIXTURES / "starcoder" / "hf" / "config.json").read_text())
    over = tmp_path / "over"
    over.mkdir()
    (over / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ref["bos_token_id"], "eos_token_id": ref["eos_token_id"]}))
    ids = prompt_ids()
    want = generate_each(original("starcoder"), ids)
    with mounted(ckpt("starcoder"), "--views", "hf", "--overlay", over, env=real_env()) as mnt:
        cfg = json.loads((mnt / "config.json").read_text())
        assert cfg["eos_token_id"] == ref["eos_token_id"]
        ours = AutoModelForCausalLM.from_pretrained(str(mnt), attn_implementation="eager").eval()
        assert generate_each(ours, ids) == want


def test_pipeline_tokenizer_and_chat_template_through_an_overlay(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    tok_dir = make_tokenizer(tmp_path / "tok")
    texts = prompts(4)
    ref = pipeline("text-generation", model=original("llama"), tokenizer=AutoTokenizer.from_pretrained(tok_dir))
    want = [r[0]["generated_text"] for r in ref(texts, **GREEDY)]
    with mounted(ckpt("llama"), "--views", "hf", "--overlay", tok_dir, env=real_env()) as mnt:
        pipe = pipeline("text-generation", model=str(mnt))
        got = [r[0]["generated_text"] for r in pipe(texts, **GREEDY)]
        tok = AutoTokenizer.from_pretrained(str(mnt))
        chat = tok.apply_chat_template([{"role": "user", "content": texts[0]}], tokenize=False)
        model = AutoModelForCausalLM.from_pretrained(str(mnt / "bin"))  # the .bin folder has the tokenizer too
        assert AutoTokenizer.from_pretrained(str(mnt / "bin")).eos_token_id == 2 and model.config.eos_token_id == 2
    assert got == want
    assert chat.strip() == texts[0]


# -- accelerate, peft ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shard", [None, "20KB"], ids=["unsharded", "sharded"])
def test_accelerate_load_checkpoint_and_dispatch(shard):
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import AutoConfig, AutoModelForCausalLM

    want = original("llama").state_dict()
    args = ["--views", "hf"] + (["--max-shard-size", shard] if shard else [])
    with mounted(ckpt("llama"), *args, env=real_env()) as mnt:
        assert len(list(mnt.glob("*.index.json"))) == (1 if shard else 0)
        for folder in (mnt, mnt / "bin"):
            with init_empty_weights():
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)))
            model.tie_weights()
            model = load_checkpoint_and_dispatch(model, str(folder), device_map="auto")
            state_dicts_equal(model.state_dict(), want)


def test_peft_lora_on_the_mounted_model(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    ids = prompt_ids(2)
    with mounted(ckpt("llama"), "--views", "hf", env=real_env()) as mnt:
        base = AutoModelForCausalLM.from_pretrained(str(mnt)).eval()
        base_keys = set(base.state_dict())
        with torch.no_grad():
            plain = base(ids).logits
        lora = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        with torch.no_grad():
            tuned = lora(ids).logits
        assert not torch.equal(tuned, plain)
        lora.save_pretrained(tmp_path / "adapter")
        again = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(mnt)), tmp_path / "adapter").eval()
        with torch.no_grad():
            assert torch.equal(again(ids).logits, tuned)
        merged = again.merge_and_unload()
        assert set(merged.state_dict()) == base_keys


# -- llama.cpp / vLLM / TGI-style consumers (simulated) ----------------------------------------------------------


def gguf_converter_parts(folder) -> list:
    """The weight files llama.cpp's convert_hf_to_gguf.py reads: model*.safetensors (or, with none,
    pytorch_model*.bin) directly in the folder, as its part-name search does; an index, when present, names them."""
    names = sorted(os.listdir(folder))
    parts = [n for n in names if n.startswith("model") and n.endswith(".safetensors")]
    if not parts:
        parts = [n for n in names if n.startswith("pytorch_model") and n.endswith(".bin")]
    return parts


def server_weight_files(folder) -> list:
    """What vLLM/TGI-style servers load: *.safetensors in the folder, filtered by the index's weight map."""
    names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        used = set(json.loads(open(index).read())["weight_map"].values())
        names = [n for n in names if n in used]
    return names


@pytest.mark.parametrize("shard", [None, "20KB"], ids=["unsharded", "sharded"])
def test_llama_cpp_and_server_style_consumers_find_one_complete_model(shard, tmp_path):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    tok_dir = make_tokenizer(tmp_path / "tok")
    want = set(original("llama").state_dict()) - {"lm_head.weight"}  # tied: save_pretrained leaves it out
    args = ["--views", "hf", "--overlay", tok_dir] + (["--max-shard-size", shard] if shard else [])
    with mounted(ckpt("llama"), *args, env=real_env()) as mnt:
        cfg = json.loads((mnt / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["eos_token_id"] == 2
        assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(mnt))
        parts = gguf_converter_parts(mnt)
        assert parts == server_weight_files(mnt)
        assert (len(parts) > 1) == bool(shard) and (parts == ["model.safetensors"]) == (not shard)
        if shard:
            index = json.loads((mnt / "model.safetensors.index.json").read_text())
            assert sorted(set(index["weight_map"].values())) == parts
        names = []
        for p in parts:
            with safe_open(str(mnt / p), "pt") as f:
                names += list(f.keys())
        assert len(names) == len(set(names)) and set(names) == want  # every tensor once: no second format mixed in
        assert gguf_converter_parts(mnt / "bin")[0].startswith("pytorch_model")
        assert AutoConfig.from_pretrained(str(mnt)).vocab_size == 128
        assert AutoTokenizer.from_pretrained(str(mnt)).eos_token_id == cfg["eos_token_id"]
