"""Params discovery, CS -> HF config translation, guards, warnings, muP folding, headless variants, laziness."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from ckptfs.errors import ConfigError, MappingError
from ckptfs.mapping.params.to_hf_config import convert_config
from ckptfs.mapping.to_hf import to_hf
from ckptfs.mapping.detect import detect_family
from ckptfs.mapping.lang.families import default_registry
from helpers.mapping import (FIXTURES, RecordingTensor, checkpoint_from_model, model_tensors, open_fixture, open_path,
                         params_of, write_yaml)


def copy_ckpt(case, dest):
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURES / case / "cs" / "checkpoint.mdl", dest)
    return dest


def hf_config(case, model_changes=None, drop=(), **kw):
    """convert_config for a fixture's params with edits (no tensors involved)."""
    reg = default_registry()
    params = params_of(case)["model"]
    params.update(model_changes or {})
    for k in drop:
        params.pop(k)
    spec = reg.for_cs_name(params.get("name", case)) if "name" in params else reg.family(case)
    return convert_config(spec, spec.variant(kw.get("model")), params, None)


# -- params discovery ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["stem", "train", "parent_train", "configs", "explicit"])
def test_params_found_in_modelzoo_layouts(tmp_path, layout):
    params = params_of("llama")
    if layout == "stem":
        ckpt = copy_ckpt("llama", tmp_path / "checkpoint_100.mdl")
        where = write_yaml(tmp_path / "checkpoint_100.yaml", params)
    elif layout == "train":
        ckpt = copy_ckpt("llama", tmp_path / "run" / "checkpoint_100.mdl")
        where = write_yaml(tmp_path / "run" / "train" / "params_train.yaml", params)
    elif layout == "parent_train":
        ckpt = copy_ckpt("llama", tmp_path / "run" / "ckpts" / "checkpoint_100.mdl")
        where = write_yaml(tmp_path / "run" / "train" / "params_train.yaml", params)
    elif layout == "configs":
        ckpt = copy_ckpt("llama", tmp_path / "checkpoint_100.mdl")
        where = write_yaml(tmp_path / "configs" / "llama_tiny.yaml", params)
    else:
        ckpt = copy_ckpt("llama", tmp_path / "checkpoint_100.mdl")
        write_yaml(tmp_path / "params.yaml", {"model": {"name": "gpt2"}})  # would be wrong; explicit wins
        where = write_yaml(tmp_path / "elsewhere" / "mine.yaml", params)
    with open_path(ckpt) as ck:
        hf = to_hf(ck, config=where if layout == "explicit" else None)
    assert hf.params_path == where
    assert hf.family == "llama" and hf.config["num_key_value_heads"] == 2


def test_trainer_layout_and_trainer_lists(tmp_path):
    model = params_of("llama")["model"]
    ckpt = copy_ckpt("llama", tmp_path / "c.mdl")
    write_yaml(tmp_path / "params.yaml", {"trainer": {"init": {"model": model}, "fit": {}}})
    with open_path(ckpt) as ck:
        assert to_hf(ck).config["hidden_size"] == 32
    other = dict(model, hidden_size=999)
    write_yaml(tmp_path / "params.yaml", {"trainer": [{"trainer": {"init": {"model": other}}},
                                                      {"trainer": {"init": {"model": model}}}]})
    with open_path(ckpt) as ck:
        with pytest.raises(ConfigError, match="2 trainers.*--trainer-index"):
            to_hf(ck)
        det = detect_family(ck)  # still recognised from the tensor names, and says why params are unusable
        assert det.family == "llama" and "--trainer-index" in det.reason
        assert to_hf(ck, trainer_index=1).config["hidden_size"] == 32
        with pytest.raises(ConfigError, match="out of range"):
            to_hf(ck, trainer_index=5)


