"""The background mount's start (issue 14): the CLI imports nothing a tree needs before it starts the server, the
checkpoint is opened only by the server, and the server's error is relayed by ``ckptfs mount`` as the server
printed it (same class, path and problem, plus where the log is)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ckptfs.errors import CheckpointError, ConfigError, CkptfsError
from ckptfs.fuse.mount import MountError, encode_status_error, relayed_error
from helpers import REPO, needs_fuse, real_env, run_ckptfs
from helpers.fuse import FAKE, FIXTURES_CKPT, force_unmount, is_mounted, process_gone


@pytest.mark.parametrize("err", [CheckpointError("/x/ck.mdl", "not an HDF5 file"),
                                 ConfigError("/x/params.yaml", "no 'model' section"),
                                 MountError(None, "something without a path")])
def test_status_error_round_trip_keeps_class_path_and_problem(err):
    got = relayed_error(encode_status_error(err))
    assert type(got) is type(err) and got.path == err.path and str(got) == str(err)
    with_log = relayed_error(encode_status_error(err), "/logs/mount.log")
    assert str(with_log) == f"{err} (log: /logs/mount.log)"


def test_status_error_of_an_unknown_class_is_a_ckptfs_error():
    data = json.dumps({"type": "NoSuchError", "path": "/p", "problem": "why"}).encode() + b"\n"
    got = relayed_error(data)
    assert type(got) is CkptfsError and str(got) == "/p: why"
    assert relayed_error(b"not json\n") is None


@pytest.mark.slow  # starts a Python process
def test_the_cli_starts_a_mount_without_importing_what_a_tree_needs():
    """Everything ``ckptfs mount`` does before it starts the server: parse, options, mount point, libfuse."""
    code = """if True:
        import sys, tempfile
        from ckptfs.cli import build_parser
        from ckptfs.views import options
        from ckptfs.fuse.mount import check_mountpoint
        args = build_parser().parse_args(["mount", "x.mdl", "mnt"])
        o = options.from_args(args)
        options.check_options(o)
        check_mountpoint(tempfile.mkdtemp())
        import subprocess
        spawned = []
        subprocess.Popen.__init__ = lambda self, args, *a, **k: spawned.append(args) or 1 / 0
        from ckptfs.fuse.operations import check_fuse
        check_fuse()
        heavy = sorted(m for m in ("h5py", "numpy", "yaml", "ckptfs.readers", "ckptfs.views.hf.view", "ckptfs.mapping.lang.spec",
                                   "mfusepy") if m in sys.modules)
        print(",".join(heavy) + ";" + repr(spawned))
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    # nothing heavy imported, and libfuse 3 found without running ``ldconfig -p`` (ctypes.util.find_library)
    assert r.stdout.strip() == ";[]"


