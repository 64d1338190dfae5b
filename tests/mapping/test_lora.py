"""LoRA folding (ckptfs/mapping/lora/find.py, lora_fold.py): bit-exact to Model Zoo's fold_lora_checkpoint.py, lazy
(a row block reads only its rows of W and B), lora_params groups chosen by Model Zoo class paths, the params in
either layout, and clear errors when the checkpoint and the params disagree."""
from __future__ import annotations

import hashlib
import json
from fractions import Fraction

import numpy as np
import pytest
import yaml

from ckptfs.errors import ConfigError, MappingError
from ckptfs.mapping.to_hf import to_hf
from ckptfs.mapping.detect import cs_model_tensors
from ckptfs.mapping.lora.find import find_lora, lora_settings, parse_groups
from ckptfs.mapping.lora.fold import LoraFold, fma32, fma_matmul
from ckptfs.mapping.params.find import find_params
from ckptfs.mapping.lang.families import default_registry
from helpers.mapping import FIXTURES, RecordingTensor, checkpoint_from_model, open_fixture

CASES = ["lora_gpt2", "lora_llama"]


def manifest(case: str) -> dict:
    return json.loads((FIXTURES / case / "MANIFEST.json").read_text())


def params_doc(case: str) -> dict:
    return yaml.safe_load((FIXTURES / case / "cs" / "params.yaml").read_text())


def sha(t) -> str:
    return hashlib.sha256(t.read_all().tobytes()).hexdigest()


def lora_of(case: str, params=None, tmp_path=None):
    """find_lora on a fixture case (optionally with other params, written next to a copy of its tensors)."""
    ck = open_fixture(case)
    cs = cs_model_tensors(ck)
    if params is not None:
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
        ck = checkpoint_from_model(tmp_path / "c.mdl", cs)
    spec = default_registry().family(manifest(case)["family"])
    return find_lora(spec, find_params(ck), cs, ck.path), cs


# -- bit-exact to the fold tool ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_folded_tensors_equal_the_fold_tools_checkpoint(case):
    """Every tensor of fold_lora_checkpoint.py's output (MANIFEST folded_checkpoint), by sha256; no LoRA key left."""
    lora, _ = lora_of(case)
    expected = manifest(case)["folded_checkpoint"]["tensors"]
    ours = {"model." + k: t for k, t in lora.tensors.items()}
    assert set(ours) == set(expected)
    for key, e in expected.items():
        assert list(ours[key].shape) == e["shape"] and ours[key].dtype.name == e["dtype"], key
        assert sha(ours[key]) == e["sha256"], f"{key} differs from the fold tool's"
    folded = [k for k, t in lora.tensors.items() if isinstance(t, LoraFold)]
    assert len(folded) == len(manifest(case)["lora_folding"]["per_key"])


@pytest.mark.parametrize("case", CASES)
def test_groups_scaling_and_class_paths_as_model_zoo_chose_them(case):
    lora, _ = lora_of(case)
    modules = manifest(case)["cs_model"]["lora_modules"]
    assert {m.name for m in lora.modules} == set(modules)
    for m in lora.modules:
        want = modules[m.name]
        assert list(m.class_path) == want["class_path"], m.name
        assert (m.group.index, m.group.r, m.group.alpha, m.kind) == (want["group"], want["r"], want["lora_alpha"],
                                                                     want["kind"])
        assert m.group.scaling == want["scaling"]


def test_a_multiply_then_add_chain_would_not_be_bit_exact():
    """The FMA chain matters: the plain float32 chain differs on the fixture's data (MANIFEST lora_folding)."""
    cs = cs_model_tensors(open_fixture("lora_llama"))
    key = "model.transformer_decoder.layers.0.self_attn.proj_q_dense_layer"
    a, b = cs[key + ".lora_A"].read_all(), cs[key + ".lora_B"].read_all()
    plain = np.zeros((b.shape[0], a.shape[1]), np.float32)
    for k in range(a.shape[0]):
        plain = plain + b[:, k:k + 1] * a[k:k + 1, :]
    fused = fma_matmul(b, a)
    assert (plain != fused).any()
    assert np.allclose(plain, fused, rtol=1e-6, atol=1e-6)