def test_params_from_checkpoint_metadata_when_no_yaml(tmp_path):
    ckpt = copy_ckpt("train_gpt2", tmp_path / "lonely.mdl")
    exp = json.loads((FIXTURES / "train_gpt2" / "expected_hf" / "keys.json").read_text())["tensors"]
    with open_path(ckpt) as ck:
        det = detect_family(ck)
        hf = to_hf(ck)
    assert det.family == "gpt2" and "__metadata__" in det.reason
    assert hf.params_path is None
    assert [n for n, _ in hf.tensors] == [n for n in exp if n != "lm_head.weight" and not n.endswith(".attn.bias")
                                          and not n.endswith(".attn.masked_bias")]
    assert hf.config["n_embd"] == 32 and hf.config["tie_word_embeddings"] is True


def test_missing_params_is_a_clear_error_but_detection_still_works(tmp_path):
    ckpt = copy_ckpt("gpt2", tmp_path / "alone.mdl")
    with open_path(ckpt) as ck:
        with pytest.raises(ConfigError, match="no Cerebras params YAML found.*--config"):
            to_hf(ck)
        det = detect_family(ck)
    assert det.family == "gpt2" and "tensor names" in det.reason and det.params_path is None


def test_params_without_model_section(tmp_path):
    ckpt = copy_ckpt("gpt2", tmp_path / "c.mdl")
    bad = write_yaml(tmp_path / "p.yaml", {"optimizer": {"lr": 1}})
    with open_path(ckpt) as ck:
        with pytest.raises(ConfigError, match="no 'model' section"):
            to_hf(ck, config=bad)


# -- config translation ----------------------------------------------------------------------------


def test_gpt2_attention_type_value_map():
    assert hf_config("gpt2", {"attention_type": "dot_product"}).hf["scale_attn_weights"] is False
    with pytest.raises(ConfigError, match="attention_type='scaled_cosine'.*supported"):
        hf_config("gpt2", {"attention_type": "scaled_cosine"})


def test_gpt2_dropout_defaults_follow_dropout_rate():
    hf = hf_config("gpt2", {"dropout_rate": 0.3}, drop=("embedding_dropout_rate", "attention_dropout_rate")).hf
    assert hf["embd_pdrop"] == hf["attn_pdrop"] == hf["resid_pdrop"] == 0.3


@pytest.mark.parametrize("key,value,match", [
    ("norm_type", "layernorm", "norm_type='layernorm' cannot be converted"),
    ("position_embedding_type", "alibi", "position_embedding_type"),
    ("nonlinearity", "gelu_new", "nonlinearity='gelu_new' has no HF equivalent"),
    ("rotary_dim", 4, r"rotary_dim \(4\) must equal the head size \(8\)"),
    ("attention_sliding_window_length", 16, "sliding window"),
])
def test_llama_guards_reject_what_hf_cannot_express(key, value, match):
    with pytest.raises(ConfigError, match=match):
        hf_config("llama", {key: value})


def test_missing_required_key_names_it():
    with pytest.raises(ConfigError, match="params lack model.rotary_dim"):
        hf_config("llama", drop=("rotary_dim",))


def test_unconverted_keys_are_reported_once():
    res = hf_config("mixtral", {"foo_bar": 3, "moe": {"num_experts": 4, "top_k": 2,
                                                      "load_balancing_loss_coef": 0.001, "routing_algorithm": "hash"}})
    from ckptfs.mapping.params.to_hf_config import unused_key_warnings
    spec = default_registry().family("mixtral")
    warnings = unused_key_warnings(res.cs_scope, spec, spec.variant(None))
    assert any("model.foo_bar=3" in w for w in warnings)
    assert any("model.moe.routing_algorithm='hash'" in w for w in warnings)
    assert not any("num_experts" in w or "hidden_size" in w for w in warnings)
    assert len(warnings) == len(set(warnings))


def test_head_dim_from_attention_inner_dim_is_not_dropped():
    res = hf_config("llama", {"attention_inner_dim": 64, "rotary_dim": 16})
    assert res.hf["head_dim"] == 16 and res.hf["num_attention_heads"] == 4


