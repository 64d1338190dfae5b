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
from conftest import FIXTURES

CONFORMANCE = Path(__file__).parent / "conformance"


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


def test_params_without_a_model_name_need_model(tmp_path, capsys):
    params = yaml.safe_load((FIXTURES / "llama" / "cs" / "params.yaml").read_text())
    del params["model"]["name"]
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(params))
    code, _, err = convert([p], capsys)
    assert code == 2 and "pass --model" in err
    code, out, _ = convert([p, "--model", "llama"], capsys)
    assert code == 0 and json.loads(out)["model_type"] == "llama"
