"""Every alias of a model name gives the same bytes as the name it aliases (checked on a fixture of that model), and
`ckptfs models` lists every name with its family, HF class (none for a family without an HF side) and a note."""
from __future__ import annotations

import json

import pytest

from helpers.cases import CASES, FIXTURES, case_checkpoint, case_facts, case_model, has_hf, sha256
from ckptfs.cli import main
from ckptfs.mapping.to_hf import to_hf
from ckptfs.mapping.lang.families import default_registry
from ckptfs.readers import open_checkpoint


def alias_groups() -> list:
    """(case, [names]) for every model entry with aliases that some covered fixture case uses."""
    registry = default_registry()
    out = []
    for spec in registry.families.values():
        for m in spec.models:
            if not m.aliases:
                continue
            names = [m.name, *m.aliases]
            case = next((c for c in CASES if case_model(c) in names and has_hf(c) and not case_facts(c).get("pending")),
                        None)
            if case is not None:
                out.append(pytest.param(case, names, id=m.name))
    return out


def fingerprint(case: str, name: str):
    with open_checkpoint(case_checkpoint(case)) as ckpt:
        hf = to_hf(ckpt, model=name)
        folders = {}
        for folder, model in hf.folders().items():
            folders[folder] = ([(n, sha256(t)) for n, t in model.tensors],
                               json.dumps(model.config, sort_keys=True), model.hf_class)
    return folders


@pytest.mark.parametrize("case,names", alias_groups())
def test_alias_gives_the_same_bytes(case, names):
    base = fingerprint(case, names[0])
    for alias in names[1:]:
        assert fingerprint(case, alias) == base, f"{alias} differs from {names[0]}"


def test_aliases_are_checked_for_the_big_families():
    checked = {p.id for p in alias_groups()}
    assert {"llama", "starcoder", "t5"} <= checked


def test_models_table_lists_every_name_with_family_class_and_notes(capsys):
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    registry = default_registry()
    assert {r["name"] for r in rows} == set(registry.by_model)
    for r in rows:
        assert r["family"] and r["notes"], r
        assert r["hf_class"] or registry.family(r["family"]).no_hf, r  # a family without an HF side says why


def test_multi_query_params_named_gpt2_point_to_the_starcoder_family(tmp_path):
    """WizardCoder's params say `name: gpt2`; without --model the gpt2 family refuses it and names the fix."""
    import shutil

    from ckptfs.errors import ConfigError, MappingError

    case = FIXTURES / "wizardcoder" / "cs"
    shutil.copy(case / "checkpoint.mdl", tmp_path / "checkpoint.mdl")
    shutil.copy(case / "params.yaml", tmp_path / "params.yaml")
    with open_checkpoint(tmp_path / "checkpoint.mdl") as ckpt:
        with pytest.raises((ConfigError, MappingError), match="--model wizardcoder"):
            to_hf(ckpt)
        assert to_hf(ckpt, model="wizardcoder").family == "starcoder"
