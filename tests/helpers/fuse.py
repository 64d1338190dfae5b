"""Test helpers for real FUSE mounts: a ``mounted()`` context manager that runs ``ckptfs mount … --foreground`` in a
subprocess with guaranteed cleanup, and synthetic views.

Synthetic views: ``fake_views`` gives the files of a made-up checkpoint; ``fake_tree()`` builds its tree here
(``build_tree(views=fake_views)``), and ``run_ckptfs(..., fake=FAKE)`` or ``mounted(..., fake=FAKE)`` run the command
line over it in a subprocess (tests/helpers/fakecli.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ckptfs.errors import CheckpointError, TensorReadError
from ckptfs.fuse.mount import fusermount, proc_mounts
from ckptfs.views.base import BytesFile, ViewResult
from ckptfs.layouts.file import VirtualFile
from helpers import FIXTURES, ckptfs_argv, real_env

MiB = 1 << 20
#: the synthetic views ``run_ckptfs(..., fake=FAKE)`` and ``mounted(..., fake=FAKE)`` serve
FAKE = "fake_views"
FIXTURES_CKPT = FIXTURES / "llama" / "cs" / "checkpoint.mdl"  # a real Cerebras checkpoint


# ---- synthetic files ---------------------------------------------------------------------------------


def pattern(offset: int, n: int, seed: int) -> bytes:
    """Bytes ``[offset, offset + n)`` of the pseudo-random stream ``seed``: each a function of (offset, seed)."""
    import numpy as np  # not before the first read: tests/helpers/fakecli.py forks its mount server while single-threaded

    i = np.arange(offset, offset + n, dtype=np.uint64)
    return (((i * np.uint64(2654435761) + np.uint64(seed * 40503)) >> np.uint64(11)) & np.uint64(255)) \
        .astype(np.uint8).tobytes()


class PatternFile(VirtualFile):
    """``size`` pseudo-random bytes (``pattern``): any range can be produced independently."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed = size, seed

    def readinto(self, offset: int, out: memoryview, cursor=None) -> int:
        n = max(0, min(len(out), self.size - offset))  # a test may shrink ``size`` after its tree fixed it
        out[:n] = pattern(offset, n, self.seed)
        return n


class FailingFile(PatternFile):
    """Like PatternFile, but any read touching bytes at or after ``fail_from`` raises TensorReadError."""

    def __init__(self, size: int, seed: int, fail_from: int):
        super().__init__(size, seed)
        self.fail_from = fail_from

    def readinto(self, offset: int, out: memoryview, cursor=None) -> int:
        if offset + len(out) > self.fail_from:
            raise TensorReadError("model.layers.1.weight", "corrupt chunk (synthetic failure)")
        return super().readinto(offset, out)


FAILING = "torch/broken.pt"  # the one file of fake_views whose reads fail past FAIL_FROM
FAIL_FROM = MiB + 5


def fake_views(ckpt_path: Path, options) -> dict:
    """The synthetic views (``build_tree(views=fake_views)``): three present views, one failing view, one file that
    cannot be read."""
    if Path(ckpt_path).suffix == ".bad":
        raise CheckpointError(ckpt_path, "not a Cerebras checkpoint (synthetic)")
    return {
        "hf": ViewResult(files={
            "config.json": BytesFile(json.dumps({"model_type": "fakefam", "architectures": ["FakeForCausalLM"]})),
            "model.safetensors": PatternFile(5 * MiB + 123, 1),
            "empty.bin": PatternFile(0, 2),
            "one.bin": PatternFile(1, 3),
            "page.bin": PatternFile(4096, 4),
        }, notes=["hf: synthetic note"]),
        "tensors": ViewResult(files={
            "model/layers/0/weight.npy": PatternFile(3 * 4096 + 1, 5),
            "model/layers/0/bias.npy": PatternFile(700, 6),
            "model/odd%2Fkey.npy": PatternFile(MiB, 7),
        }),
        "cs": CheckpointError("/synthetic/cs", "upgrade not possible (synthetic)"),
        "torch": ViewResult(files={"broken.pt": FailingFile(3 * MiB, 8, FAIL_FROM)}),
    }


def fake_views_server_fails(ckpt_path: Path, options) -> dict:
    """Like fake_views, but the checkpoint "breaks" in the background server process (``--foreground``)."""
    if "--foreground" in sys.argv:
        raise CheckpointError(ckpt_path, "vanished before the server started (synthetic)")
    return fake_views(ckpt_path, options)


def fake_tree(ckpt="fake.mdl", **options):
    """The tree of ``fake_views`` in this process (what a mount of it must show)."""
    from ckptfs.views.options import MountOptions
    from ckptfs.tree.assemble import build_tree

    return build_tree(ckpt, MountOptions(**options), views=fake_views)


# ---- running ckptfs ---------------------------------------------------------------------------------


def is_mounted(mnt) -> bool:
    """Listed in /proc/self/mounts (true for a stale mount too)."""
    return any(m == os.path.abspath(str(mnt)) for m, _ in proc_mounts())


