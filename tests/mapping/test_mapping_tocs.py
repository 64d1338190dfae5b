"""The Hugging Face -> Cerebras mapping (``mapping.tocs``) beyond the per-case conformance: every converter name has
this direction, models are recognised from their HF configs, the params alone (``hf_to_params``, what the reverse
``convert-config`` prints) with one line per setting the Cerebras model cannot take, the tensors the HF model does
not hold said in notes and left out on request, and the family-file errors of this direction."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import yaml

from ckptfs.dtypes import by_name
from ckptfs.errors import ConfigError, MappingError
from ckptfs.mapping.lang.families import Registry, default_registry, list_models
from ckptfs.mapping.to_cs import detect_hf, hf_to_params, to_cs
from ckptfs.tensor.base import ArrayTensor
from helpers import FIXTURES
from helpers.tocs import HF_CASES, hf_folders, hf_model


def _configs(case: str) -> dict:
    return {f: c for f, (c, _) in hf_folders(case).items()}


def test_every_model_name_has_the_hf_to_cs_direction():
    """Each name `ckptfs models` lists maps HF configs to params: its family (or, for a component, the family that
    maps it) has config.cs entries; a component naming its model by the params (DPO) takes any of them. A family
    without an HF side has none."""
    registry = default_registry()
    for info in list_models():
        spec = registry.for_model(info.name)
        variant = spec.variant(info.name)
        if spec.no_hf is not None:
            continue  # a family without an HF side (bert-summarization) has no HF model to read either
        if not variant.components:
            assert spec.config.cs, f"{info.name}: {spec.path.name} has no config.cs"
            continue
        for comp in variant.components:
            if comp.model_from is not None:
                continue
            mapping = registry.for_model(comp.model) if comp.model else spec
            assert mapping.config.cs or (comp.config and comp.config.cs), f"{info.name}/{comp.folder}: no config.cs"


#: cases whose HF folder alone does not say the case's converter name, and what is chosen instead
DETECTED_OTHERWISE = {
    "dpo_llama": "llama",  # a DPO checkpoint is made from a plain causal LM: --model dpo asks for it
    "mmsimple_llava": "llava",  # the same HF folders as llava: --model mmsimple-llava chooses the other layout
}


@pytest.mark.slow  # every fixture case
@pytest.mark.parametrize("case", HF_CASES)
def test_models_are_recognised_from_their_hf_configs(case):
    registry = default_registry()
    names = {f: list(t) for f, (_, t) in hf_folders(case).items()}
    spec, variant, name, _ = detect_hf(_configs(case), None, registry, names)
    expected = DETECTED_OTHERWISE.get(case, hf_model(case))
    want = registry.for_model(expected)
    assert spec is want and variant is want.variant(expected), f"{case}: detected {name}, expected {expected}"


@pytest.mark.parametrize("case", ["llama", "gpt2", "t5", "dpr", "llava", "mllama", "bert_token_classifier"])
def test_params_from_the_configs_alone_equal_the_converters(case):
    out = hf_to_params(_configs(case), model=hf_model(case))
    assert out.ok, out.problems
    assert out.params == yaml.safe_load((FIXTURES / case / "cs" / "params.yaml").read_text())


@pytest.mark.parametrize("case, edit, problem", [
    ("llama", lambda c: c.update(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling type='dynamic'"),
    ("llama", lambda c: c.update(hidden_act="gelu_new"), "hidden_act='gelu_new' has no Cerebras equivalent"),
    ("gpt2", lambda c: c.update(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    ("falcon", lambda c: c.update(alibi=True), "ALiBi"),
    ("gpt2", lambda c: c.pop("n_embd"), "config.json lacks n_embd, needed for params model.hidden_size"),
])
def test_settings_the_cerebras_model_cannot_take_are_one_line_each(case, edit, problem):
    configs = copy.deepcopy(_configs(case))
    edit(configs[""])
    out = hf_to_params(configs, model=hf_model(case))
    assert not out.ok and any(problem in p for p in out.problems), out.problems
    with pytest.raises(ConfigError, match="lacks|Cerebras|ALiBi|scale_attn"):
        to_cs({"": (configs[""], hf_folders(case)[""][1])}, model=hf_model(case))


def test_hf_settings_the_params_do_not_carry_are_noted():
    configs = copy.deepcopy(_configs("llama"))
    configs[""]["pretraining_tp"] = 2
    configs[""]["my_own_setting"] = 7
    out = hf_to_params(configs)
    assert out.ok
    assert any("pretraining_tp=2 is not in the Cerebras params" in n for n in out.notes)
    assert any("my_own_setting=7 has no counterpart" in n for n in out.notes)
    assert not any("vocab_size" in n or "architectures" in n for n in out.notes)


def test_added_tensors_are_said_and_left_out_on_request():
    with_added = to_cs(hf_folders("llama_headless"), model="llama-headless")
    assert "lm_head.weight" in with_added.added
    assert any(n.startswith("added model.lm_head.weight") and "at random" in n for n in with_added.notes)
    without = to_cs(hf_folders("llama_headless"), model="llama-headless", added=False)
    assert "lm_head.weight" not in dict(without.tensors) and not without.added
    assert any(n.startswith("left out model.lm_head.weight") for n in without.notes)

    dpo = to_cs(hf_folders("dpo_llama"), model="dpo", added=False)
    assert dpo.tensors and not any(k.startswith("ref_model.") for k, _ in dpo.tensors)
    assert any("left out model.ref_model.model." in n for n in dpo.notes)
    bloom = to_cs(hf_folders("bloom"), model="bloom", added=False)
    assert "embedding_layer.position_embed_helper.slopes" not in dict(bloom.tensors)


def test_tied_copies_are_separate_tensors_of_the_same_data():
    plan = to_cs(hf_folders("t5"), model="t5")
    tensors = dict(plan.tensors)
    shared = [tensors[k] for k in ("encoder_embeddings.word_embeddings.weight",
                                   "decoder_embeddings.word_embeddings.weight", "lm_head.weight")]
    assert len({id(t) for t in shared}) == 3, "one object per key: a checkpoint writer would link a repeat"
    assert len({t.cache_key for t in shared}) == 1, "the copies share their cache blocks"
    assert not plan.added, "a tied copy is part of the model, not an added tensor"


def test_hf_tensors_no_rule_takes_are_an_error_unless_allowed():
    folders = hf_folders("llama")
    config, tensors = folders[""]
    tensors = {**tensors, "model.extra.weight": ArrayTensor(np.zeros((2, 2), np.float32))}
    with pytest.raises(ConfigError, match=r"HF weight model.extra.weight \[2, 2\] float32 matches no rule of "
                                          r"llama.yaml.*--allow-unused-weights"):
        to_cs({"": (config, tensors)})
    plan = to_cs({"": (config, tensors)}, allow_unused=True)
    assert any("model.extra.weight [2, 2] float32 matches no rule of llama.yaml" in n for n in plan.notes)


# -- the family files' HF -> CS parts --------------------------------------------------------------------------------

TINY = """
family: tiny
description: a tiny family
model_type: tiny
models:
  - {name: tiny, hf_class: TinyModel}
