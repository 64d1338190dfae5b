"""Shared test helpers: the fixtures folder (copied from the genuine Cerebras fixtures into tests/fixtures/) and
the one way tests run the ``ckptfs`` command as a user would."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


def run_ckptfs(*args, env=None, cwd=None, text: bool = False, timeout: float = 300,
               check: bool = False) -> subprocess.CompletedProcess:
    """Run ``python -m ckptfs ARGS`` in a subprocess and capture its output (``check``: assert it exits 0)."""
    r = subprocess.run([sys.executable, "-m", "ckptfs", *map(str, args)], env=env, cwd=cwd, capture_output=True,
                       text=text, timeout=timeout)
    if check:
        assert r.returncode == 0, r.stderr
    return r


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES
