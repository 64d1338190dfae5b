"""Hugging Face → Cerebras input is untrusted: safetensors headers are bounded (size, nesting, entries) and parsed in
linear time; config.json values must be integers that agree with the weights; a weight the mapping does not use is
an error naming it (``--allow-unused-weights`` converts without it). Every refusal is one line and exit 2, with peak
memory bounded; every genuine fixture keeps converting."""
from __future__ import annotations

import glob
import json
import shutil
import struct
from pathlib import Path

import pytest

from ckptfs.views.options import MountOptions
from ckptfs.mapping.hf_checkpoint import open_hf_checkpoint
from helpers import FIXTURES, needs_fuse, run_ckptfs
from helpers.fuse import force_unmount, is_mounted
from helpers.hf import hf_env
from helpers.rss import measure_ckptfs

pytestmark = pytest.mark.slow  # processes: the CLI, a server, TensorFlow

LLAMA = FIXTURES / "llama" / "hf"
MIXTRAL = FIXTURES / "mixtral" / "hf"
#: what the largest refusal or bounded conversion may add to a ckptfs command's peak memory
MAX_GROWTH_MIB = 256
#: the documented bounds of a safetensors header (docs/security.md)
MAX_HEADER_DEPTH, MAX_HEADER_ENTRIES = 8, 100_000


def with_header(folder: Path, src: Path, extra: int = 0, raw_header: bytes | None = None) -> Path:
    """``src`` (an HF folder with model.safetensors) copied to ``folder`` with ``extra`` one-element float32 tensors
    added to its header (``junk.<i>``), or with ``raw_header`` as the whole header."""
    shutil.copytree(src, folder)
    data = (src / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header, body = json.loads(data[8:8 + n]), data[8 + n:]
    base = len(body)
    for i in range(extra):
        header[f"junk.{i}"] = {"dtype": "F32", "shape": [1], "data_offsets": [base + 4 * i, base + 4 * i + 4]}
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + body + bytes(4 * extra))
    return folder


