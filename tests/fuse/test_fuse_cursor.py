"""Two processes reading one file of a real mount at once: each open handle has its own prefetch cursor
(ckptfs.layouts.cursor), and whatever the two streams prepare ahead, each gets exactly the file's bytes."""
from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import needs_fuse, real_env
from helpers.fuse import mounted

pytestmark = [needs_fuse, pytest.mark.slow, pytest.mark.timeout(600)]

#: a reader in a process of its own: the file from ``start`` to its end then from 0 to ``start``, ``step`` bytes at a
#: time, written to ``out``
READER = """
import os, sys
path, out, start, step = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
size = os.path.getsize(path)
with open(path, "rb", buffering=0) as f, open(out, "wb") as w:
    w.truncate(size)
    for lo, hi in ((start, size), (0, start)):
        f.seek(lo)
        pos = lo
        while pos < hi:
            data = f.read(min(step, hi - pos))
            assert data, pos
            w.seek(pos)
            w.write(data)
            pos += len(data)
"""


def test_two_processes_reading_one_file_at_once_get_its_bytes(tmp_path):
    from ckptfs.tree.assemble import build_tree
    from helpers.s3 import generated_checkpoint

    mdl, _ = generated_checkpoint(tmp_path / "ck", ffn=2048)  # tens of MB: both streams reach their full windows
    tree = build_tree(mdl)
    try:
        name = "model.safetensors"
        want = tree.read(name, 0, 1 << 40)
    finally:
        tree.close()
    assert len(want) > 32 << 20
    with mounted(mdl, env=real_env()) as mnt:
        path = mnt / name
        # one reads from the start in 1 MiB reads, the other from the middle in 128 KiB reads (then wraps around):
        # two streams in one file at the same time
        procs = [subprocess.Popen([sys.executable, "-c", READER, str(path), str(tmp_path / f"out{k}"), str(start),
                                   str(step)]) for k, (start, step) in enumerate([(0, 1 << 20),
                                                                                  (len(want) // 2, 128 << 10)])]
        assert [p.wait(300) for p in procs] == [0, 0]
    for k in range(2):
        assert (tmp_path / f"out{k}").read_bytes() == want, k
