"""Hostile buckets: what a bucket holds (or an endpoint sends) never makes ckptfs hold more memory than the bounds of
docs/security.md ("Bounds on S3 input"), on the command line (one line, exit 2) as in a mount (EIO for that file).

Against the moto endpoint the tests start (``s3help.LocalS3``); an endpoint that misbehaves (a body sent chunked,
without ``Content-Length``, far larger than anything ckptfs reads whole) is the fault-injecting proxy of
``s3fault.py`` in front of it. Memory is the ckptfs process's own peak RSS (``s3fault.peak_rss``), compared with the
same command over the genuine checkpoint.
"""
from __future__ import annotations

import errno
import json
import pickle
import struct
import sys
from pathlib import Path

import pytest

from helpers.s3fault import FaultProxy, peak_rss
from helpers.s3 import BUCKET, endpoint_with, upload_case

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # processes: the CLI, a server, TensorFlow

MiB = 1 << 20
#: how much more than over the genuine checkpoint a hostile one may make the process hold at its peak
SLACK = 160 * MiB


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    yield from endpoint_with(tmp_path_factory.mktemp("s3"), "s3_llama")


@pytest.fixture(scope="module")
def env(s3, tmp_path_factory):
    return s3.env(CKPTFS_CACHE_DIR=str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def baseline(s3, env, tmp_path_factory):
    """Peak RSS of ``ckptfs info`` over the genuine checkpoint."""
    r, peak = peak_rss(["info", f"s3://{BUCKET}/s3_llama/checkpoint_100.mdl"], env, tmp_path_factory.mktemp("rss"))
    assert r.returncode == 0, r.stderr
    return peak


def _copy(s3, name: str) -> str:
    """A copy of the genuine checkpoint at ``<name>/checkpoint_100.mdl``: its prefix."""
    upload_case(s3, "s3_llama", rename=("s3_llama/", f"{name}/"))
    return f"{name}/checkpoint_100.mdl/"


def _metadata(s3, prefix: str) -> dict:
    from ckptfs.guard.safepickle import loads_plain

    body = s3.client().get_object(Bucket=BUCKET, Key=prefix + "__METADATA__")["Body"].read()
    return loads_plain(body)


def _one_line(r, *expected: str) -> None:
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out, r.stderr
    for e in expected:
        assert e in lines[0], lines[0]


def _as_pickled_object(s3, prefix: str, key: str, body: bytes) -> None:
    """Make ``key`` of the checkpoint a zstd-compressed pickled object (``ObjectSerializer``) whose object holds
    ``body``."""
    meta = _metadata(s3, prefix)
    entry = json.loads(meta[key + ".__metadata__"])
    entry[key + ".__metadata__"] = {"__TYPE__": "ObjectSerializer", "compressed": True}
    meta[key + ".__metadata__"] = json.dumps(entry)
    client = s3.client()
    client.put_object(Bucket=BUCKET, Key=prefix + "__METADATA__", Body=pickle.dumps(meta, protocol=4))
    client.put_object(Bucket=BUCKET, Key=prefix + key, Body=body)


def _zstd_of_zeros(n: int) -> bytes:
    """A zstd frame of ``n`` zero bytes that states its content size (as ``cstorch`` writes them), made in pieces."""
    import zstandard

    c = zstandard.ZstdCompressor(level=1, write_content_size=True).compressobj(size=n)
    zeros = bytes(8 * MiB)
    out = [c.compress(zeros) for _ in range(n // len(zeros))]
    return b"".join(out) + c.flush()


def _frame_declaring(size: int) -> bytes:
    """A zstd frame whose header declares ``size`` bytes of content (single segment, 8-byte content size field)
    followed by one raw block of one byte."""
    return b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + struct.pack("<Q", size) + bytes([0x09, 0, 0]) + b"x"


LEAF = "model.lm_head.weight"


def test_zstd_bomb_object_declaring_2gib_is_refused_before_decompressing(s3, env, baseline, tmp_path):
    """A 64 KiB object whose frame states 2 GiB: decoded, ``max_output_size`` would be ignored (2 GiB of RSS)."""
    bomb = _zstd_of_zeros(2 << 30)
    assert len(bomb) < 256 << 10
    prefix = _copy(s3, "zbomb")
    _as_pickled_object(s3, prefix, LEAF, bomb)
    r, peak = peak_rss(["info", f"s3://{BUCKET}/{prefix}"], env, tmp_path)
    assert "Traceback" not in r.stderr, r.stderr
    assert peak - baseline < SLACK, (peak - baseline) / MiB
    assert "declares 2147483648 decompressed bytes" in r.stdout + r.stderr, r.stdout + r.stderr


def test_zstd_frame_declaring_2_to_the_40_is_one_line_not_memory_error(s3, env, tmp_path):
    prefix = _copy(s3, "zhuge")
    _as_pickled_object(s3, prefix, LEAF, _frame_declaring(1 << 40))
    r, _ = peak_rss(["info", f"s3://{BUCKET}/{prefix}"], env, tmp_path)
    assert "MemoryError" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.returncode in (0, 2), r.stderr
    assert f"declares {1 << 40} decompressed bytes" in r.stdout + r.stderr


def test_decompress_bounded_caps_what_a_frame_makes():
    import zstandard

    from ckptfs.guard.zstd_bound import ZstdRefused, decompress_bounded

    assert decompress_bounded(zstandard.ZstdCompressor().compress(b"abc" * 100), 300) == b"abc" * 100
    with pytest.raises(ZstdRefused, match="declares 301"):
        decompress_bounded(zstandard.ZstdCompressor().compress(b"a" * 301), 300)
    # a frame that does not state its size is cut at the cap as it decodes
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(b"a" * 10_000)
    with pytest.raises(ZstdRefused, match="more than the 300 bytes"):
        decompress_bounded(unsized, 300)
    with pytest.raises(ZstdRefused, match="not a zstd frame"):
        decompress_bounded(b"not zstd at all", 300)


def _nested_metadata(prefix_meta: dict) -> bytes:
    """The genuine ``__METADATA__`` plus an entry of 3,000,000 small lists (a pickle of ~10 MB)."""
    meta = dict(prefix_meta)
    meta["junk"] = [[] for _ in range(3_000_000)]
    return pickle.dumps(meta, protocol=4)


def test_metadata_of_millions_of_containers_is_refused_in_one_line(s3, env, baseline, tmp_path):
    prefix = _copy(s3, "nested")
    body = _nested_metadata(_metadata(s3, prefix))
    s3.client().put_object(Bucket=BUCKET, Key=prefix + "__METADATA__", Body=body)
    r, peak = peak_rss(["info", f"s3://{BUCKET}/{prefix}"], env, tmp_path)
    _one_line(r, f"s3://{BUCKET}/{prefix}__METADATA__: refused", "objects and items")
    assert peak - baseline < SLACK, (peak - baseline) / MiB


def test_metadata_nested_deeply_is_refused_in_one_line(s3, env, tmp_path):
    prefix = _copy(s3, "deep")
    meta = _metadata(s3, prefix)
    deep: list = []
    for _ in range(100):
        deep = [deep]
    meta["deep"] = deep
    s3.client().put_object(Bucket=BUCKET, Key=prefix + "__METADATA__", Body=pickle.dumps(meta, protocol=4))
    r, _ = peak_rss(["info", f"s3://{BUCKET}/{prefix}"], env, tmp_path)
    _one_line(r, "__METADATA__: refused", "deeper than 32")


def test_metadata_holding_a_120_mb_string_is_refused_in_one_line(s3, env, baseline, tmp_path):
    prefix = _copy(s3, "bigstr")
    meta = _metadata(s3, prefix)
    meta["huge"] = "x" * (120 * 1000 * 1000)
    s3.client().put_object(Bucket=BUCKET, Key=prefix + "__METADATA__", Body=pickle.dumps(meta, protocol=4))
    r, peak = peak_rss(["info", f"s3://{BUCKET}/{prefix}"], env, tmp_path)
    _one_line(r, "__METADATA__: refused", "a string of 120000000 bytes")
    # the body itself (120 MB) is read, within MAX_METADATA_BYTES; its string is not copied again
    assert peak - baseline < 120 * 1000 * 1000 + SLACK, (peak - baseline) / MiB


@pytest.fixture
def proxy(s3):
    p = FaultProxy(s3.url)
    yield p
    p.stop()


def test_a_chunked_gigabyte_for_metadata_is_refused_at_the_bound(s3, env, proxy, baseline, tmp_path):
    """An endpoint answering the ``__METADATA__`` GET with 1 GiB and no Content-Length: read only up to the bound."""
    from ckptfs.readers.s3.layout import MAX_METADATA_BYTES

    prefix = _copy(s3, "chunked")
    proxy.chunked[prefix + "__METADATA__"] = 1 << 30
    r, peak = peak_rss(["info", f"s3://{BUCKET}/{prefix}"], {**env, "AWS_ENDPOINT_URL": proxy.url}, tmp_path)
    _one_line(r, f"s3://{BUCKET}/{prefix}__METADATA__", f"more than {MAX_METADATA_BYTES} bytes")
    assert peak - baseline < MAX_METADATA_BYTES + SLACK, (peak - baseline) / MiB
    assert proxy.served[prefix + "__METADATA__"] < MAX_METADATA_BYTES + 64 * MiB


def test_a_chunked_gigabyte_for_params_is_refused_at_the_bound(s3, env, proxy, baseline, tmp_path):
    from ckptfs.readers.s3.params import MAX_BYTES

    prefix = _copy(s3, "chunkparams")
    s3.client().put_object(Bucket=BUCKET, Key="chunkparams/params.yaml", Body=b"model: {}\n")
    proxy.chunked["chunkparams/params.yaml"] = 1 << 30
    r, peak = peak_rss(["info", f"s3://{BUCKET}/{prefix}"], {**env, "AWS_ENDPOINT_URL": proxy.url}, tmp_path)
    assert "Traceback" not in r.stderr, r.stderr
    assert f"more than {MAX_BYTES} bytes" in r.stdout + r.stderr, r.stdout + r.stderr
    assert peak - baseline < MAX_BYTES + SLACK, (peak - baseline) / MiB
    assert proxy.served["chunkparams/params.yaml"] < MAX_BYTES + 64 * MiB


def test_a_whole_object_is_never_read_without_a_bound(s3, monkeypatch):
    from ckptfs.storage.s3client import S3Client
    from ckptfs.storage.s3url import S3Settings

    client = S3Client(S3Settings(s3.url))
    for k, v in s3.env().items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="only with a bound"):
        client.get(BUCKET, "s3_llama/checkpoint_100.mdl/__METADATA__")


def _superblock_eof(eof: int) -> bytes:
    """The llama fixture's ``.mdl`` with its (version 0) superblock's end-of-file address set to ``eof``."""
    from helpers import FIXTURES

    data = bytearray((FIXTURES / "llama" / "cs" / "checkpoint.mdl").read_bytes())
    assert data[8] == 0  # superblock version 0: the end-of-file address is at byte 40
    data[40:48] = struct.pack("<Q", eof)
    return bytes(data)


def test_mdl_object_whose_superblock_claims_2_to_the_60_bytes_is_one_line(s3, env, tmp_path):
    import subprocess

    body = _superblock_eof(1 << 60)
    s3.client().put_object(Bucket=BUCKET, Key="odd/checkpoint_1.mdl", Body=body)
    local = tmp_path / "checkpoint_1.mdl"
    local.write_bytes(body)
    for where, kind in ((f"s3://{BUCKET}/odd/checkpoint_1.mdl", "object"), (str(local), "file")):
        r = subprocess.run([sys.executable, "-m", "ckptfs", "info", where], env=env, capture_output=True, text=True,
                           timeout=120)
        _one_line(r, f"{where}: truncated or damaged HDF5 {kind}", f"holds {len(body)} bytes",
                  f"ends at {1 << 60}", "copy the whole checkpoint again")
        assert "eof =" not in r.stderr and "sblock" not in r.stderr and "Unable to" not in r.stderr, r.stderr
    # in a run, the same object is listed as not served, with the same reason
    r = subprocess.run([sys.executable, "-m", "ckptfs", "info", f"s3://{BUCKET}/odd/"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert "truncated or damaged HDF5 file" in r.stdout and "stored_eof" not in r.stdout, r.stdout + r.stderr


def test_hdf5_messages_become_what_was_found_and_what_works():
    from ckptfs.readers.cerebras.h5errors import open_problem

    assert open_problem(OSError("Unable to synchronously open file (bad superblock version number)"), "object") == (
        "damaged HDF5 object (HDF5: bad superblock version number); copy the whole checkpoint again from where it "
        "was saved (or save it again)")
    assert "not an HDF5 file" in open_problem("Unable to open file (file signature not found)")
    odd = open_problem("Unable to open file (something new)")
    assert odd.startswith("cannot be opened as an HDF5 file (HDF5: something new)") and "\n" not in odd


PASSWORD = "Hunter2-secret-PASSWORD-never-shown"


def _no_secret_in_server(pid: int, mnt, log_path) -> None:
    for what in ("cmdline", "environ"):
        raw = Path(f"/proc/{pid}/{what}").read_bytes()
        assert PASSWORD.encode() not in raw and b"user:" not in raw, (what, raw[:400])
    assert "mount" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    assert PASSWORD not in Path(log_path).read_text(errors="replace")
    assert PASSWORD not in (mnt / "README.txt").read_text()


@pytest.mark.needs_fuse
def test_endpoint_password_is_not_on_the_forked_servers_command_line(s3, env, tmp_path):
    """``--endpoint-url http://user:PASSWORD@host``: the background server (a fork of ``ckptfs mount``) shows
    neither in /proc/PID/cmdline nor in its environment, log or README.txt."""
    import re
    import subprocess

    url = s3.url.replace("http://", f"http://user:{PASSWORD}@")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    e = {k: v for k, v in env.items() if k != "AWS_ENDPOINT_URL"}
    r = subprocess.run([sys.executable, "-m", "ckptfs", "mount", f"s3://{BUCKET}/s3_llama/checkpoint_100.mdl",
                        str(mnt), "--endpoint-url", url, "--views", "tensors"], env=e, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    m = re.search(r"server pid (\d+); log: (.*?);", r.stdout)
    try:
        assert (mnt / "tensors" / "model" / "ln_f" / "weight.npy").read_bytes()  # it reads through that endpoint
        _no_secret_in_server(int(m.group(1)), mnt, m.group(2))
    finally:
        subprocess.run([sys.executable, "-m", "ckptfs", "umount", str(mnt)], env=e, capture_output=True, timeout=60)


@pytest.mark.needs_fuse
def test_endpoint_password_is_not_on_the_spawned_servers_command_line(s3, env, tmp_path, monkeypatch):
    """The same for a server started as a new process (the Python API from a program with threads): its options
    come through a pipe, not its command line."""
    from ckptfs.fuse.mount import start_background, unmount
    from ckptfs.views.options import MountOptions

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    url = s3.url.replace("http://", f"http://user:{PASSWORD}@")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    started = start_background(f"s3://{BUCKET}/s3_llama/checkpoint_100.mdl", mnt,
                               MountOptions(endpoint_url=url, views=("tensors",)), fork=False)
    try:
        assert (mnt / "tensors" / "model" / "ln_f" / "weight.npy").read_bytes()
        _no_secret_in_server(started.pid, mnt, started.log_path)
    finally:
        unmount(mnt)


@pytest.mark.needs_fuse
def test_a_1000_checkpoint_bucket_run_mounts_fast_and_ls_costs_a_listing(s3, env, tmp_path):
    """A run of 1,000 checkpoints in Cerebras' S3 layout: mounting costs a few listings and the newest checkpoint's
    HEAD, an ``ls -l`` of the mount a listing or two (no request per checkpoint), and a checkpoint's
    ``__METADATA__`` is fetched only when its folder is entered."""
    import os
    import re
    import subprocess
    import time

    n = 1000
    s3.put_many(BUCKET, [(f"big/checkpoint_{i}.mdl/__METADATA__", b"never read", {}) for i in range(1, n)
                         if i != 500])
    s3.put_many(BUCKET, [("big/checkpoint_500.mdl/model.w", b"\0" * 8, {})])  # a failed save: no __METADATA__
    upload_case(s3, "s3_llama", rename=("s3_llama/checkpoint_100.mdl/", f"big/checkpoint_{n}.mdl/"))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    s3.reset()
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "ckptfs", "mount", f"s3://{BUCKET}/big/", str(mnt)], env=env,
                       capture_output=True, text=True, timeout=300)
    took = time.monotonic() - start
    try:
        assert r.returncode == 0, r.stderr
        mounting = s3.counts()
        assert took < 10, (took, mounting)
        # the listings (whether it is a run, the background start's check, the mount's scan) and a HEAD of the
        # object named and of the newest checkpoint's __METADATA__: nothing per checkpoint
        assert mounting["LIST"] <= 6 and mounting["GET"] == 0 and mounting["HEAD"] <= 3, mounting

        s3.reset()
        names = os.listdir(mnt)
        assert len([x for x in names if x.startswith("checkpoint_")]) == n
        for x in names:
            os.lstat(mnt / x)
        assert os.readlink(mnt / "latest") == f"checkpoint_{n}"
        listing = s3.counts()
        assert listing["HEAD"] == 0 and listing["GET"] == 0 and listing["LIST"] <= 4, listing

        s3.reset()
        assert "tensors" in os.listdir(mnt / f"checkpoint_{n}")
        gets = [q.path for q in s3.requests() if q.kind == "GET"]
        assert f"/{BUCKET}/big/checkpoint_{n}.mdl/__METADATA__" in gets
        assert not [g for g in gets if g.endswith("__METADATA__") and f"checkpoint_{n}.mdl" not in g], gets

        # the failed save among the older ones is listed without a request, and fails when entered, with the reason
        with pytest.raises(OSError) as e:
            os.listdir(mnt / "checkpoint_500")
        assert e.value.errno == errno.EIO
        log = re.search(r"log: (.*?);", r.stdout).group(1)
        assert "checkpoint_500.mdl: no __METADATA__ object" in Path(log).read_text()
    finally:
        subprocess.run([sys.executable, "-m", "ckptfs", "umount", str(mnt)], env=env, capture_output=True, timeout=60)
