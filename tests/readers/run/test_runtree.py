"""A training run without FUSE: the model_dir scan (names, completeness, autoload order, the latest pointer), the run
tree (lazy per-checkpoint trees, a bounded number kept, handles pinned to the tree they opened, live changes) and
``ckptfs ls`` / ``info`` of a model_dir."""
from __future__ import annotations

import errno
import json
import os
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from ckptfs.views.options import MountOptions
from ckptfs.tree.run import LATEST, RunTree, is_run, open_run
from ckptfs.readers.run.scan import IN_PROGRESS, RunScanner, parse_name
from ckptfs.tree.base import VirtualPathError
from helpers import run_ckptfs
from helpers.run import NORM_HF, model_dir, norm_of, save, save_partial, set_success, write_copy

HF_ONLY = MountOptions(views=("hf",))


def run_tree(d: Path, **kw) -> RunTree:
    return RunTree(d, HF_ONLY, poll=0, **kw)  # poll=0: every lookup rescans


def safetensors_norm(tree, folder: str) -> float:
    data = tree.read(f"{folder}/model.safetensors", 0, 1 << 30)
    values = norm_of(data)
    assert np.all(values == values[0])
    return float(values[0])


def test_names_follow_model_zoo():
    assert parse_name("checkpoint_2000.mdl") == (2000, datetime.min)
    assert parse_name("checkpoint_2000_20240102_030405.mdl") == (2000, datetime(2024, 1, 2, 3, 4, 5))
    assert parse_name("checkpoint_70_1700000000.mdl")[0] == 70  # the unix-time suffix of older tools
    assert parse_name("checkpoint_2000.mdl.0badcafe.tmp") == (2000, datetime.min)
    for other in ("checkpoint_final.mdl", "trainer_state_500.mdl", "checkpoint_1_20241399_000000.mdl",
                  "checkpoint_1.mdl.tmp", "checkpoint_1.h5", "params.yaml"):
        assert parse_name(other) is None, other


def test_scan_orders_as_autoload_and_tells_what_is_complete(tmp_path):
    d = model_dir(tmp_path / "run")
    save(d, 20)
    save(d, 100)
    save(d, 100, "checkpoint_100_20240101_000000.mdl")  # a second save at step 100 (name clash)
    save(d, 9)
    save_partial(d, 300)
    write_copy(d / "checkpoint_400.mdl.1234abcd.tmp", 400, success=False)
    (d / "checkpoint_500.mdl").write_bytes(b"not hdf5")
    save(d, 7, "trainer_state_7.mdl")  # not a model checkpoint
    (d / "sub").mkdir()
    save(d / "sub", 9999)  # another run's folder

    listing = RunScanner(d).scan()
    assert [c.path.name for c in listing.checkpoints] == [
        "checkpoint_9.mdl", "checkpoint_20.mdl", "checkpoint_100.mdl", "checkpoint_100_20240101_000000.mdl",
        "checkpoint_300.mdl", "checkpoint_400.mdl.1234abcd.tmp", "checkpoint_500.mdl"]
    assert [c.name for c in listing.complete] == ["checkpoint_9", "checkpoint_20", "checkpoint_100",
                                                  "checkpoint_100_20240101_000000"]
    status = {c.path.name: c.status for c in listing.incomplete}
    assert "__SUCCESS__" in status["checkpoint_300.mdl"]
    assert status["checkpoint_400.mdl.1234abcd.tmp"] == IN_PROGRESS
    assert "HDF5" in status["checkpoint_500.mdl"]
    assert listing.latest.name == "checkpoint_100_20240101_000000"  # highest step, then the later timestamp


def test_a_latest_pointer_wins_when_it_names_a_complete_checkpoint(tmp_path):
    d = model_dir(tmp_path / "run")
    save(d, 10)
    save(d, 20)
    (d / "latest").write_text("checkpoint_10.mdl\n")
    listing = RunScanner(d).scan()
    assert listing.latest.name == "checkpoint_10" and "pointer" in listing.latest_reason
    (d / "latest").write_text("checkpoint_99.mdl\n")
    listing = RunScanner(d).scan()
    assert listing.latest.name == "checkpoint_20" and "latest" in listing.pointer_problem


def test_files_are_probed_once_until_they_change(tmp_path, monkeypatch):
    from ckptfs.readers.run import scan as rundir

    d = model_dir(tmp_path / "run")
    save(d, 1)
    partial = save_partial(d, 2)
    probed = []
    real = rundir.probe
    monkeypatch.setattr(rundir, "probe", lambda p: probed.append(Path(p).name) or real(p))
    scanner = RunScanner(d)
    scanner.scan()
    scanner.scan()
    assert sorted(probed) == ["checkpoint_1.mdl", "checkpoint_2.mdl"]
    set_success(partial)  # written in place: the file changed, so it is probed again
    assert [c.name for c in scanner.scan().complete] == ["checkpoint_1", "checkpoint_2"]
    assert sorted(probed) == ["checkpoint_1.mdl", "checkpoint_2.mdl", "checkpoint_2.mdl"]