def process_gone(pid: int, timeout: float = 20) -> bool:
    """Wait until process ``pid`` (not necessarily our child) has exited (a zombie waiting to be reaped counts)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def force_unmount(mnt) -> None:
    for args in (["-u"], ["-u", "-z"]):
        if not is_mounted(mnt):
            return
        subprocess.run([fusermount(), *args, str(mnt)], capture_output=True, timeout=30)


def reap(proc: subprocess.Popen, timeout: float = 15) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


@dataclass
class Server:
    mnt: Path
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def wait_mounted(proc: subprocess.Popen, mnt: Path, log_path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"ckptfs mount exited with {proc.returncode}:\n{log_path.read_text(errors='replace')}")
        if os.path.ismount(mnt) and (mnt / "README.txt").exists():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not mounted after {timeout} s:\n{log_path.read_text(errors='replace')}")
        time.sleep(0.05)


def start_server(ckpt, mnt: Path, *args, env=None, log_path: Path | None = None, fake: str | None = None) -> Server:
    """Start a foreground server (not waiting; ``env`` default ``real_env()``, ``fake``: see ``ckptfs_argv``); the
    caller must reap it."""
    log_path = log_path or Path(tempfile.mkstemp(prefix="ckptfs-test-", suffix=".log")[1])
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(ckptfs_argv("mount", ckpt, mnt, *args, "--foreground", fake=fake),
                                env=env if env is not None else real_env(), stdin=subprocess.DEVNULL, stdout=logf,
                                stderr=subprocess.STDOUT, preexec_fn=_default_signals)
    return Server(mnt, proc, log_path)


def _default_signals() -> None:
    """In the server child: the termination signals at their defaults, whatever the test run inherited (under
    ``nohup`` SIGHUP is ignored, and libfuse then rightly leaves it ignored: the signal tests would hang)."""
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


@contextlib.contextmanager
def mounted_server(ckpt, *args, env=None, timeout: float = 60, fake: str | None = None):
    """Mount ``ckpt`` on a fresh temporary directory in a foreground subprocess; yield a ``Server``.

    Cleanup always runs: fusermount3 -u, reap, then -u -z and kill as last resorts, then remove the directory.
    """
    mnt = Path(tempfile.mkdtemp(prefix="ckptfs-mnt-"))
    srv = start_server(ckpt, mnt, *args, env=env, fake=fake)
    try:
        wait_mounted(srv.proc, mnt, srv.log_path, timeout)
        yield srv
    finally:
        if srv.proc.poll() is None and is_mounted(mnt):
            r = subprocess.run([fusermount(), "-u", str(mnt)], capture_output=True, timeout=30)
            if r.returncode != 0 and is_mounted(mnt):
                # busy: the test still maps a file of the mount (a model loaded with mmap); detach the mount
                # and stop the server now instead of waiting for the mapping to go away
                subprocess.run([fusermount(), "-u", "-z", str(mnt)], capture_output=True, timeout=30)
                srv.proc.terminate()
        try:
            srv.proc.wait(15)
        except subprocess.TimeoutExpired:
            force_unmount(mnt)
            reap(srv.proc)
        force_unmount(mnt)
        with contextlib.suppress(OSError):
            mnt.rmdir()
        with contextlib.suppress(OSError):
            srv.log_path.unlink()  # read it inside the with block


@contextlib.contextmanager
def mounted(ckpt, *args, env=None, timeout: float = 60, fake: str | None = None):
    """``with mounted(ckpt, "--views", "hf") as mnt:`` — the mount point as a Path."""
    with mounted_server(ckpt, *args, env=env, timeout=timeout, fake=fake) as srv:
        yield srv.mnt


def concurrent_random_reads(mnt: Path, expected: dict, *, threads: int = 8, seconds: float = 4) -> tuple:
    """``threads`` readers pread random ranges of every file in ``expected`` ({relative path: bytes}) for about
    ``seconds``; returns (mismatches and errors, reads done per thread)."""
    import random
    import threading

    paths = sorted(expected)
    errors: list = []
    counts = [0] * threads

    def worker(k):
        rnd = random.Random(k)
        fds = {p: os.open(mnt / p, os.O_RDONLY) for p in paths}
        p = None
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and not errors:
                p = rnd.choice(paths)
                want = expected[p]
                off = rnd.randrange(0, len(want) + 1)
                n = rnd.choice([1, 7, 4096, 65536, 1 << 20, 3 << 20, rnd.randrange(1, 300000)])
                got = os.pread(fds[p], n, off)
                if got != want[off:off + n]:
                    errors.append(f"{p} [{off}+{n}]: {len(got)} bytes differ")
                counts[k] += 1
        except Exception as e:  # reported by the caller
            errors.append(f"{p}: {e!r}")
        finally:
            for fd in fds.values():
                os.close(fd)

    workers = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return errors, counts
