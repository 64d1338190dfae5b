"""A slow or hostile tensor does not stall the other files of a mount, through real mounts of a checkpoint in S3.

The endpoint is the tests' moto server behind a fault-injecting proxy (``stallproxy.py``) that never answers the GETs
of one object, as a stalled or hostile endpoint may: while a read of that tensor waits (up to the S3 client's
timeouts), ``README.txt``, ``stat``, ``ls`` and the other tensors answer within a second, the stalled read gets EIO,
and the mount keeps serving. A compressed object that declares 1 TiB of data over 32 MiB (zstd's RLE blocks: 4 bytes
stand for 128 KiB) is refused when the catalog is built: its file fails at once instead of decoding a terabyte for a
4 KiB read at its end.
"""
from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import TESTS, needs_fuse
from helpers.fuse import mounted_server
from helpers.s3 import BUCKET, LocalS3, upload_case

pytestmark = [needs_fuse, pytest.mark.timeout(300)]

#: what a request that needs no bytes of the stalled object may take (the acceptance bound)
PROMPT = 1.0
STALLED = "layers.1.ffn.ffn.0.linear_layer.weight"
STALLED_FILE = "tensors/model/transformer_decoder/layers/1/ffn/ffn/0/linear_layer/weight.npy"
OTHER_FILES = ["tensors/model/transformer_decoder/layers/0/ffn/ffn/0/linear_layer/weight.npy",
               "tensors/model/transformer_decoder/layers/0/self_attn/proj_q_dense_layer/weight.npy"]
LATER_FILE = "tensors/model/transformer_decoder/layers/1/self_attn/proj_k_dense_layer/weight.npy"