@pytest.mark.parametrize("changes,expected", [
    ({"pos_scaling_factor": 2.0, "pos_scaling_type": "linear"}, {"rope_type": "linear", "factor": 2.0}),
    ({"pos_scaling_factor": 8.0, "pos_scaling_type": "llama3",
      "pos_scaling_extra_args": {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 32}},
     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 32}),
])
def test_rope_scaling_round_trips_into_transformers(tmp_path, changes, expected):
    from transformers import AutoConfig

    hf = hf_config("llama", dict(changes, rope_theta=500000.0)).hf
    assert hf["rope_scaling"] == expected
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = AutoConfig.from_pretrained(tmp_path)
    rope = cfg.rope_parameters
    assert rope["rope_theta"] == 500000.0 and rope["factor"] == expected["factor"]
    assert "type" not in rope  # only rope_type, as a config built by transformers holds it


@pytest.mark.parametrize("family", ["falcon", "gpt_neox", "mistral", "mixtral"])
def test_rope_scaling_loads_as_transformers_builds_it(tmp_path, family):
    """config.json's rope settings load to what the transformers config class builds from them (no legacy
    ``type`` beside ``rope_type``)."""
    from transformers import AutoConfig, CONFIG_MAPPING

    hf = hf_config(family, {"pos_scaling_factor": 2.0, "pos_scaling_type": "linear"}).hf
    (tmp_path / "config.json").write_text(json.dumps(hf))
    loaded = AutoConfig.from_pretrained(tmp_path).rope_parameters
    built = CONFIG_MAPPING[hf["model_type"]](**{k: v for k, v in hf.items() if k != "model_type"}).rope_parameters
    assert loaded == built and loaded["rope_type"] == "linear" and "type" not in loaded


def test_token_ids_reach_generation_config():
    res = hf_config("llama", {"bos_token_id": 1, "eos_token_id": 2})
    assert res.generation == {"bos_token_id": 1, "eos_token_id": 2}
    assert res.hf["bos_token_id"] == 1
    # without ids in the params, LlamaConfig's defaults (tests/views/test_token_ids.py covers the rule)
    assert hf_config("llama").generation == {"bos_token_id": 1, "eos_token_id": 2}


def test_llama_biases_map_to_attention_and_mlp_bias():
    res = hf_config("llama", {"use_projection_bias_in_attention": True, "use_ffn_bias_in_attention": True,
                              "use_ffn_bias": True})
    assert res.hf["attention_bias"] is True and res.hf["mlp_bias"] is True
    with pytest.raises(ConfigError, match="one attention_bias switch"):
        hf_config("llama", {"use_projection_bias_in_attention": True})


# -- muP -------------------------------------------------------------------------------------------


