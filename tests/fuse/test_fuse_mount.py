"""The FUSE frontend on a real mount of synthetic views: listing, sizes, cp, mmap, concurrency, EROFS, EIO."""
from __future__ import annotations

import errno
import os
import subprocess

import numpy as np
import pytest

from helpers import needs_fuse, run_ckptfs
from helpers.fuse import FAIL_FROM, FAILING, FAKE, concurrent_random_reads, fake_tree, mounted_server

pytestmark = [needs_fuse, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    p = tmp_path_factory.mktemp("ck") / "fake.mdl"
    p.write_bytes(b"synthetic")
    os.utime(p, ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))
    return p


@pytest.fixture(scope="module")
def srv(ckpt):
    with mounted_server(ckpt, fake=FAKE) as s:
        yield s


@pytest.fixture(scope="module")
def tree(ckpt):
    return fake_tree(ckpt)


@pytest.fixture(scope="module")
def exported(ckpt, tree, tmp_path_factory):
    """Every readable file as written by ``ckptfs export`` (the reference bytes)."""
    d = tmp_path_factory.mktemp("exported")
    out = {}
    for path in tree.file_paths():
        if path == FAILING:
            continue
        dest = d / path.replace("/", "__")
        r = run_ckptfs("export", ckpt, path, dest, fake=FAKE, timeout=120)
        assert r.returncode == 0, r.stderr
        out[path] = dest.read_bytes()
    return out


