"""Params YAMLs are loaded with bounds (issue 16): an alias bomb or a recursive document is refused with one line
before anything expands it; a FIFO is never opened; ordinary params load as before."""
from __future__ import annotations

import os

import pytest

from ckptfs.errors import ConfigError
from ckptfs.guard.safe_yaml import MAX_BYTES, load_params_yaml
from helpers import FIXTURES

pytestmark = pytest.mark.timeout(120)  # the harness bound (a FIFO opened by mistake would block)


def alias_bomb(levels: int = 8, fanout: int = 10) -> str:
    """~1 KB of YAML whose aliases expand to fanout**levels leaves."""
    lines = ["a0: &a0 [" + ", ".join(["x"] * fanout) + "]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * fanout) + "]")
    lines.append(f"model: {{name: llama, hidden_size: 32, bomb: *a{levels}}}")
    return "\n".join(lines) + "\n"


def test_alias_bomb_is_refused_in_one_line(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text(alias_bomb())
    assert len(alias_bomb()) < 2048
    with pytest.raises(ConfigError) as ei:
        load_params_yaml(p)
    msg = str(ei.value)
    assert "alias" in msg and "\n" not in msg and str(p) in msg


def test_recursive_document_is_refused(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("model: &m {name: llama, again: *m}\n")
    with pytest.raises(ConfigError, match="recursive"):
        load_params_yaml(p)


def test_moderate_aliases_and_real_params_load(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("base: &b {lr: 0.1, betas: [0.9, 0.99]}\nmodel: {name: llama}\noptimizer: *b\n")
    doc = load_params_yaml(p)
    assert doc["optimizer"] == {"lr": 0.1, "betas": [0.9, 0.99]}
    assert load_params_yaml(FIXTURES / "llama" / "cs" / "params.yaml")["model"]["name"] == "llama"


def test_fifo_oversized_and_unparsable(tmp_path):
    os.mkfifo(tmp_path / "fifo.yaml")
    with pytest.raises(ConfigError, match="not a regular file"):
        load_params_yaml(tmp_path / "fifo.yaml")
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(MAX_BYTES + 1)
    with pytest.raises(ConfigError, match="more than"):
        load_params_yaml(big)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_params_yaml(bad)
