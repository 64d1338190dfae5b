"""The pieces of the S3 source that need no endpoint: locations, the checks of what ``__METADATA__`` says about an
object, and object names confined to the checkpoint's prefix."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptfs.dtypes import BFLOAT16, BY_NAME
from ckptfs.errors import CheckpointError
from ckptfs.readers.s3.layout import name_problem
from ckptfs.readers.s3.object_tensor import metadata_fingerprint, object_problem
from ckptfs.storage.locate import locate
from ckptfs.storage.s3url import S3Location, S3Settings, parse_s3_url, safe_endpoint

F32 = BY_NAME["float32"]


def test_locations():
    loc = parse_s3_url("s3://ckpts/run/model_dir/checkpoint_100.mdl/", S3Settings("http://127.0.0.1:9000"))
    assert (loc.bucket, loc.key, str(loc)) == ("ckpts", "run/model_dir/checkpoint_100.mdl",
                                               "s3://ckpts/run/model_dir/checkpoint_100.mdl")
    assert (loc.name, loc.stem, loc.suffix) == ("checkpoint_100.mdl", "checkpoint_100", ".mdl")
    assert loc.parent / "params.yaml" == S3Location("ckpts", "run/model_dir/params.yaml", loc.settings)
    assert loc.prefix == "run/model_dir/checkpoint_100.mdl/" and parse_s3_url("s3://ckpts").prefix == ""
    with pytest.raises(TypeError):  # never taken for a local path
        open(loc)
    with pytest.raises(CheckpointError, match="names no bucket"):
        locate("s3:///key")
    assert safe_endpoint("https://user:secret@minio.local:9000/x?token=abc") == "https://minio.local:9000/x"


def test_object_checks():
    md = {"__NUMPY__": {"shape": [4, 2], "dtype": "float32"}, "compressed": False, "data_sizes": [32],
          "boundaries": [32]}
    assert object_problem(md, (4, 2), F32, 32) is None
    assert "object holds 16 bytes" in object_problem(md, (4, 2), F32, 16)
    assert "not shape [4, 4]" in object_problem(md, (4, 4), F32, 32)
    assert "one part expected" in object_problem({**md, "data_sizes": [16, 16]}, (4, 2), F32, 32)
    assert "uncompressed, yet" in object_problem({**md, "boundaries": [20]}, (4, 2), F32, 20)
    assert object_problem({**md, "compressed": True, "boundaries": [20]}, (4, 2), F32, 20) is None
    bf16 = {"__NUMPY__": {"shape": [4], "dtype": "int16"}, "data_sizes": [8], "boundaries": [8]}
    assert object_problem(bf16, (4,), BFLOAT16, 8) is None  # bf16 is stored as int16
    assert metadata_fingerprint(md) == metadata_fingerprint(dict(reversed(list(md.items()))))
    assert metadata_fingerprint(md) != metadata_fingerprint({**md, "dtypes": ["torch.int32"]})


@pytest.mark.parametrize("name", ["../other/checkpoint_1.mdl/w", "a/./b", "a//b", "/abs", "x\n", ""])
def test_object_names_outside_the_prefix_are_refused(name):
    assert name_problem(name) is not None


def test_plain_object_names_are_read():
    assert name_problem("model.transformer_decoder.layers.0.norm1.weight") is None
    assert name_problem("optimizer.state.0.exp_avg.0") is None


def test_a_silent_endpoint_fails_within_the_bound_then_at_once(monkeypatch):
    """An endpoint that accepts connections and never answers: a request fails within ``worst_case_seconds()``
    (timeouts, bounded retries); for ``DOWN_SECONDS`` afterwards that object's requests fail at once, and once a
    second object got no answer either, every request does."""
    import socket
    import threading
    import time

    from ckptfs.errors import StorageError
    from ckptfs.storage import s3client

    monkeypatch.setattr(s3client, "CONNECT_TIMEOUT", 0.5)
    monkeypatch.setattr(s3client, "READ_TIMEOUT", 0.5)
    for k, v in {"AWS_ACCESS_KEY_ID": "AKIDSILENT0000000000", "AWS_SECRET_ACCESS_KEY": "silent-secret",
                 "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": "/nonexistent",
                 "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}.items():
        monkeypatch.setenv(k, v)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held = []
    stop = threading.Event()

    def accept():  # take every connection, answer nothing
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        client = s3client.S3Client(S3Settings(f"http://127.0.0.1:{listener.getsockname()[1]}"))
        start = time.monotonic()
        with pytest.raises(StorageError) as e:
            client.get("ckpts", "run/checkpoint_1.mdl", start=0, end=4096, etag='"x"')
        took = time.monotonic() - start
        assert e.value.kind == "timeout" and took <= s3client.worst_case_seconds(), (took, e.value)
        assert "silent-secret" not in str(e.value)
        start = time.monotonic()
        with pytest.raises(StorageError, match="not asked again"):
            client.get("ckpts", "run/checkpoint_1.mdl", start=4096, end=8192, etag='"x"')
        assert time.monotonic() - start < 0.5
        # one silent object is not a silent endpoint: another object is still asked for (and gets no answer)
        start = time.monotonic()
        with pytest.raises(StorageError) as e:
            client.head("ckpts", "run/checkpoint_2.mdl")
        assert e.value.kind == "timeout" and 0.5 <= time.monotonic() - start <= s3client.worst_case_seconds()
        start = time.monotonic()
        with pytest.raises(StorageError, match="not asked again"):  # two silent objects: the endpoint is down
            client.head("ckpts", "run/checkpoint_3.mdl")
        assert time.monotonic() - start < 0.5
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        listener.close()



@pytest.mark.slow  # starts an S3 server
def test_a_peek_reads_no_part_ahead_and_a_sequential_read_is_announced_by_its_reader(tmp_path, monkeypatch):
    """Against a local endpoint: a few large reads in order (the blocks a 4 KiB peek's read-ahead asks for) fetch
    only the part under them; reads continuing each other over whole parts fetch the parts they read, and the parts
    ahead once their reader announces them (``will_need``: a cursor's window), by groups."""
    import time

    from helpers.s3 import LocalS3

    from ckptfs.storage.s3client import S3Client
    from ckptfs.storage.s3object import FETCH_PARTS, PART_BYTES, PART_MIN, S3Object

    srv = LocalS3(tmp_path / "s3")
    try:
        for k, v in srv.env().items():
            monkeypatch.setenv(k, v)
        boto = srv.client()
        boto.create_bucket(Bucket="ahead")
        body = bytes(range(256)) * (5 * PART_BYTES // 256)
        blobs = {}
        for key in ("peek", "sequential"):  # two objects: nothing of one is in the part cache for the other
            boto.put_object(Bucket="ahead", Key=key, Body=body)
            etag = boto.head_object(Bucket="ahead", Key=key)["ETag"]
            blobs[key] = S3Object(S3Client(S3Settings(srv.url)), "ahead", key, len(body), etag)

        def read_in_order(blob: S3Object, step: int, end: int) -> None:
            for off in range(0, end, step):
                out = bytearray(step)
                blob.read_into(memoryview(out), off, step)
                assert bytes(out) == body[off:off + step]

        srv.reset()
        read_in_order(blobs["peek"], 2 * PART_MIN, 6 * PART_MIN)  # three blocks in order, inside the first part
        assert srv.counts()["GET"] == 1, srv.requests()
        srv.reset()
        read_in_order(blobs["sequential"], PART_BYTES // 4, PART_BYTES)  # a whole part in order
        blobs["sequential"].will_need(PART_BYTES, PART_BYTES)  # what its reader's cursor announces next
        deadline = time.monotonic() + 10
        while srv.counts()["GET"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        # part 0 read; parts 1 to 3 (the rest of its group of FETCH_PARTS) queued ahead, as one request
        assert [r.range for r in srv.requests()] == [f"bytes=0-{PART_BYTES - 1}",
                                                     f"bytes={PART_BYTES}-{FETCH_PARTS * PART_BYTES - 1}"]
    finally:
        srv.stop()


def _endpoint_blob(srv, monkeypatch, bucket: str, key: str, body: bytes, pool=None):
    """``body`` put as ``s3://bucket/key`` on the local endpoint ``srv``, as an ``S3Object`` reading through
    ``pool`` (None: its own)."""
    from ckptfs.storage.s3client import S3Client
    from ckptfs.storage.s3object import S3Object

    for k, v in srv.env().items():
        monkeypatch.setenv(k, v)
    boto = srv.client()
    if bucket not in [b["Name"] for b in boto.list_buckets()["Buckets"]]:
        boto.create_bucket(Bucket=bucket)
    boto.put_object(Bucket=bucket, Key=key, Body=body)
    etag = boto.head_object(Bucket=bucket, Key=key)["ETag"]
    return S3Object(S3Client(S3Settings(srv.url)), bucket, key, len(body), etag, pool=pool)


def _wait_for_parts(pool) -> None:
    """Until every part ``pool`` asked for has arrived."""
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with pool.lock:
            if all(fut.done() for fut, _ in pool.parts.values()):
                return
        time.sleep(0.02)


def _wait_for_gets(srv, n: int) -> list:
    import time

    deadline = time.monotonic() + 10
    while srv.counts()["GET"] < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return [r for r in srv.requests() if r.kind == "GET"]


def _small_parts(monkeypatch, keep: int, ahead: int) -> tuple:
    """Parts of 256 KiB (groups of 4, reads of 64 KiB or more through parts), ``keep`` parts kept after a read and
    ``ahead`` fetched ahead: ``(the part size, a fresh pool of those budgets)``."""
    from ckptfs.storage import s3object

    part = 256 << 10
    for name, value in (("PART_BYTES", part), ("PART_MIN", 64 << 10), ("FETCH_PARTS", 4),
                        ("PART_CACHE_BYTES", keep * part), ("AHEAD_BYTES", ahead * part)):
        monkeypatch.setattr(s3object, name, value)
    return part, s3object.PartPool()


@pytest.mark.slow  # starts an S3 server
def test_parts_asked_for_ahead_come_by_groups_and_stay_until_read(tmp_path, monkeypatch):
    """``will_need`` fetches aligned groups of ``FETCH_PARTS`` parts, one request each, no more than ``AHEAD_BYTES``
    at once; parts fetched ahead outlive other reads pushing the cache over its budget, so the read that comes for
    them asks for nothing again."""
    from helpers.s3 import LocalS3

    from ckptfs.storage import s3object

    part, pool = _small_parts(monkeypatch, 2, 8)
    srv = LocalS3(tmp_path / "s3")
    try:
        body = bytes(range(256)) * (12 * part // 256)
        blob = _endpoint_blob(srv, monkeypatch, "ahead", "grouped", body, pool)
        other = _endpoint_blob(srv, monkeypatch, "ahead", "other", body, pool)
        srv.reset()
        blob.will_need(part, 11 * part)  # parts 1-11: groups 0-2, at most 8 parts in flight ahead
        gets = _wait_for_gets(srv, 2)
        assert sorted((r.range for r in gets), key=len) == [f"bytes={part}-{4 * part - 1}",  # parts 1-3, 4-7
                                                            f"bytes={4 * part}-{8 * part - 1}"]
        out = bytearray(4 * part)
        other.read_into(memoryview(out), 0, len(out))  # 4 parts read: twice the budget of parts that were read
        assert bytes(out) == body[:4 * part]
        srv.reset()
        for off in range(part, 8 * part, part // 2):
            got = bytearray(part // 2)
            blob.read_into(memoryview(got), off, len(got))
            assert bytes(got) == body[off:off + len(got)]
        again = [r for r in srv.requests() if int(r.range.split("=")[1].split("-")[0]) < 8 * part]
        assert not again, again  # every part read was still there (parts 8 on may be read ahead meanwhile)
    finally:
        srv.stop()
        pool.close()


@pytest.mark.slow  # starts an S3 server
def test_a_small_read_of_a_part_in_flight_waits_for_it_instead_of_asking_again(tmp_path, monkeypatch):
    """An object announced ahead (one part, in flight) and then read a little, by one range and by ``read_spans``
    (whose small ranges otherwise go to the request threads): the read gets the part's bytes, one GET in all. Before,
    a read that came while the part was still in flight asked for its range again. An object smaller than
    ``PART_MIN`` is fetched whole by its first read, once, whatever reads follow."""
    import threading

    from helpers.s3 import LocalS3

    from ckptfs.storage import s3object

    part, pool = _small_parts(monkeypatch, 2, 8)
    srv = LocalS3(tmp_path / "s3")
    try:
        body = bytes(range(256)) * (part // 2 // 256)  # more than PART_MIN, inside one part
        for way in ("read_into", "read_spans"):
            blob = _endpoint_blob(srv, monkeypatch, "ahead", way, body, pool)
            release = threading.Event()
            real_get = blob._get

            def held_get(lo, hi, into=None, filled=None, real_get=real_get, release=release):
                release.wait(10)  # the announced request is slow: the read comes while it is in flight
                return real_get(lo, hi, into, filled)

            blob._get = held_get
            srv.reset()
            blob.will_need(0, len(body))
            threading.Timer(0.3, release.set).start()
            if way == "read_into":
                out = bytearray(100)
                blob.read_into(memoryview(out), 1000, 100)
                assert bytes(out) == body[1000:1100]
            else:
                buf, starts = blob.read_spans([(0, 10), (len(body) - 48, len(body))], bytearray)
                assert bytes(buf) == body[:10] + body[-48:] and starts == [0, 10]
            release.set()
            _wait_for_parts(pool)
            assert [r.range for r in srv.requests() if r.kind == "GET"] == [f"bytes=0-{len(body) - 1}"], way
        tiny = _endpoint_blob(srv, monkeypatch, "ahead", "norm", body[:2048], pool)
        srv.reset()
        for lo, hi in ((0, 10), (1000, 1100), (2000, 2048)):
            buf, _ = tiny.read_spans([(lo, hi)], bytearray)
            assert bytes(buf) == body[lo:hi]
        assert [r.range for r in srv.requests() if r.kind == "GET"] == ["bytes=0-2047"]
    finally:
        srv.stop()
        pool.close()


def _uploaded(srv, monkeypatch, tmp_path, mdl) -> str:
    """``mdl`` put on the local endpoint ``srv`` in Cerebras' S3 layout, the environment pointed at it (and at a cache
    directory of this test's own): its ``s3://`` URL."""
    from benchlib import s3 as bench_s3  # importable once generated_checkpoint has put scripts/ on the path

    for k, v in srv.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CKPTFS_CACHE_DIR", str(tmp_path / "cache"))
    bench_s3.upload(srv, mdl, "run/checkpoint_0.mdl")
    return f"s3://{bench_s3.BUCKET}/run/checkpoint_0.mdl"


@pytest.mark.slow  # starts an S3 server
def test_a_sequential_read_fetches_the_next_objects_ahead_and_no_byte_twice(tmp_path, monkeypatch):
    """Reading ``model.safetensors`` of a checkpoint in Cerebras' S3 layout in order, as the FUSE server serves it:
    while the first tensor is read, the objects of the tensors after it are already asked for (without that, every
    object's first part was waited for); the whole file equals the local checkpoint's, and no byte range of any
    object is asked for twice (parts fetched ahead are kept until read)."""
    import re
    import struct
    import sys
    import time

    from helpers.s3 import LocalS3

    import ckptfs
    from ckptfs.fuse import operations as fusefs
    from ckptfs.layouts.cursor import ReadCursor
    from ckptfs.storage import s3object

    from helpers.s3 import generated_checkpoint

    mdl, params = generated_checkpoint(tmp_path / "ck", ffn=2048)
    srv = LocalS3(tmp_path / "s3")
    try:
        url = _uploaded(srv, monkeypatch, tmp_path, mdl)
        local = ckptfs.open(mdl, config=str(params)).read("model.safetensors", 0, 1 << 40)
        tree = ckptfs.open(url, config=str(params))
        tree.cache.streaming, tree.cache.read_ahead = True, fusefs.SERVER_READ_AHEAD
        tree.cache.announce_ahead = fusefs.SERVER_ANNOUNCE_AHEAD
        (n,) = struct.unpack("<Q", local[:8])
        header = json.loads(local[8:8 + n])
        first = min((v["data_offsets"] for k, v in header.items() if k != "__metadata__"), key=lambda o: o[0])
        srv.reset()
        got = bytearray()
        cursor = ReadCursor()  # one stream, as an open handle reads it
        upto = 8 + n + first[1] + (1 << 20)  # the header, the first tensor and a MiB of the next: in file order
        for off in range(0, upto, 1 << 20):
            got += tree.read("model.safetensors", off, 1 << 20, cursor)
        reach = upto + (1 << 20) + fusefs.SERVER_READ_AHEAD  # what the server's own read-ahead may have read
        near = sum(1 for k, v in header.items() if k != "__metadata__" and 8 + n + v["data_offsets"][0] < reach)
        deadline = time.monotonic() + 10
        while len(objects := {r.path for r in srv.requests() if r.kind == "GET"}) <= near:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(objects) > near, (near, objects)  # objects of tensors further on, asked for ahead
        for off in range(len(got), len(local), 1 << 20):
            got += tree.read("model.safetensors", off, 1 << 20, cursor)
        assert bytes(got) == local
        asked: dict = {}
        for r in srv.requests():
            if r.kind == "GET" and r.range:
                lo, hi = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", r.range).groups())
                asked.setdefault(r.path, []).append((lo, hi))
        for path, ranges in asked.items():
            ranges.sort()
            assert all(a[1] < b[0] for a, b in zip(ranges, ranges[1:])), (path, ranges)
        tree.close()
    finally:
        srv.stop()


def test_only_a_stream_through_the_file_announces_what_follows():
    """A peek's read and the kernel's read-ahead after it (up to 2 MiB in order), and a loader reading each tensor
    whole in an order of its own, queue no storage fetches for the tensors after them in the file; reads in order past
    the server's read-ahead window and on into the next tensor do."""
    from array import array

    from ckptfs.tensor.cache import BlockCache
    from ckptfs.dtypes import BY_NAME
    from ckptfs.layouts.cursor import ReadCursor
    from ckptfs.layouts.pieces import PiecedFile, TensorRun
    from ckptfs.tensor.base import ArrayTensor

    announced = []

    class Noted(ArrayTensor):
        def will_need(self, start, stop, continuing=False):
            announced.append((self.name, start, stop))

    import numpy as np

    tensors = []
    for k in range(4):
        t = Noted(np.zeros(3 << 20, dtype=np.uint8), BY_NAME["uint8"])
        t.name = f"t{k}"
        tensors.append(t)
    cache = BlockCache(64 << 20)
    cache.streaming, cache.read_ahead, cache.announce_ahead = True, 4 << 20, 16 << 20
    run = TensorRun([t.name for t in tensors], tensors, array("q", [k * (3 << 20) for k in range(5)]))
    f = PiecedFile([run], name="weights", cache=cache)
    peek, loader, stream = ReadCursor(), ReadCursor(), ReadCursor()  # three handles
    f.readinto(100 << 10, memoryview(bytearray(4096)), peek)  # a peek, then the kernel's read-ahead in order
    for off in range((100 << 10) + 4096, (100 << 10) + (2 << 20), 256 << 10):
        f.readinto(off, memoryview(bytearray(256 << 10)), peek)
    assert announced == []
    for k in (2, 0, 3):  # a loader reading tensors whole in its own order: what follows in the file is not next
        for off in range(k * (3 << 20), (k + 1) * (3 << 20), 1 << 20):
            f.readinto(off, memoryview(bytearray(1 << 20)), loader)
    assert announced == []
    for off in range(0, 5 << 20, 1 << 20):  # a stream through the file
        f.readinto(off, memoryview(bytearray(1 << 20)), stream)
    assert {name for name, *_ in announced} >= {"t2", "t3"}


@pytest.mark.slow  # starts an S3 server
def test_a_tree_over_object_storage_keeps_its_parts_within_its_cache_size(tmp_path, monkeypatch):
    """``--cache-size`` bounds an S3 mount as it bounds a local one: the tree's block cache gets half of it, the parts
    fetched from the endpoint (read, or fetched ahead and not read yet) the other half, and a whole file read in
    order, with the server's announcements, never holds more parts than that; a local tree's block cache has it all."""
    import time

    import ckptfs
    from ckptfs.fuse import operations as fusefs
    from ckptfs.storage import s3object
    from ckptfs.tree.memory import REMOTE_SHARE
    from helpers.s3 import LocalS3, generated_checkpoint

    mdl, params = generated_checkpoint(tmp_path / "ck", ffn=2048)
    size = 16 << 20
    assert ckptfs.open(mdl, config=str(params), cache_size=size).cache.max_bytes == size
    monkeypatch.setattr(s3object, "PART_BYTES", 1 << 20)  # groups of 4 MiB: several fit in the ahead budget
    srv = LocalS3(tmp_path / "s3")
    try:
        tree = ckptfs.open(_uploaded(srv, monkeypatch, tmp_path, mdl), config=str(params), cache_size=size)
        pool = tree.parts
        parts = int(size * REMOTE_SHARE)
        assert tree.cache.max_bytes == size - parts
        assert (pool.keep_bytes, pool.ahead_limit) == (parts // 2, parts - parts // 2)
        tree.cache.streaming, tree.cache.read_ahead = True, fusefs.SERVER_READ_AHEAD
        tree.cache.announce_ahead = fusefs.SERVER_ANNOUNCE_AHEAD
        total, peak = tree.attr(tree.lookup("model.safetensors")).size, 0
        for off in range(0, total, 1 << 20):
            tree.read("model.safetensors", off, 1 << 20)
            with pool.lock:
                held = sum(size for fut, size in pool.parts.values() if fut.done())
            peak = max(peak, held)
        assert total > 4 * parts  # the file is larger than the parts' budget: it had to be kept to it
        assert 0 < peak <= parts, (peak, parts)
        tree.close()
    finally:
        srv.stop()


def test_parts_that_arrive_over_the_budget_are_dropped_when_they_arrive():
    """Parts still in flight cannot be dropped when more are asked for; the budget holds again once they arrive (a
    whole-file read under load held a few KiB of parts beyond it until the next part was asked for)."""
    import threading
    import time

    from ckptfs.storage.s3object import PartPool

    pool = PartPool(4000, "stream")  # parts reads used: 1000 bytes
    gate = threading.Event()

    def fetch(buffers, filled):
        gate.wait(10)
        for b in buffers:
            b[:] = b"x" * len(b)
        return sum(len(b) for b in buffers)

    try:
        futures = [pool.part(("object", i), fetch, 600) for i in range(3)]  # 1800 bytes, all in flight: none dropped
        with pool.lock:
            assert len(pool.parts) == 3
        gate.set()
        assert [len(f.result(10)) for f in futures] == [600] * 3
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with pool.lock:
                held = sum(size for fut, size in pool.parts.values() if fut.done())
            if held <= pool.keep_bytes:
                break
            time.sleep(0.01)
        assert held <= pool.keep_bytes == 1000, held
    finally:
        gate.set()
        pool.close()


@pytest.mark.slow  # starts an S3 server
def test_parts_fetched_ahead_hold_the_budget_until_read_and_reads_go_on_meanwhile(tmp_path, monkeypatch):
    """Parts fetched ahead and not read yet hold the ahead budget: announcements past it fetch nothing (the parts
    announced first, which the reader needs first, are never let go of for later ones), reads of other bytes still
    fetch what they need, and reads of the parts fetched ahead make room again."""
    from helpers.s3 import LocalS3

    part, pool = _small_parts(monkeypatch, 2, 4)
    srv = LocalS3(tmp_path / "s3")
    try:
        body = bytes(range(256)) * (16 * part // 256)
        blobs = [_endpoint_blob(srv, monkeypatch, "held", f"o{k}", body, pool) for k in range(3)]
        blobs[0].will_need(0, 4 * part)  # the whole ahead budget
        _wait_for_parts(pool)
        srv.reset()
        blobs[1].will_need(0, 4 * part)  # no room
        assert srv.counts()["GET"] == 0, srv.requests()
        out = bytearray(part)
        for i in range(4):  # reads elsewhere fetch their own parts
            off = 3 * i % 16 * part  # never the part after the last: no stream, nothing read ahead
            blobs[2].read_into(memoryview(out), off, part)
            assert bytes(out) == body[off:off + part]
        assert srv.counts()["GET"] == 4, srv.requests()
        for i in range(4):  # the parts fetched ahead, read: no request
            blobs[0].read_into(memoryview(out), i * part, part)
            assert bytes(out) == body[i * part:(i + 1) * part]
        assert srv.counts()["GET"] == 4
        srv.reset()
        blobs[1].will_need(0, 4 * part)  # room again
        assert [r.range for r in _wait_for_gets(srv, 1)] == [f"bytes=0-{4 * part - 1}"]
    finally:
        srv.stop()
        pool.close()


@pytest.mark.slow  # starts an S3 server
def test_an_object_fetches_nothing_ahead_by_itself(tmp_path, monkeypatch):
    """The object keeps no stream state: reads in order, part after part, fetch the parts they read and nothing
    after them (what comes next is the reader's cursor's to announce, ``will_need``)."""
    import time

    from helpers.s3 import LocalS3

    from ckptfs.storage import s3object

    part, pool = _small_parts(monkeypatch, 4, 8)
    srv = LocalS3(tmp_path / "s3")
    try:
        body = bytes(range(256)) * (16 * part // 256)
        blob = _endpoint_blob(srv, monkeypatch, "own", "ahead", body, pool)
        srv.reset()
        out = bytearray(part)
        for i in range(3):  # three parts in order: a sequential read
            blob.read_into(memoryview(out), i * part, part)
            assert bytes(out) == body[i * part:(i + 1) * part]
        time.sleep(0.3)  # a fetch ahead would have been sent by now
        gets = sorted(r.range for r in srv.requests() if r.kind == "GET")
        assert gets == sorted(f"bytes={i * part}-{(i + 1) * part - 1}" for i in range(3)), gets
    finally:
        srv.stop()
        pool.close()


@pytest.mark.slow  # starts an S3 server
def test_a_streams_own_continuation_is_fetched_while_announcements_pause(tmp_path, monkeypatch):
    """While fetching ahead is paused, announcements of other bytes (``will_need``) fetch nothing, but a reader's
    cursor announcing the continuation of the tensor its stream reads (``announced=False``) still has those parts
    fetched ahead (a loader reading a tensor whole after its first pass would otherwise wait for every part)."""
    from helpers.s3 import LocalS3

    from ckptfs.storage import s3object

    part, pool = _small_parts(monkeypatch, 4, 8)
    srv = LocalS3(tmp_path / "s3")
    try:
        body = bytes(range(256)) * (16 * part // 256)
        blob = _endpoint_blob(srv, monkeypatch, "own", "ahead", body, pool)
        pool.paused = 1 << 40
        srv.reset()
        blob.will_need(8 * part, 4 * part)
        assert srv.counts()["GET"] == 0, srv.requests()  # announced: paused
        out = bytearray(part)
        for i in range(2):  # two parts in order: a sequential read, its continuation announced by its cursor
            blob.read_into(memoryview(out), i * part, part)
            assert bytes(out) == body[i * part:(i + 1) * part]
        blob.will_need(2 * part, 2 * part, announced=False)
        gets = _wait_for_gets(srv, 3)
        assert f"bytes={2 * part}-{4 * part - 1}" in [r.range for r in gets], gets  # parts 2-3, fetched ahead
    finally:
        srv.stop()
        pool.close()


def test_a_client_follows_the_endpoint_the_environment_names(monkeypatch):
    """The process keeps one client per settings and ``AWS_*`` environment: the same environment gets the same
    client, a program that points ``AWS_ENDPOINT_URL`` at another endpoint between two opens gets a new one (the first
    one's endpoint may be gone: a test's server, a notebook's switch from staging to production)."""
    from ckptfs.storage.s3client import client_for

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    first = client_for(S3Settings())
    assert client_for(S3Settings()) is first
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:10")
    second = client_for(S3Settings())
    assert second is not first and client_for(S3Settings()) is second
    assert client_for(S3Settings(endpoint_url="http://127.0.0.1:9")) not in (first, second)
