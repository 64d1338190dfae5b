"""``ckptfs info`` and ``ckptfs ls`` driven as a user would: through ``python -m ckptfs``."""
from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from helpers import FIXTURES as FIX, run_ckptfs

pytestmark = pytest.mark.slow  # every test runs the CLI

ROOT = Path(__file__).parent.parent.parent
EDGE = FIX / "cstorch_edge_cases"
ALL_MDL = sorted(FIX.rglob("*.mdl"))
GOOD_MDL = [p for p in ALL_MDL if p.name != "intkeys.mdl"]


def _attrs(p: Path) -> dict:
    with h5py.File(p, "r") as f:
        return {k: f.attrs[k] for k in ("__version__", "__cstorch_version__", "__SUCCESS__") if k in f.attrs}


@pytest.mark.parametrize("mdl", GOOD_MDL, ids=lambda p: str(p.relative_to(FIX)))
def test_info_on_every_fixture(mdl):
    r = run_ckptfs("info", mdl, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    a = _attrs(mdl)
    assert f"format: {float(a.get('__version__', 0.1)):g}" in out
    if "__cstorch_version__" in a:
        assert f"release {a['__cstorch_version__']}" in out
    assert ("complete: yes" in out) == bool(a.get("__SUCCESS__", "__version__" not in a or a["__version__"] < 0.5))
    assert any(line.startswith("family: ") for line in out.splitlines())
    assert any(line.startswith("tensors: ") for line in out.splitlines())

    j = json.loads(run_ckptfs("info", "--json", mdl, text=True, timeout=120).stdout)
    assert j["format_version"] == float(a.get("__version__", 0.1))
    assert j["tensors"] == sum(d["tensors"] for d in j["by_dtype"].values())
    assert j["total_bytes"] == sum(d["bytes"] for d in j["by_dtype"].values())


@pytest.mark.parametrize("case", sorted(p.parent.parent.name for p in FIX.glob("*/cs/keys.json")))
def test_info_totals_match_keys_json(case):
    entries = json.loads((FIX / case / "cs" / "keys.json").read_text())["entries"]
    tensors = [e for e in entries.values() if e["kind"] == "tensor" and e.get("serializer") != "LinkedObject"]
    by_dtype = Counter()
    nbytes = Counter()
    for e in tensors:
        by_dtype[e["dtype"]] += 1
        nbytes[e["dtype"]] += int(np.prod(e["shape"])) * torch.empty(0, dtype=getattr(torch, e["dtype"])).element_size()
    j = json.loads(run_ckptfs("info", "--json", FIX / case / "cs" / "checkpoint.mdl", text=True, timeout=120).stdout)
    assert {k: v["tensors"] for k, v in j["by_dtype"].items()} == dict(by_dtype)
    assert {k: v["bytes"] for k, v in j["by_dtype"].items()} == dict(nbytes)
    assert j["aliases"] == sum(1 for e in entries.values() if e.get("serializer") == "LinkedObject")
    with h5py.File(FIX / case / "cs" / "checkpoint.mdl", "r") as f:
        top = json.loads(f.attrs["__spec__"])[0]
    assert j["top_level_keys"] == list(top)


def _bad_inputs(tmp_path: Path) -> list[Path]:
    d = tmp_path / "a_directory"
    d.mkdir()
    text = tmp_path / "notes.mdl"
    text.write_text("just text\n")
    trunc = tmp_path / "truncated.mdl"
    raw = (FIX / "llama" / "cs" / "checkpoint.mdl").read_bytes()
    trunc.write_bytes(raw[: len(raw) // 3])
    plain = tmp_path / "plain.h5"
    with h5py.File(plain, "w") as f:
        f["x"] = np.arange(4)
        f.attrs["note"] = "no cerebras attributes"
    st = tmp_path / "model.safetensors"
    from safetensors.numpy import save_file

    save_file({"w": np.ones(2, np.float32)}, str(st))
    pt = tmp_path / "model.pt"  # torch's format before 1.6 (a zip is a legacy-mode checkpoint: served)
    torch.save({"w": torch.ones(2)}, pt, _use_new_zipfile_serialization=False)
    tmps = []
    for p in sorted(EDGE.glob("*.mdl.*.tmp")):
        shutil.copy(p, tmp_path / p.name)
        tmps.append(tmp_path / p.name)
    return [d, text, trunc, plain, st, pt, tmp_path / "missing.mdl", EDGE / "intkeys.mdl", *tmps]


@pytest.mark.parametrize("command", [["info"], ["info", "--json"], ["ls"], ["ls", "-l"]])
def test_bad_inputs_exit_2_with_one_line(tmp_path, command):
    for bad in _bad_inputs(tmp_path):
        r = run_ckptfs(*command, bad, text=True, timeout=120)
        assert r.returncode == 2, (bad, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1, (bad, r.stderr)
        assert bad.name in lines[0] and "Traceback" not in r.stderr
        assert r.stdout == ""


@pytest.mark.parametrize("command", [["info"], ["ls", "-l"]])
def test_a_success_flag_stored_as_an_array_is_one_line(tmp_path, command):
    """``__SUCCESS__`` written as a bool array (not a flag): the same one line as every other bad input."""
    bad = Path(shutil.copy(FIX / "llama" / "cs" / "checkpoint.mdl", tmp_path / "checkpoint.mdl"))
    with h5py.File(bad, "r+") as f:
        del f.attrs["__SUCCESS__"]
        f.attrs["__SUCCESS__"] = np.array([True, False])
    r = run_ckptfs(*command, bad, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "__SUCCESS__" in r.stderr and bad.name in r.stderr


def test_allow_partial_opens_the_tmp_files(tmp_path):
    for p in sorted(EDGE.glob("*.mdl.*.tmp")):
        r = run_ckptfs("info", p, text=True, timeout=120)
        assert r.returncode == 2 and "--allow-partial" in r.stderr
        r = run_ckptfs("info", "--allow-partial", p, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "complete: no" in r.stdout and "warning: partial checkpoint" in r.stdout
        assert run_ckptfs("ls", "--allow-partial", p, text=True, timeout=120).returncode == 0


def test_debug_shows_the_traceback(tmp_path):
    p = tmp_path / "x.mdl"
    p.write_text("nope")
    r = run_ckptfs("--debug", "info", p, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" in r.stderr


def _count_nodes(obj) -> int:
    if isinstance(obj, dict):
        return sum(1 + _count_nodes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(1 + _count_nodes(v) for v in obj)
    return 0


@pytest.mark.parametrize("ref", [EDGE / "adamw.ref.pt", EDGE / "tied.ref.pt", FIX / "train_gpt2" / "ref.pt",
                                 FIX / "tied_and_scalars" / "ref.pt", FIX / "legacy_emulated" / "legacy04.ref.pt"],
                         ids=lambda p: str(p.relative_to(FIX)))
def test_ls_tree_matches_reference_structure(ref):
    mdl = {"ref.pt": ref.parent / "cs" / "checkpoint.mdl"}.get(ref.name, ref.with_name(ref.name.replace(".ref.pt", ".mdl")))
    expected = torch.load(ref, weights_only=False)
    r = run_ckptfs("ls", mdl, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == _count_nodes(expected)
    # top-level names appear unindented, in order
    assert [ln.rstrip("/").split(" ->")[0] for ln in lines if not ln.startswith(" ")] == [str(k) for k in expected]


def test_ls_marks_aliases_and_long_shows_shapes():
    r = run_ckptfs("ls", "-l", EDGE / "tied.mdl", text=True, timeout=120)
    assert r.returncode == 0
    lines = r.stdout.splitlines()
    with h5py.File(EDGE / "tied.mdl", "r") as f:
        shape = list(f["model.emb.weight"].shape)
        links = {k[: -len(".__metadata__")]: json.loads(v) for k, v in f.attrs.items() if k.endswith(".__metadata__")}
    assert lines[0].startswith("model/")
    assert f"  emb.weight  {shape} float32" in lines
    alias_lines = [ln for ln in lines if " -> " in ln]
    targets = {k: md[k + ".__metadata__"]["key"] for k, md in links.items()
               if md[k + ".__metadata__"]["__TYPE__"] == "LinkedObject"}
    assert len(alias_lines) == len(targets)
    for ln in alias_lines:
        assert ln.split(" -> ")[1].split()[0] in targets.values()
    assert "  lm_head.weight -> model.emb.weight" in "\n".join(lines)