def _exact_fma32(x, y, z) -> np.float32:
    """float32(x * y + z) rounded once, from exact rationals (ties to even)."""
    v = Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))
    near = np.float32(float(v))
    cands = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - v), int(np.array(c).view(np.int32)) & 1))


def test_fma32_rounds_once():
    rng = np.random.default_rng(1)
    n = 4000
    x = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    y = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    z = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    # sums that land on a float32 rounding midpoint in float64 but not exactly: the double-rounding trap
    one_ulp = np.float32(1 + 2 ** -23)
    x[:3] = [one_ulp, 1.0, -one_ulp]
    y[:3] = [np.float32(2 ** -24 * (1 - 2 ** -23)), np.float32(2 ** -24 * (1 + 2 ** -23)), y[2]]
    z[:3] = [one_ulp, one_ulp, np.float32(0)]
    got = fma32(x, y, z)
    for i in range(n):
        assert got[i] == _exact_fma32(x[i], y[i], z[i]), (x[i], y[i], z[i])
    assert got[0] != np.float32(np.float64(x[0]) * np.float64(y[0]) + np.float64(z[0])), "trap case exercised"
    # subnormal, overflow and special values
    sx = np.array([1e-30, 3e38, np.inf, np.nan, -0.0], np.float32)
    sy = np.array([1e-15, 10.0, 0.0, 1.0, 1.0], np.float32)
    sz = np.array([1e-45, 0.0, 1.0, 1.0, 0.0], np.float32)
    out = fma32(sx, sy, sz)
    assert out[0] == _exact_fma32(sx[0], sy[0], sz[0]) and np.isinf(out[1]) and np.isnan(out[2]) and np.isnan(out[3])
    assert out[4] == 0 and not np.signbit(out[4])  # -0 * 1 + +0 = +0


# -- lazy: a row block reads its rows -----------------------------------------------------------------------------


def test_region_read_of_a_folded_linear_reads_only_its_rows_of_w_and_b():
    rng = np.random.default_rng(2)
    w = RecordingTensor(rng.standard_normal((64, 16)).astype(np.float32))
    a = RecordingTensor(rng.standard_normal((4, 16)).astype(np.float32))
    b = RecordingTensor(rng.standard_normal((64, 4)).astype(np.float32))
    folded = LoraFold(w, a, b, 8 / 3)
    block = folded.read(((8, 24), (0, 16)))
    assert w.boxes == [((8, 24), (0, 16))]
    assert b.boxes == [((8, 24), (0, 4))]
    assert a.boxes == [((0, 4), (0, 16))]  # A is small: all of it
    full = folded.read_all()
    np.testing.assert_array_equal(block, full[8:24])
    ref = w.inner.array + fma_matmul(b.inner.array, a.inner.array) * np.float32(8 / 3)
    np.testing.assert_array_equal(full, ref)


def test_region_read_of_a_folded_embedding_reads_only_its_rows_and_a_columns():
    rng = np.random.default_rng(3)
    w = RecordingTensor(rng.standard_normal((50, 8)).astype(np.float32))  # [num_embeddings, dim]
    a = RecordingTensor(rng.standard_normal((2, 50)).astype(np.float32))  # [r, num_embeddings]
    b = RecordingTensor(rng.standard_normal((8, 2)).astype(np.float32))  # [dim, r]
    folded = LoraFold(w, a, b, 2.5, embedding=True)
    block = folded.read(((10, 20), (0, 8)))
    assert w.boxes == [((10, 20), (0, 8))] and a.boxes == [((0, 2), (10, 20))] and b.boxes == [((0, 8), (0, 2))]
    ref = w.inner.array + fma_matmul(b.inner.array, a.inner.array).T * np.float32(2.5)
    np.testing.assert_array_equal(block, ref[10:20])