def with_config(folder: Path, src: Path, config_from: Path | None = None, **changes) -> Path:
    shutil.copytree(src, folder)
    config = json.loads(((config_from or src) / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def refused_in_one_line(*args, timeout: float = 120) -> str:
    base = measure_ckptfs("info", LLAMA, timeout=timeout)
    r = measure_ckptfs(*args, timeout=timeout)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptfs: error: "), r.stderr
    assert r.peak_mib - base.peak_mib < MAX_GROWTH_MIB, (r.peak_mib, base.peak_mib)
    return lines[0]


# -- safetensors headers --------------------------------------------------------------------------------------

def test_header_of_400000_entries_is_refused_in_one_line_quickly(tmp_path):
    """The red team's 34 MB header ran past 180 s."""
    m = with_header(tmp_path / "m", LLAMA, extra=400_000)
    line = refused_in_one_line("info", m, timeout=60)
    assert "model.safetensors" in line and "header" in line


def test_header_just_under_the_entry_bound_converts_in_linear_time_and_bounded_memory(tmp_path):
    """95,000 entries (quadratic before: about 80 s) convert with the flag, in bounded time and memory."""
    m = with_header(tmp_path / "m", LLAMA, extra=95_000)
    base = measure_ckptfs("info", LLAMA)
    r = measure_ckptfs("info", m, "--allow-unused-weights", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "95000 more HF tensors" not in r.stdout and "94980 more HF tensors unused" in r.stdout
    assert r.seconds < 45, r.seconds
    assert r.peak_mib - base.peak_mib < MAX_GROWTH_MIB


def test_too_many_entries_for_one_file_is_refused(tmp_path):
    m = with_header(tmp_path / "m", LLAMA, extra=MAX_HEADER_ENTRIES + 1)
    assert "tensors, more than the" in refused_in_one_line("info", m, "--allow-unused-weights")


@pytest.mark.parametrize("depth", [MAX_HEADER_DEPTH + 1, 100_000])
def test_deeply_nested_header_is_refused_in_one_line(tmp_path, depth):
    nested = b'{"__metadata__": ' + b"[" * depth + b"]" * depth + b"}"
    m = with_header(tmp_path / "m", LLAMA, raw_header=nested)
    line = refused_in_one_line("info", m)
    assert "model.safetensors" in line and "nests" in line and "Traceback" not in line


def test_brackets_inside_strings_do_not_count_as_nesting(tmp_path):
    data = (LLAMA / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header["__metadata__"] = {"format": "pt", "note": "[" * 50 + '"{' * 20}
    m = with_header(tmp_path / "m", LLAMA, raw_header=json.dumps(header).encode())
    assert run_ckptfs("info", m, env=hf_env(), text=True).returncode == 0


# -- config.json against the weights ------------------------------------------------------------------------

@pytest.mark.parametrize("key,value,says", [
    ("num_hidden_layers", 1e9, "num_hidden_layers=1000000000.0 is a float"),
    ("num_hidden_layers", 10 ** 9, "gives 1000000000 layers"),
    ("hidden_size", -32, "hidden_size=-32 is not a size"),
    ("hidden_size", "32", "hidden_size='32' is a str"),
    ("hidden_size", 64, "gives hidden size 64"),
    ("vocab_size", True, "vocab_size=True is a bool"),
])
def test_config_values_of_the_wrong_type_or_contradicting_the_weights_are_refused(tmp_path, key, value, says):
    m = with_config(tmp_path / "m", LLAMA, **{key: value})
    line = refused_in_one_line("info", m)
    assert says in line and key in line.replace("hidden size", "hidden_size").replace("layers", "num_hidden_layers")


@pytest.mark.parametrize("value,says", [(1e9, "num_local_experts=1000000000.0 is a float"),
                                        (10 ** 9, "gives 1000000000 experts")])
def test_expert_count_contradicting_the_weights_is_refused(tmp_path, value, says):
    m = with_config(tmp_path / "m", MIXTRAL, num_local_experts=value)
    assert says in refused_in_one_line("info", m)


def test_mixtral_config_over_llama_weights_is_refused(tmp_path):
    m = with_config(tmp_path / "m", LLAMA, config_from=MIXTRAL)
    line = refused_in_one_line("info", m)
    assert "model.layers.0.mlp.down_proj.weight" in line and "(and 5 more unused)" in line
    line = refused_in_one_line("info", m, "--allow-unused-weights")
    assert "experts" in line and "no expert tensors" in line


# -- weights the mapping does not use -----------------------------------------------------------------------

def test_a_weight_no_rule_takes_is_an_error_naming_it(tmp_path):
    m = with_header(tmp_path / "m", LLAMA, extra=1)
    line = refused_in_one_line("info", m)
    assert "HF weight junk.0 [1] float32 matches no rule of llama.yaml" in line and "--allow-unused-weights" in line
    r = run_ckptfs("info", m, "--allow-unused-weights", env=hf_env(), text=True)
    assert r.returncode == 0 and "junk.0" in r.stdout


@needs_fuse
def test_mount_of_unused_weights_is_refused_and_nothing_is_mounted(tmp_path):
    m = with_config(tmp_path / "m", LLAMA, config_from=MIXTRAL)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = run_ckptfs("mount", m, mnt, env=hf_env(), text=True, timeout=120)
    if is_mounted(mnt):  # the attack worked: do not leave its mount behind
        force_unmount(mnt)
        pytest.fail("the mount was made")
    assert r.returncode == 2 and not is_mounted(mnt)
    assert len(r.stderr.strip().splitlines()) == 1 and "down_proj" in r.stderr


def test_every_genuine_fixture_still_converts_and_declared_drops_are_notes():
    folders = sorted(glob.glob(str(FIXTURES / "*" / "hf")))
    assert len(folders) >= 59
    notes = {}
    for folder in folders:
        hc = open_hf_checkpoint(folder, MountOptions())  # raises on any refusal
        notes[Path(folder).parent.name] = [n for n in hc.plan.notes if "not converted:" in n]
    assert any("inv_freq" in n and "rotary frequencies" in n for n in notes["esm2"])
    assert any("contact_head" in n for n in notes["esm2"])
    assert len(notes["dragon"]) == 2 and all("pooler.dense" in n for n in notes["dragon"])
