"""Tokenizer and overlay files from untrusted places (issue 31, attacks 1 and 2): a folder shaped like a Hugging Face
cache snapshot whose ``blobs`` is a link elsewhere serves nothing from there; a huge tokenizer file is never read
whole into the server's memory."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import ckptfs
from helpers import needs_fuse, real_env
from helpers.fuse import mounted, mounted_server
from helpers.untrusted import MARK, all_served_bytes, copy_llama

pytestmark = [needs_fuse, pytest.mark.timeout(300)]


def fake_snapshot(repo: Path, secret_dir: Path) -> Path:
    """``repo/snapshots/r`` whose tokenizer.json links to ``../../blobs/passwd``, with ``repo/blobs`` a link to
    ``secret_dir`` (holding ``passwd`` with the marker): the layout of a Hub cache snapshot, pointing elsewhere."""
    secret_dir.mkdir(parents=True, exist_ok=True)
    (secret_dir / "passwd").write_bytes(b'{"secret": "' + MARK + b'"}')
    snap = repo / "snapshots" / "r"
    snap.mkdir(parents=True)
    (repo / "blobs").symlink_to(secret_dir)
    (snap / "tokenizer.json").symlink_to("../../blobs/passwd")
    return snap


def test_a_fake_hub_snapshot_does_not_lead_out_of_the_checkpoints_folder(tmp_path):
    ckpt = copy_llama(tmp_path / "ck")
    snap = fake_snapshot(tmp_path / "ck" / "tok", tmp_path / "etc")
    params = yaml.safe_load((tmp_path / "ck" / "params.yaml").read_text())
    params["train_input"] = {"tokenizer_path": "tok/snapshots/r"}
    (tmp_path / "ck" / "params.yaml").write_text(yaml.safe_dump(params))
    with mounted(ckpt, "--views", "hf", env=real_env()) as mnt:
        served = all_served_bytes(mnt)
    assert not [p for p, data in served.items() if MARK in data]
    assert "tokenizer.json" not in served
    # the same folder named with --overlay: its links lead outside the snapshot's own repository
    tree = ckptfs.open(ckpt, views="hf", overlay=[str(snap)])
    try:
        assert "tokenizer.json" not in tree.file_paths()
        assert "outside" in tree.read("README.txt", 0, 1 << 20).decode()
    finally:
        tree.close()


def test_a_genuine_hub_snapshot_still_serves_its_blobs(tmp_path):
    from helpers.tokens import make_tokenizer

    tok = make_tokenizer(tmp_path / "made")
    repo = tmp_path / "hub" / "models--x--y"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc"
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(tok.iterdir())):
        (repo / "blobs" / f"blob{i}").write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(f"../../blobs/blob{i}")
    tree = ckptfs.open(copy_llama(tmp_path / "ck"), views="hf", overlay=[str(snap)])
    try:
        got = tree.read("tokenizer.json", 0, 1 << 24)
    finally:
        tree.close()
    assert got == (tok / "tokenizer.json").read_bytes()


def _peak_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmHWM:")[1].split()[0])


def test_a_huge_tokenizer_file_is_served_without_being_read_whole(tmp_path):
    ckpt = copy_llama(tmp_path / "ck")
    with mounted_server(ckpt, "--views", "hf", env=real_env()) as srv:
        baseline = _peak_kib(srv.proc.pid)
    (tmp_path / "ck" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with open(tmp_path / "ck" / "tokenizer_config.json", "r+b") as f:
        f.truncate(512 << 20)  # sparse: 512 MiB to whoever reads it whole
    with mounted_server(ckpt, "--views", "hf", env=real_env()) as srv:
        mnt = srv.mnt
        assert (mnt / "tokenizer_config.json").stat().st_size == 512 << 20
        with open(mnt / "tokenizer_config.json", "rb") as f:
            assert f.read(12) == b'{"bos_token"'
            f.seek((512 << 20) - 4)
            assert f.read() == bytes(4)
        grown = _peak_kib(srv.proc.pid) - baseline
        readme = (mnt / "README.txt").read_text()
    assert grown < 64 << 10, grown  # KiB: reading it whole would take 512 MiB and more
    assert "tokenizer_config.json" in readme and "larger than" in readme
