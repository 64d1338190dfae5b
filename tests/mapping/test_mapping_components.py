"""The ``components:`` part of the mapping spec (issues 11, 12): validation of the YAML, resolution of the model a
component names, and the warnings gathered on the root HFModel (unread params, unclaimed CS tensors)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from ckptfs.errors import ConfigError, MappingError
from ckptfs.mapping.components import params_at, unused_settings
from ckptfs.mapping.to_hf import to_hf
from ckptfs.mapping.lang.families import Registry, default_registry, mapping_dirs
from ckptfs.readers import open_checkpoint
from helpers import FIXTURES


DPR_LIKE = """
family: twin
description: two encoders
model_type: bert
models:
  - name: twin
    hf_class: BertModel+BertModel
    components:
      - {folder: a, cs_prefix: question_encoder., params: q_encoder, hf_class: BertModel}
      - {folder: b, cs_prefix: ctx_encoder., params: ctx_encoder, hf_class: BertModel}
tensors:
  - {cs: "{rest:.*}", hf: "{rest}"}
"""


def registry_with(tmp_path, text: str, name: str = "twin.yaml") -> Registry:
    d = tmp_path / "mappings"
    d.mkdir(exist_ok=True)
    for f in ("common.yaml", "llama.yaml", "llama_like.yaml", "mup.yaml", "lora_gpt2_lm.yaml"):
        shutil.copy(mapping_dirs()[0] / f, d / f)
    (d / name).write_text(text)
    return Registry([d])


@pytest.mark.parametrize("change, problem", [
    (lambda m: m["components"][1].update(folder="a"), "'a' listed twice"),
    (lambda m: m["components"][0].pop("hf_class"), "needs 'hf_class'"),
    (lambda m: m["components"][0].update(model="llama", model_from="model_name"), "not both"),
    (lambda m: m["components"][0].update(folder="/abs"), "relative folder"),
    (lambda m: m["components"][0].update(colour="red"), "unknown key"),
    (lambda m: m["components"][0].update(vars={"prefix": "x."}), "vars"),
])
def test_component_yaml_errors_name_the_place(tmp_path, change, problem):
    data = yaml.safe_load(DPR_LIKE)
    change(data["models"][0])
    with pytest.raises(MappingError, match=problem) as e:
        registry_with(tmp_path, yaml.safe_dump(data))
    assert "twin.yaml" in str(e.value)


def test_a_family_whose_components_name_other_models_needs_no_rules(tmp_path):
    text = """
family: pair
description: policy and reference
models:
  - name: pair
    hf_class: "<model_name>"
    components:
      - {folder: "", cs_prefix: policy_model.model., model_from: model_name}
      - {folder: ref, cs_prefix: ref_model.model., model: llama}
"""
    spec = registry_with(tmp_path, text, "pair.yaml").family("pair")
    assert spec.tensors == [] and spec.model_type == ""
    assert [c.folder for c in spec.models[0].components] == ["", "ref"]


def test_every_component_model_of_the_shipped_mappings_exists():
    registry = default_registry()
    for spec in registry.families.values():
        for m in spec.models:
            for c in m.components:
                if c.model is not None:
                    target = registry.for_model(c.model)
                    assert target is not None, f"{c.where}: unknown model {c.model!r}"
                    assert not target.variant(c.model).components, f"{c.where}: components do not nest"


def test_params_paths_walk_dicts_and_lists():
    params = {"a": {"b": [{"c": 1}, {"c": 2}]}}
    assert params_at(params, ("a", "b", 1, "c")) == 2
    with pytest.raises(KeyError, match="a.b.2"):
        params_at(params, ("a", "b", 2, "c"))
    used = {("a", "b", 0, "c")}
    assert unused_settings(params, used) == [(("a", "b", 1, "c"), 2)]
    assert unused_settings(params, {("a",)}) == []


def _dpo_copy(tmp_path, edit) -> Path:
    shutil.copy(FIXTURES / "dpo_llama" / "cs" / "checkpoint.mdl", tmp_path / "checkpoint.mdl")
    params = yaml.safe_load((FIXTURES / "dpo_llama" / "cs" / "params.yaml").read_text())
    edit(params["model"])
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    return tmp_path / "checkpoint.mdl"


def test_model_from_names_the_base_model(tmp_path):
    with open_checkpoint(_dpo_copy(tmp_path, lambda m: m.update(model_name="no-such-model"))) as ck:
        with pytest.raises(ConfigError, match="'no-such-model'.*ckptfs models"):
            to_hf(ck)
    with open_checkpoint(_dpo_copy(tmp_path, lambda m: m.pop("model_name"))) as ck:
        with pytest.raises(ConfigError, match="model.model_name"):
            to_hf(ck)


def test_root_model_reports_unread_params_and_every_folder(tmp_path):
    with open_checkpoint(_dpo_copy(tmp_path, lambda m: m.update(extra_knob=3))) as ck:
        hf = to_hf(ck)
    assert set(hf.folders()) == {"", "ref_model"} and hf.family == "dpo" and hf.model_name == "dpo"
    assert hf.folders()["ref_model"].config == hf.config
    text = "\n".join(hf.warnings)
    assert "model.extra_knob=3" in text and "model.dpo.beta" in text and "DPO loss settings" in text
    assert "ref_model/: CS tensor model.ref_model.model.ln_f.weight not converted" in text
    assert "model.model_name" not in text and "model.name=" not in text


def test_root_without_model_has_no_tensors_and_lists_its_folders():
    with open_checkpoint(FIXTURES / "dpr" / "cs" / "checkpoint.mdl") as ck:
        hf = to_hf(ck)
    assert hf.tensors == [] and hf.config == {} and hf.model_name == "dpr"
    assert list(hf.folders()) == ["q_encoder", "ctx_encoder"]
    assert [m.hf_class for m in hf.folders().values()] == ["DPRQuestionEncoder", "DPRContextEncoder"]
