"""``ckptfs models``: lists every supported model name with family, HF class and notes."""
from __future__ import annotations

import json

import pytest

from ckptfs.cli import main
from ckptfs.mapping.lang.families import list_models
from helpers import run_ckptfs


def test_table_lists_every_name(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["MODEL", "FAMILY", "HF"]
    first_words = [line.split()[0] for line in lines[1:] if line and not line.startswith(" ")]
    assert first_words == [m.name for m in list_models()]
    for m in list_models():
        row = next(line for line in lines if line.split()[0] == m.name)
        assert m.family in row.split() and (m.hf_class or "(none)") in row.split()


def test_json_output(capsys):
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["family"], r["hf_class"], r["notes"]) for r in rows] == \
        [(m.name, m.family, m.hf_class or None, m.notes) for m in list_models()]
    assert {"gpt2", "gpt2-headless", "llamaV2-headless", "mixtral-headless", "gemma2"} <= {r["name"] for r in rows}


def test_filter_and_unknown(capsys):
    assert main(["models", "mixtral", "--json"]) == 0
    assert {r["name"] for r in json.loads(capsys.readouterr().out)} == {"mixtral", "mixtral-headless"}
    assert main(["models", "bort"]) == 2
    assert "unknown model 'bort'" in capsys.readouterr().err


@pytest.mark.slow  # runs the CLI
def test_runs_as_a_program():
    out = run_ckptfs("models", "--hide-notes", text=True, check=True).stdout
    assert "code-llama-headless" in out and "NOTES" not in out


def test_a_family_without_hf_side_is_listed_with_its_notes(capsys):
    assert main(["models", "bert-summarization", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["family"], r["hf_class"]) for r in rows] == [
        ("bert-summarization", "bert-summarization", None),
        ("bert/extractive_summarization", "bert-summarization", None)]
    assert "no Hugging Face class" in rows[0]["notes"]
