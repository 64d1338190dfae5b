"""Falcon, BLOOM and MPT mappings beyond the fixture cases (issue 11).

- Falcon: every query_key_value layout transformers' Falcon attention reads (7B multi-query, full
  multi-head, the 40B/180B ``new_decoder_architecture`` with grouped KV heads and one or two layer norms).
  A tiny transformers Falcon model is split into CS form here (q/k/v apart, RoPE rows interleaved per head),
  converted back by the mapping, and must give bit-identical outputs.
- MPT: an untied LM head keeps its own trained values (the 2.3.1 converter drops it).
- Detection without ``name:`` in the params finds these families from the CS tensor names, and never
  claims another family's fixture checkpoint.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ckptfs.mapping.to_hf import to_hf
from ckptfs.mapping.detect import cs_model_tensors, infer_from_keys
from ckptfs.mapping.lang.families import default_registry
from ckptfs.tensor.base import ArrayTensor
from helpers.mapping import FIXTURES, checkpoint_from_model, open_fixture

MINE = {"falcon", "bloom", "mpt"}


# -- helpers -------------------------------------------------------------------------------------------------


def _randomised(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter redrawn (layer norms included) so a misplaced row shows in the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


def _interleave_rope_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """HF rotate-half rows -> CS interleaved rows, per head: CS row 2j = HF row j, 2j+1 = HF row j + d/2."""
    rest = t.shape[1:]
    per_head = t.reshape(heads, 2, -1, *rest)  # [heads, halves, d/2, ...]
    return per_head.transpose(1, 2).reshape(t.shape).contiguous()


def _split_falcon_qkv(fused: torch.Tensor, heads: int, kv_heads: int) -> tuple:
    """query_key_value -> CS (q, k, v) as transformers' _split_heads reads it: per KV group [q.., k, v]."""
    rest = fused.shape[1:]
    groups = fused.reshape(kv_heads, heads // kv_heads + 2, -1, *rest)
    q = groups[:, :-2].reshape(-1, *rest)
    k = groups[:, -2].reshape(-1, *rest)
    v = groups[:, -1].reshape(-1, *rest)
    return _interleave_rope_rows(q, heads), _interleave_rope_rows(k, kv_heads), v.contiguous()


def _tensors(state: dict) -> dict:
    return {k: ArrayTensor(v.detach().numpy().copy()) for k, v in state.items()}


def _rebuilt(hf, cls, tmp_path: Path):
    """The transformers model built from ckptfs' config.json and tensors."""
    out = tmp_path / "converted"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf.config))
    weights = {name: torch.from_numpy(np.ascontiguousarray(t.read_all())) for name, t in hf.tensors}
    from safetensors.torch import save_file

    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return cls.from_pretrained(out, attn_implementation="eager").eval()


def _reloaded(model, tmp_path: Path):
    """The original as save_pretrained writes it, loaded back with eager attention like the converted one."""
    out = tmp_path / "original"
    model.save_pretrained(out)
    return type(model).from_pretrained(out, attn_implementation="eager").eval()


def _same_outputs(a, b, vocab: int):
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        oa, ob = a(input_ids=ids), b(input_ids=ids)
    first = "logits" if "logits" in oa else "last_hidden_state"
    assert torch.equal(oa[first], ob[first])


# -- Falcon layouts ------------------------------------------------------------------------------------------

# (HF config, CS attention settings): each layout transformers' Falcon reads
FALCON_LAYOUTS = {
    "7b_multi_query": (dict(new_decoder_architecture=False, multi_query=True, parallel_attn=True),
                       dict(untied=False, kv=1)),
    "7b_multi_head_bias": (dict(new_decoder_architecture=False, multi_query=False, parallel_attn=True, bias=True),
                           dict(untied=False, kv=4)),
    "40b_grouped_two_norms": (dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=2),
                              dict(untied=True, kv=2)),
    "180b_one_kv_head_two_norms": (dict(new_decoder_architecture=True, num_kv_heads=1, num_ln_in_parallel_attn=2),
                                   dict(untied=True, kv=1)),
    "grouped_one_norm": (dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),
                         dict(untied=False, kv=2)),
}


