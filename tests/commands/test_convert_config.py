"""``ckptfs convert-config PARAMS.yaml`` (issue 15): on every fixture's params it prints the config.json the hf view
serves for that checkpoint (every HF folder of a multi-component model); params HF cannot express exit 2 with one
error per obstacle and the keys that would be dropped."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import ckptfs
from ckptfs.cli import main
from helpers import FIXTURES

CONFORMANCE = Path(__file__).parent.parent / "conformance"


def fixture_model(case: str) -> str | None:
    """--model for a case: its conformance facts' model, else the MANIFEST's converter_model (None: params name)."""
    facts = CONFORMANCE / f"{case}.yaml"
    model = (yaml.safe_load(facts.read_text()) or {}).get("model") if facts.is_file() else None
    return model or json.loads((FIXTURES / case / "MANIFEST.json").read_text()).get("converter_model")


CASES = sorted(p.parts[-3] for p in FIXTURES.glob("*/cs/params.yaml"))


def view_configs(case: str, model: str | None) -> dict:
    """{HF folder: config.json} as the hf view serves them (bin/ and hub/ copies left out)."""
    tree = ckptfs.open(FIXTURES / case / "cs" / "checkpoint.mdl", views="hf", model=model)
    try:
        out = {}
        for path in tree.file_paths():
            folder, _, name = path.rpartition("/")
            if name == "config.json" and folder.rpartition("/")[2] != "bin" and folder.split("/")[0] != "hub":
                out[folder] = json.loads(tree.read(path, 0, tree.attr(path).size))
        return out
    finally:
        tree.close()


def convert(args: list, capsys) -> tuple:
    code = main(["convert-config", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("case", CASES)
def test_prints_the_hf_views_config(case, capsys):
    model = fixture_model(case)
    view = view_configs(case, model)
    assert view, f"{case}: the hf view has no config.json"
    dtype = next(iter(view.values()))["dtype"]
    args = [FIXTURES / case / "cs" / "params.yaml"] + (["--model", model] if model else [])
    args += [] if dtype == "float32" else ["--dtype", dtype]  # float32 is the default
    code, out, err = convert(args, capsys)
    assert code == 0, err
    printed = json.loads(out)
    assert (printed if len(view) > 1 else {next(iter(view)): printed}) == view


def test_the_text_is_the_views_config_json_byte_for_byte(capsys):
    tree = ckptfs.open(FIXTURES / "llama" / "cs" / "checkpoint.mdl", views="hf")
    try:
        want = tree.read("config.json", 0, 1 << 20).decode()
    finally:
        tree.close()
    code, out, _ = convert([FIXTURES / "llama" / "cs" / "params.yaml"], capsys)
    assert code == 0 and out == want


def test_what_hf_cannot_express_exits_2_with_every_obstacle(tmp_path, capsys):
    params = yaml.safe_load((FIXTURES / "llama" / "cs" / "params.yaml").read_text())
    params["model"].update(norm_type="layernorm", position_embedding_type="alibi", nonlinearity="sigmoid",
                           my_custom_knob=3)
    bad = tmp_path / "params.yaml"
    bad.write_text(yaml.safe_dump(params))
    code, out, err = convert([bad, "-o", tmp_path / "config.json"], capsys)
    assert code == 2 and out == "" and not (tmp_path / "config.json").exists()
    errors = [line for line in err.splitlines() if line.startswith("ckptfs: error:")]
    assert len(errors) == 3, err
    assert any("model.norm_type='layernorm'" in e for e in errors)
    assert any("model.position_embedding_type='alibi'" in e for e in errors)
    assert any("nonlinearity='sigmoid' has no HF equivalent" in e for e in errors)
    assert "would be dropped" in err and "model.my_custom_knob=3" in err


def test_dropped_keys_are_listed_on_success(tmp_path, capsys):
    params = yaml.safe_load((FIXTURES / "llama" / "cs" / "params.yaml").read_text())
    params["model"]["my_custom_knob"] = 3
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(params))
    code, out, err = convert([p], capsys)
    assert code == 0 and json.loads(out)["model_type"] == "llama"
    assert "model.my_custom_knob=3 has no counterpart" in err


def test_output_file_folder_and_multi_component_directory(tmp_path, capsys):
    code, out, _ = convert([FIXTURES / "llama" / "cs" / "params.yaml", "-o", tmp_path / "c.json"], capsys)
    assert code == 0 and out == "" and json.loads((tmp_path / "c.json").read_text())["model_type"] == "llama"
    llava = FIXTURES / "llava" / "cs" / "params.yaml"
    code, out, _ = convert([llava, "--model", "llava", "-o", tmp_path / "llava"], capsys)
    assert code == 0
    assert {p.relative_to(tmp_path / "llava").as_posix() for p in (tmp_path / "llava").rglob("*.json")} == {
        "image_model/config.json", "text_model/config.json"}
    code, out, _ = convert([llava, "--model", "llava", "--folder", "text_model"], capsys)
    assert code == 0 and json.loads(out) == json.loads((tmp_path / "llava" / "text_model" / "config.json").read_text())
    code, _, err = convert([llava, "--model", "llava", "--folder", "nope"], capsys)
    assert code == 2 and "no HF folder 'nope'" in err


def test_output_is_not_written_through_a_linked_folder_or_temporary_file(tmp_path, capsys):
    """``-o DIR`` writes as export does (``ckptfs.state.outfiles``): a component folder that is a link elsewhere, or a
    ``config.json.tmp`` link to a victim, stop it with one line and nothing is written through them."""
    elsewhere, victim = tmp_path / "elsewhere", tmp_path / "victim.txt"
    elsewhere.mkdir()
    victim.write_text("precious\n")
    out = tmp_path / "llava"
    out.mkdir()
    (out / "text_model").symlink_to(elsewhere)
    llava = FIXTURES / "llava" / "cs" / "params.yaml"
    code, _, err = convert([llava, "--model", "llava", "-o", out], capsys)
    assert code == 2 and "text_model" in err and "symbolic link" in err and list(elsewhere.iterdir()) == []
    (tmp_path / "c.json.tmp").symlink_to(victim)
    code, _, err = convert([FIXTURES / "llama" / "cs" / "params.yaml", "-o", tmp_path / "c.json"], capsys)
    assert code == 2 and "c.json.tmp" in err and victim.read_text() == "precious\n"


def test_params_without_a_model_name_need_model(tmp_path, capsys):
    params = yaml.safe_load((FIXTURES / "llama" / "cs" / "params.yaml").read_text())
    del params["model"]["name"]
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(params))
    code, _, err = convert([p], capsys)
    assert code == 2 and "pass --model" in err
    code, out, _ = convert([p, "--model", "llama"], capsys)
    assert code == 0 and json.loads(out)["model_type"] == "llama"


def test_the_params_choose_the_class_and_a_model_without_hf_side_is_refused(tmp_path, capsys):
    code, out, err = convert([FIXTURES / "roberta" / "cs" / "params.yaml"], capsys)  # name: bert, RoBERTa's trait
    assert code == 0 and json.loads(out)["architectures"] == ["RobertaForMaskedLM"]
    assert "model roberta chosen instead of bert" in err
    params = yaml.safe_load((FIXTURES / "bert" / "cs" / "params.yaml").read_text())
    params["model"].update(disable_nsp=True)
    (tmp_path / "bert.yaml").write_text(yaml.safe_dump(params))
    code, out, err = convert([tmp_path / "bert.yaml"], capsys)
    assert code == 0 and json.loads(out)["architectures"] == ["BertForMaskedLM"] and "disable_nsp is true" in err
    params["model"].update(name="bert/extractive_summarization")
    (tmp_path / "summarization.yaml").write_text(yaml.safe_dump(params))
    code, out, err = convert([tmp_path / "summarization.yaml"], capsys)
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert "model bert/extractive_summarization (family bert-summarization) has no Hugging Face counterpart" in err