def test_fold_checks_shapes_and_dtypes():
    from ckptfs.tensor.base import ArrayTensor

    w = ArrayTensor(np.zeros((4, 6), np.float32))
    with pytest.raises(MappingError, match="do not fit"):
        LoraFold(w, ArrayTensor(np.zeros((2, 4), np.float32)), ArrayTensor(np.zeros((4, 2), np.float32)), 1.0)
    with pytest.raises(MappingError, match="float64"):
        LoraFold(ArrayTensor(np.zeros((4, 6))), ArrayTensor(np.zeros((2, 6))), ArrayTensor(np.zeros((4, 2))), 1.0)


def test_bfloat16_fold_rounds_after_every_operation():
    from ckptfs.dtypes import BFLOAT16
    from ckptfs.tensor import floats
    from ckptfs.tensor.base import ArrayTensor

    rng = np.random.default_rng(4)
    w32, a32, b32 = (rng.standard_normal(s).astype(np.float32) for s in ((6, 5), (2, 5), (6, 2)))
    bf = lambda v: ArrayTensor(floats.f32_to_bf16_bits(v), BFLOAT16)  # noqa: E731
    folded = LoraFold(bf(w32), bf(a32), bf(b32), 2.5)
    assert folded.dtype == BFLOAT16
    wide = lambda t: floats.bf16_bits_to_f32(t.read_all())  # noqa: E731
    rnd = lambda v: floats.bf16_bits_to_f32(floats.f32_to_bf16_bits(v))  # noqa: E731
    delta = rnd(fma_matmul(wide(bf(b32)), wide(bf(a32))))
    ref = rnd(wide(bf(w32)) + rnd(delta * np.float32(2.5)))
    np.testing.assert_array_equal(floats.bf16_bits_to_f32(folded.read_all()), ref)


# -- groups, params layouts, errors -------------------------------------------------------------------------------


def test_lora_params_one_group_or_a_list_with_model_zoo_defaults():
    one = parse_groups({"r": 4, "alpha": 8, "target_modules": ["Linear"]}, "model.lora_params", None)
    assert len(one) == 1 and one[0].scaling == 2.0 and one[0].target_modules == ("Linear",)
    two = parse_groups([{"r": 2}, {"r": 3, "alpha": 9, "target_modules": None}], "model.lora_params", None)
    assert two[0].alpha == 1 and two[0].target_modules is None and two[1].index == 1
    with pytest.raises(ConfigError, match="unknown LoRA setting"):
        parse_groups({"r": 2, "rank": 4}, "model.lora_params", None)
    with pytest.raises(ConfigError, match="target_modules"):
        parse_groups({"r": 2, "target_modules": "Linear"}, "model.lora_params", None)


def test_first_matching_group_wins_and_null_selects_everything(tmp_path):
    """A null-target group first takes every module: all of them then fold with its scaling."""
    doc = params_doc("lora_llama")
    doc["model"]["lora_params"] = [{"r": 3, "alpha": 6, "target_modules": None},
                                   {"r": 2, "alpha": 7, "target_modules": ["FeedForwardNetwork"]}]
    with pytest.raises(ConfigError, match="has r 3, but .*linear_layer.lora_A has 2 rows"):
        lora_of("lora_llama", doc, tmp_path)
    doc["model"]["lora_params"] = [{"r": 2, "alpha": 7, "target_modules": ["FeedForwardNetwork"]},
                                   {"r": 3, "alpha": 8, "target_modules": None}]
    lora, _ = lora_of("lora_llama", doc, tmp_path)
    assert {m.group.index for m in lora.modules if "ffn" in m.name} == {0}
    assert {m.group.index for m in lora.modules if "self_attn" in m.name} == {1}


