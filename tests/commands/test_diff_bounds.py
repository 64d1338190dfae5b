"""``ckptfs diff`` is bounded whatever the checkpoints declare: two checkpoints whose tensors declare 4 TiB and wrote
nothing once ran past 120 s. Chunks neither side wrote are not read (unwritten datasets compare by their fill
values), ``--max-bytes`` caps what is read (one line, exit 2 when reached), and a terminal gets a progress bar."""
from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import h5py
import hdf5plugin
import numpy as np

from helpers import FIXTURES, ckptfs_argv, real_env, run_ckptfs
from helpers.rss import measure_ckptfs
from helpers.untrusted import add_leaves, copy_llama, leaf_metadata, tensor_md
import pytest

pytestmark = pytest.mark.slow  # processes: the CLI, a server, TensorFlow

HUGE = (1 << 20, 1 << 20)  # 4 TiB of float32
MAX_GROWTH_MIB = 256


def huge_checkpoint(folder: Path, chunks=(1024, 1024), fill: float = 0.0, written: bool = False) -> Path:
    """The llama fixture plus ``huge``, a 4 TiB float32 tensor of which nothing (or one chunk) is written."""
    ckpt = copy_llama(folder)
    with h5py.File(ckpt, "a") as f:
        d = f.create_dataset("huge", shape=HUGE, dtype=np.float32, chunks=chunks, fillvalue=fill,
                             **hdf5plugin.LZ4())
        if written:
            d[:chunks[0], :chunks[1]] = np.ones(chunks, np.float32)
    add_leaves(ckpt, {"huge": leaf_metadata("huge", tensor_md(HUGE))})
    return ckpt


def test_two_4tib_tensors_that_wrote_nothing_are_equal_without_reading(tmp_path):
    a, b = huge_checkpoint(tmp_path / "a"), huge_checkpoint(tmp_path / "b")
    base = measure_ckptfs("diff", FIXTURES / "llama" / "cs" / "checkpoint.mdl",
                          FIXTURES / "llama" / "cs" / "checkpoint.mdl")
    r = measure_ckptfs("diff", a, b, "--equal", timeout=60)
    assert r.returncode == 0, r.stderr
    assert "= huge  [1048576, 1048576] float32" in r.stdout
    assert r.seconds < 30 and r.peak_mib - base.peak_mib < MAX_GROWTH_MIB


def test_unwritten_tensors_of_other_chunkings_compare_by_fill_value(tmp_path):
    a = huge_checkpoint(tmp_path / "a")
    b = huge_checkpoint(tmp_path / "b", chunks=(2048, 512))
    r = run_ckptfs("diff", a, b, text=True, timeout=60)
    assert r.returncode == 0 and "23 keys: 23 equal" in r.stdout, r.stdout + r.stderr
    c = huge_checkpoint(tmp_path / "c", chunks=(2048, 512), fill=1.5)
    r = run_ckptfs("diff", a, c, "--json", text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    import json

    doc = json.loads(r.stdout)
    huge = next(k for k in doc["keys"] if k["key"] == "huge")
    assert huge["status"] == "changed" and huge["changed"] == 1 << 40
    assert huge["first_index"] == [0, 0] and huge["first_values"] == [0.0, 1.5]


def test_a_written_chunk_is_compared_and_the_rest_is_not_read(tmp_path):
    a = huge_checkpoint(tmp_path / "a", written=True)
    b = huge_checkpoint(tmp_path / "b")
    r = run_ckptfs("diff", a, b, "--json", text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    import json

    huge = next(k for k in json.loads(r.stdout)["keys"] if k["key"] == "huge")
    assert huge["changed"] == 1024 * 1024 and huge["first_values"] == [1.0, 0.0]


def test_max_bytes_stops_the_diff_in_one_line(tmp_path):
    a = huge_checkpoint(tmp_path / "a", written=True)  # stored unlike B: its values must be decoded box by box
    b = huge_checkpoint(tmp_path / "b", chunks=(2048, 512), written=True)
    t0 = time.monotonic()
    r = run_ckptfs("diff", a, b, "--max-bytes", "64MiB", text=True, timeout=120)
    assert time.monotonic() - t0 < 60
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "diff stopped at huge" in lines[0] and "--max-bytes" in lines[0], r.stderr
    r = run_ckptfs("diff", a, b, "--max-bytes", "lots", text=True)
    assert r.returncode == 2 and "lots" in r.stderr


def test_the_default_bound_is_documented_in_the_help():
    r = run_ckptfs("diff", "--help", text=True)
    assert "--max-bytes" in r.stdout and "256GiB" in r.stdout


def test_a_terminal_gets_a_progress_bar(tmp_path):
    a = huge_checkpoint(tmp_path / "a")
    master, slave = pty.openpty()
    proc = subprocess.Popen(ckptfs_argv("diff", a, FIXTURES / "llama" / "cs" / "checkpoint.mdl"),
                            env=real_env(COLUMNS="100"), stdout=subprocess.DEVNULL, stderr=slave,
                            stdin=subprocess.DEVNULL)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    proc.wait(30)
    os.close(master)
    text = out.decode(errors="replace")
    assert "diff" in text and "%" in text, text
    r = run_ckptfs("diff", a, FIXTURES / "llama" / "cs" / "checkpoint.mdl", text=True)
    assert "%" not in r.stderr  # no terminal, no bar