config:
  hf: {hidden_size: hidden_size}
  cs: {name: "'tiny'", hidden_size: hidden_size}
tensors:
  - cs: "a.{i}.weight"
    hf: "a.{i}.weight"
    op: OP
"""


def tiny_registry(tmp_path, op: str, extra: str = "") -> Registry:
    d = tmp_path / "mappings"
    d.mkdir(exist_ok=True)
    (d / "tiny.yaml").write_text(TINY.replace("OP", op) + extra)
    return Registry([d])


def tiny_model(shape=(4, 6)):
    t = ArrayTensor(np.arange(np.prod(shape), dtype=np.float32).reshape(shape))
    return {"": ({"architectures": ["TinyModel"], "hidden_size": 4}, {"a.0.weight": t})}


def test_an_op_without_inverse_asks_for_one(tmp_path):
    reg = tiny_registry(tmp_path, "cast(x, 'bfloat16')")
    with pytest.raises(MappingError, match=r"tiny.yaml: tensors\[0\]: op .* does not invert .* give the rule an "
                                           r"'inverse:'"):
        to_cs(tiny_model(), registry=reg)


def test_a_rule_inverse_is_checked_by_mapping_it_forward_again(tmp_path):
    wrong = tiny_registry(tmp_path, "transpose(x)", "    inverse: {x: y}\n")
    with pytest.raises(MappingError, match="would come back as"):
        to_cs(tiny_model(), registry=wrong)
    right = tiny_registry(tmp_path, "transpose(x)", "    inverse: {x: transpose(y)}\n")
    plan = to_cs(tiny_model(), registry=right)
    t = dict(plan.tensors)["a.0.weight"]
    np.testing.assert_array_equal(t.read_all(), np.arange(24, dtype=np.float32).reshape(4, 6).T)


def test_automatic_inverses_give_back_the_cs_tensor(tmp_path):
    """Pieces of x (slice/select over several outputs) come back joined; a transform inverts through INVERSES."""
    x = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    ops_text = {"experts": ("select(x, dim=1, index=e)", "a.{i}.e{e}.weight", {"e": "range(size(x, 1))"}),
                "halves": ("chunk(x, 2, h, dim=2)", "a.{i}.h{h}.weight", {"h": "[0, 1]"})}
    for name, (op, hf, each) in ops_text.items():
        d = tmp_path / name / "mappings"
        d.mkdir(parents=True)
        text = TINY.replace('''    hf: "a.{i}.weight"
    op: OP
''', f'''    emit:
      - {{hf: "{hf}", op: "{op}", each: {each}}}
''')
        (d / "tiny.yaml").write_text(text)
        from ckptfs.mapping.forward import RuleEngine  # forward, to make the HF tensors from x
        from ckptfs.mapping.params.to_hf_config import config_functions, convert_config

        reg = Registry([d])
        spec = reg.family("tiny")
        cfg = convert_config(spec, spec.models[0], {"hidden_size": 4}, None)
        forward = RuleEngine(spec, spec.models[0], cfg.scope, config_functions(cfg.cs_scope, "tiny", None), None)
        hf = {n: ArrayTensor(t.read_all()) for n, t in forward.run({"a.0.weight": ArrayTensor(x)}).tensors}
        plan = to_cs({"": ({"architectures": ["TinyModel"], "hidden_size": 4}, hf)}, registry=reg)
        np.testing.assert_array_equal(dict(plan.tensors)["a.0.weight"].read_all(), x, err_msg=name)


@pytest.mark.parametrize("rule, problem", [
    ('{cs: "b.weight", hf: "b.weight", make: "x"}', "'make' and 'added' go with 'drop'"),
    ('{cs: "b.{i}.weight", drop: gone, make: "x"}', "must be listed by 'cs'"),
    ('{cs: "b.weight", hf: "b.weight", inverse: {k: y}}', "'k' is not the rule's CS tensor"),
    ('{cs: "b.weight", drop: gone, added: why}', "give 'make'"),
])
def test_hf_to_cs_rule_errors_name_the_place(tmp_path, rule, problem):
    with pytest.raises(MappingError, match=problem) as e:
        tiny_registry(tmp_path, "x", f"  - {rule}\n")
    assert "tiny.yaml" in str(e.value)


def test_copy_of_names_another_component(tmp_path):
    text = """
