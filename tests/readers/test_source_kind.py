"""What a checkpoint argument is (``ckptfs.readers.kind``), driven as a user drives it: the CLI in a subprocess, real
FUSE mounts, the local S3 endpoint the S3 tests start (moto), a Hugging Face Hub cache laid out by
``huggingface_hub``'s own functions.

* a folder that holds no model (an HF config without weights, an empty or misspelt folder, a Hub ``snapshots/``
  folder, a checkpoint or run in Cerebras' S3 layout copied to disk) is refused before anything is mounted, with
  the same one line from mount, info, ls, export and diff; a model_dir before its first checkpoint mounts as an
  empty run;
* ``diff`` takes ``s3://`` objects, prefixes, runs and ``RUN/latest``;
* ``S3://``, ``s3a://`` and AWS https URLs name the same object; an https URL of another host is explained;
* ``ORG/NAME`` mounts the repository from the local Hub cache (a revision by ``--revision``), never downloading;
* README.txt and ``ckptfs info`` say that the ``.bin`` files load from ``MOUNT/bin``.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import FIXTURES, needs_fuse, real_env, run_ckptfs
from helpers.fuse import is_mounted, mounted
from helpers.run import model_dir, save
from helpers.s3 import FIXTURES_S3, LocalS3, upload_case

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # processes: the CLI, a server, TensorFlow

LLAMA_MDL = FIXTURES / "llama" / "cs" / "checkpoint.mdl"


# ---- helpers -------------------------------------------------------------------------------------------------------

def synced_copy(case: str, dest: Path) -> Path:
    """The objects of fixture case ``case`` written to ``dest`` at their keys, as ``aws s3 sync`` writes them (the
    bodies only: a file system keeps no S3 user metadata)."""
    listing = json.loads((FIXTURES_S3 / case / "objects.json").read_text())
    for key, e in listing.items():
        out = dest / key
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(FIXTURES_S3 / case / "blobs" / e["sha256"], out)
    return dest


def hub_cache(src: Path, cache: Path, repo_id: str, commit: str, revision: str | None = "main") -> Path:
    """The files of ``src`` put into a Hub cache by ``huggingface_hub``'s own functions, as its downloads store them:
    ``blobs/<sha256>``, ``snapshots/<commit>/<file>`` linked to the blob, ``refs/<revision>`` holding the commit.
    Returns the snapshot folder."""
    from huggingface_hub.file_download import (_cache_commit_hash_for_specific_revision, _create_symlink,
                                               _get_pointer_path, repo_folder_name)

    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        pointer = Path(_get_pointer_path(str(storage), commit, str(f.relative_to(src))))
        pointer.parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(pointer), new_blob=False)
    if revision is not None:
        _cache_commit_hash_for_specific_revision(str(storage), revision, commit)
    return storage / "snapshots" / commit


def one_line(r) -> str:
    """The single stderr line of a refused command (exit code 2), checked to be alone."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stdout, r.stderr)
    return lines[0]


# ---- in-process: the table's order ---------------------------------------------------------------------------------

def test_the_table_tells_each_local_form_apart(tmp_path):
    from ckptfs.readers.kind import HDF5_FILE, HF_FOLDER, NOTHING, RECOGNISERS, RUN, classify

    assert classify(LLAMA_MDL).kind == HDF5_FILE
    assert classify(FIXTURES / "llama" / "hf").kind == HF_FOLDER
    run = model_dir(tmp_path / "run")
    assert classify(run).kind == RUN  # Model Zoo's params before the first checkpoint
    save(run, 100)
    assert classify(run).kind == RUN
    latest = classify(run / "latest")  # the names a run mount shows
    assert latest.kind == HDF5_FILE and latest.path == run / "checkpoint_100.mdl"
    assert classify(run / "checkpoint_100").path == run / "checkpoint_100.mdl"
    logs = tmp_path / "logs_only"
    (logs / "cerebras_logs").mkdir(parents=True)
    assert classify(logs).kind == RUN
    # a folder holding both checkpoints and HF files is a run, as before
    shutil.copy(FIXTURES / "llama" / "hf" / "config.json", run)
    assert classify(run).kind == RUN
    (tmp_path / "hf_bin").mkdir()
    shutil.copy(FIXTURES / "llama" / "hf" / "model.safetensors", tmp_path / "hf_bin")
    alone = classify(tmp_path / "hf_bin" / "model.safetensors")
    assert alone.kind == NOTHING and "safetensors" in alone.reason and "config.json" in alone.reason
    # the other sources are rows of the table, in their documented places
    rows = [(r.name, r.stage) for r in RECOGNISERS]
    assert rows.index(("tf index", "file")) < rows.index(("hdf5", "file")) < rows.index(("legacy torch", "file"))
    assert rows.index(("run", "folder")) < rows.index(("tf checkpoint", "folder")) < rows.index(("hf", "folder"))
    assert all(r.handled for r in RECOGNISERS)