def test_class_names_match_exactly(tmp_path):
    """MultiheadAttention does not select Llama's MultiQueryAttention modules, which carry LoRA matrices."""
    doc = params_doc("lora_llama")
    doc["model"]["lora_params"][0]["target_modules"] = ["MultiheadAttention"]
    with pytest.raises(ConfigError, match="no group of model.lora_params selects the LoRA module .*proj_q"):
        lora_of("lora_llama", doc, tmp_path)


def test_params_selecting_modules_without_lora_matrices_warn(tmp_path):
    doc = params_doc("lora_gpt2")
    doc["model"]["lora_params"] = [doc["model"]["lora_params"], {"r": 2, "alpha": 1, "target_modules": ["Linear"]}]
    lora, _ = lora_of("lora_gpt2", doc, tmp_path)
    assert any("selects 5 more modules" in n and "ffn.ffn.*.linear_layer" in n and "lm_head" in n
               for n in lora.notes), lora.notes


def test_trainer_lora_callback_gives_the_same_fold(tmp_path):
    """V2 trainer params: lora_params under trainer.init.callbacks: - Lora: ..."""
    legacy = params_doc("lora_llama")
    model = dict(legacy["model"])
    groups = model.pop("lora_params")
    doc = {"trainer": {"init": {"model": model, "callbacks": [{"CheckLoss": {}}, {"Lora": {"lora_params": groups}}]}}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(doc))
    ck = checkpoint_from_model(tmp_path / "c.mdl", cs_model_tensors(open_fixture("lora_llama")))
    settings = lora_settings(find_params(ck))
    assert settings.where == "trainer.init.callbacks[1].Lora.lora_params" and len(settings.groups) == 2
    hf = to_hf(ck, model="llama")
    expected = json.loads((FIXTURES / "lora_llama" / "expected_hf" / "keys.json").read_text())["tensors"]
    for name, t in hf.tensors:
        assert sha(t) == expected[name]["sha256"], name
    assert any("trainer.init.callbacks[1].Lora.lora_params" in w for w in hf.warnings)


def test_lora_matrices_without_lora_params_are_an_error(tmp_path):
    doc = params_doc("lora_gpt2")
    del doc["model"]["lora_params"]
    with pytest.raises(ConfigError, match="holds LoRA matrices .* no lora_params"):
        lora_of("lora_gpt2", doc, tmp_path)


def test_lora_params_on_a_folded_checkpoint_map_it_as_it_is(tmp_path):
    """fold_lora_checkpoint.py's output with the unfolded params: no LoRA keys, a note, the same HF tensors."""
    from ckptfs.readers import open_checkpoint

    cs = cs_model_tensors(open_checkpoint(FIXTURES / "lora_gpt2" / "cs" / "folded.mdl"))
    (tmp_path / "params.yaml").write_text((FIXTURES / "lora_gpt2" / "cs" / "params.yaml").read_text())
    hf = to_hf(checkpoint_from_model(tmp_path / "c.mdl", cs))
    expected = json.loads((FIXTURES / "lora_gpt2" / "expected_hf" / "keys.json").read_text())["tensors"]
    assert all(sha(t) == expected[n]["sha256"] for n, t in hf.tensors)
    assert any("no lora_A / lora_B tensors: mapped as it is" in w for w in hf.warnings)
    assert not any("lora_params" in w and "not converted" in w for w in hf.warnings)


def test_a_family_without_lora_class_paths_cannot_fold():
    """A family whose mapping has no lora: section: an error naming it, never a silent pre-LoRA model."""
    from dataclasses import replace

    ck = open_fixture("lora_llama")
    spec = replace(default_registry().family("llama"), lora=None)
    with pytest.raises(MappingError, match="no lora: section"):
        find_lora(spec, find_params(ck), cs_model_tensors(ck), ck.path)


