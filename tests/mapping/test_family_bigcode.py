"""StarCoder, SantaCoder, BTLM and JAIS details the conformance cases cannot show: aliases give the same bytes,
multi-head GPTBigCode (per-head interleaved c_attn) against transformers, muP of CS 2.3+ params kept in BTLM's
config.json under the remote code's names, remote-code notes, and detection of names-less params."""
from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
import torch
import yaml

from ckptfs.errors import ConfigError
from ckptfs.mapping.to_hf import to_hf
from ckptfs.mapping.detect import detect_family
from helpers.mapping import FIXTURES, checkpoint_from_model, open_fixture
from ckptfs.tensor.base import ArrayTensor


def digest(hf) -> dict:
    return {name: hashlib.sha256(t.read_all().tobytes()).hexdigest() for name, t in hf.tensors}


@pytest.mark.parametrize("base,aliases", [
    ("starcoder", ["octocoder", "wizardcoder", "sqlcoder"]),
    ("starcoder-headless", ["octocoder-headless", "wizardcoder-headless", "sqlcoder-headless"]),
])
def test_aliases_give_identical_bytes(base, aliases):
    ckpt = open_fixture("starcoder")
    ref = to_hf(ckpt, model=base)
    for alias in aliases:
        hf = to_hf(ckpt, model=alias)
        assert hf.hf_class == ref.hf_class and hf.config == ref.config
        assert [n for n, _ in hf.tensors] == [n for n, _ in ref.tensors]
        assert digest(hf) == digest(ref)
    ckpt.close()


def test_wizardcoder_params_name_gpt2_stays_gpt2_without_model():
    ckpt = open_fixture("wizardcoder")
    assert detect_family(ckpt).family == "gpt2"
    assert to_hf(ckpt, model="wizardcoder").hf_class == "GPTBigCodeForCausalLM"
    ckpt.close()


def _write_params(tmp_path, case: str, changes: dict, drop=()) -> object:
    doc = yaml.safe_load((FIXTURES / case / "cs" / "params.yaml").read_text())
    doc["model"].update(changes)
    for key in drop:
        doc["model"].pop(key, None)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize("case,family", [("starcoder", "starcoder"), ("santacoder", "santacoder"),
                                         ("btlm", "btlm"), ("jais", "jais")])
def test_names_less_params_are_detected(tmp_path, case, family):
    """Without `name:` the tensor names (and, where they are shared, the params) pick the family."""
    ckpt = open_fixture(case)
    params = _write_params(tmp_path, case, {}, drop=() if case == "jais" else ("name",))
    det = detect_family(ckpt, params)
    assert det.family == family, det.reason
    ckpt.close()


def test_gpt2_and_mha_checkpoints_are_not_taken_for_starcoder(tmp_path):
    ckpt = open_fixture("gpt2")
    params = _write_params(tmp_path, "gpt2", {}, drop=("name",))
    assert detect_family(ckpt, params).family == "gpt2"
    ckpt.close()


# -- multi-head GPTBigCode: c_attn holds per-head [q_h; k_h; v_h] blocks --------------------------------------------


def test_multi_head_starcoder_matches_transformers(tmp_path):
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    hidden, heads, d = 32, 4, 8
    cfg = GPTBigCodeConfig(vocab_size=64, n_positions=16, n_embd=hidden, n_layer=2, n_head=heads, n_inner=64,
                           multi_query=False, activation_function="gelu", resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    torch.manual_seed(3)
    original = GPTBigCodeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in original.parameters():
            p.normal_(0, 0.5)
    sd = {k: v.detach().numpy().copy() for k, v in original.state_dict().items()}
    cs = {"embedding_layer.word_embeddings.weight": sd["transformer.wte.weight"],
          "embedding_layer.position_embeddings.embed.weight": sd["transformer.wpe.weight"],
          "lm_head.weight": sd["transformer.wte.weight"].copy()}
    for i in range(2):
        h, c = f"transformer.h.{i}.", f"transformer_decoder.layers.{i}."
        for p in ("weight", "bias"):
            fused = sd[f"{h}attn.c_attn.{p}"]
            per_head = fused.reshape(heads, 3, d, *fused.shape[1:])  # HF splits c_attn per head into q, k, v
            for j, name in enumerate(("q", "k", "v")):
                cs[f"{c}self_attn.proj_{name}_dense_layer.{p}"] = per_head[:, j].reshape(hidden, *fused.shape[1:])
            cs[f"{c}self_attn.proj_output_dense_layer.{p}"] = sd[f"{h}attn.c_proj.{p}"]
            cs[f"{c}norm1.{p}"] = sd[f"{h}ln_1.{p}"]
            cs[f"{c}norm3.{p}"] = sd[f"{h}ln_2.{p}"]
            cs[f"{c}ffn.ffn.0.linear_layer.{p}"] = sd[f"{h}mlp.c_fc.{p}"]
            cs[f"{c}ffn.ffn.1.linear_layer.{p}"] = sd[f"{h}mlp.c_proj.{p}"]
    for p in ("weight", "bias"):
        cs[f"transformer_decoder.norm.{p}"] = sd[f"transformer.ln_f.{p}"]
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"model": {
        "name": "starcoder", "vocab_size": 64, "hidden_size": hidden, "num_heads": heads, "num_hidden_layers": 2,
        "filter_size": 64, "max_position_embeddings": 16, "attention_module": "aiayn_attention",
        "attention_type": "scaled_dot_product", "nonlinearity": "gelu", "dropout_rate": 0.0,
        "layer_norm_epsilon": 1e-5, "share_embedding_weights": True}}))
    ckpt = checkpoint_from_model(tmp_path / "c.mdl", {k: ArrayTensor(np.ascontiguousarray(v)) for k, v in cs.items()})
    hf = to_hf(ckpt, config=params)
    assert hf.config["multi_query"] is False
    ours = {n: torch.from_numpy(t.read_all().copy()) for n, t in hf.tensors}
    assert set(ours) == set(sd) - {"lm_head.weight"}
    for name, t in ours.items():
        assert torch.equal(t, torch.from_numpy(sd[name])), name
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text(json.dumps(hf.config))
    from safetensors.torch import save_file

    save_file(ours, str(tmp_path / "out" / "model.safetensors"), metadata={"format": "pt"})
    rebuilt = GPTBigCodeForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    original.config._attn_implementation = "eager"
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(rebuilt(ids).logits, original(ids).logits)