# ---- item 1/2: folders that hold no model --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wrong_folders(tmp_path_factory) -> dict:
    """``{name: (path, words its refusal says)}``"""
    root = tmp_path_factory.mktemp("wrong")
    hf_no_weights = root / "hf_config_only"
    hf_no_weights.mkdir()
    shutil.copy(FIXTURES / "llama" / "hf" / "config.json", hf_no_weights)
    (root / "empty").mkdir()
    (root / "notes").mkdir()
    (root / "notes" / "todo.txt").write_text("train llama\n")
    snap = hub_cache(FIXTURES / "llama" / "hf", root / "hub", "acme/llama", "a" * 40)
    layout = synced_copy("s3_llama", root / "synced") / "s3_llama" / "checkpoint_100.mdl"
    synced_run = synced_copy("s3_run", root / "synced_run") / "s3_run" / "model_dir"
    return {
        "hf without weights": (hf_no_weights, ["config.json", "no model.safetensors", "weights"]),
        "empty folder": (root / "empty", ["an empty folder", "give a checkpoint_<step>.mdl file"]),
        "misspelt folder": (root / "emtpy", ["no such file or directory"]),
        "folder of notes": (root / "notes", ["todo.txt", "Hugging Face model folder"]),
        "hub snapshots/": (snap.parent, ["snapshots/ folder", str(snap), "acme/llama"]),
        "s3 layout copied": (layout, ["S3 layout copied to a file system", "__METADATA__", "S3 metadata",
                                      "mount it in the bucket"]),
        "s3 run copied": (synced_run, ["S3 layout copied to a file system", "checkpoint_0.mdl", "S3 metadata"]),
    }


def test_every_command_refuses_a_folder_without_a_model_in_the_same_line(wrong_folders, tmp_path):
    out = tmp_path / "out"
    for name, (path, words) in wrong_folders.items():
        lines = set()
        for argv in (("info", path), ("ls", path), ("export", path, out), ("diff", path, LLAMA_MDL)):
            line = one_line(run_ckptfs(*argv, text=True, timeout=120))
            assert line.startswith(f"ckptfs: error: {path}: "), (name, argv, line)
            assert all(w in line for w in words), (name, argv, line)
            assert "not a model_dir" not in line and "no checkpoint_<step>.mdl" not in line, line
            lines.add(line)
        assert len(lines) == 1, (name, lines)  # the same reason from every command
        assert not out.exists()


def test_a_run_holding_a_copied_s3_layout_checkpoint_lists_it_as_unreadable(tmp_path):
    d = model_dir(tmp_path / "run")
    save(d, 100)
    synced_copy("s3_run", tmp_path / "synced")
    shutil.copytree(tmp_path / "synced" / "s3_run" / "model_dir" / "checkpoint_200.mdl", d / "checkpoint_200.mdl")
    r = run_ckptfs("ls", d, text=True, check=True)
    row = next(line for line in r.stdout.splitlines() if "checkpoint_200.mdl" in line)
    assert "S3 layout copied to disk: unreadable" in row and "checkpoint_100 (highest step" in r.stdout


