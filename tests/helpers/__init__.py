"""Shared test helpers: the fixtures folder (copied from the genuine Cerebras fixtures into tests/fixtures/), the one
way tests run the ``ckptfs`` command as a user would (``run_ckptfs``, in ``real_env()``), and the markers.

Markers: ``needs_fuse`` (a usable /dev/fuse: skipped where there is none, a failure when ``CKPTFS_REQUIRE_FUSE=1``,
as ``.ci/run`` sets) and ``slow`` (tests that start processes: the CLI, an S3 server, TensorFlow, a FUSE mount; and
conformance and property tests: every ``needs_fuse`` test and every hypothesis test is marked by conftest, the others
mark themselves). ``pytest -m "not slow"`` is the fast subset: there, a test that starts a program or imports
TensorFlow fails (conftest), so the subset stays in-process work.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from ctypes.util import find_library
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
#: what ``run_ckptfs(..., fake=NAME)`` runs: the CLI over a synthetic tree (``helpers.fuse.NAME``)
FAKE_CLI = TESTS / "helpers" / "fakecli.py"
#: set by .ci/run: a test that needs FUSE fails where FUSE is unusable instead of being skipped
REQUIRE_FUSE = os.environ.get("CKPTFS_REQUIRE_FUSE") == "1"

needs_fuse = pytest.mark.needs_fuse
slow = pytest.mark.slow


def real_env(**extra) -> dict:
    """The environment of a ckptfs subprocess: this one, with this checkout and tests/ importable, plus ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(TESTS), str(REPO), env.get("PYTHONPATH")) if x)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def ckptfs_argv(*args, fake: str | None = None) -> list:
    """The command line of ``ckptfs ARGS``: ``python -m ckptfs``, or with ``fake`` the CLI over the synthetic tree
    ``fusehelp.<fake>`` (tests/helpers/fakecli.py)."""
    head = [sys.executable, "-m", "ckptfs"] if fake is None else [sys.executable, str(FAKE_CLI), "--fake", fake]
    return [*head, *map(str, args)]


def run_ckptfs(*args, env=None, cwd=None, text: bool = False, timeout: float = 300, check: bool = False,
               fake: str | None = None) -> subprocess.CompletedProcess:
    """Run ``ckptfs ARGS`` in a subprocess (``env`` default ``real_env()``; ``fake``: see ``ckptfs_argv``) and
    capture its output (``check``: assert it exits 0)."""
    r = subprocess.run(ckptfs_argv(*args, fake=fake), env=env if env is not None else real_env(), cwd=cwd,
                       capture_output=True, text=text, timeout=timeout)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def read_all(vf, step: int = 1 << 20) -> bytes:
    """A whole virtual file, read ``step`` bytes at a time in order."""
    return b"".join(vf.read(o, step) for o in range(0, vf.size, step))


def fuse_unusable_reason() -> str | None:
    """Why a FUSE mount cannot work here (None when it can)."""
    if not shutil.which("fusermount3") and not shutil.which("fusermount"):
        return "fusermount3 not installed"
    if not find_library("fuse3") and not find_library("fuse"):
        return "libfuse not installed"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as e:
        return f"/dev/fuse unusable: {e.strerror}"
    return None