def test_config_has_no_lora_keys_and_the_notes_say_what_was_folded():
    hf = to_hf(open_fixture("lora_llama"), model="llama")
    assert not any("lora" in k.lower() for k in hf.config)
    text = "\n".join(hf.warnings)
    assert "LoRA folded into the weights (14 modules: 14 Linear)" in text
    assert "group 0: r 3, alpha 8 (scaling 8/3 = 2.6666666666666665, multiplied as float32 2.6666667461395264)" in text
    assert "target_modules ['FeedForwardNetwork']: folded into 6 modules" in text


# -- tied embeddings ------------------------------------------------------------------------------------------------


def _with_embedding_lora(tmp_path, head_too: bool):
    """lora_llama plus LoRA on the word embedding (and on lm_head): a third group for EmbeddingLayer."""
    cs = dict(cs_model_tensors(open_fixture("lora_llama")))
    from ckptfs.tensor.base import ArrayTensor

    rng = np.random.default_rng(5)
    emb = "model.embedding_layer.word_embeddings"
    cs[emb + ".lora_A"] = ArrayTensor(rng.standard_normal((2, 128)).astype(np.float32))
    cs[emb + ".lora_B"] = ArrayTensor(rng.standard_normal((32, 2)).astype(np.float32))
    doc = params_doc("lora_llama")
    doc["model"]["lora_params"].append({"r": 2, "alpha": 3, "target_modules": ["EmbeddingLayer"]})
    if head_too:
        cs["model.lm_head.lora_A"] = ArrayTensor(rng.standard_normal((4, 32)).astype(np.float32))
        cs["model.lm_head.lora_B"] = ArrayTensor(rng.standard_normal((128, 4)).astype(np.float32))
        doc["model"]["lora_params"].append({"r": 4, "alpha": 4, "target_modules": ["LlamaModel", "Linear"]})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(doc))
    return checkpoint_from_model(tmp_path / "c.mdl", cs), cs


@pytest.mark.parametrize("head_too", [False, True])
def test_lora_on_a_tied_embedding_unties_it(tmp_path, head_too):
    import torch

    ck, cs = _with_embedding_lora(tmp_path, head_too)
    hf = to_hf(ck, model="llama")
    tensors = dict(hf.tensors)
    assert hf.config["tie_word_embeddings"] is False
    assert any("share_embedding_weights set to false" in w for w in hf.warnings)
    w = torch.from_numpy(cs["model.embedding_layer.word_embeddings.weight"].read_all())
    a, b = (torch.from_numpy(cs["model.embedding_layer.word_embeddings" + s].read_all()) for s in (".lora_A", ".lora_B"))
    folded = torch.from_numpy(tensors["model.embed_tokens.weight"].read_all())
    assert torch.allclose(folded, w + (b @ a).T * 1.5, atol=1e-5) and not torch.equal(folded, w)
    head = tensors["lm_head.weight"].read_all()
    raw_head = cs["model.lm_head.weight"].read_all()
    if head_too:  # the head has LoRA matrices of its own (group 3 of 4: LlamaModel + Linear)
        assert not np.array_equal(head, raw_head)
    else:  # the LM head keeps the weights as trained (the tie broken), as the fold tool's untied model has them
        np.testing.assert_array_equal(head, raw_head)


def test_a_rank_zero_group_wraps_nothing(tmp_path):
    """r 0 makes no LoRA matrices (Model Zoo keeps such modules as they are): a group that selects them is fine."""
    doc = params_doc("lora_llama")
    doc["model"]["lora_params"].insert(0, {"r": 0, "target_modules": ["LlamaModel", "Embedding"]})
    lora, _ = lora_of("lora_llama", doc, tmp_path)
    assert len(lora.modules) == 14 and {m.group.index for m in lora.modules} == {1, 2}
    assert any("group 0: r 0 (no LoRA matrices)" in n for n in lora.notes)
    assert not any("selects" in n and "more modules" in n for n in lora.notes)