def _falcon_to_cs(model, heads: int, kv: int, untied: bool, headless: bool) -> dict:
    state = model.state_dict()
    pre = "" if headless else "transformer."
    cs = {"embedding_layer.word_embeddings.weight": state[f"{pre}word_embeddings.weight"]}
    n_layers = model.config.num_hidden_layers
    for i in range(n_layers):
        h, layer = f"{pre}h.{i}.", f"transformer_decoder.layers.{i}."
        for p in ("weight", "bias"):
            key = f"{h}self_attention.query_key_value.{p}"
            if key in state:
                q, k, v = _split_falcon_qkv(state[key], heads, kv)
                cs[f"{layer}self_attn.proj_q_dense_layer.{p}"] = q
                cs[f"{layer}self_attn.proj_k_dense_layer.{p}"] = k
                cs[f"{layer}self_attn.proj_v_dense_layer.{p}"] = v
            for hf_name, cs_name in (("self_attention.dense", "self_attn.proj_output_dense_layer"),
                                     ("mlp.dense_h_to_4h", "ffn.ffn.0.linear_layer"),
                                     ("mlp.dense_4h_to_h", "ffn.ffn.1.linear_layer"),
                                     ("ln_attn" if untied else "input_layernorm", "norm1"),
                                     ("ln_mlp", "norm3")):
                if f"{h}{hf_name}.{p}" in state:
                    cs[f"{layer}{cs_name}.{p}"] = state[f"{h}{hf_name}.{p}"]
    for p in ("weight", "bias"):
        cs[f"transformer_decoder.norm.{p}"] = state[f"{pre}ln_f.{p}"]
        cs[f"ln_f.{p}"] = state[f"{pre}ln_f.{p}"]
    cs["lm_head.weight"] = state["lm_head.weight"] if not headless else torch.zeros_like(cs[
        "embedding_layer.word_embeddings.weight"])
    return cs


