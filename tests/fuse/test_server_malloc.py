"""The mount server's malloc settings (``fuse.operations.pin_malloc``): a server of a checkpoint in object storage
serves on libfuse's threads, and pins one malloc arena before any thread starts, so the blocks those threads free are
reused instead of each thread's arena growing fresh memory (docs/measurements.md, "S3: scratch buffers of the FUSE
threads")."""
from __future__ import annotations

import subprocess
import sys

import pytest

from ckptfs.errors import CkptfsError
from ckptfs.fuse import mount as mount_mod
from ckptfs.fuse import operations
from helpers import slow

ARENAS = r"""
import ctypes, re, sys, threading
from ckptfs.fuse.operations import pin_malloc
assert pin_malloc(one_arena=sys.argv[1] == "1")
go = threading.Barrier(4)
keep = []
def work():
    go.wait()  # all four alive at once: each would take an arena of its own
    keep.append(bytearray(1 << 20))
    go.wait()
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
f = libc.fopen(sys.argv[2].encode(), b"w")
libc.malloc_info(0, f)
libc.fclose(f)
print(len(re.findall(r'<heap nr="', open(sys.argv[2]).read())))
"""


@slow
@pytest.mark.parametrize("one_arena, most", [(True, 1), (False, None)])
def test_one_arena_keeps_every_thread_in_it(one_arena, most, tmp_path):
    r = subprocess.run([sys.executable, "-c", ARENAS, "1" if one_arena else "0", str(tmp_path / "malloc_info.xml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    heaps = int(r.stdout.strip())
    if most is not None:
        assert heaps == most
    else:
        assert heaps > 1  # without it, the threads took arenas of their own


@pytest.mark.parametrize("ckpt, threads, one_arena", [("s3://bucket/run/checkpoint_0.mdl", None, True),
                                                     ("/data/run/checkpoint_0.mdl", None, False),
                                                     ("/data/run/checkpoint_0.mdl", "1", True)],
                         ids=["s3", "local", "local-threads-chosen"])
def test_the_server_pins_one_arena_for_object_storage_before_building(ckpt, threads, one_arena, tmp_path,
                                                                      monkeypatch):
    calls = []
    if threads is None:
        monkeypatch.delenv("CKPTFS_FUSE_THREADS", raising=False)
    else:
        monkeypatch.setenv("CKPTFS_FUSE_THREADS", threads)

    def build(*_a, **_k):
        calls.append("build")
        raise CkptfsError(ckpt, "stop here")

    monkeypatch.setattr(operations, "pin_malloc", lambda one_arena=False: calls.append(("pin", one_arena)) or True)
    monkeypatch.setattr(operations, "load_mfusepy", lambda: None)
    (tmp_path / "mnt").mkdir()
    with pytest.raises(CkptfsError, match="stop here"):
        mount_mod.mount(ckpt, tmp_path / "mnt", foreground=True, build=build)
    assert calls == [("pin", one_arena), "build"]
