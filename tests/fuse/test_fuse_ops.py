"""The FUSE operations object without a mount: errno mapping, attributes, EIO logging, no public state."""
from __future__ import annotations

import errno
import logging
import os
import stat
import threading

import pytest

from ckptfs.fuse.operations import CkptfsOperations
from helpers.fuse import FAIL_FROM, FAILING, fake_tree


@pytest.fixture(scope="module")
def tree():
    return fake_tree()


@pytest.fixture
def ops(tree):
    return CkptfsOperations(tree, uid=1234, gid=5678)


def _errno(fn, *args):
    with pytest.raises(OSError) as e:
        fn(*args)
    return e.value.errno


def test_getattr_and_readdir(ops, tree):
    st = ops.getattr("/model.safetensors")
    a = tree.attr("model.safetensors")
    assert (st["st_size"], st["st_ino"], st["st_mode"], st["st_mtime"]) == (a.size, a.ino, a.mode, tree.mtime_ns)
    assert (st["st_uid"], st["st_gid"], st["st_blksize"]) == (1234, 5678, 1 << 20)
    assert stat.S_ISDIR(ops.getattr("/")["st_mode"])
    assert _errno(ops.getattr, "/nope") == errno.ENOENT
    names = [x if isinstance(x, str) else x[0] for x in ops.readdir("/", 0)]
    assert names == [".", ".."] + tree.listdir("")
    kinds = {x[0]: x[1]["st_mode"] for x in ops.readdir("/", 0) if not isinstance(x, str)}
    assert stat.S_ISDIR(kinds["tensors"]) and stat.S_ISREG(kinds["README.txt"])
    assert _errno(ops.readdir, "/README.txt", 0) == errno.ENOTDIR


def test_open_is_read_only(ops):
    assert _errno(ops.open, "/config.json", os.O_WRONLY) == errno.EROFS
    assert _errno(ops.open, "/config.json", os.O_RDWR) == errno.EROFS
    assert _errno(ops.open, "/missing", os.O_RDONLY) == errno.ENOENT
    assert _errno(ops.access, "/config.json", os.W_OK) == errno.EROFS
    assert ops.access("/config.json", os.R_OK) == 0


@pytest.mark.parametrize("name,args", [
    ("write", ("/config.json", b"x", 0, 0)), ("create", ("/new", 0o644)), ("mkdir", ("/d", 0o755)),
    ("mknod", ("/n", 0o644, 0)), ("unlink", ("/README.txt",)), ("rmdir", ("/hf",)), ("rename", ("/a", "/b")),
    ("truncate", ("/README.txt", 0)), ("chmod", ("/README.txt", 0o777)), ("chown", ("/README.txt", 0, 0)),
    ("symlink", ("/l", "x")), ("link", ("/l", "/README.txt")), ("setxattr", ("/README.txt", "user.a", b"1", 0)),
    ("removexattr", ("/README.txt", "user.a")), ("utimens", ("/README.txt", None)),
    ("fallocate", ("/README.txt", 0, 0, 10, 0)),
])
def test_every_write_operation_is_erofs(ops, name, args):
    assert _errno(getattr(ops, name), *args) == errno.EROFS


def test_read_by_handle_and_eio_logged_once_per_file(ops, tree, caplog):
    fh = ops.open("/model.safetensors", os.O_RDONLY)
    assert ops.read("/model.safetensors", 1 << 20, 12345, fh) == tree.read("model.safetensors", 12345, 1 << 20)
    assert ops.read("/model.safetensors", 10, 1 << 30, fh) == b""
    bad = ops.open("/" + FAILING, os.O_RDONLY)
    assert ops.read("/" + FAILING, 4096, 0, bad) == tree.read(FAILING, 0, 4096)
    with caplog.at_level(logging.INFO, logger="ckptfs.fuse"):
        for off in (FAIL_FROM, 0, FAIL_FROM + 4096):
            assert _errno(ops.read, "/" + FAILING, 2 * FAIL_FROM, off, bad) == errno.EIO
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(lines) == 1 and FAILING in lines[0] and "corrupt chunk" in lines[0] and "\n" not in lines[0]


def test_concurrent_reads_through_the_operations(ops, tree):
    path = "model.safetensors"
    fh = ops.open("/" + path, os.O_RDONLY)
    want = tree.read(path, 0, tree.attr(path).size)
    bad = []

    def worker(k):
        for i in range(200):
            off = (k * 7919 + i * 104729) % len(want)
            if ops.read("/" + path, 131072, off, fh) != want[off:off + 131072]:
                bad.append((k, off))

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not bad


def test_no_public_attribute_shadows_a_fuse_operation(ops):
    """mfusepy registers every public attribute named like a FUSE op; state must stay private."""
    public_data = {k for k, v in vars(ops).items() if not k.startswith("_")}
    assert public_data == set()


def test_statfs(ops, tree):
    s = ops.statfs("/")
    assert s["f_blocks"] * s["f_frsize"] >= tree.total_size and s["f_bavail"] == 0
    assert s["f_files"] == len(tree.all_paths()) + 1