family: pair
description: two folders
model_type: pair
models:
  - name: pair
    hf_class: A+B
    components:
      - {folder: a, cs_prefix: a., hf_class: A}
      - {folder: b, cs_prefix: b., hf_class: B, copy_of: c}
tensors:
  - {cs: "{rest:.*}", hf: "{rest}"}
"""
    d = tmp_path / "mappings"
    d.mkdir()
    (d / "pair.yaml").write_text(text)
    with pytest.raises(MappingError, match="copy_of: 'c' is not another component's folder"):
        Registry([d])


def test_bf16_hf_weights_stay_bf16():
    config, tensors = hf_folders("llama")[""]
    bf16 = by_name("bfloat16")
    halved = {n: ArrayTensor((t.read_all().view(np.uint32) >> 16).astype(np.uint16), bf16) for n, t in tensors.items()}
    plan = to_cs({"": (config, halved)})
    assert {t.dtype.name for _, t in plan.tensors} == {"bfloat16"}
    q = dict(plan.tensors)["transformer_decoder.layers.0.self_attn.proj_q_dense_layer.weight"]
    assert q.read_all().dtype == np.uint16


def test_a_llava_text_model_without_projector_gets_a_zero_one():
    folders = copy.deepcopy({f: (c, dict(t)) for f, (c, t) in hf_folders("llava").items()})
    config, tensors = folders["text_model"]
    for key in [k for k in config if k.startswith("mm_")]:
        del config[key]
    for name in [n for n in tensors if "mm_projector" in n]:
        del tensors[name]
    plan = to_cs(folders, model="llava")
    reference = to_cs(hf_folders("llava"), model="llava")
    assert plan.params == reference.params
    made = {k: t for k, t in plan.tensors if k.startswith("projector_image_model.")}
    assert {k: list(t.shape) for k, t in made.items()} == {
        k: list(t.shape) for k, t in reference.tensors if k.startswith("projector_image_model.")}
    assert all(not t.read_all().any() for t in made.values())
    assert set(made) <= set(plan.added)
    assert any("no LLaVA projector" in n and "at random" in n for n in plan.notes)


def test_a_clip_vision_model_without_projection_gets_a_zero_classifier():
    config, tensors = copy.deepcopy(hf_folders("clip_vit")[""])
    config["architectures"] = ["CLIPVisionModel"]
    tensors = {n: t for n, t in tensors.items() if not n.startswith("visual_projection.")}
    plan = to_cs({"": (config, tensors)})
    assert plan.model_name == "clip-vit"
    head = dict(plan.tensors)["classifier.classifier.ffn.0.linear_layer.weight"]
    assert list(head.shape) == [config["projection_dim"], config["hidden_size"]] and not head.read_all().any()
    assert "classifier.classifier.ffn.0.linear_layer.weight" in plan.added


def test_errors_name_the_hf_folder(tmp_path):
    configs = copy.deepcopy(_configs("gpt2"))
    configs[""]["architectures"] = ["NoSuchModel"]
    configs[""]["model_type"] = "no_such_type"
    with pytest.raises(ConfigError, match="no converter name takes this Hugging Face model") as e:
        to_cs({"": (configs[""], hf_folders("gpt2")[""][1])}, path=tmp_path)
    assert str(e.value).startswith(str(tmp_path))
