"""Issue #17 on a real FUSE mount: a model_dir mounted as a whole training run, live while "training" writes.

The model_dir is built from the llama fixture (tests/helpers/run.py): each checkpoint's norm weight holds its step, so
every byte read tells which checkpoint it came from. Live changes are waited for by polling with a generous timeout
(the mount rescans at most once a second); nothing asserts on time."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

import ckptfs
from helpers import needs_fuse, real_env
from helpers.fuse import mounted, mounted_server
from helpers.run import model_dir, norm_of, save, save_partial, set_success, write_copy

pytestmark = [needs_fuse, pytest.mark.timeout(900)]

WAIT = 60  # seconds a live change may take to show (it takes about one)


def wait_for(what, cond, timeout: float = WAIT):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen within {timeout} s: {what}")
        time.sleep(0.1)


def folders(mnt: Path) -> list:
    return sorted(n for n in os.listdir(mnt) if n.startswith("checkpoint_"))


def step_of(mnt: Path, folder: str) -> float:
    values = norm_of((mnt / folder / "model.safetensors").read_bytes())
    assert np.all(values == values[0])
    return float(values[0])


def test_every_checkpoint_is_a_folder_and_latest_a_link(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    d = model_dir(tmp_path / "run")
    for step in (100, 2000, 300):
        save(d, step)
    save_partial(d, 5000)
    with mounted(d, env=real_env()) as mnt:
        assert sorted(os.listdir(mnt)) == ["README.txt", "checkpoint_100", "checkpoint_2000", "checkpoint_300",
                                           "latest"]
        assert os.readlink(mnt / "latest") == "checkpoint_2000" and (mnt / "latest").is_symlink()
        readme = (mnt / "README.txt").read_text()
        assert "latest:      checkpoint_2000" in readme and "checkpoint_5000.mdl: partial" in readme
        for folder in ("checkpoint_100", "checkpoint_300"):
            names = os.listdir(mnt / folder)
            assert {"config.json", "model.safetensors", "cs", "torch", "tensors", "README.txt"} <= set(names)
            want = ckptfs.open(d / f"{folder}.mdl")
            try:
                assert sorted(names) == sorted(want.listdir(""))
                for name in names:
                    if not want.lookup(name).is_dir:
                        assert (mnt / folder / name).read_bytes() == want.read(name, 0, 1 << 30), (folder, name)
            finally:
                want.close()
        for where, step in (("latest", 2000), ("checkpoint_300", 300)):
            model = AutoModelForCausalLM.from_pretrained(str(mnt / where))
            assert torch.all(model.state_dict()["model.norm.weight"] == step), where
        inos = [os.stat(mnt / f / "config.json").st_ino for f in folders(mnt)]
        assert len(set(inos)) == len(inos)


def test_single_keeps_one_checkpoint(tmp_path):
    d = model_dir(tmp_path / "run")
    save(d, 1)
    save(d, 2)
    with mounted(d, "--single", "--views", "hf", env=real_env()) as mnt:
        assert "config.json" in os.listdir(mnt) and not (mnt / "latest").exists()
        assert float(norm_of((mnt / "model.safetensors").read_bytes())[0]) == 2


def test_the_mount_follows_the_run_while_training_writes(tmp_path):
    d = model_dir(tmp_path / "run")
    save(d, 10)
    with mounted(d, "--views", "hf", env=real_env()) as mnt:
        assert folders(mnt) == ["checkpoint_10"] and os.readlink(mnt / "latest") == "checkpoint_10"
        assert not (mnt / "checkpoint_20").exists()  # also leaves a negative lookup in the kernel's cache

        save(d, 20)  # written as .tmp, then renamed
        wait_for("checkpoint_20 appears", lambda: (mnt / "checkpoint_20").exists())
        wait_for("latest moves to checkpoint_20", lambda: os.readlink(mnt / "latest") == "checkpoint_20")
        assert step_of(mnt, "latest") == 20 and step_of(mnt, "checkpoint_10") == 10

        tmp = write_copy(d / "checkpoint_30.mdl.00aa11bb.tmp", 30)  # a save in progress (complete only once renamed)
        partial = save_partial(d, 40)  # a file without __SUCCESS__
        wait_for("README lists the partial files", lambda: "checkpoint_40.mdl: partial" in
                 (mnt / "README.txt").read_text() and tmp.name in (mnt / "README.txt").read_text())
        assert folders(mnt) == ["checkpoint_10", "checkpoint_20"]
        assert not (mnt / "checkpoint_30").exists() and not (mnt / "checkpoint_40").exists()
        assert os.readlink(mnt / "latest") == "checkpoint_20"

        set_success(partial)  # the save completes
        wait_for("checkpoint_40 appears once complete", lambda: (mnt / "checkpoint_40").exists())
        wait_for("latest moves to checkpoint_40", lambda: os.readlink(mnt / "latest") == "checkpoint_40")
        assert step_of(mnt, "latest") == 40
        os.replace(tmp, d / "checkpoint_30.mdl")  # an older step completing does not move latest
        wait_for("checkpoint_30 appears", lambda: (mnt / "checkpoint_30").exists())
        assert os.readlink(mnt / "latest") == "checkpoint_40"

        (d / "checkpoint_40.mdl").unlink()  # KeepNCheckpoints
        wait_for("checkpoint_40 vanishes", lambda: not (mnt / "checkpoint_40").exists())
        wait_for("latest moves back", lambda: os.readlink(mnt / "latest") == "checkpoint_30")
        assert folders(mnt) == ["checkpoint_10", "checkpoint_20", "checkpoint_30"]


def test_an_open_reader_of_a_deleted_checkpoint_finishes_with_its_bytes(tmp_path):
    d = model_dir(tmp_path / "run")
    save(d, 1)
    save(d, 2)
    ref = model_dir(tmp_path / "ref") / "checkpoint_1.mdl"  # the same file elsewhere, with its params
    shutil.copy(d / "checkpoint_1.mdl", ref)
    want = ckptfs.open(ref, views="hf")
    try:
        expected = {n: want.read(n, 0, 1 << 30) for n in ("model.safetensors", "config.json")}
    finally:
        want.close()
    with mounted(d, "--views", "hf", env=real_env()) as mnt:
        fds = {n: os.open(mnt / "checkpoint_1" / n, os.O_RDONLY) for n in expected}
        try:
            heads = {n: os.pread(fd, 1000, 0) for n, fd in fds.items()}  # only the start is read before
            (d / "checkpoint_1.mdl").unlink()  # KeepNCheckpoints deletes it
            wait_for("checkpoint_1 vanishes", lambda: not (mnt / "checkpoint_1").exists())
            assert folders(mnt) == ["checkpoint_2"]
            save(d, 11, "checkpoint_1.mdl")  # another checkpoint takes its name while it is still open
            wait_for("README says the new checkpoint_1 waits", lambda: "checkpoint_1.mdl: replaces a file"
                     in (mnt / "README.txt").read_text())
            assert not (mnt / "checkpoint_1").exists()
            for n, fd in fds.items():
                rest = b"".join(iter(lambda fd=fd, got=[1000]: _next(fd, got), b""))
                assert heads[n] + rest == expected[n], n  # the whole file, from the checkpoint it was opened on
                assert os.fstat(fd).st_size == len(expected[n])
        finally:
            for fd in fds.values():
                os.close(fd)
        wait_for("the new checkpoint_1 appears once the old one is closed", lambda: (mnt / "checkpoint_1").exists())
        assert step_of(mnt, "checkpoint_1") == 11
        assert folders(mnt) == ["checkpoint_1", "checkpoint_2"]


def _next(fd: int, pos: list, n: int = 65536) -> bytes:
    """The next ``n`` bytes of ``fd`` from ``pos[0]`` (advanced); b"" at the end."""
    data = os.pread(fd, n, pos[0])
    pos[0] += len(data)
    return data


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_two_hundred_checkpoints_mount_at_once_and_memory_stays_bounded(tmp_path):
    d = model_dir(tmp_path / "run")
    src = write_copy(tmp_path / "one.mdl", None)
    for step in range(1, 201):
        shutil.copy(src, d / f"checkpoint_{step * 10}.mdl")
    with mounted_server(d, "--cache-size", "16MiB", env=real_env()) as srv:
        mnt, pid = srv.mnt, srv.proc.pid
        assert len(folders(mnt)) == 200 and os.readlink(mnt / "latest") == "checkpoint_2000"
        for f in folders(mnt):
            os.stat(mnt / f)  # the root and every folder stat'ed: no tree built yet
        base_rss, base_fds = _rss_kib(pid), _fds(pid)
        rss = []
        for i, f in enumerate(folders(mnt)):
            assert (mnt / f / "config.json").read_bytes()[:1] == b"{"
            assert len((mnt / f / "model.safetensors").read_bytes()) > 0
            assert (mnt / f / "tensors" / "model").is_dir()
            if i % 40 == 39:
                rss.append(_rss_kib(pid))
                assert _fds(pid) <= base_fds + 16, "trees of released checkpoints must be closed"
        # 200 trees built one after another, a handful kept (a few MB each here, plus a 16 MiB block cache each).
        # Measured: ~20 MB for the first trees (imports, first caches), then flat; keeping every tree would grow
        # by hundreds of MB.
        assert max(rss) - base_rss < 200 * 1024, f"server RSS: {base_rss} KiB at mount, then {rss}"
        assert rss[-1] - rss[0] < 64 * 1024, f"server RSS kept growing: {rss} KiB every 40 checkpoints"
