"""``ckptfs export CKPT OUTDIR`` with what may already be in OUTDIR (issue 31, attacks 3 and 4): it never writes
through a link, never opens a FIFO, and on a re-run keeps only files it finished itself from the same content."""
from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

import pytest

from helpers import FIXTURES, real_env, run_ckptfs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # every test runs the CLI

LLAMA = FIXTURES / "llama" / "cs"


@pytest.fixture
def env(tmp_path) -> dict:
    return real_env(CKPTFS_CACHE_DIR=tmp_path / "cache")


def export(env, *args, timeout: float = 120):
    return run_ckptfs("export", *args, env=env, timeout=timeout)


def one_line_error(r, *words) -> str:
    err = r.stderr.decode()
    assert r.returncode == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), err
    return lines[0]


# -- attack 3: links and FIFOs in OUTDIR --------------------------------------------------------------------------


def test_a_linked_part_file_does_not_overwrite_its_target(tmp_path, env):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json.part").symlink_to(victim)
    r = export(env, LLAMA / "checkpoint.mdl", out, "--views", "hf", "--hf-format", "safetensors")
    one_line_error(r, "config.json.part", "symbolic link")
    assert victim.read_text() == "precious\n"
    assert (out / "config.json.part").is_symlink()


def test_a_linked_subfolder_gets_nothing_written_through_it(tmp_path, env):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "tensors").symlink_to(elsewhere)
    r = export(env, LLAMA / "checkpoint.mdl", out, "--views", "tensors")
    one_line_error(r, "tensors", "symbolic link")
    assert list(elsewhere.rglob("*")) == []


def test_a_fifo_named_like_a_part_file_does_not_block_the_export(tmp_path, env):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "config.json.part")
    r = export(env, LLAMA / "checkpoint.mdl", out, "--views", "hf", "--hf-format", "safetensors", timeout=60)
    one_line_error(r, "config.json.part", "FIFO")


def test_a_single_file_export_does_not_write_through_a_linked_temporary_file(tmp_path, env):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "config.json.tmp").symlink_to(victim)
    r = export(env, LLAMA / "checkpoint.mdl", "config.json", tmp_path / "config.json")
    one_line_error(r, "config.json.tmp", "symbolic link")
    assert victim.read_text() == "precious\n" and not (tmp_path / "config.json").exists()


# -- attack 4: what a re-run keeps ----------------------------------------------------------------------------------


def test_a_rerun_keeps_only_files_it_finished_from_the_same_content(tmp_path, env):
    ck = tmp_path / "ck"
    ck.mkdir()
    mdl = Path(shutil.copy(LLAMA / "checkpoint.mdl", ck / "checkpoint.mdl"))
    params = Path(shutil.copy(LLAMA / "params.yaml", tmp_path / "params.yaml"))
    out = tmp_path / "out"
    base = (mdl, out, "--views", "hf", "--hf-format", "bin", "--config", params)

    # an earlier export with zero CRCs: a re-run with exact CRCs must not keep its .bin (same size, same mtime)
    assert export(env, *base, "--zip-crc", "zero").returncode == 0
    assert zipfile.ZipFile(out / "pytorch_model.bin").testzip() is not None  # zero CRCs do not check
    r = export(env, *base)
    assert r.returncode == 0, r.stderr
    assert zipfile.ZipFile(out / "pytorch_model.bin").testzip() is None
    good = (out / "pytorch_model.bin").read_bytes()

    # a finished file zeroed with its size and mtime kept is written again
    st = (out / "pytorch_model.bin").stat()
    with open(out / "pytorch_model.bin", "r+b") as f:
        f.write(bytes(st.st_size))
    os.utime(out / "pytorch_model.bin", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert export(env, *base).returncode == 0
    assert (out / "pytorch_model.bin").read_bytes() == good

    # other params (same size of config.json): config.json follows them
    text = params.read_text()
    assert "rope_theta: 10000.0" in text
    params.write_text(text.replace("rope_theta: 10000.0", "rope_theta: 20000.0"))
    assert export(env, *base).returncode == 0
    assert '"rope_theta": 20000.0' in (out / "config.json").read_text()
    # and nothing changed: everything kept
    inode = (out / "pytorch_model.bin").stat().st_ino
    assert export(env, *base).returncode == 0
    assert (out / "pytorch_model.bin").stat().st_ino == inode
