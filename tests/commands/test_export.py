"""``ckptfs export``: the bytes of one virtual file without FUSE, run as a user would (a subprocess)."""
from __future__ import annotations

import os
import shutil

import pytest

from helpers import run_ckptfs
from helpers.fuse import FAILING, FAKE, FIXTURES_CKPT, fake_tree

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def ckpt(tmp_path):
    p = tmp_path / "fake.mdl"
    p.write_bytes(b"synthetic")
    return p


@pytest.mark.slow  # runs the CLI
def test_every_file_exports_the_tree_bytes(ckpt, tmp_path):
    tree = fake_tree(ckpt)
    for path in tree.file_paths():
        if path == FAILING:
            continue
        dest = tmp_path / "out.bin"
        r = run_ckptfs("export", ckpt, path, dest, fake=FAKE, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stderr == b""  # no progress bar when stderr is not a terminal
        assert dest.read_bytes() == tree.read(path, 0, tree.attr(path).size), path
        assert not (tmp_path / "out.bin.tmp").exists()


@pytest.mark.slow  # runs the CLI
def test_stdout_and_directory_destinations(ckpt, tmp_path):
    tree = fake_tree(ckpt)
    want = tree.read("model.safetensors", 0, 1 << 30)
    r = run_ckptfs("export", ckpt, "/model.safetensors", "-", fake=FAKE, timeout=120)
    assert r.returncode == 0 and r.stdout == want
    outdir = tmp_path / "d"
    outdir.mkdir()
    r = run_ckptfs("export", ckpt, "model.safetensors", outdir, fake=FAKE, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (outdir / "model.safetensors").read_bytes() == want


@pytest.mark.slow  # runs the CLI
def test_view_options_change_what_exists(ckpt, tmp_path):
    r = run_ckptfs("export", ckpt, "config.json", tmp_path / "c.json", "--views", "tensors", fake=FAKE, timeout=120)
    assert r.returncode == 2
    assert b"no such file" in r.stderr


@pytest.mark.slow  # runs the CLI
def test_unknown_path_lists_close_matches(ckpt, tmp_path):
    r = run_ckptfs("export", ckpt, "model.safetensor", tmp_path / "x", fake=FAKE, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "model.safetensors" in lines[0]
    assert not (tmp_path / "x").exists()
    r = run_ckptfs("export", ckpt, "tensors/model", tmp_path / "x", fake=FAKE, timeout=120)
    assert r.returncode == 2 and b"is a directory" in r.stderr and b"bias.npy" in r.stderr


@pytest.mark.slow  # runs the CLI
def test_read_error_exits_2_and_leaves_no_partial_file(ckpt, tmp_path):
    dest = tmp_path / "broken.pt"
    r = run_ckptfs("export", ckpt, FAILING, dest, fake=FAKE, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "corrupt chunk" in lines[0]
    assert sorted(os.listdir(tmp_path)) == ["fake.mdl"]
    dest.write_bytes(b"old content")  # an existing DEST is left alone on failure
    r = run_ckptfs("export", ckpt, FAILING, dest, fake=FAKE, timeout=120)
    assert r.returncode == 2 and dest.read_bytes() == b"old content"
    assert sorted(os.listdir(tmp_path)) == ["broken.pt", "fake.mdl"]


@pytest.mark.slow  # runs the CLI
def test_bad_checkpoint_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "garbage.mdl"
    bad.write_bytes(b"garbage" * 1000)
    r = run_ckptfs("export", bad, "README.txt", tmp_path / "r.txt", timeout=120)
    assert r.returncode == 2 and len(r.stderr.decode().strip().splitlines()) == 1
    assert not (tmp_path / "r.txt").exists()


@pytest.mark.slow  # one ckptfs process per file
def test_real_checkpoint_export_matches_the_tree(tmp_path):
    from ckptfs.tree.assemble import build_tree

    tree = build_tree(FIXTURES_CKPT)
    try:
        files = [p for p in tree.file_paths() if not p.startswith("tensors/")][:8] + \
                [p for p in tree.file_paths() if p.startswith("tensors/")][:2]
        assert len(files) > 2
        for path in files:
            dest = tmp_path / path.replace("/", "_")
            r = run_ckptfs("export", FIXTURES_CKPT, path, dest, timeout=120)
            assert r.returncode == 0, r.stderr
            assert dest.read_bytes() == tree.read(path, 0, tree.attr(path).size), path
    finally:
        tree.close()


@pytest.mark.slow  # runs the CLI
def test_a_model_dir_means_its_latest_checkpoint(tmp_path):
    model_dir = tmp_path / "model_dir"
    model_dir.mkdir()
    for step in (10, 200):
        shutil.copy(FIXTURES_CKPT, model_dir / f"checkpoint_{step}.mdl")
    r = run_ckptfs("export", model_dir, "README.txt", "-", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "checkpoint_200.mdl" in r.stdout.decode()


@pytest.mark.slow  # runs the CLI
def test_a_model_dir_of_dated_checkpoints_means_the_latest_one(tmp_path):
    """Model Zoo's ``checkpoint_<step>_<YYYYmmdd_HHMMSS>.mdl`` names: ``ckptfs export model_dir`` takes the highest
    step, then the later date (before, such a folder had "no checkpoint_<step>.mdl file")."""
    model_dir = tmp_path / "model_dir"
    model_dir.mkdir()
    for name in ("checkpoint_200_20240102_030405.mdl", "checkpoint_200_20231231_235959.mdl",
                 "checkpoint_10_20250101_000000.mdl"):
        shutil.copy(FIXTURES_CKPT, model_dir / name)
    r = run_ckptfs("export", model_dir, "README.txt", "-", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "checkpoint_200_20240102_030405.mdl" in r.stdout.decode()


@pytest.mark.slow  # runs the CLI
def test_a_model_dir_of_links_to_elsewhere_needs_allow_external(tmp_path):
    """Checkpoint files that are links out of the model_dir are what the model_dir names: confined like the rest."""
    model_dir = tmp_path / "model_dir"
    model_dir.mkdir()
    (model_dir / "checkpoint_10.mdl").symlink_to(FIXTURES_CKPT)
    r = run_ckptfs("export", model_dir, "README.txt", "-", timeout=120)
    assert r.returncode == 2 and b"outside the model_dir" in r.stderr and b"--allow-external" in r.stderr
    r = run_ckptfs("export", model_dir, "README.txt", "-", "--allow-external", FIXTURES_CKPT.parent, timeout=120)
    assert r.returncode == 0, r.stderr


def test_a_file_export_reads_ahead_while_it_writes_and_leaves_the_tree_as_it_was(tmp_path, monkeypatch):
    """``export_file`` reads like the FUSE server's kernel does (blocks dropped once read, the next ones prepared in
    the background), same bytes, and the tree's cache settings are back afterwards."""
    from ckptfs.commands.export import export_file
    from ckptfs.tree.assemble import build_tree

    tree = build_tree(FIXTURES_CKPT)
    try:
        seen = []
        real = tree.read
        monkeypatch.setattr(tree, "read", lambda e, off, n, cursor=None: seen.append(
            (tree.cache.streaming, tree.cache.read_ahead, cursor)) or real(e, off, n, cursor))
        size = export_file(tree, "model.safetensors", tmp_path / "m.safetensors", block=4096)
        assert (tmp_path / "m.safetensors").read_bytes() == real("model.safetensors", 0, size)
        assert len(seen) == -(-size // 4096) and {s[:2] for s in seen} == {(True, 4096)}
        assert len({id(s[2]) for s in seen}) == 1 and seen[0][2] is not None  # one stream: one cursor
        assert not tree.cache.streaming and tree.cache.read_ahead == 0
    finally:
        tree.close()