def test_mup_is_folded_into_the_weights(tmp_path):
    ckpt = copy_ckpt("gpt2", tmp_path / "c.mdl")
    params = params_of("gpt2")
    params["model"].update(mup_base_hidden_size=16, output_logits_alpha=4.0, embeddings_scale=3.0,
                           attention_logits_alpha=0.5, share_embedding_weights=True)
    write_yaml(tmp_path / "params.yaml", params)
    with open_path(ckpt) as ck:
        hf = to_hf(ck)
        cs = {k: torch.from_numpy(t.read_all().copy()) for k, t in model_tensors(ck).items()}
        got = {n: torch.from_numpy(t.read_all().copy()) for n, t in hf.tensors}
    assert hf.config["tie_word_embeddings"] is False
    assert torch.equal(got["lm_head.weight"], cs["lm_head.weight"] * (4.0 / (32 / 16)))
    assert torch.equal(got["transformer.wte.weight"], cs["embedding_layer.word_embeddings.weight"] * 3.0)
    assert torch.equal(got["transformer.wpe.weight"], cs["embedding_layer.position_embeddings.embed.weight"] * 3.0)
    pre = "transformer_decoder.layers.0.self_attn."
    k_hf = 0.5 * cs[pre + "proj_k_dense_layer.weight"] / math.sqrt(32 // 4)
    c_attn = got["transformer.h.0.attn.c_attn.weight"]
    assert torch.equal(c_attn[:, 32:64], k_hf.T)
    assert torch.equal(c_attn[:, :32], cs[pre + "proj_q_dense_layer.weight"].T)
    k_bias = 0.5 * cs[pre + "proj_k_dense_layer.bias"] / math.sqrt(8)
    assert torch.equal(got["transformer.h.0.attn.c_attn.bias"][32:64], k_bias)
    assert not any("mup_base_hidden_size" in w or "output_logits_alpha" in w for w in hf.warnings)


def test_mup_without_support_and_unfolded_scales_are_refused():
    with pytest.raises(ConfigError, match="muP"):
        hf_config("mixtral", {"mup_base_hidden_size": 16})
    with pytest.raises(ConfigError, match="embeddings_scale"):
        hf_config("llama", {"embeddings_scale": 2.0})
    with pytest.raises(ConfigError, match="incomplete muP"):
        hf_config("gpt2", {"scale_qk_dot_by_d": True})


# -- variants and detection ------------------------------------------------------------------------


@pytest.mark.parametrize("case,model,hf_model_class", [("llama", "llama-headless", "LlamaModel"),
                                                         ("gpt2", "gpt2-headless", "GPT2Model"),
                                                         ("mistral", "mistral-headless", "MistralModel")])
def test_headless_variants_load_into_the_hf_base_model(tmp_path, case, model, hf_model_class):
    import transformers
    from safetensors.torch import load_file

    with open_fixture(case) as ck:
        hf = to_hf(ck, model=model)
        weights = {n: torch.from_numpy(t.read_all().copy()) for n, t in hf.tensors}
    names = [n for n, _ in hf.tensors]
    assert hf.hf_class == hf_model_class and hf.config["architectures"] == [hf_model_class]
    assert not any(n.startswith(("model.", "transformer.", "lm_head")) for n in names)
    assert any("lm_head" in w and "no LM head" in w for w in hf.warnings)
    (tmp_path / "config.json").write_text(json.dumps(hf.config))
    cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    base = getattr(transformers, hf_model_class)(cfg)
    result = base.load_state_dict(weights, strict=False)
    assert result.missing_keys == []
    assert result.unexpected_keys == []
    original = load_file(str(FIXTURES / case / "hf" / "model.safetensors"))
    prefix = "transformer." if case == "gpt2" else "model."
    for n, t in original.items():
        if n.startswith(prefix):
            assert torch.equal(weights[n[len(prefix):]], t), n


@pytest.mark.parametrize("case,expected", [("gpt2", "gpt2"), ("llama", "llama"), ("mixtral", "mixtral"),
                                           ("gemma2", "gemma2"), ("mistral", "llama")])
def test_family_inferred_from_tensor_names_without_params_name(tmp_path, case, expected):
    ckpt = copy_ckpt(case, tmp_path / "c.mdl")
    params = params_of(case)
    del params["model"]["name"]
    write_yaml(tmp_path / "params.yaml", params)
    with open_path(ckpt) as ck:
        det = detect_family(ck)
        assert det.family == expected, det.reason
        assert "tensor names" in det.reason
        # mistral without a sliding window converts as the equivalent Llama
        hf = to_hf(ck)
        assert hf.family == expected


def test_mistral_recognised_by_its_sliding_window(tmp_path):
    ckpt = copy_ckpt("mistral", tmp_path / "c.mdl")
    params = params_of("mistral")
    del params["model"]["name"]
    params["model"]["attention_sliding_window_length"] = 16
    write_yaml(tmp_path / "params.yaml", params)
    with open_path(ckpt) as ck:
        assert detect_family(ck).family == "mistral"
        assert to_hf(ck).config["sliding_window"] == 16


def test_unknown_model_and_unknown_params_name(tmp_path):
    with open_fixture("gpt2") as ck:
        det = detect_family(ck, model="bort")
        assert det.family is None and "unknown model name 'bort'" in det.reason
        with pytest.raises(MappingError, match="unknown model name 'bort'.*ckptfs models"):
            to_hf(ck, model="bort")
    ckpt = copy_ckpt("gpt2", tmp_path / "c.mdl")
    params = params_of("gpt2")
    params["model"]["name"] = "bort"
    write_yaml(tmp_path / "params.yaml", params)
    with open_path(ckpt) as ck:
        det = detect_family(ck)
        assert det.family is None and "'bort'" in det.reason and "--model" in det.reason
        with pytest.raises(MappingError, match="not a supported model family"):
            to_hf(ck)
        assert to_hf(ck, model="gpt2").family == "gpt2"


def test_model_alias_and_override_warning():
    with open_fixture("llama") as ck:
        hf = to_hf(ck, model="code-llama")
        assert hf.model_name == "code-llama" and hf.hf_class == "LlamaForCausalLM"
    with open_fixture("mistral") as ck:
        hf = to_hf(ck, model="llama")
        assert hf.family == "llama" and any("overridden by --model llama" in w for w in hf.warnings)


def test_legacy_extra_model_prefix_is_accepted(tmp_path):
    with open_fixture("llama") as ck:
        ref = to_hf(ck)
        tensors = {"model." + k: t for k, t in model_tensors(ck).items()}
        write_yaml(tmp_path / "params.yaml", params_of("llama"))
        legacy = checkpoint_from_model(tmp_path / "old.mdl", tensors)
        hf = to_hf(legacy)
        assert [n for n, _ in hf.tensors] == [n for n, _ in ref.tensors]
        for (_, a), (_, b) in zip(hf.tensors, ref.tensors):
            assert np.array_equal(a.read_all(), b.read_all())


def test_unmatched_tensors_are_warned_and_missing_inputs_fail(tmp_path):
    with open_fixture("gpt2") as ck:
        tensors = model_tensors(ck)
    write_yaml(tmp_path / "params.yaml", params_of("gpt2"))
    extra = dict(tensors, **{"transformer_decoder.layers.0.self_attn.proj_q_dense_layer.weight_mask":
                             tensors["lm_head.weight"]})
    hf = to_hf(checkpoint_from_model(tmp_path / "x.mdl", extra))
    assert any("weight_mask" in w and "matches no rule" in w for w in hf.warnings)
    missing = {k: v for k, v in tensors.items() if "layers.1.self_attn.proj_v_dense_layer.weight" not in k}
    with pytest.raises(MappingError, match="needs transformer_decoder.layers.1.self_attn.proj_v_dense_layer.weight"):
        to_hf(checkpoint_from_model(tmp_path / "y.mdl", missing))


# -- laziness --------------------------------------------------------------------------------------


def test_conversion_reads_nothing_and_a_row_block_reads_only_its_source_rows(tmp_path):
    with open_fixture("llama") as ck:
        recorded = {k: RecordingTensor(t.read_all(), t.dtype) for k, t in model_tensors(ck).items()}
    write_yaml(tmp_path / "params.yaml", params_of("llama"))
    hf = to_hf(checkpoint_from_model(tmp_path / "c.mdl", recorded))
    assert all(r.boxes == [] for r in recorded.values())  # building the HF model read no data
    q = dict(hf.tensors)["model.layers.0.self_attn.q_proj.weight"]
    src = recorded["transformer_decoder.layers.0.self_attn.proj_q_dense_layer.weight"]
    q.read(((8, 12), (0, 32)))  # HF rows 0..3 of head 1 (head_dim 8) = CS rows 8, 10, 12, 14
    rows = {r for (a, b), _ in src.boxes for r in range(a, b)}
    assert {8, 10, 12, 14} <= rows <= set(range(8, 16))
    assert all(r.boxes == [] for k, r in recorded.items() if r is not src)


def test_gpt2_tied_embedding_stored_as_none_is_restored_from_lm_head(tmp_path):
    with open_fixture("gpt2") as ck:
        tensors = {k: RecordingTensor(t.read_all(), t.dtype) for k, t in model_tensors(ck).items()}
    del tensors["embedding_layer.word_embeddings.weight"]
    write_yaml(tmp_path / "params.yaml", params_of("gpt2"))
    hf = to_hf(checkpoint_from_model(tmp_path / "c.mdl", tensors))
    out = dict(hf.tensors)
    assert out["transformer.wte.weight"] is tensors["lm_head.weight"]
    assert "lm_head.weight" not in out  # tied: save_pretrained leaves the copy out
