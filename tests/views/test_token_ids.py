"""Special token ids in config.json and generation_config.json (issue 15): params first, then the transformers
config class's defaults (ckptfs/mapping/params/hf_defaults.py, checked here against the installed transformers); only
models that generate get a generation_config.json."""
from __future__ import annotations

import pytest

from ckptfs.mapping.params.to_hf_config import convert_config
from ckptfs.mapping.params.hf_defaults import CLASS_TOKEN_IDS, NO_CLASS_TOKEN_IDS, TOKEN_ID_KEYS, generates
from ckptfs.mapping.lang.families import default_registry
from test_mapping_config import hf_config, params_of


def registry_classes() -> list:
    """(model_type, hf_class, remote_code) of every model and component of every family."""
    out = []
    for spec in default_registry().families.values():
        for m in spec.models:
            if not m.components:
                out.append((spec.model_type, m.hf_class, m.remote_code))
            for c in m.components:
                out.append((c.model_type or spec.model_type, c.hf_class or m.hf_class, m.remote_code))
    return out


def test_table_equals_the_installed_transformers_config_classes():
    from transformers import CONFIG_MAPPING

    for model_type, ids in CLASS_TOKEN_IDS.items():
        cfg = CONFIG_MAPPING[model_type]()
        want = {k: getattr(cfg, k) for k in TOKEN_ID_KEYS if getattr(cfg, k, None) is not None}
        assert ids == want, model_type
    for model_type in NO_CLASS_TOKEN_IDS:
        cfg = CONFIG_MAPPING[model_type]()
        assert all(getattr(cfg, k, None) is None for k in TOKEN_ID_KEYS), model_type


def test_every_model_type_of_the_mappings_is_in_the_table():
    from transformers import CONFIG_MAPPING

    for model_type, hf_class, remote in registry_classes():
        if model_type is None or remote or model_type not in CONFIG_MAPPING:
            continue
        assert model_type in CLASS_TOKEN_IDS or model_type in NO_CLASS_TOKEN_IDS, model_type


def test_generates_agrees_with_transformers_can_generate():
    import transformers

    checked = 0
    for _, hf_class, _ in registry_classes():
        cls = getattr(transformers, hf_class or "", None)
        if cls is None:
            continue
        assert generates(hf_class) == cls.can_generate(), hf_class
        checked += 1
    assert checked > 20
    assert generates("GPT2LMHeadCustomModel") and generates("BTLMLMHeadModel") and not generates("BTLMModel")


def test_params_ids_win_over_class_defaults():
    res = hf_config("gpt2", {"bos_token_id": 3, "eos_token_id": 4, "pad_token_id": 5})
    assert {k: res.hf[k] for k in TOKEN_ID_KEYS} == {"bos_token_id": 3, "eos_token_id": 4, "pad_token_id": 5}
    assert res.generation == {"bos_token_id": 3, "eos_token_id": 4, "pad_token_id": 5}


def test_class_defaults_fill_what_the_params_lack():
    res = hf_config("gpt2", {"eos_token_id": 7})
    assert res.hf["bos_token_id"] == 50256 and res.hf["eos_token_id"] == 7 and "pad_token_id" not in res.hf
    assert res.generation == {"bos_token_id": 50256, "eos_token_id": 7}
    assert res.token_id_sources == {"bos_token_id": "class", "eos_token_id": "params"}  # what README.txt says


def test_headless_models_and_encoders_have_no_generation_config():
    spec = default_registry().family("llama")
    headless = next(m for m in spec.models if m.headless)
    res = convert_config(spec, headless, params_of("llama")["model"], None)
    assert res.hf["eos_token_id"] == 2 and res.generation is None
    bert = hf_config("bert")
    assert bert.hf["pad_token_id"] == 0 and bert.generation is None


@pytest.mark.parametrize("case", ["btlm", "santacoder"])
def test_remote_code_classes_get_no_guessed_ids(case):
    res = hf_config(case)
    assert not any(k in res.hf for k in TOKEN_ID_KEYS)
