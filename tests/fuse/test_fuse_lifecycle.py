"""Mount lifecycle as a user drives it: checks before mounting, background start, umount, signals, stale mounts."""
from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import needs_fuse, real_env, run_ckptfs
from helpers.fuse import (FAKE, force_unmount, is_mounted, mounted_server, process_gone, reap, start_server,
                      wait_mounted)

pytestmark = [needs_fuse, pytest.mark.timeout(300)]


@pytest.fixture
def ckpt(tmp_path):
    p = tmp_path / "fake.mdl"
    p.write_bytes(b"synthetic")
    return p


@pytest.fixture
def mnt(tmp_path):
    d = tmp_path / "mnt"
    d.mkdir()
    yield d
    force_unmount(d)


def test_umount_command_unmounts_and_the_server_exits_cleanly(ckpt):
    with mounted_server(ckpt, fake=FAKE) as srv:
        r = run_ckptfs("umount", srv.mnt, timeout=120)
        assert r.returncode == 0, r.stderr
        assert reap(srv.proc) == 0, srv.log()
        assert not is_mounted(srv.mnt) and os.listdir(srv.mnt) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signals_unmount_cleanly(ckpt, sig):
    with mounted_server(ckpt, fake=FAKE) as srv:
        srv.proc.send_signal(sig)
        assert reap(srv.proc) == 0, srv.log()
        assert not is_mounted(srv.mnt)


def test_umount_of_a_busy_mount_detaches_lazily(ckpt):
    with mounted_server(ckpt, fake=FAKE) as srv:
        holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=srv.mnt / "tensors")
        try:
            r = run_ckptfs("umount", srv.mnt, timeout=120)
            assert r.returncode == 0, r.stderr
            assert b"lazily" in r.stdout
            assert not is_mounted(srv.mnt)
        finally:
            holder.kill()
            holder.wait()
        assert reap(srv.proc) == 0, srv.log()


def test_umount_of_something_not_mounted_is_a_clear_error(tmp_path):
    r = run_ckptfs("umount", tmp_path, timeout=120)
    assert r.returncode == 2 and b"not mounted" in r.stderr


def test_stale_mount_is_explained_and_cleared(ckpt, mnt, tmp_path):
    srv = start_server(ckpt, mnt, fake=FAKE, log_path=tmp_path / "server1.log")
    try:
        wait_mounted(srv.proc, mnt, srv.log_path)
        srv.proc.kill()  # SIGKILL: the mount stays, with nobody serving it
        srv.proc.wait()
        with pytest.raises(OSError) as e:
            os.listdir(mnt)  # (stat may still be answered from the kernel's attribute cache)
        assert e.value.errno == errno.ENOTCONN
        r = run_ckptfs("mount", ckpt, mnt, fake=FAKE, timeout=120)
        assert r.returncode == 2
        msg = r.stderr.decode()
        assert len(msg.strip().splitlines()) == 1
        assert "stale" in msg and f"ckptfs umount {mnt}" in msg and f"fusermount3 -u -z {mnt}" in msg
        r = run_ckptfs("umount", mnt, timeout=120)
        assert r.returncode == 0, r.stderr
        assert not is_mounted(mnt) and os.listdir(mnt) == []
        srv2 = start_server(ckpt, mnt, fake=FAKE, log_path=tmp_path / "server2.log")  # the mount point is usable again
        try:
            wait_mounted(srv2.proc, mnt, srv2.log_path)
            assert (mnt / "README.txt").read_bytes()
        finally:
            force_unmount(mnt)
            reap(srv2.proc)
    finally:
        force_unmount(mnt)
        reap(srv.proc)


def test_background_mount_returns_when_ready_and_logs_to_the_cache_dir(ckpt, mnt, tmp_path):
    cache = tmp_path / "cache"
    r = run_ckptfs("mount", ckpt, mnt, env=real_env(CKPTFS_CACHE_DIR=cache), fake=FAKE, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    pid = int(re.search(r"pid (\d+)", out).group(1))
    log_path = Path(re.search(r"log: (\S+?);", out).group(1))
    try:
        assert log_path.parent == cache / "logs" and log_path.exists()
        assert is_mounted(mnt) and (mnt / "config.json").read_bytes()
        assert run_ckptfs("umount", mnt, timeout=120).returncode == 0
        assert process_gone(pid)
        assert not is_mounted(mnt)
        assert "mounting" in log_path.read_text()
    finally:
        force_unmount(mnt)


def test_background_server_failure_is_reported_with_the_log_line(ckpt, mnt, tmp_path):
    r = run_ckptfs("mount", ckpt, mnt, env=real_env(CKPTFS_CACHE_DIR=tmp_path / "cache"),
                   fake="fake_views_server_fails", timeout=120)
    assert r.returncode == 2
    assert b"vanished before the server started" in r.stderr and b"log:" in r.stderr
    assert not is_mounted(mnt)


@pytest.mark.parametrize("case", ["missing", "file", "not_empty"])
def test_unusable_mount_points_are_refused_before_mounting(ckpt, tmp_path, case):
    target = tmp_path / "target"
    if case == "file":
        target.write_text("x")
    elif case == "not_empty":
        target.mkdir()
        (target / "something").write_text("x")
    r = run_ckptfs("mount", ckpt, target, "--foreground", fake=FAKE, timeout=120)
    assert r.returncode == 2
    msg = r.stderr.decode()
    assert len(msg.strip().splitlines()) == 1
    assert {"missing": "does not exist", "file": "not a directory", "not_empty": "not empty"}[case] in msg
    assert not is_mounted(target)


def test_already_mounted_mount_point_is_refused(ckpt):
    with mounted_server(ckpt, fake=FAKE) as srv:
        r = run_ckptfs("mount", ckpt, srv.mnt, "--foreground", fake=FAKE, timeout=120)
        assert r.returncode == 2 and b"already mounted" in r.stderr
        assert srv.proc.poll() is None


def test_bad_checkpoint_exits_2_with_one_line_and_mounts_nothing(tmp_path, mnt):
    bad = tmp_path / "garbage.mdl"
    bad.write_bytes(b"garbage" * 1000)
    for extra in ([], ["--foreground"]):
        r = run_ckptfs("mount", bad, mnt, *extra, timeout=60)
        assert r.returncode == 2
        assert len(r.stderr.decode().strip().splitlines()) == 1 and str(bad) in r.stderr.decode()
        assert not is_mounted(mnt)
    r = run_ckptfs("mount", tmp_path / "nope.mdl", mnt, timeout=120)
    assert r.returncode == 2 and not is_mounted(mnt)


def test_bad_options_exit_2(ckpt, mnt):
    r = run_ckptfs("mount", ckpt, mnt, "--views", "hf,bogus", fake=FAKE, timeout=120)
    assert r.returncode == 2 and b"bogus" in r.stderr
    r = run_ckptfs("mount", ckpt, mnt, "--cache-size", "lots", fake=FAKE, timeout=120)
    assert r.returncode == 2 and b"lots" in r.stderr
    assert not is_mounted(mnt)