def test_the_root_lists_complete_checkpoints_and_latest_without_building_any(tmp_path):
    d = model_dir(tmp_path / "run")
    for step in (100, 2000, 300):
        save(d, step)
    save_partial(d, 5000)
    tree = run_tree(d)
    try:
        assert tree.listdir("") == ["README.txt", LATEST, "checkpoint_100", "checkpoint_300", "checkpoint_2000"]
        assert tree.readlink(LATEST) == "checkpoint_2000"
        for name in tree.listdir(""):
            tree.attr(name)
        assert tree.built_count == 0
        readme = tree.read("README.txt", 0, 1 << 20).decode()
        assert "latest:      checkpoint_2000" in readme and "checkpoint_5000.mdl: partial" in readme
        assert "config.json" in tree.listdir("checkpoint_300") and tree.built_count == 1
        assert safetensors_norm(tree, "checkpoint_300") == 300
        assert safetensors_norm(tree, LATEST) == 2000  # the Python API follows the link
        with pytest.raises(VirtualPathError) as e:
            tree.lookup("checkpoint_5000")
        assert e.value.errno == errno.ENOENT
        with pytest.raises(VirtualPathError) as e:
            tree.readlink("checkpoint_100")
        assert e.value.errno == errno.EINVAL
    finally:
        tree.close()


def test_inode_numbers_are_unique_across_checkpoints(tmp_path):
    d = model_dir(tmp_path / "run")
    save(d, 1)
    save(d, 2)
    tree = run_tree(d)
    try:
        inos = [tree.attr(p).ino for p in ("", "README.txt", LATEST)]
        for folder in ("checkpoint_1", "checkpoint_2"):
            inos.append(tree.attr(folder).ino)
            inos += [tree.attr(f"{folder}/{n}").ino for n in tree.listdir(folder)]
        assert len(inos) == len(set(inos))
    finally:
        tree.close()


def test_at_most_keep_idle_trees_stay_built(tmp_path):
    d = model_dir(tmp_path / "run")
    for step in range(1, 7):
        save(d, step)
    closed = []

    def build(path, options):
        from ckptfs.tree.assemble import build_tree

        t = build_tree(path, options)
        t._closers.append(lambda: closed.append(Path(path).name))
        return t

    tree = run_tree(d, keep=2, build=build)
    try:
        for step in range(1, 7):
            assert safetensors_norm(tree, f"checkpoint_{step}") == step
            assert tree.built_count <= 2
        assert closed == [f"checkpoint_{s}.mdl" for s in (1, 2, 3, 4)]
    finally:
        tree.close()
    assert sorted(closed) == sorted(f"checkpoint_{s}.mdl" for s in range(1, 7))


def test_an_open_handle_keeps_its_checkpoint_through_eviction_deletion_and_replacement(tmp_path):
    d = model_dir(tmp_path / "run")
    first = save(d, 1)
    save(d, 2)
    tree = run_tree(d, keep=1)
    try:
        e = tree.lookup("checkpoint_1/model.safetensors")
        old_attr = tree.attr(e)
        fh = tree.open(e)
        head = tree.read(tree.entry_by_handle(fh), 0, 100)
        safetensors_norm(tree, "checkpoint_2")  # builds another tree: checkpoint_1's stays (pinned)
        assert tree.built_count == 2
        first.unlink()
        assert tree.listdir("") == ["README.txt", LATEST, "checkpoint_2"]
        save(d, 11, "checkpoint_1.mdl")  # a different file under the old name, same mtime as the first
        os.utime(d / "checkpoint_1.mdl", ns=(old_attr.mtime_ns, old_attr.mtime_ns))
        # held back while the previous checkpoint_1 is open (the kernel caches pages by path)
        assert tree.listdir("") == ["README.txt", LATEST, "checkpoint_2"]
        assert "checkpoint_1.mdl: replaces a file of the same name" in tree.read("README.txt", 0, 1 << 20).decode()
        data = head + tree.read(tree.entry_by_handle(fh), 100, 1 << 30)  # the handle: the old one, whole
        assert float(norm_of(data)[0]) == 1
        tree.release(fh)
        assert tree.built_count == 1  # the deleted checkpoint's tree is closed with its last handle
        assert tree.listdir("") == ["README.txt", LATEST, "checkpoint_1", "checkpoint_2"]
        assert safetensors_norm(tree, "checkpoint_1") == 11
        new_attr = tree.attr("checkpoint_1/model.safetensors")
        assert new_attr.ino != old_attr.ino and new_attr.mtime_ns != old_attr.mtime_ns
        with pytest.raises(VirtualPathError) as err:
            tree.entry_by_handle(fh)
        assert err.value.errno == errno.EBADF
    finally:
        tree.close()