@needs_fuse
def test_mount_refuses_a_folder_without_a_model_before_mounting(wrong_folders, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for name, (path, words) in wrong_folders.items():
        line = one_line(run_ckptfs("mount", path, mnt, text=True, timeout=120))
        assert line.startswith(f"ckptfs: error: {path}: ") and all(w in line for w in words), (name, line)
        assert not is_mounted(mnt) and os.listdir(mnt) == []


@needs_fuse
def test_a_model_dir_before_its_first_checkpoint_mounts_as_an_empty_run(tmp_path):
    d = model_dir(tmp_path / "run")  # what Model Zoo leaves before the first save: its params
    (d / "cerebras_logs").mkdir()
    r = run_ckptfs("info", d, text=True, timeout=120)
    assert r.returncode == 0 and "latest: none" in r.stdout, r.stderr
    with mounted(d, env=real_env()) as mnt:
        assert os.listdir(mnt) == ["README.txt"]
        assert "latest:      none" in (mnt / "README.txt").read_text()
        save(d, 100)
        for _ in range(100):
            if "checkpoint_100" in os.listdir(mnt):
                break
            time.sleep(0.1)
        assert os.readlink(mnt / "latest") == "checkpoint_100"


# ---- items 3/4: diff and S3 spellings against the local endpoint ---------------------------------------------------

@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    srv = LocalS3(tmp_path_factory.mktemp("s3"))
    for case in ("s3_llama", "s3_run"):
        upload_case(srv, case)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def s3env(s3, tmp_path_factory):
    return s3.env(CKPTFS_CACHE_DIR=str(tmp_path_factory.mktemp("cache")), PYTHONPATH=real_env()["PYTHONPATH"])


def test_diff_takes_every_s3_form(s3, s3env):
    run = "s3://ckpts/s3_run/model_dir"
    synced = "s3://ckpts/s3_run/synced_model_dir/checkpoint_0.mdl"
    r = run_ckptfs("diff", synced, LLAMA_MDL, env=s3env, text=True)  # an HDF5 object against the local file
    assert r.returncode == 0 and f"A: {synced}" in r.stdout, r.stdout + r.stderr
    r = run_ckptfs("diff", f"{run}/latest", f"{run}/checkpoint_200.mdl", env=s3env, text=True)  # RUN/latest, layout
    assert r.returncode == 0 and f"A: {run}/checkpoint_200.mdl" in r.stdout, r.stdout + r.stderr
    r = run_ckptfs("diff", run, f"{run}/checkpoint_100", env=s3env, text=True)  # a run (its latest), a run's name
    assert r.returncode == 1 and "~ " in r.stdout, r.stdout + r.stderr
    r = run_ckptfs("diff", "--view", "hf", f"{run}/checkpoint_0.mdl", synced, env=s3env, text=True)
    assert r.returncode in (0, 1) and "files:" in r.stdout, r.stdout + r.stderr
    line = one_line(run_ckptfs("diff", f"{run}/checkpoint_300", LLAMA_MDL, env=s3env, text=True))
    assert "checkpoint_300" in line and "complete checkpoints: checkpoint_0, checkpoint_100, checkpoint_200" in line


def test_other_spellings_of_an_s3_address_name_the_same_object(s3, s3env):
    key = "s3_llama/checkpoint_100.mdl"
    want = run_ckptfs("ls", f"s3://ckpts/{key}", env=s3env, text=True, check=True).stdout
    for url in (f"S3://ckpts/{key}", f"s3a://ckpts/{key}", f"s3n://ckpts/{key}",
                f"https://ckpts.s3.amazonaws.com/{key}", f"https://ckpts.s3.us-west-2.amazonaws.com/{key}",
                f"https://s3.us-west-2.amazonaws.com/ckpts/{key}"):
        r = run_ckptfs("ls", url, env=s3env, text=True)
        assert r.returncode == 0 and r.stdout == want, (url, r.stderr)
    line = one_line(run_ckptfs("info", f"https://minio.example.org:9000/ckpts/{key}", env=s3env, text=True))
    assert "not AWS S3" in line and "--endpoint-url https://minio.example.org:9000" in line and "s3://" in line
    line = one_line(run_ckptfs("info", f"gs://ckpts/{key}", env=s3env, text=True))
    assert "gs:// URL" in line and "s3://" in line


@needs_fuse
def test_an_upper_case_s3_url_mounts(s3, s3env):
    with mounted("S3://ckpts/s3_llama/checkpoint_100.mdl", env=s3env) as mnt:
        assert (mnt / "model.safetensors").stat().st_size > 0
        assert "checkpoint:     s3://ckpts/s3_llama/checkpoint_100.mdl" in (mnt / "README.txt").read_text()


# ---- item 8: Hub repository ids --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A Hub cache holding acme/tiny-llama: main -> commit a…, tag v2 -> commit b… (another model)."""
    from helpers.hf import save_llama

    root = tmp_path_factory.mktemp("hub")
    cache = root / "cache" / "hub"
    save_llama(root / "m1", seed=1)
    save_llama(root / "m2", seed=2)
    main = hub_cache(root / "m1", cache, "acme/tiny-llama", "a" * 40)
    v2 = hub_cache(root / "m2", cache, "acme/tiny-llama", "b" * 40, revision="v2")
    return root, cache, main, v2


@needs_fuse
def test_a_hub_repository_id_mounts_from_the_local_cache(hub, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root, cache, main, v2 = hub
    env = real_env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    ref = AutoModelForCausalLM.from_pretrained("acme/tiny-llama", cache_dir=str(cache), local_files_only=True)
    with mounted("acme/tiny-llama", env=env) as mnt:
        assert "Hub cache snapshot of acme/tiny-llama" in (mnt / "README.txt").read_text()
        out = tmp_path / "hf"
        # its checkpoint.mdl, converted back to Hugging Face files, loads as the model the cache holds
        run_ckptfs("export", mnt / "checkpoint.mdl", out, "--views", "hf", "--hf-format", "safetensors", env=env,
                   check=True)
        back = AutoModelForCausalLM.from_pretrained(out)
        for k, v in ref.state_dict().items():
            assert torch.equal(back.state_dict()[k], v), k
    with mounted("acme/tiny-llama", "--revision", "v2", env=env) as mnt:
        assert f"revision {'b' * 40}" in (mnt / "README.txt").read_text()
    # HF_HOME/hub is the cache when HF_HUB_CACHE is not set
    env_home = {k: v for k, v in real_env(HF_HOME=str(cache.parent)).items() if k != "HF_HUB_CACHE"}
    r = run_ckptfs("info", "acme/tiny-llama", "--revision", "b" * 40, env=env_home, text=True)
    assert r.returncode == 0 and f"acme/tiny-llama at revision {'b' * 40}" in r.stdout, r.stderr
    assert load_file(v2 / "model.safetensors")  # the cache was not touched


def test_a_hub_id_not_in_the_cache_is_one_line_and_a_local_folder_wins(hub, tmp_path):
    root, cache, main, v2 = hub
    env = real_env(HF_HUB_CACHE=str(cache))
    line = one_line(run_ckptfs("info", "acme/other-model", env=env, text=True))
    assert str(cache / "models--acme--other-model") in line and "huggingface-cli download acme/other-model" in line
    line = one_line(run_ckptfs("info", "acme/tiny-llama", "--revision", "v9", env=env, text=True))
    assert "no revision 'v9'" in line and "main" in line and "v2" in line
    r = run_ckptfs("convert-config", "acme/tiny-llama", env=env, text=True)
    assert r.returncode == 0 and r.stdout.startswith("model:") and "vocab_size: 256" in r.stdout, r.stderr
    # a folder of the same name in the working directory is what the argument names
    local = tmp_path / "acme" / "tiny-llama"
    shutil.copytree(root / "m2", local)
    r = run_ckptfs("info", "acme/tiny-llama", env=env, cwd=tmp_path, text=True)
    assert r.returncode == 0 and "Hugging Face model: " + str(local) in r.stdout and "Hub cache" not in r.stdout


# ---- item 9: the .bin files load from bin/ --------------------------------------------------------------------------

@needs_fuse
def test_readme_and_info_point_use_safetensors_false_at_bin():
    from transformers import AutoModelForCausalLM

    r = run_ckptfs("info", LLAMA_MDL, text=True, check=True)
    assert "from_pretrained(MOUNT/bin, use_safetensors=False)" in r.stdout
    with mounted(LLAMA_MDL, env=real_env()) as mnt:
        readme = (mnt / "README.txt").read_text()
        assert "load:           from_pretrained(MOUNT) loads the safetensors" in readme
        assert "from_pretrained(MOUNT/bin, use_safetensors=False) loads the .bin files" in readme
        with pytest.raises(OSError):  # what the user tripped on: the root holds no pytorch_model.bin
            AutoModelForCausalLM.from_pretrained(mnt, use_safetensors=False)
        AutoModelForCausalLM.from_pretrained(mnt / "bin", use_safetensors=False)  # what README.txt says works


if __name__ == "__main__":
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-q", __file__]))
