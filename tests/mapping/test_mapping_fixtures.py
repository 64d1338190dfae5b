"""CS -> HF details the conformance test (tests/project/test_conformance.py) does not cover: converter order, and the cases
without an hf/ folder of their own (bf16_llama, train_gpt2) against the model they were made from."""
from __future__ import annotations

import json

import pytest
import torch

from ckptfs.mapping.to_hf import to_hf
from helpers.mapping import FIXTURES, open_fixture, to_torch

CASES = ["gpt2", "llama", "mistral", "mixtral", "gemma2", "bf16_llama", "train_gpt2"]


@pytest.fixture(scope="module", params=CASES)
def converted(request):
    case = request.param
    ckpt = open_fixture(case)
    hf = to_hf(ckpt)  # params.yaml next to the checkpoint is found on its own
    yield case, hf
    ckpt.close()


def expected_keys(case):
    return json.loads((FIXTURES / case / "expected_hf" / "keys.json").read_text())["tensors"]


def test_order_follows_converter(converted):
    """The tensors ckptfs writes come in the converter's order (it leaves out tied copies and legacy buffers)."""
    case, hf = converted
    ours = [n for n, _ in hf.tensors]
    assert ours == [n for n in expected_keys(case) if n in set(ours)]


# cases without an hf/ folder of their own: the HF model they were made from
SOURCE_MODEL = {"bf16_llama": "llama", "train_gpt2": "gpt2"}


def test_names_as_the_source_model_saves_them(converted):
    """bf16_llama / train_gpt2 have no hf/ of their own: their names are those of the model they came from."""
    from safetensors import safe_open

    case, hf = converted
    source = SOURCE_MODEL.get(case, case)
    with safe_open(str(FIXTURES / source / "hf" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {n for n, _ in hf.tensors} == names


def test_bf16_llama_equals_llama_cast():
    from safetensors.torch import load_file

    ckpt = open_fixture("bf16_llama")
    hf = to_hf(ckpt)
    original = load_file(str(FIXTURES / "llama" / "hf" / "model.safetensors"))
    for name, t in hf.tensors:
        assert torch.equal(to_torch(t).view(torch.int16), original[name].to(torch.bfloat16).view(torch.int16)), name
    ckpt.close()


def test_bf16_llama_logits_equal_original_cast(tmp_path):
    from transformers import AutoModelForCausalLM

    from safetensors.torch import save_file

    ckpt = open_fixture("bf16_llama")
    hf = to_hf(ckpt)
    (tmp_path / "config.json").write_text(json.dumps(hf.config))
    save_file({n: to_torch(t) for n, t in hf.tensors}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    kw = {"dtype": torch.bfloat16, "attn_implementation": "eager"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path, **kw)
    original = AutoModelForCausalLM.from_pretrained(FIXTURES / "llama" / "hf", **kw)
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(7))
    model.eval(), original.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, original(input_ids=ids).logits)
    ckpt.close()


def test_bf16_llama_config_says_bfloat16():
    hf = to_hf(open_fixture("bf16_llama"))
    assert hf.config["torch_dtype"] == "bfloat16"
    assert all(t.dtype.name == "bfloat16" for _, t in hf.tensors)