@pytest.mark.slow  # starts a Python process
def test_the_cli_imports_only_the_command_it_runs():
    """``ckptfs mount …`` (also after ``--debug``) imports the mount command's module alone; ``ckptfs --help`` and
    anything that is not a command name still get the parser of every command."""
    code = """if True:
        import sys
        from ckptfs import cli
        for argv in (["mount", "x.mdl", "mnt"], ["--debug", "mount", "x.mdl", "mnt"], ["convert-config", "p.yaml"]):
            before = set(sys.modules)
            cli.build_parser(cli._command_named(argv)).parse_args(argv)
            print(sorted(m for m in set(sys.modules) - before if m.startswith("ckptfs.commands.")))
        for argv in (["--help"], ["mnt"], ["convert_config"], []):
            print(cli._command_named(argv))
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:7] == ["['ckptfs.commands.mount']", "[]", "['ckptfs.commands.convert_config']",
                                         "None", "None", "None", "None"]
    full = subprocess.run([sys.executable, "-m", "ckptfs", "--help"], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert full.returncode == 0 and all(c in full.stdout for c in ("mount", "umount", "export", "convert-config",
                                                                   "explain", "models", "info"))
    one = subprocess.run([sys.executable, "-m", "ckptfs", "umount", "--help"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert one.returncode == 0 and one.stdout.startswith("usage: ckptfs umount")


@needs_fuse
def test_libfuse3_is_loaded_by_soname_without_a_subprocess(monkeypatch):
    from ckptfs.fuse import operations as fusefs

    monkeypatch.setattr(subprocess.Popen, "__init__", lambda *a, **k: pytest.fail(f"subprocess started: {a[1:]}"))
    name = fusefs.libfuse3_path()
    assert name in fusefs.LIBFUSE3_SONAMES
    import ctypes

    assert ctypes.CDLL(name).fuse_version() >= 30


def test_a_missing_mfusepy_is_one_line_naming_the_fix(monkeypatch):
    import importlib.util

    from ckptfs.fuse import operations as fusefs

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mfusepy" else real(name, *a))
    with pytest.raises(fusefs.FuseUnavailableError, match=r"mfusepy is not installed: pip install"):
        fusefs.check_fuse()


@needs_fuse
def test_background_mount_of_a_bad_checkpoint_relays_the_servers_line(tmp_path):
    bad = tmp_path / "garbage.mdl"
    bad.write_bytes(b"garbage" * 1000)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = real_env(CKPTFS_CACHE_DIR=tmp_path / "cache")
    try:
        fg = run_ckptfs("mount", bad, mnt, "--foreground", env=env, timeout=60)
        bg = run_ckptfs("mount", bad, mnt, env=env, timeout=60)
    finally:
        force_unmount(mnt)
    assert fg.returncode == bg.returncode == 2
    fg_line, = fg.stderr.decode().strip().splitlines()
    bg_line, = bg.stderr.decode().strip().splitlines()
    logs = list((tmp_path / "cache" / "logs").glob("mount-*.log"))
    assert len(logs) == 1 and bg_line == f"{fg_line} (log: {logs[0]})"
    assert str(bad) in bg_line and not is_mounted(mnt)
    assert fg_line in logs[0].read_text()  # the server printed the same line to its log


def test_convert_config_dtypes_are_the_mapping_cores():
    from ckptfs.commands.convert_config import DTYPES as cli_dtypes
    from ckptfs.mapping.params.convert_config import DTYPES

    assert cli_dtypes == DTYPES


def _server_cmdline(pid: int) -> list:
    return [a.decode() for a in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0") if a]


@needs_fuse
def test_ckptfs_mount_forks_its_server_instead_of_starting_another_interpreter(tmp_path):
    """``ckptfs mount`` runs one thread when it starts the server, so the server is a fork of it: its command line
    is the user's command (a spawned server's would be ``python -m ckptfs mount … --foreground``). It keeps none of
    the command's output pipes (``ckptfs`` here reads them to their end: it would wait as long as the server runs),
    serves, and stops on ``ckptfs umount``."""
    import re

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = run_ckptfs("mount", "fake.mdl", mnt, env=real_env(CKPTFS_CACHE_DIR=tmp_path / "cache"), fake=FAKE, timeout=60)
    assert r.returncode == 0, r.stderr
    pid = int(re.search(r"pid (\d+)", r.stdout.decode()).group(1))
    try:
        argv = _server_cmdline(pid)
        assert "mount" in argv and str(mnt) in argv and "--foreground" not in argv, argv
        assert os.readlink(f"/proc/{pid}/fd/0") == os.devnull and os.readlink(f"/proc/{pid}/cwd") == "/"
        assert os.getsid(pid) == pid  # its own session: a Ctrl-C meant for the shell does not reach it
        assert (mnt / "README.txt").read_bytes()
        assert run_ckptfs("umount", mnt, timeout=120).returncode == 0
        assert process_gone(pid) and not is_mounted(mnt)
    finally:
        force_unmount(mnt)


@needs_fuse
def test_a_process_running_threads_starts_a_new_interpreter_for_the_server(tmp_path):
    """Forking a process that runs other threads could leave a lock held forever in the child: there the server is
    a fresh ``python -m ckptfs mount … --foreground`` process, and it serves the same."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    code = f"""if True:
        import threading, time
        from ckptfs.fuse.mount import mount, single_threaded
        assert single_threaded()
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        assert not single_threaded()
        print(mount({str(FIXTURES_CKPT)!r}, {str(mnt)!r}).pid)
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env=real_env(CKPTFS_CACHE_DIR=tmp_path / "cache"))
    try:
        assert r.returncode == 0, r.stderr
        pid = int(r.stdout.split()[-1])
        argv = _server_cmdline(pid)
        assert argv[1:4] == ["-m", "ckptfs", "mount"] and "--foreground" in argv, argv
        assert (mnt / "README.txt").read_bytes()
        assert run_ckptfs("umount", mnt, timeout=120).returncode == 0
        assert process_gone(pid)
    finally:
        force_unmount(mnt)