def test_ls_lR_lists_every_file_with_exact_size_mode_and_mtime(srv, tree, ckpt):
    r = subprocess.run(["ls", "-lRn", "--time-style=+%s", str(srv.mnt)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    seen, cur = {}, None
    for line in r.stdout.splitlines():
        if line.endswith(":") and line.startswith(str(srv.mnt)):
            cur = line[len(str(srv.mnt)):-1].strip("/")
        elif line.startswith("-") or line.startswith("d"):
            mode, _n, _u, _g, size, mtime, name = line.split(None, 6)
            path = f"{cur}/{name}" if cur else name
            seen[path] = (mode, int(size), int(mtime))
    files = set(tree.file_paths())
    assert {p for p, (m, _, _) in seen.items() if m.startswith("-")} == files
    assert {p for p, (m, _, _) in seen.items() if m.startswith("d")} == set(tree.all_paths()) - files
    for p, (mode, size, mtime) in seen.items():
        assert mtime == int(ckpt.stat().st_mtime)
        if p in files:
            assert mode == "-r--r--r--" and size == tree.attr(p).size, p
        else:
            assert mode == "dr-xr-xr-x", p


def test_the_mount_reads_ahead_read_ahead_kb(srv):
    """The server raises its mount's kernel read-ahead (bdi ``read_ahead_kb``) to ``READ_AHEAD_KB`` when it may:
    a page fault of a memory-mapped file then reads that much around it (``from_pretrained`` maps the weights)."""
    from ckptfs.fuse.operations import READ_AHEAD_KB, mount_device, mount_target

    dev = mount_device(mount_target(srv.mnt))
    assert dev is not None
    ra = f"/sys/class/bdi/{dev}/read_ahead_kb"
    if os.geteuid() != 0:
        pytest.skip("only root may raise a mount's read-ahead (the server leaves it at the kernel's default)")
    with open(ra) as f:
        assert int(f.read()) == READ_AHEAD_KB > 128  # above the kernel default for FUSE (128 KiB)


def _fuse_requests(pid: int) -> int:
    """FUSE requests a server has taken so far: each is one read(2) of /dev/fuse (``syscr`` of the process)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("syscr:"))


def test_ls_lR_takes_attributes_from_the_listing_not_one_lookup_per_entry(ckpt, tree):
    """READDIRPLUS replies carry every entry's attributes (libfuse 3 passes them on only for entries filled with
    ``FUSE_FILL_DIR_PLUS`` and a position), so ``ls -lR`` of a fresh mount costs the server a fixed number of
    requests per directory (open, two listings, release) and none per entry; without them the kernel sends a LOOKUP
    for every entry. The sizes shown are the tree's (attributes from the listing are not placeholders)."""
    dirs = [p for p in tree.all_paths() if p not in set(tree.file_paths())]
    entries = len(tree.all_paths())
    assert entries - len(dirs) >= 2 * len(dirs)  # a LOOKUP per entry would be visible over the per-directory cost
    with mounted_server(ckpt, fake=FAKE) as s:
        before = _fuse_requests(s.proc.pid)
        r = subprocess.run(["ls", "-lRn", str(s.mnt)], capture_output=True, text=True, timeout=60)
        taken = _fuse_requests(s.proc.pid) - before
    assert r.returncode == 0, r.stderr
    sizes = {ln.split(None, 8)[8]: int(ln.split()[4]) for ln in r.stdout.splitlines() if ln.startswith("-")}
    assert sizes == {p.rsplit("/", 1)[-1]: tree.attr(p).size for p in tree.file_paths()}
    assert taken <= 4 * (len(dirs) + 1) + 4, (taken, len(dirs), entries)


def test_stat_is_exact_from_the_first_call_and_inodes_are_stable(srv, tree, ckpt):
    for p in tree.all_paths():
        st = os.stat(srv.mnt / p)
        a = tree.attr(p)
        assert (st.st_size, st.st_ino, st.st_mode, st.st_nlink) == (a.size, a.ino, a.mode, a.nlink), p
        assert st.st_mtime_ns == ckpt.stat().st_mtime_ns
        if not p.endswith("/") and st.st_size:
            assert st.st_blksize == 1 << 20
    assert sorted(os.listdir(srv.mnt)) == tree.listdir("/")


def test_cp_of_every_file_equals_export(srv, exported, tmp_path):
    for path, want in exported.items():
        dest = tmp_path / "copy"
        r = subprocess.run(["cp", str(srv.mnt / path), str(dest)], capture_output=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert dest.read_bytes() == want, path


def test_numpy_memmap_of_a_file_works(srv, exported):
    for path in ("model.safetensors", "tensors/model/layers/0/weight.npy", "one.bin"):
        m = np.memmap(srv.mnt / path, dtype=np.uint8, mode="r")
        assert m.tobytes() == exported[path]
        assert bytes(m[-3:]) == exported[path][-3:]
        del m


def test_eight_threads_reading_random_ranges_get_export_bytes(srv, exported):
    errors, counts = concurrent_random_reads(srv.mnt, exported, threads=8, seconds=4)
    assert not errors, errors[:5]
    assert all(c > 0 for c in counts)


@pytest.mark.parametrize("action", [
    "open_wronly", "open_rdwr", "create", "mkdir", "unlink", "rmdir", "rename", "chmod", "chown", "truncate",
    "symlink", "link", "setxattr", "utime",
])
def test_every_modification_fails_with_erofs(srv, action):
    m = srv.mnt
    f, d = m / "config.json", m / "tensors" / "model"
    ops = {
        "open_wronly": lambda: os.open(f, os.O_WRONLY),
        "open_rdwr": lambda: os.open(f, os.O_RDWR),
        "create": lambda: os.open(m / "new.txt", os.O_WRONLY | os.O_CREAT, 0o644),
        "mkdir": lambda: os.mkdir(m / "newdir"),
        "unlink": lambda: os.unlink(f),
        "rmdir": lambda: os.rmdir(m / "tensors" / "model" / "layers" / "0"),
        "rename": lambda: os.rename(f, m / "renamed.json"),
        "chmod": lambda: os.chmod(f, 0o666),
        "chown": lambda: os.chown(f, 1, 1),
        "truncate": lambda: os.truncate(f, 0),
        "symlink": lambda: os.symlink("x", d / "link"),
        "link": lambda: os.link(f, m / "hard"),
        "setxattr": lambda: os.setxattr(f, "user.x", b"1"),
        "utime": lambda: os.utime(f, (0, 0)),
    }
    with pytest.raises(OSError) as e:
        ops[action]()
    assert e.value.errno == errno.EROFS, e.value
    assert {"config.json", "empty.bin", "model.safetensors", "one.bin", "page.bin"} <= set(os.listdir(m))


def test_failing_file_gives_eio_other_files_work_and_one_log_line(srv, exported, tree):
    bad = srv.mnt / FAILING
    assert os.stat(bad).st_size == tree.attr(FAILING).size  # metadata is fine
    r = subprocess.run(["cat", str(bad)], capture_output=True, timeout=60)
    assert r.returncode != 0 and b"Input/output error" in r.stderr
    with open(bad, "rb", buffering=0) as fh:
        assert os.pread(fh.fileno(), 4096, 0) == tree.read(FAILING, 0, 4096)  # the readable part is correct
        got = os.pread(fh.fileno(), 8192, FAIL_FROM - 100)  # the kernel may return the pages before the bad one
        assert len(got) < 8192 and got == tree.read(FAILING, FAIL_FROM - 100, len(got))
        with pytest.raises(OSError) as e:
            os.pread(fh.fileno(), 8192, FAIL_FROM // 4096 * 4096)
        assert e.value.errno == errno.EIO
    for path, want in exported.items():
        assert (srv.mnt / path).read_bytes() == want, path
    lines = [ln for ln in srv.log().splitlines() if FAILING in ln]
    assert len(lines) == 1, srv.log()
    assert "corrupt chunk" in lines[0]
    assert srv.proc.poll() is None  # the server survived
