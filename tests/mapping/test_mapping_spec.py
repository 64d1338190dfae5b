"""Mapping YAML loading: the shipped files, validation errors naming file and problem, YAML-only families."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import yaml

from ckptfs.errors import ConfigError, MappingError
from ckptfs.mapping.to_hf import to_hf
from ckptfs.mapping.lang.expr import ExprError, Scope, evaluate, parse
from ckptfs.mapping.lang.pattern import KeyPattern, PatternError
from ckptfs.mapping.lang.families import LazyRegistry, Registry, default_registry, list_models, mapping_dirs
from helpers.mapping import RecordingTensor, checkpoint_from_model

REQUIRED_NAMES = {"gpt2", "gpt2-headless", "llama", "llamaV2", "code-llama", "wizardlm", "llama-headless",
                  "llamaV2-headless", "code-llama-headless", "wizardlm-headless", "mistral", "mistral-headless",
                  "mixtral", "mixtral-headless", "gemma2"}


def test_shipped_mappings_load_and_cover_the_cerebras_names():
    reg = default_registry()
    assert {"gpt2", "llama", "mistral", "mixtral", "gemma2"} <= set(reg.families)
    names = {m.name for m in list_models()}
    assert REQUIRED_NAMES <= names
    for m in list_models():
        spec = reg.for_model(m.name)
        assert spec.family == m.family and spec.variant(m.name).hf_class == m.hf_class
        headless = m.name.endswith("-headless")
        assert spec.variant(m.name).headless == headless
        if headless:
            assert m.hf_class.endswith("Model"), m.name
    assert any(d.name == "mappings" for d in mapping_dirs())


def test_key_patterns():
    p = KeyPattern.compile("transformer_decoder.layers.{i}.norm1.{p:weight|bias}")
    assert p.match("transformer_decoder.layers.12.norm1.bias") == {"i": 12, "p": "bias"}
    assert p.match("transformer_decoder.layers.12.norm1.gamma") is None
    assert p.match("transformer_decoder_layers.1.norm1.bias") is None  # dots are literal
    assert p.format({"i": 3, "p": "weight"}) == "transformer_decoder.layers.3.norm1.weight"
    with pytest.raises(PatternError, match="groups"):
        KeyPattern.compile("a.{x:(b|c)}")
    with pytest.raises(PatternError, match="twice"):
        KeyPattern.compile("{i}.{i}")


def test_expressions_are_a_safe_subset():
    scope = Scope({"a": 3, "cfg": {"moe": {"k": 2}}})
    fns = {"sqrt": lambda x: x ** 0.5}
    assert evaluate("a * 2 + cfg.moe.k if a > 1 else 0", scope, fns) == 8
    assert evaluate("cfg['moe']['k'] in [1, 2]", scope, fns) is True
    for bad in ("__import__('os')", "a.__class__", "[x for x in range(3)]", "lambda: 1", "(1).real"):
        with pytest.raises(ExprError):
            parse(bad)
            evaluate(bad, scope, fns)


BAD_FAMILIES = [
    ({"unexpected": 1}, "unknown key"),
    ({"tensors": [{"cs": "a.{i}", "hf": "b.{j}"}]}, r"uses \{j\}"),
    ({"tensors": [{"cs": "a", "hf": "b", "op": "transpose(x"}]}, "syntax error"),
    ({"tensors": [{"cs": "a", "hf": "b", "drop": "why"}]}, "exactly one of"),
    ({"tensors": [{"cs": "a.{x:(y)}", "hf": "b"}]}, "groups"),
    ({"include": ["nope"]}, "unknown fragment 'nope'"),
    ({"tensors": []}, "at least one tensor rule"),
    ({"config": {"guards": [{"key": "k"}]}}, "allowed"),
    ({"models": [{"name": "toy", "hf_class": "X"}, {"name": "toy", "hf_class": "Y"}]}, "listed twice"),
    ({"models": [{"name": "toy", "hf_class": "X", "replaces": [{"model": "nope", "when": "True", "reason": "r"}]}]},
     "replaces: unknown model name 'nope'"),
    ({"models": [{"name": "toy", "hf_class": "X", "replaces": [{"model": "toy", "when": "(", "reason": "r"}]}]},
     "syntax error"),
    ({"no_hf": "why", "models": [{"name": "toy", "hf_class": "X"}]}, "no HF side"),
    ({"no_hf": "why", "models": [{"name": "toy"}]}, "no config, prepare, tensors"),
]


def toy_family(**changes):
    doc = {"family": "toy", "model_type": "gpt2", "models": [{"name": "toy", "hf_class": "GPT2Model"}],
           "tensors": [{"cs": "w.{i}", "hf": "h.{i}.weight"}]}
    doc.update(changes)
    return doc


@pytest.mark.parametrize("changes,problem", BAD_FAMILIES)
def test_invalid_yaml_names_file_and_problem(tmp_path, changes, problem):
    (tmp_path / "toy.yaml").write_text(yaml.safe_dump(toy_family(**changes)))
    with pytest.raises(MappingError, match=problem) as err:
        Registry([tmp_path])
    assert "toy.yaml" in str(err.value)


def test_name_clash_between_files(tmp_path):
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(toy_family()))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(toy_family(family="toy2")))
    with pytest.raises(MappingError, match="model name 'toy' also belongs"):
        Registry([tmp_path])


def test_family_defined_twice_names_both_files(tmp_path):
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(toy_family()))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(toy_family(models=[{"name": "other", "hf_class": "X"}])))
    with pytest.raises(MappingError, match=r"b\.yaml: family 'toy' also defined in .*a\.yaml"):
        Registry([tmp_path])


@pytest.mark.parametrize("detect_both", [False, True])
def test_a_shared_cs_name_needs_detect_config_in_every_sharing_family(tmp_path, detect_both):
    detect = {"config": "get('k', 0) == 1"}
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(toy_family(cs_names=["shared"], detect=detect)))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(toy_family(
        family="toy2", models=[{"name": "toy2", "hf_class": "X"}], cs_names=["shared"],
        **({"detect": {"config": "get('k', 0) == 2"}} if detect_both else {}))))
    if not detect_both:
        with pytest.raises(MappingError, match=r"b\.yaml: CS model name 'shared' also claimed by a\.yaml"):
            Registry([tmp_path])
        with pytest.raises(MappingError, match=r"CS model name 'shared' also claimed by a\.yaml"):
            LazyRegistry([tmp_path])  # its index refuses the clash, and the full parse says why
        return
    reg = Registry([tmp_path])
    assert reg.for_cs_name("shared") is None
    assert [s.family for s in reg.families_for_cs_name("shared")] == ["toy", "toy2"]
    lazy = LazyRegistry([tmp_path])
    assert lazy._index is not None and [s.family for s in lazy.families_for_cs_name("shared")] == ["toy", "toy2"]


def test_a_new_family_needs_only_yaml(tmp_path):
    """A fused-qkv family with a derived config value and a generated buffer, written as YAML only."""
    shutil.copy(mapping_dirs()[0] / "common.yaml", tmp_path / "common.yaml")
    (tmp_path / "toy.yaml").write_text(yaml.safe_dump({
        "family": "toy", "model_type": "toy", "include": ["common"],
        "models": [{"name": "toy", "hf_class": "ToyForCausalLM", "vars": {"prefix": "m."}}],
        "config": {"derive": {"width": "hidden_size * 3"},
                   "guards": [{"key": "norm", "allowed": ["rms"]}],
                   "hf": {"hidden": "hidden_size", "fused_width": "width",
                          "act": "lookup('act', {'swiglu': 'silu'})"}},
        "tensors": [
            {"cs": "layers.{i}.q", "with": {"k": "layers.{i}.k", "v": "layers.{i}.v"},
             "emit": [{"hf": "{prefix}h.{i}.qkv", "op": "transpose(concat(x, k, v))"},
                      {"hf": "{prefix}h.{i}.mask", "op": "causal_mask(4)"}]},
            {"cs": "norm", "hf": "{prefix}norm", "op": "sub(x, 1.0)"},
            {"cs": "junk", "drop": "not needed"},
        ]}))
    reg = Registry([tmp_path])
    rng = np.random.default_rng(0)
    t = {k: RecordingTensor(rng.standard_normal(s).astype(np.float32))
         for k, s in {"layers.0.q": (2, 2), "layers.0.k": (2, 2), "layers.0.v": (2, 2), "norm": (2,),
                      "junk": (1,)}.items()}
    params = tmp_path / "p.yaml"
    params.write_text(yaml.safe_dump({"model": {"name": "toy", "hidden_size": 2, "norm": "rms", "act": "swiglu",
                                                "extra": 1}}))
    hf = to_hf(checkpoint_from_model(tmp_path / "c.mdl", t), config=params, registry=reg)
    assert [n for n, _ in hf.tensors] == ["m.h.0.qkv", "m.h.0.mask", "m.norm"]
    qkv = dict(hf.tensors)["m.h.0.qkv"].read_all()
    ref = np.concatenate([t["layers.0.q"].inner.array, t["layers.0.k"].inner.array, t["layers.0.v"].inner.array]).T
    np.testing.assert_array_equal(qkv, ref)
    assert hf.config["fused_width"] == 6 and hf.config["act"] == "silu"
    assert hf.config["architectures"] == ["ToyForCausalLM"] and hf.config["torch_dtype"] == "float32"
    assert any("model.extra=1" in w for w in hf.warnings)
    assert any("junk" in w and "not needed" in w for w in hf.warnings)
    params.write_text(yaml.safe_dump({"model": {"name": "toy", "hidden_size": 2, "norm": "layer", "act": "swiglu"}}))
    with pytest.raises(ConfigError, match="norm='layer' cannot be converted"):
        to_hf(checkpoint_from_model(tmp_path / "c.mdl", t), config=params, registry=reg)


def test_a_replacement_may_name_a_model_by_an_alias_and_applies_to_every_name_of_it(tmp_path):
    """`replaces: {model: old-alias}` is chosen for params naming the model by its name or by any alias."""
    from ckptfs.mapping.detect import detect_family

    (tmp_path / "toy.yaml").write_text(yaml.safe_dump(toy_family(models=[
        {"name": "toy", "hf_class": "GPT2Model", "aliases": ["toy-alias"]},
        {"name": "toy-big", "hf_class": "GPT2LMHeadModel",
         "replaces": [{"model": "toy-alias", "when": "get('big', False)", "reason": "big is {big}"}]}])))
    reg = Registry([tmp_path])
    for name in ("toy", "toy-alias"):
        (tmp_path / "params.yaml").write_text(yaml.safe_dump({"model": {"name": name, "big": True}}))
        ck = checkpoint_from_model(tmp_path / "checkpoint.mdl", {})
        det = detect_family(ck, tmp_path / "params.yaml", registry=reg)
        assert (det.model_name, det.chosen) == ("toy-big", f"model toy-big chosen instead of {name}: big is True")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"model": {"name": "toy", "big": False}}))
    det = detect_family(checkpoint_from_model(tmp_path / "checkpoint.mdl", {}), tmp_path / "params.yaml",
                        registry=reg)
    assert (det.model_name, det.chosen) == ("toy", None)
