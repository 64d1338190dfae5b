"""pytest hooks and fixtures of the suite; the shared helpers are the ``helpers`` package (tests/helpers/)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import FAKE_CLI, FIXTURES, REPO, REQUIRE_FUSE, TESTS, ckptfs_argv, fuse_unusable_reason, needs_fuse, read_all, real_env, run_ckptfs, slow  # noqa: F401

#: audit events of a test that starts a program (a fork of the test's own process is not one)
PROGRAM_STARTS = frozenset({"subprocess.Popen", "os.posix_spawn", "os.exec", "os.system"})
#: the fast test running in this process: (its nodeid, [what it started], TensorFlow imported before it); None: none
_watched: list = [None]


def _watch_program_starts(event: str, args: tuple) -> None:
    if _watched[0] is not None and event in PROGRAM_STARTS:
        _watched[0][1].append(f"started {args[1] if event == 'subprocess.Popen' else args[0]!r}"[:300])


sys.addaudithook(_watch_program_starts)

# h5py's import asks ``uname -p`` once per process (through ``platform``): done here, before any test is watched, so a
# fast test that happens to be the first to read an HDF5 file (a single file run alone) is not taken for one that
# starts a program
import h5py  # noqa: E402,F401


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_fuse: mounts with real FUSE (fails without FUSE when "
                                       "CKPTFS_REQUIRE_FUSE=1, else skipped); implies slow")
    config.addinivalue_line("markers", "slow: starts processes (the CLI, an S3 server, TensorFlow, a FUSE mount), "
                                       "conformance and property tests (deselect with -m 'not slow' for the fast "
                                       "subset; a test left out of slow that starts a program fails)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("needs_fuse") is not None or getattr(item.obj, "is_hypothesis_test", False):
            item.add_marker(slow)


@pytest.hookimpl(tryfirst=True)  # before its fixtures are set up: they count as the test's
def pytest_runtest_setup(item):
    if item.get_closest_marker("slow") is None:
        _watched[0] = (item.nodeid, [], "tensorflow" in sys.modules)
    if item.get_closest_marker("needs_fuse") is not None:
        why = fuse_unusable_reason()
        if why is not None:
            if REQUIRE_FUSE:
                pytest.fail(f"FUSE is required (CKPTFS_REQUIRE_FUSE=1) but not usable here: {why}", pytrace=False)
            pytest.skip(f"FUSE not usable here: {why}")


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test of the fast subset (not marked slow) that started a program or imported TensorFlow, in its setup
    (its fixtures) or its body, fails: it belongs to ``slow``. Teardowns are not watched: a module's fixtures end in
    the teardown of whichever of its tests a worker runs last, slow or not."""
    outcome = yield
    report = outcome.get_result()
    if _watched[0] is None or _watched[0][0] != item.nodeid or (call.when == "setup" and report.passed):
        return
    _, started, had_tf = _watched[0]
    _watched[0] = None
    if not had_tf and "tensorflow" in sys.modules:
        started.append("imported tensorflow")
    if started and report.passed:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} is in the fast subset (not marked slow) but "
                           + "; ".join(started[:3]) + (f" and {len(started) - 3} more" if len(started) > 3 else "")
                           + ": mark it slow (tests/conftest.py)")
