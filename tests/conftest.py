"""pytest hooks and fixtures of the suite; the shared helpers are the ``helpers`` package (tests/helpers/)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import FAKE_CLI, FIXTURES, REPO, REQUIRE_FUSE, TESTS, ckptfs_argv, fuse_unusable_reason, needs_fuse, read_all, real_env, run_ckptfs, slow  # noqa: F401

def pytest_configure(config):
    config.addinivalue_line("markers", "needs_fuse: mounts with real FUSE (fails without FUSE when "
                                       "CKPTFS_REQUIRE_FUSE=1, else skipped); implies slow")
    config.addinivalue_line("markers", "slow: real mounts, conformance and property tests (deselect with "
                                       "-m 'not slow' for the fast subset)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("needs_fuse") is not None or getattr(item.obj, "is_hypothesis_test", False):
            item.add_marker(slow)


def pytest_runtest_setup(item):
    if item.get_closest_marker("needs_fuse") is not None:
        why = fuse_unusable_reason()
        if why is not None:
            if REQUIRE_FUSE:
                pytest.fail(f"FUSE is required (CKPTFS_REQUIRE_FUSE=1) but not usable here: {why}", pytrace=False)
            pytest.skip(f"FUSE not usable here: {why}")


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES
