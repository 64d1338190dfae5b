"""The HDF5 skeleton built in a forked process (``Hdf5Layout.fork_build``, the mount server's cs view): the same
bytes as a build in the process, a failed child falls back to building here, an unused child is reaped, and no
fork happens once the process has another thread. Forks run in fresh interpreters (a pytest process has threads)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from helpers import read_all, real_env
from ckptfs.layouts.hdf5.layout import Hdf5Layout
from test_layout_hdf5 import _tree

TESTS = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # each test a Python process that forks


def _run(code: str) -> str:
    env = real_env()  # tests/ (the helpers) and the repository importable
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), env["PYTHONPATH"]])  # test_layout_hdf5
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=TESTS,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


PRELUDE = """
    import gc, os, threading
    from helpers import read_all
    from ckptfs.layouts.hdf5 import fork as hdf5_fork
    from ckptfs.layouts.hdf5.layout import Hdf5Layout
    from test_layout_hdf5 import _tree

    def reaped(pid):
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        return False

    assert threading.active_count() == 1
    want = read_all(Hdf5Layout(_tree()))
"""


def test_forked_build_gives_the_same_bytes_and_reaps_its_child():
    out = _run(PRELUDE + """
    lay = Hdf5Layout(_tree())
    assert lay.fork_build() and not lay.fork_build()  # one child per layout
    pid = lay.build_pid
    assert read_all(lay) == want and lay.build_pid is None and reaped(pid)
    print("ok")
    """)
    assert out.strip() == "ok"


def test_a_failed_child_falls_back_to_building_here():
    out = _run(PRELUDE + """
    import logging

    hdf5_fork.build_in_child = lambda *a: os._exit(3)  # what the forked child runs
    seen = []
    logging.getLogger("ckptfs.layouts.hdf5.layout").addHandler(
        type("Seen", (logging.Handler,), {"emit": lambda self, rec: seen.append(rec.getMessage())})())
    lay = Hdf5Layout(_tree())
    assert lay.fork_build()
    assert read_all(lay) == want
    assert any("build process failed" in m for m in seen), seen
    print("ok")
    """)
    assert out.strip() == "ok"


def test_an_unused_child_is_killed_and_reaped_with_its_layout():
    out = _run(PRELUDE + """
    lay = Hdf5Layout(_tree())
    assert lay.fork_build()
    pid = lay.build_pid
    del lay
    gc.collect()
    assert reaped(pid)
    print("ok")
    """)
    assert out.strip() == "ok"


def test_cs_view_of_a_forking_mount_has_the_same_bytes():
    out = _run("""
    import hashlib, os
    from helpers import read_all
    from helpers import FIXTURES
    from ckptfs.tree.assemble import build_tree
    from ckptfs.views.options import MountOptions

    def digest(fork):
        tree = build_tree(FIXTURES / "llama" / "cs" / "checkpoint.mdl", MountOptions(views=("cs", "hf")),
                          fork_builds=fork)
        try:
            pid = os.getpid()
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                forked = bool(f.read().split())  # the skeleton's build process (running, or exited, not reaped)
            return hashlib.sha256(read_all(tree.lookup("cs/checkpoint.mdl").file)).hexdigest(), forked
        finally:
            tree.close()

    assert digest(True) == (digest(False)[0], True)
    print("ok")
    """)
    assert out.strip() == "ok"


def test_no_fork_once_the_process_has_another_thread():
    stop = threading.Event()
    th = threading.Thread(target=stop.wait, daemon=True)
    th.start()
    try:
        lay = Hdf5Layout(_tree())
        assert lay.fork_build() is False and lay.build_pid is None
        assert read_all(lay) == read_all(Hdf5Layout(_tree()))
    finally:
        stop.set()
        th.join()
