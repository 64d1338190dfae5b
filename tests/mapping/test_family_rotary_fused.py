"""GPT-J, GPT-NeoX and CodeGen details the conformance cases do not reach: the fused qkv layouts read back the
way HF splits them, detection without a params ``name:``, GPT-J's lm_head bias (absent, muP) and the guards."""
from __future__ import annotations

import numpy as np
import pytest
import yaml

from ckptfs.errors import ConfigError
from ckptfs.mapping.to_hf import to_hf
from ckptfs.mapping.transforms.codegen import codegen_fused_qkv
from ckptfs.mapping.transforms.gpt_neox import interleave_blocks, neox_fused_qkv
from ckptfs.tensor.base import ArrayTensor
from helpers.mapping import FIXTURES, checkpoint_from_model, model_tensors, open_fixture

HEADS, HEAD_DIM = 4, 8
HIDDEN = HEADS * HEAD_DIM


def _qkv(rows_shape):
    rng = np.random.default_rng(5)
    return [rng.standard_normal(rows_shape).astype(np.float32) for _ in range(3)]


@pytest.mark.parametrize("shape", [(HIDDEN, HIDDEN), (HIDDEN,)], ids=["weight", "bias"])
def test_neox_fused_qkv_is_what_hf_splits_per_head(shape):
    q, k, v = _qkv(shape)
    fused = neox_fused_qkv(ArrayTensor(q), ArrayTensor(k), ArrayTensor(v), HEADS).read_all()
    assert fused.shape == (3 * HIDDEN,) + shape[1:]
    # HF GPTNeoXAttention: view(heads, 3 * head_dim, ...) then q, k, v = consecutive head_dim chunks
    per_head = fused.reshape((HEADS, 3, HEAD_DIM) + shape[1:])
    for part, src in enumerate((q, k, v)):
        np.testing.assert_array_equal(per_head[:, part], src.reshape((HEADS, HEAD_DIM) + shape[1:]))


def test_codegen_fused_qkv_is_what_hf_splits_in_four_blocks():
    q, k, v = _qkv((HIDDEN, HIDDEN))
    fused = codegen_fused_qkv(ArrayTensor(q), ArrayTensor(k), ArrayTensor(v)).read_all()
    # HF CodeGenAttention: reshape(mp_num=4, -1) on the output features, then split into query, value, key
    blocks = fused.reshape(4, 3 * HIDDEN // 4, HIDDEN)
    local = HIDDEN // 4
    for part, src in enumerate((q, v, k)):
        np.testing.assert_array_equal(blocks[:, part * local:(part + 1) * local], src.reshape(4, local, HIDDEN))


def test_interleave_blocks_reads_only_the_rows_asked():
    a = ArrayTensor(np.arange(8, dtype=np.float32))
    b = ArrayTensor(np.arange(8, 16, dtype=np.float32))
    out = interleave_blocks([a, b], 4)
    assert out.read_all().tolist() == [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]
    assert out.read(((2, 5),)).tolist() == [8, 9, 2]


def test_interleave_blocks_rejects_uneven_blocks():
    with pytest.raises(Exception, match="equal blocks"):
        interleave_blocks([ArrayTensor(np.zeros(6, np.float32))], 4)


def _params(case: str, tmp_path, **changes):
    model = yaml.safe_load((FIXTURES / case / "cs" / "params.yaml").read_text())["model"]
    for key, value in changes.items():
        if value is None:
            model.pop(key, None)
        else:
            model[key] = value
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"model": model}))
    return path


@pytest.mark.parametrize("case, family", [("gptj", "gptj"), ("gpt_neox", "gpt_neox"), ("codegen", "gptj")])
def test_family_recognised_from_tensor_names_without_params_name(case, family, tmp_path):
    params = _params(case, tmp_path, name=None)
    with open_fixture(case) as ck:
        hf = to_hf(ck, config=params)
    assert hf.family == family  # a CodeGen checkpoint has GPT-J's tensors (and is a GPT-J model)


def _gptj_without_lm_head_bias(tmp_path, share):
    with open_fixture("gptj") as ck:
        cs = {k: ArrayTensor(t.read_all()) for k, t in model_tensors(ck).items() if k != "lm_head.bias"}
    if share:
        cs["lm_head.weight"] = cs["embedding_layer.word_embeddings.weight"]
    params = _params("gptj", tmp_path, use_bias_in_output=False, share_embedding_weights=share)
    return to_hf(checkpoint_from_model(tmp_path / "x.mdl", cs), config=params, model="gptj")


@pytest.mark.parametrize("share", [False, True], ids=["untied", "tied"])
def test_gptj_without_output_bias_gets_a_zero_lm_head_bias(tmp_path, share):
    hf = _gptj_without_lm_head_bias(tmp_path, share)
    tensors = dict(hf.tensors)
    bias = tensors["lm_head.bias"]
    assert bias.shape == (128,) and bias.dtype.name == "float32"
    assert not bias.read_all().any()
    assert ("lm_head.weight" in tensors) == (not share)
    assert hf.config["tie_word_embeddings"] is share


def test_gptj_mup_scales_the_whole_lm_head(tmp_path):
    params = _params("gptj", tmp_path, mup_base_hidden_size=8, mup_base_filter_size=32, output_logits_alpha=2.0)
    with open_fixture("gptj") as ck:
        cs = model_tensors(ck)
        hf = dict(to_hf(ck, config=params, model="gptj").tensors)
        scale = np.float32(2.0 / (32 / 8))
        for name in ("weight", "bias"):
            np.testing.assert_array_equal(hf[f"lm_head.{name}"].read_all(), cs[f"lm_head.{name}"].read_all() * scale)


@pytest.mark.parametrize("case, model", [("gpt_neox", "gpt-neox"), ("codegen", "codegen")])
def test_mup_refused_where_the_converter_refuses_it(case, model, tmp_path):
    params = _params(case, tmp_path, mup_base_hidden_size=8)
    with open_fixture(case) as ck, pytest.raises(ConfigError, match="muP"):
        to_hf(ck, config=params, model=model)


@pytest.mark.parametrize("case, model, changes, problem", [
    ("codegen", "codegen", {"num_heads": 2}, "multiple of 4"),
    ("gptj", "gptj", {"use_untied_layer_norm": True}, "gpt-neox"),
    ("gpt_neox", "gpt-neox", {"use_untied_layer_norm": False}, "gptj"),
    ("gptj", "gptj", {"rope_theta": 500000.0}, "base 10000"),
])
def test_guards(case, model, changes, problem, tmp_path):
    params = _params(case, tmp_path, **changes)
    with open_fixture(case) as ck, pytest.raises(ConfigError, match=problem):
        to_hf(ck, config=params, model=model)