class StallProxy:
    """``stallproxy.py`` in a process of its own, in front of ``upstream``."""

    def __init__(self, upstream: str, tmp: Path):
        port_file = tmp / "proxy-port"
        self.proc = subprocess.Popen([sys.executable, str(TESTS / "helpers" / "stall_proxy.py"), upstream,
                                      str(port_file)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, "the proxy did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"

    def _call(self, path: str, data: bytes | None = None) -> bytes:
        req = urllib.request.Request(self.url + path, data=data, method="POST" if data is not None else "GET")
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read()

    def stall(self, *substrings: str) -> None:
        self._call("/__stall__", json.dumps(list(substrings)).encode())

    def held(self) -> int:
        return int(self._call("/__stalled__"))

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    srv = LocalS3(tmp_path_factory.mktemp("s3"))
    upload_case(srv, "s3_llama")
    upload_case(srv, "s3_llama_zstd")
    yield srv
    srv.stop()


def _timed(what: str, fn, took: dict):
    t = time.monotonic()
    out = fn()
    took[what] = time.monotonic() - t
    return out


def test_a_silent_object_does_not_stall_the_other_files(s3, tmp_path):
    proxy = StallProxy(s3.url, tmp_path)
    try:
        env = s3.env(AWS_ENDPOINT_URL=proxy.url, CKPTFS_CACHE_DIR=str(tmp_path / "cache"))
        with mounted_server("s3://ckpts/s3_llama/checkpoint_100.mdl", "--views", "hf,tensors", env=env) as srv:
            mnt = srv.mnt
            proxy.stall(STALLED)
            result: dict = {}

            def stalled_read():
                t = time.monotonic()
                try:
                    with open(mnt / STALLED_FILE, "rb") as f:
                        result["data"] = f.read()
                except OSError as e:
                    result["errno"] = e.errno
                result["took"] = time.monotonic() - t

            th = threading.Thread(target=stalled_read, daemon=True)
            th.start()
            deadline = time.monotonic() + 20
            while proxy.held() == 0:  # the read is waiting at the endpoint
                assert time.monotonic() < deadline and th.is_alive(), result
                time.sleep(0.05)
            took: dict = {}
            # every one of these is the kernel's first sight of the entry or its pages: each reaches the server
            readme = _timed("cat README.txt", lambda: (mnt / "README.txt").read_text(), took)
            _timed("stat", lambda: os.stat(mnt / "config.json"), took)
            listed = _timed("ls", lambda: sorted(os.listdir(mnt / "tensors/model/transformer_decoder/layers/1")),
                            took)
            config = _timed("read config.json", lambda: json.loads((mnt / "config.json").read_text()), took)
            others = {p: _timed(f"read {p}", lambda p=p: (mnt / p).read_bytes(), took) for p in OTHER_FILES}
            assert all(t < PROMPT for t in took.values()), took
            assert th.is_alive() and "took" not in result, "the stalled read did not wait"
            assert "s3://ckpts/s3_llama/checkpoint_100.mdl" in readme and "self_attn" in listed
            assert config["model_type"] == "llama"
            assert all(d.startswith(b"\x93NUMPY") and len(d) > 1000 for d in others.values())

            th.join(120)  # the S3 client's timeouts, then EIO for this read only
            assert not th.is_alive() and result.get("errno") == errno.EIO, result
            # the mount keeps serving: a tensor not read before is fetched (one silent object is not a dead
            # endpoint), and the silent one fails at once now
            t = time.monotonic()
            assert (mnt / LATER_FILE).read_bytes().startswith(b"\x93NUMPY")
            assert time.monotonic() - t < PROMPT
            t = time.monotonic()
            with pytest.raises(OSError) as e:
                (mnt / STALLED_FILE).read_bytes()
            assert e.value.errno == errno.EIO and time.monotonic() - t < PROMPT
            assert "read error in /" + STALLED_FILE in srv.log()
    finally:
        proxy.stop()


def rle_zstd_frame(nbytes: int) -> bytes:
    """A zstd frame of ``nbytes`` zeros made of RLE blocks (4 bytes for each 128 KiB: what a constant tensor
    compresses to), built directly: compressing a terabyte to make it would take minutes."""
    block = 128 << 10
    assert nbytes % block == 0
    header = b"\x28\xb5\x2f\xfd" + bytes([0x00, 0x38])  # magic; no content size, no checksum; a 128 KiB window
    rle = (block << 3 | 1 << 1).to_bytes(3, "little") + b"\0"
    last = (block << 3 | 1 << 1 | 1).to_bytes(3, "little") + b"\0"
    return header + rle * (nbytes // block - 1) + last


def test_rle_zstd_frame_is_what_zstd_decodes():
    import zstandard

    assert zstandard.ZstdDecompressor().stream_reader(rle_zstd_frame(4 << 17)).read(1 << 20) == bytes(4 << 17)


def test_a_tensor_declared_1_tib_over_a_32_mib_object_fails_at_once(s3, tmp_path, monkeypatch):
    tib = 1 << 40
    key = "model.transformer_decoder.layers.1.ffn.ffn.0.linear_layer.weight"
    prefix = "bomb/checkpoint_100.mdl/"
    upload_case(s3, "s3_llama_zstd", rename=("s3_llama_zstd/", "bomb/"))
    client = s3.client()
    body = rle_zstd_frame(tib)
    assert len(body) < (32 << 20) + 16
    meta = pickle.loads(client.get_object(Bucket=BUCKET, Key=prefix + "__METADATA__")["Body"].read())
    entry = json.loads(meta[key + ".__metadata__"])
    md = entry[key + ".__metadata__"]
    shape = [1 << 19, 1 << 19]  # float32: 1 TiB
    md.update(shapes=[shape], data_sizes=[tib], boundaries=[len(body)], compressed=True)
    md["__NUMPY__"]["shape"] = shape
    meta[key + ".__metadata__"] = json.dumps(entry)
    client.put_object(Bucket=BUCKET, Key=prefix + key, Body=body, Metadata={"metadata": json.dumps(md)})
    client.put_object(Bucket=BUCKET, Key=prefix + "__METADATA__", Body=pickle.dumps(meta, protocol=4))

    env = s3.env(CKPTFS_CACHE_DIR=str(tmp_path / "cache"))
    with mounted_server("s3://ckpts/bomb/checkpoint_100.mdl", "--views", "tensors", env=env) as srv:
        mnt = srv.mnt
        result: dict = {}

        def read_the_end():
            t = time.monotonic()
            try:
                with open(mnt / STALLED_FILE, "rb") as f:
                    f.seek(tib - 4096 + 128)
                    result["data"] = f.read(4096)
            except OSError as e:
                result["errno"] = e.errno
            result["took"] = time.monotonic() - t

        th = threading.Thread(target=read_the_end, daemon=True)
        th.start()
        t = time.monotonic()
        assert (mnt / OTHER_FILES[0]).read_bytes().startswith(b"\x93NUMPY")  # meanwhile, the others answer
        assert "s3://ckpts/bomb/checkpoint_100.mdl" in (mnt / "README.txt").read_text()
        assert time.monotonic() - t < PROMPT
        th.join(30)
        assert not th.is_alive(), "a 4 KiB read of the 1 TiB tensor still runs after 30 s"
        assert result.get("errno") in (errno.EIO, errno.ENOENT) and result["took"] < 5, result
        assert (mnt / OTHER_FILES[1]).read_bytes().startswith(b"\x93NUMPY")

    # why: the catalog refuses the tensor with a reason (the file is left out of the views)
    from ckptfs.readers import open_checkpoint
    from ckptfs.catalog.model import UnreadableLeaf
    from ckptfs.storage.s3url import S3Settings, parse_s3_url

    for k, v in env.items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    ck = open_checkpoint(parse_s3_url("s3://ckpts/bomb/checkpoint_100.mdl", S3Settings(s3.url)))
    try:
        leaf = ck.leaves[key]
        assert isinstance(leaf, UnreadableLeaf) and "more than 1024× its size" in leaf.reason, leaf
    finally:
        ck.close()


def test_a_silent_object_leaves_request_threads_to_the_others(s3, tmp_path, monkeypatch):
    """Many reads of one silent object at once (a loader's threads, the read-ahead) take at most
    ``MAX_IN_FLIGHT_PER_OBJECT`` request threads: a read of another object is answered meanwhile."""
    from ckptfs.storage import s3client, s3object
    from ckptfs.storage.s3url import S3Settings

    monkeypatch.setattr(s3client, "READ_TIMEOUT", 2.0)
    monkeypatch.setattr(s3object, "PART_BYTES", 1 << 20)
    for k, v in s3.env().items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    client = s3.client()
    parts = 2 * s3object.MAX_IN_FLIGHT
    client.put_object(Bucket=BUCKET, Key="slow/object", Body=bytes(parts << 20))
    client.put_object(Bucket=BUCKET, Key="fast/object", Body=b"x" * (1 << 20))
    proxy = StallProxy(s3.url, tmp_path)
    try:
        proxy.stall("slow/object")
        c = s3client.S3Client(S3Settings(proxy.url))
        pool = s3object.PartPool()  # one tree's pool, its request threads shared by the two objects
        slow, fast = (s3object.S3Object(c, BUCKET, k, i.size, i.etag, pool=pool)
                      for k, i in ((k, c.head(BUCKET, k)) for k in ("slow/object", "fast/object")))
        errors: list = []

        def read_part(i):
            try:
                slow.read(i << 20, 1 << 20)
            except Exception as e:  # noqa: BLE001 - expected: the object does not answer
                errors.append(e)

        readers = [threading.Thread(target=read_part, args=(i,), daemon=True) for i in range(parts)]
        for th in readers:
            th.start()
        deadline = time.monotonic() + 20
        while proxy.held() < s3object.MAX_IN_FLIGHT_PER_OBJECT:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)
        assert proxy.held() == s3object.MAX_IN_FLIGHT_PER_OBJECT  # the others wait without a thread
        t = time.monotonic()
        assert fast.read(0, 1 << 20) == b"x" * (1 << 20)
        assert time.monotonic() - t < PROMPT
        for th in readers:
            th.join(120)
        assert not any(th.is_alive() for th in readers) and len(errors) == parts
        pool.close()
    finally:
        proxy.stop()


def test_compressed_blocks_read_out_of_order_decode_the_frame_once(s3, monkeypatch):
    """The multi-threaded loop's threads finish a stream's reads out of order: a compressed tensor serves a block
    just behind its stream from the bytes it decoded last, instead of decoding the frame again from its front."""
    import numpy as np
    import zstandard

    from ckptfs.dtypes import from_numpy
    from ckptfs.readers.s3 import object_tensor as s3tensor
    from ckptfs.storage import s3object
    from ckptfs.storage.s3client import S3Client
    from ckptfs.storage.s3url import S3Settings

    for k, v in s3.env().items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    data = np.random.default_rng(0).standard_normal((4096, 1024)).astype(np.float32)  # 16 MiB
    body = zstandard.ZstdCompressor(level=1).compress(data.tobytes())
    s3.client().put_object(Bucket=BUCKET, Key="zstd/object", Body=body)
    c = S3Client(S3Settings(s3.url))
    info = c.head(BUCKET, "zstd/object")
    blob = s3object.S3Object(c, BUCKET, "zstd/object", info.size, info.etag)
    starts = []

    class Counted(s3tensor._Stream):
        def __init__(self, *a):
            starts.append(1)
            super().__init__(*a)

    monkeypatch.setattr(s3tensor, "_Stream", Counted)
    t = s3tensor.S3ObjectTensor(blob, "k", "s3://ckpts/zstd", data.shape, from_numpy("float32"), compressed=True)
    rows = list(range(0, 4096, 512))  # 2 MiB blocks, each pair read second one first
    for k in range(0, len(rows), 2):
        for r in (rows[k + 1], rows[k]):
            assert np.array_equal(t.read(((r, r + 512), (0, 1024))), data[r:r + 512]), r
    assert len(starts) == 1
    assert np.array_equal(t.read(((0, 8), (0, 1024))), data[:8]) and len(starts) == 2  # far behind: from the front