@pytest.mark.parametrize("headless", [False, True], ids=["causal_lm", "headless"])
@pytest.mark.parametrize("layout", sorted(FALCON_LAYOUTS))
def test_falcon_layouts_give_the_original_outputs(layout, headless, tmp_path):
    from transformers import FalconConfig, FalconForCausalLM, FalconModel

    hf_kw, cs_kw = FALCON_LAYOUTS[layout]
    heads, hidden, vocab = 4, 32, 64
    config = FalconConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads,
                          ffn_hidden_size=48, max_position_embeddings=64, tie_word_embeddings=False, **hf_kw)
    cls = FalconModel if headless else FalconForCausalLM
    original = _randomised(cls(config), seed=sum(map(ord, layout)))
    cs = _falcon_to_cs(original, heads, cs_kw["kv"], cs_kw["untied"], headless)
    bias = bool(hf_kw.get("bias", False))
    params = {"model": {
        "name": "falcon", "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": 2, "num_heads": heads,
        "filter_size": 48, "max_position_embeddings": 64, "position_embedding_type": "rotary",
        "rotary_dim": hidden // heads, "rope_theta": 10000.0, "layer_norm_epsilon": 1.0e-5,
        "attention_module": "multiquery_attention" if cs_kw["kv"] != heads else "aiayn_attention",
        **({"extra_attention_params": {"num_kv_groups": cs_kw["kv"]}} if cs_kw["kv"] != heads else {}),
        "use_untied_layer_norm": cs_kw["untied"], "share_embedding_weights": False,
        "use_projection_bias_in_attention": bias, "use_ffn_bias_in_attention": bias, "use_ffn_bias": bias,
        "embedding_dropout_rate": 0.0, "attention_dropout_rate": 0.0, "residual_dropout_rate": 0.0}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    hf = to_hf(checkpoint_from_model(tmp_path / "c.mdl", _tensors(cs)),
               model="falcon-headless" if headless else "falcon")

    assert {n for n, _ in hf.tensors} == set(original.state_dict()), "names as the HF class has them"
    assert hf.config["new_decoder_architecture"] == hf_kw["new_decoder_architecture"]
    assert hf.config["num_ln_in_parallel_attn"] == hf_kw.get("num_ln_in_parallel_attn")
    assert hf.config["ffn_hidden_size"] == 48 and hf.config["bias"] is bias
    ours = _rebuilt(hf, cls, tmp_path)
    for name, t in original.state_dict().items():
        assert torch.equal(ours.state_dict()[name], t), name
    _same_outputs(ours, _reloaded(original, tmp_path), vocab)


def test_falcon_qkv_row_block_reads_only_its_group(tmp_path):
    """A row block of the fused tensor touches only the q/k/v rows of the groups it covers."""
    from helpers.mapping import RecordingTensor

    rng = np.random.default_rng(0)
    q, k, v = (RecordingTensor(rng.standard_normal(s).astype(np.float32)) for s in ((32, 8), (16, 8), (16, 8)))
    from ckptfs.mapping.transforms.falcon import fuse_qkv_groups

    fused = fuse_qkv_groups(q, k, v, groups=2)  # per group: 16 q rows, 8 k rows, 8 v rows
    assert fused.shape == (64, 8)
    block = fused.read(((32, 48), (0, 8)))  # group 1's q rows
    np.testing.assert_array_equal(block, q.inner.array[16:32])
    assert k.boxes == [] and v.boxes == []
    ref = np.concatenate([q.inner.array[:16], k.inner.array[:8], v.inner.array[:8],
                          q.inner.array[16:], k.inner.array[8:], v.inner.array[8:]])
    np.testing.assert_array_equal(fused.read_all(), ref)


def test_falcon_refuses_what_hf_falcon_cannot_express(tmp_path):
    from ckptfs.errors import ConfigError

    with open_fixture("falcon") as ck:
        tensors = cs_model_tensors(ck)
    base = yaml.safe_load((FIXTURES / "falcon" / "cs" / "params.yaml").read_text())
    for change, message in (({"use_ffn_bias": True}, "one `bias` switch"),
                            ({"rotary_dim": 4}, "rotates whole heads"),
                            ({"position_embedding_type": "alibi"}, "position_embedding_type='alibi'")):
        params = {"model": {**base["model"], **change}}
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
        with pytest.raises(ConfigError, match=message):
            to_hf(checkpoint_from_model(tmp_path / "c.mdl", tensors))


@pytest.mark.parametrize("tied", [True, False])
def test_falcon_headless_drops_the_lm_head_tied_or_not(tied, tmp_path):
    from safetensors import safe_open

    with open_fixture("falcon_headless_tied") as ck:
        tensors = cs_model_tensors(ck)
    params = yaml.safe_load((FIXTURES / "falcon_headless_tied" / "cs" / "params.yaml").read_text())
    params["model"]["share_embedding_weights"] = tied
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    hf = to_hf(checkpoint_from_model(tmp_path / "c.mdl", tensors), model="falcon-headless")
    with safe_open(str(FIXTURES / "falcon_headless_tied" / "hf" / "model.safetensors"), "np") as f:
        original = set(f.keys())
    assert {n for n, _ in hf.tensors} == original
    assert hf.config["tie_word_embeddings"] is tied
    assert any("lm_head.weight not converted: the headless HF model has no LM head" in w for w in hf.warnings)


# -- MPT: an untied LM head is kept ----------------------------------------------------------------------


def test_mpt_untied_lm_head_is_kept_and_outputs_match(tmp_path):
    from transformers import MptConfig, MptForCausalLM

    vocab, hidden, heads = 64, 32, 4
    config = MptConfig(vocab_size=vocab, d_model=hidden, n_heads=heads, n_layers=2, max_seq_len=32,
                       tie_word_embeddings=False)
    original = _randomised(MptForCausalLM(config), seed=11)
    state = original.state_dict()
    cs = {"embedding_layer.word_embeddings.weight": state["transformer.wte.weight"],
          "transformer_decoder.norm.weight": state["transformer.norm_f.weight"],
          "ln_f.weight": state["transformer.norm_f.weight"], "lm_head.weight": state["lm_head.weight"],
          "embedding_layer.position_embed_helper.slopes": torch.zeros(heads, 1)}
    for i in range(2):
        b, layer = f"transformer.blocks.{i}.", f"transformer_decoder.layers.{i}."
        q, k, v = state[f"{b}attn.Wqkv.weight"].chunk(3)
        cs.update({f"{layer}self_attn.proj_q_dense_layer.weight": q, f"{layer}self_attn.proj_k_dense_layer.weight": k,
                   f"{layer}self_attn.proj_v_dense_layer.weight": v,
                   f"{layer}self_attn.proj_output_dense_layer.weight": state[f"{b}attn.out_proj.weight"],
                   f"{layer}norm1.weight": state[f"{b}norm_1.weight"], f"{layer}norm3.weight": state[f"{b}norm_2.weight"],
                   f"{layer}ffn.ffn.0.linear_layer.weight": state[f"{b}ffn.up_proj.weight"],
                   f"{layer}ffn.ffn.1.linear_layer.weight": state[f"{b}ffn.down_proj.weight"]})
    params = yaml.safe_load((FIXTURES / "mpt" / "cs" / "params.yaml").read_text())
    params["model"].update(vocab_size=vocab, hidden_size=hidden, num_heads=heads, filter_size=4 * hidden,
                           max_position_embeddings=32, share_embedding_weights=False)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    hf = to_hf(checkpoint_from_model(tmp_path / "c.mdl", _tensors(cs)))  # no name: found from the tensor names

    assert hf.family == "mpt" and hf.config["tie_word_embeddings"] is False
    assert {n for n, _ in hf.tensors} == set(state)
    _same_outputs(_rebuilt(hf, MptForCausalLM, tmp_path), _reloaded(original, tmp_path), vocab)


# -- detection without `name:` ------------------------------------------------------------------------------


def _cases():
    out = []
    for d in sorted(FIXTURES.iterdir()):
        if (d / "MANIFEST.json").is_file() and (d / "cs" / "checkpoint.mdl").is_file():
            family = json.loads((d / "MANIFEST.json").read_text()).get("family")
            if family:
                out.append((d.name, family))
    return out


@pytest.mark.parametrize("case,family", _cases(), ids=[c for c, _ in _cases()])
def test_detection_from_tensor_names_finds_ours_and_steals_nothing(case, family):
    with open_fixture(case) as ck:
        keys = list(cs_model_tensors(ck))
    spec = infer_from_keys(default_registry(), keys, None)
    found = spec.family if spec else None
    if family in MINE:
        assert found == family, f"{case}: detected as {found}"
    else:
        assert found not in MINE, f"{case} ({family}) would be taken for {found}"