# -- BTLM / JAIS: muP stays in config.json ------------------------------------------------------------------------


MUP_2_10 = {"mup_base_hidden_size": 16, "mup_base_filter_size": 32, "output_logits_alpha": 2.22}


@pytest.mark.parametrize("case,model", [("btlm", "btlm"), ("btlm_headless", "btlm-headless"), ("jais", "jais")])
def test_cs_2_10_mup_keys_become_the_remote_code_fields(tmp_path, case, model):
    """The converter drops these keys; CS logits x alpha * base / width = HF mup_output_alpha * mup_width_scale."""
    ckpt = open_fixture(case)
    hf = to_hf(ckpt, config=_write_params(tmp_path, case, MUP_2_10), model=model)
    assert hf.config["mup_width_scale"] == 0.5  # 16 / 32
    assert hf.config["mup_output_alpha"] == 2.22
    assert hf.config["mup_embeddings_scale"] == 14.6 and hf.config["mup_scale_qk_dot_by_d"] is True
    filter_notes = [w for w in hf.warnings if "mup_base_filter_size=32" in w]
    assert len(filter_notes) == 1 and "learning rates" in filter_notes[0]
    assert not any("mup_base_hidden_size" in w or "output_logits_alpha" in w for w in hf.warnings)
    before = to_hf(ckpt, model=model)
    assert digest(hf) == digest(before), "muP is not folded into the weights"
    ckpt.close()


def test_mup_logits_scaled_by_sqrt_width(tmp_path):
    ckpt = open_fixture("btlm")
    hf = to_hf(ckpt, config=_write_params(tmp_path, "btlm", {**MUP_2_10, "scale_output_logits_by_d": False}))
    cs_scale = 2.22 / math.sqrt(32 / 16)
    assert math.isclose(hf.config["mup_output_alpha"] * hf.config["mup_width_scale"], cs_scale, rel_tol=1e-12)
    ckpt.close()


def test_legacy_output_logits_scale(tmp_path):
    ckpt = open_fixture("btlm")
    hf = to_hf(ckpt, config=_write_params(tmp_path, "btlm", {"output_logits_scale": 1.11}))
    assert hf.config["mup_output_alpha"] == 1.11 and hf.config["mup_width_scale"] == 1.0
    ckpt.close()


def test_btlm_alibi_scaling_and_unsupported_attention_alpha(tmp_path):
    ckpt = open_fixture("btlm")
    hf = to_hf(ckpt, config=_write_params(tmp_path, "btlm", {"pos_scaling_factor": 2.0}))
    assert hf.config["alibi_scaling"] == {"type": "linear", "factor": 2.0}
    with pytest.raises(ConfigError, match="attention_logits_alpha"):
        to_hf(ckpt, config=_write_params(tmp_path, "btlm", {**MUP_2_10, "attention_logits_alpha": 2.0}))
    ckpt.close()


# -- remote code ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case,model,repo", [
    ("btlm", "btlm", "cerebras/btlm-3b-8k-base"), ("btlm_headless", "btlm-headless", "cerebras/btlm-3b-8k-base"),
    ("jais", "jais", "inceptionai/jais-30b-v3"), ("santacoder", "santacoder", "bigcode/santacoder"),
    ("santacoder_headless", "santacoder-headless", "bigcode/santacoder")])
def test_remote_code_classes_say_trust_remote_code_and_where(case, model, repo):
    ckpt = open_fixture(case)
    hf = to_hf(ckpt, model=model)
    notes = [w for w in hf.warnings if "trust_remote_code=True" in w]
    assert len(notes) == 1 and repo in notes[0] and hf.hf_class in notes[0]
    ckpt.close()


def test_transformers_classes_have_no_remote_code_note():
    ckpt = open_fixture("starcoder")
    assert not any("trust_remote_code" in w for w in to_hf(ckpt).warnings)
    ckpt.close()
