"""A Hugging Face Hub cache is untrusted: every path component below the ``models--ORG--NAME`` folder — ``snapshots/``,
the snapshot folder, ``refs/`` and its ref file, ``blobs/`` and each file's link into it — must resolve inside that
repository folder. Attack fixtures are real Hub layouts (files in snapshots are relative links ``../../blobs/<sha>``,
as huggingface_hub writes them) with one component turned into a link out of the repository; the folder it leads to
holds a complete, different model, so a mount that followed it would serve foreign bytes."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from ckptfs.errors import CheckpointError
from ckptfs.readers.hf.folder import open_hf_model, read_hf_configs
from ckptfs.readers.kind import is_hf_folder
from helpers import needs_fuse, run_ckptfs
from helpers.fuse import force_unmount, is_mounted, mounted
from helpers.hf import as_hub_cache, hf_env, llama_state, save_hf, save_llama

pytestmark = pytest.mark.slow  # processes: the CLI, a server, TensorFlow

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
REV = "a" * 40


def hub_and_foreign(tmp_path: Path) -> tuple:
    """(repository folder, snapshot folder, foreign model folder): a genuine Hub cache of one model and, outside it,
    a complete model of other weights."""
    save_hf(tmp_path / "src", llama_state(seed=1), CONFIG)
    snap = as_hub_cache(tmp_path / "src", tmp_path / "hub", repo_id="org/tiny", revision=REV)
    foreign = save_hf(tmp_path / "elsewhere" / "foreign", llama_state(seed=2), CONFIG)
    return snap.parent.parent, snap, foreign


def link_snapshot_out(repo: Path, snap: Path, foreign: Path) -> None:
    """The attack: ``snapshots/<rev>`` is a link to the foreign folder."""
    for f in snap.iterdir():
        f.unlink()
    snap.rmdir()
    os.symlink(foreign, snap)


def refused(call) -> str:
    with pytest.raises(CheckpointError) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_genuine_hub_cache_opens_from_repository_and_snapshot(tmp_path):
    repo, snap, _ = hub_and_foreign(tmp_path)
    assert os.readlink(snap / "model.safetensors").startswith("../../blobs/")
    for source in (repo, snap):
        m = open_hf_model(source)
        assert m.path == snap and m.hub.revision == REV
    assert read_hf_configs(repo)[""] == CONFIG


@pytest.mark.parametrize("given", ["repository", "snapshot"])
def test_snapshot_folder_linked_out_of_its_repository_is_refused(tmp_path, given):
    repo, snap, foreign = hub_and_foreign(tmp_path)
    link_snapshot_out(repo, snap, foreign)
    assert (snap / "config.json").is_file()  # the link works: the attack would serve the foreign model
    source = repo if given == "repository" else snap
    msg = refused(lambda: open_hf_model(source))
    assert "outside its repository" in msg and str(foreign) in msg
    refused(lambda: read_hf_configs(source))
    assert is_hf_folder(source)  # still recognised as a Hub cache: opening it says why it is refused


def test_snapshots_folder_linked_out_of_its_repository_is_refused(tmp_path):
    repo, snap, foreign = hub_and_foreign(tmp_path)
    outside = tmp_path / "elsewhere" / "snapshots"
    outside.mkdir()
    os.symlink(foreign, outside / REV)
    for f in snap.iterdir():
        f.unlink()
    snap.rmdir()
    (repo / "snapshots").rmdir()
    os.symlink(outside, repo / "snapshots")
    msg = refused(lambda: open_hf_model(repo))
    assert "snapshots" in msg and "outside its repository" in msg


def test_ref_that_is_a_link_is_refused(tmp_path):
    repo, snap, _ = hub_and_foreign(tmp_path)
    (tmp_path / "elsewhere" / "main").write_text(REV)
    (repo / "refs" / "main").unlink()
    os.symlink(tmp_path / "elsewhere" / "main", repo / "refs" / "main")
    msg = refused(lambda: open_hf_model(repo))
    assert "refs/main" in msg and "link" in msg


def test_refs_folder_linked_out_of_its_repository_is_refused(tmp_path):
    repo, snap, _ = hub_and_foreign(tmp_path)
    outside = tmp_path / "elsewhere" / "refs"
    outside.mkdir()
    (outside / "main").write_text(REV)
    (repo / "refs" / "main").unlink()
    (repo / "refs").rmdir()
    os.symlink(outside, repo / "refs")
    msg = refused(lambda: open_hf_model(repo))
    assert "refs" in msg and "outside its repository" in msg


def test_ref_naming_a_revision_outside_snapshots_is_refused(tmp_path):
    repo, snap, foreign = hub_and_foreign(tmp_path)
    (repo / "refs" / "main").write_text("../../elsewhere/foreign")
    msg = refused(lambda: open_hf_model(repo))
    assert "refs/main" in msg and "not a snapshot name" in msg


def test_blob_that_links_to_etc_passwd_is_refused(tmp_path):
    repo, snap, _ = hub_and_foreign(tmp_path)
    blob = Path(os.path.realpath(snap / "model.safetensors"))
    blob.unlink()
    os.symlink("/etc/passwd", blob)  # snapshot file -> ../../blobs/<sha> -> /etc/passwd
    msg = refused(lambda: open_hf_model(repo))
    assert "model.safetensors" in msg and "/etc/passwd" in msg


def test_snapshot_linked_to_the_root_cannot_serve_etc_passwd_as_weights(tmp_path):
    """The snapshot folder a link to a folder whose own links reach /etc/passwd: refused at the snapshot."""
    repo, snap, _ = hub_and_foreign(tmp_path)
    evil = tmp_path / "elsewhere" / "evil"
    evil.mkdir()
    (evil / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    os.symlink("/etc/passwd", evil / "pytorch_model.bin")
    link_snapshot_out(repo, snap, evil)
    assert "outside its repository" in refused(lambda: open_hf_model(repo))


def test_cli_refuses_the_attack_in_one_line_and_exits_2(tmp_path):
    repo, snap, foreign = hub_and_foreign(tmp_path)
    link_snapshot_out(repo, snap, foreign)
    r = run_ckptfs("info", repo, env=hf_env(), text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "outside its repository" in lines[0], r.stderr
    assert "foreign" not in r.stdout or not r.stdout.strip()


@needs_fuse
def test_mount_of_the_attack_is_refused_and_nothing_is_mounted(tmp_path):
    repo, snap, foreign = hub_and_foreign(tmp_path)
    link_snapshot_out(repo, snap, foreign)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = run_ckptfs("mount", repo, mnt, env=hf_env(), text=True, timeout=120)
    if is_mounted(mnt):  # the attack worked: do not leave its mount behind
        force_unmount(mnt)
        pytest.fail("the mount was made")
    assert r.returncode == 2 and not is_mounted(mnt)
    assert len(r.stderr.strip().splitlines()) == 1 and "outside its repository" in r.stderr


@needs_fuse
def test_genuine_hub_cache_still_mounts(tmp_path):
    from safetensors.numpy import load_file

    save_llama(tmp_path / "src", seed=4)
    snap = as_hub_cache(tmp_path / "src", tmp_path / "hub", repo_id="org/tiny", revision=REV)
    want = load_file(tmp_path / "src" / "model.safetensors")["model.embed_tokens.weight"]
    with mounted(snap.parent.parent, env=hf_env()) as mnt:
        assert "Hub cache snapshot of org/tiny" in (mnt / "README.txt").read_text()
        got = np.load(mnt / "tensors" / "model" / "embedding_layer" / "word_embeddings" / "weight.npy")
        assert got.tobytes() == want.tobytes()
