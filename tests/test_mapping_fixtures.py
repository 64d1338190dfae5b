"""CS -> HF on the genuine converter fixtures: bit-identical tensors, same names, loadable config, same logits."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch

from ckptfs.mapping.convert import to_hf
from test_mapping_helpers import FIXTURES, open_fixture

CASES = ["gpt2", "llama", "mistral", "mixtral", "gemma2", "bf16_llama", "train_gpt2"]
# cases whose original HF model is stored (bf16_llama is the llama model cast to bfloat16)
HF_SOURCE = {"gpt2": "gpt2", "llama": "llama", "mistral": "mistral", "mixtral": "mixtral", "gemma2": "gemma2",
             "bf16_llama": "llama"}


def to_torch(t) -> torch.Tensor:
    """A virtual tensor's bytes as a torch tensor of its real dtype."""
    raw = t.read_all()
    dtype = getattr(torch, t.dtype.name)
    if raw.size == 0:
        return torch.empty(t.shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw.tobytes()), dtype=dtype).reshape(t.shape).clone()


@pytest.fixture(scope="module", params=CASES)
def converted(request):
    case = request.param
    ckpt = open_fixture(case)
    hf = to_hf(ckpt)  # params.yaml next to the checkpoint is found on its own
    yield case, hf
    ckpt.close()


def expected_keys(case):
    return json.loads((FIXTURES / case / "expected_hf" / "keys.json").read_text())["tensors"]


def test_names_and_order_match_converter(converted):
    case, hf = converted
    assert [n for n, _ in hf.tensors] == list(expected_keys(case))


def test_every_tensor_matches_converter_sha256(converted):
    case, hf = converted
    exp = expected_keys(case)
    got = dict(hf.tensors)
    for name, e in exp.items():
        t = got[name]
        assert list(t.shape) == e["shape"], name
        assert t.dtype.name == e["dtype"], name
        assert hashlib.sha256(t.read_all().tobytes()).hexdigest() == e["sha256"], name


def test_tensors_bit_identical_to_original_hf(converted):
    from safetensors.torch import load_file

    case, hf = converted
    if case not in HF_SOURCE:
        pytest.skip("train_gpt2 has no stored HF model (its weights took an optimizer step)")
    original = load_file(str(FIXTURES / HF_SOURCE[case] / "hf" / "model.safetensors"))
    got = {n: to_torch(t) for n, t in hf.tensors}
    for name, ref in original.items():
        if case == "bf16_llama":
            ref = ref.to(torch.bfloat16)
        assert got[name].dtype == ref.dtype, name
        if case == "gemma2" and "norm" in name:
            # the converter's float32 (w + 1) - 1 round trip; exactness is checked against its sha256
            assert torch.allclose(got[name], ref, rtol=0, atol=1e-6), name
            continue
        assert torch.equal(got[name].view(torch.uint8) if ref.dtype == torch.bfloat16 else got[name],
                           ref.view(torch.uint8) if ref.dtype == torch.bfloat16 else ref), name
    # names the original lacks are exactly the converter's additions listed in the manifest
    manifest = json.loads((FIXTURES / HF_SOURCE[case] / "MANIFEST.json").read_text())
    added = set(manifest["roundtrip"]["added_hf_keys"])
    assert set(got) - set(original) == added


def test_config_loads_with_transformers(converted, tmp_path):
    from transformers import AutoConfig

    case, hf = converted
    (tmp_path / "config.json").write_text(json.dumps(hf.config))
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert cfg.model_type == hf.config["model_type"]
    assert cfg.architectures == [hf.hf_class]


# deliberate differences from the converter's config.json (see gemma2.yaml)
CONFIG_DIFFERENCES = {("gemma2", "hidden_activation")}


def test_config_agrees_with_converter(converted):
    case, hf = converted
    expected = json.loads((FIXTURES / case / "expected_hf" / "config.json").read_text())
    for key, value in expected.items():
        if (case, key) in CONFIG_DIFFERENCES:
            continue
        assert key in hf.config, key
        assert hf.config[key] == value, key
    if case == "gemma2":
        assert hf.config["hidden_activation"] == "gelu_pytorch_tanh"
        assert any("gelu_pytorch_tanh" in w for w in hf.warnings)


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_logits_equal_original_model(converted, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    case, hf = converted
    if case not in HF_SOURCE:
        pytest.skip("train_gpt2 has no stored HF model")
    dtype = torch.bfloat16 if case == "bf16_llama" else torch.float32
    original = AutoModelForCausalLM.from_pretrained(FIXTURES / HF_SOURCE[case] / "hf", dtype=dtype,
                                                    attn_implementation="eager")
    (tmp_path / "config.json").write_text(json.dumps(hf.config))
    cfg = AutoConfig.from_pretrained(tmp_path)
    weights = {n: to_torch(t) for n, t in hf.tensors}
    if case == "mixtral":
        # transformers 5 keeps Mixtral experts fused in memory; its loader converts the per-expert hub layout
        save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
        model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype, attn_implementation="eager")
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="eager")
        result = model.load_state_dict(weights, strict=False)
        assert result.missing_keys == []
        manifest = json.loads((FIXTURES / HF_SOURCE[case] / "MANIFEST.json").read_text())
        buffers = {k for k in manifest["roundtrip"]["added_hf_keys"] if not k.endswith("lm_head.weight")}
        assert set(result.unexpected_keys) <= buffers  # legacy buffers transformers 5 no longer keeps
    ids = torch.randint(0, hf.config.get("vocab_size", 128), (2, 17), generator=torch.Generator().manual_seed(7))
    assert torch.equal(_logits(model, ids), _logits(original, ids))


def test_bf16_llama_is_llama_cast(converted):
    case, hf = converted
    if case != "bf16_llama":
        pytest.skip("bf16 specific")
    assert hf.config["torch_dtype"] == "bfloat16"
    assert all(t.dtype.name == "bfloat16" for _, t in hf.tensors)