def test_new_partial_and_deleted_checkpoints_follow_the_model_dir(tmp_path):
    d = model_dir(tmp_path / "run")
    tree = run_tree(d)
    try:
        assert tree.listdir("") == ["README.txt"]  # nothing saved yet: still mountable
        save(d, 10)
        assert tree.listdir("") == ["README.txt", LATEST, "checkpoint_10"]
        write_copy(d / "checkpoint_20.mdl.00aa11bb.tmp", 20, success=False)
        partial = save_partial(d, 30)
        assert tree.listdir("") == ["README.txt", LATEST, "checkpoint_10"]
        assert tree.readlink(LATEST) == "checkpoint_10"
        set_success(partial)
        assert tree.readlink(LATEST) == "checkpoint_30"
        (d / "checkpoint_30.mdl").unlink()
        assert tree.listdir("") == ["README.txt", LATEST, "checkpoint_10"]
        assert tree.readlink(LATEST) == "checkpoint_10"
    finally:
        tree.close()


def test_polling_is_rate_limited(tmp_path):
    d = model_dir(tmp_path / "run")
    tree = RunTree(d, HF_ONLY, poll=3600)
    try:
        save(d, 1)
        assert tree.listdir("") == ["README.txt"]  # not rescanned yet
        tree.refresh()
        assert tree.listdir("") == ["README.txt", LATEST, "checkpoint_1"]
    finally:
        tree.close()


def test_single_and_files_are_not_runs(tmp_path):
    d = model_dir(tmp_path / "run")
    f = save(d, 1)
    assert is_run(d) and not is_run(d, MountOptions(single=True)) and not is_run(f)
    with pytest.raises(Exception, match="not a directory"):
        open_run(f)


@pytest.mark.slow  # runs the CLI
def test_ls_and_info_of_a_model_dir_list_the_run(tmp_path):
    d = model_dir(tmp_path / "run")
    save(d, 100)
    save(d, 2000)
    write_copy(d / "checkpoint_3000.mdl.00aa11bb.tmp", 3000, success=False)
    r = run_ckptfs("ls", d, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    row = next(ln for ln in lines if "checkpoint_2000.mdl" in ln)
    assert row.split()[0] == "2000" and "complete" in row and "<- latest" in row
    assert "save in progress" in next(ln for ln in lines if "checkpoint_3000.mdl.00aa11bb.tmp" in ln)
    assert "2 complete checkpoint(s), 1 not complete" in r.stdout

    j = json.loads(run_ckptfs("info", "--json", d, text=True).stdout)
    assert j["run"]["latest"] == "checkpoint_2000"
    assert [(c["step"], c["complete"], c["latest"]) for c in j["run"]["checkpoints"]] == [
        (100, True, False), (2000, True, True), (3000, False, False)]
    assert j["run"]["checkpoints"][0]["size"] == (d / "checkpoint_100.mdl").stat().st_size
    assert j["latest_checkpoint"]["path"] == str(d / "checkpoint_2000.mdl")
    text = run_ckptfs("info", d, text=True).stdout
    assert "latest: checkpoint_2000" in text and "latest checkpoint:" in text

    single = run_ckptfs("ls", "--single", d, text=True)
    assert single.returncode == 0 and "model/" in single.stdout  # the latest checkpoint's keys, as before


def test_params_are_found_per_checkpoint_as_for_one(tmp_path):
    d = model_dir(tmp_path / "run")
    (d / "train").mkdir()
    (d / "params.yaml").rename(d / "train" / "params_train.yaml")  # the Model Zoo run layout
    save(d, 5)
    tree = run_tree(d)
    try:
        assert json.loads(tree.read("latest/config.json", 0, 1 << 20))["model_type"] == "llama"
        assert "params_train.yaml" in tree.read("checkpoint_5/README.txt", 0, 1 << 20).decode()
    finally:
        tree.close()


def test_the_runs_trees_share_one_block_cache(tmp_path):
    d = model_dir(tmp_path / "run")
    save(d, 1)
    save(d, 2)
    tree = RunTree(d, MountOptions(views=("hf",), cache_size=1 << 20), poll=0)
    try:
        entries = [tree.lookup(f"checkpoint_{s}/model.safetensors") for s in (1, 2)]
        assert all(e.tree.cache is tree.cache for e in entries) and tree.cache.max_bytes == 1 << 20
        assert [float(norm_of(tree.read(e, 0, 1 << 30))[0]) for e in entries] == [1, 2]  # one cache, no mixing
    finally:
        tree.close()


def test_the_python_api_opens_a_run(tmp_path):
    import ckptfs

    d = model_dir(tmp_path / "run")
    save(d, 3)
    run = ckptfs.open_run(d, views="hf", max_shard_size="5GB")
    try:
        assert run.readlink("latest") == "checkpoint_3" and safetensors_norm(run, "latest") == 3
    finally:
        run.close()
