"""The storage contract: one set of tests every ``Blob`` passes (as zarr's ``StoreTests``), whatever holds its bytes —
a local file (opened at once, or on its first read as the region tensors open theirs: ``RegionFile``), an S3 object
over the real local endpoint, an S3 object over the in-memory endpoint (``faults.FakeS3``),
an in-memory blob, and a blob that delays every read (``faults.FaultyBlob``). A new backend adds one factory to
``BACKENDS``; what it must do is written here once.

Then the faults, without a server: errors, short reads and bodies, latency, and an object replaced mid-read, each met
the way the layers above rely on (an error naming the blob, ``ShortRead``, concurrency, ``SourceChangedError``; never
bytes of two versions).
"""
from __future__ import annotations

import os
import random
import threading
import time

import pytest

from ckptfs.errors import CkptfsError, SourceChangedError, StorageError
from ckptfs.storage.base import Blob, ShortRead
from ckptfs.storage.local import LocalFile
from ckptfs.storage.memory import MemoryBlob
from ckptfs.guard.confine import Confinement
from ckptfs.tensor.regions import RegionFile

from helpers.faults import FakeS3, FaultyBlob, s3_object

DATA = random.Random(7).randbytes(3 * (8 << 20) + 12345)  # more than three S3 parts: parts and merging are used
SECRET = "ckptfs-test-secret-never-printed"


class Opened:
    """A blob of a backend over ``data``, and how to store other bytes under its name (a writer replacing it)."""

    def __init__(self, blob: Blob, replace):
        self.blob, self.replace = blob, replace


def local(tmp_path, data) -> Opened:
    p = tmp_path / "blob.bin"
    p.write_bytes(data)

    def replace(new):
        q = tmp_path / "blob.new"
        q.write_bytes(new)
        os.replace(q, p)

    return Opened(LocalFile(str(p)), replace)


def region_file(tmp_path, data) -> Opened:
    """A local file as the region tensors read it: opened on the first read, confined, as a regular file only."""
    o = local(tmp_path, data)
    o.blob.close()
    return Opened(RegionFile(tmp_path / "blob.bin", Confinement.of(tmp_path / "blob.bin")), o.replace)


def memory(tmp_path, data) -> Opened:
    b = MemoryBlob(data, "memory:blob")
    return Opened(b, b.replace)


def fake_s3(tmp_path, data) -> Opened:
    fake = FakeS3({("b", "k/blob.bin"): data})
    return Opened(s3_object(fake, "b", "k/blob.bin"), lambda new: fake.objects.__setitem__(("b", "k/blob.bin"), new))


def delayed(tmp_path, data) -> Opened:
    inner = memory(tmp_path, data)
    return Opened(FaultyBlob(inner.blob, latency=0.001), inner.replace)


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    from helpers.s3 import LocalS3

    srv = LocalS3(tmp_path_factory.mktemp("s3"))
    yield srv
    srv.stop()


def real_s3(tmp_path, data, endpoint) -> Opened:
    from ckptfs.storage.s3client import S3Client
    from ckptfs.storage.s3object import S3Object
    from ckptfs.storage.s3url import S3Settings

    c = endpoint.client()
    try:
        c.create_bucket(Bucket="contract")
    except c.exceptions.BucketAlreadyOwnedByYou:
        pass
    key = f"{tmp_path.name}/blob.bin"
    c.put_object(Bucket="contract", Key=key, Body=data)
    for k, v in endpoint.env().items():
        os.environ[k] = v
    client = S3Client(S3Settings(endpoint_url=endpoint.url))
    info = client.head("contract", key)
    return Opened(S3Object(client, "contract", key, info.size, info.etag, info.mtime_ns),
                  lambda new: c.put_object(Bucket="contract", Key=key, Body=new))


BACKENDS = {"local": local, "region_file": region_file, "memory": memory, "fake_s3": fake_s3, "delayed": delayed, "s3": real_s3}


@pytest.fixture(params=[pytest.param(b, marks=pytest.mark.slow) if b == "s3" else b for b in sorted(BACKENDS)])  # s3: a server
def opened(request, tmp_path, monkeypatch):
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    make = BACKENDS[request.param]
    o = make(tmp_path, DATA, request.getfixturevalue("endpoint")) if request.param == "s3" else make(tmp_path, DATA)
    yield o
    o.blob.close()


def test_size_name_and_version(opened):
    b = opened.blob
    assert b.size == len(DATA)
    assert isinstance(b.name, str) and b.name and SECRET not in b.name
    assert b.current_version() == b.version


@pytest.mark.parametrize("offset,need", [(0, 1), (0, 4096), (1, 100_000), (5 << 20, 9 << 20), (len(DATA) - 10, 10)])
def test_read_into_gives_the_bytes(opened, offset, need):
    buf = bytearray(need)
    got, _ = opened.blob.read_into(memoryview(buf), offset, need)
    assert got == need and bytes(buf) == DATA[offset:offset + need]


def test_a_read_past_the_end_gives_what_there_is(opened):
    b = opened.blob
    buf = bytearray(100)
    got, _ = b.read_into(memoryview(buf), len(DATA) - 30, 30)
    assert got == 30 and bytes(buf[:30]) == DATA[-30:]
    assert b.read(len(DATA) - 30, 100) == DATA[-30:]
    assert b.read(len(DATA), 10) == b""


def test_read_spans_places_every_span(opened):
    spans = [(9 << 20, (9 << 20) + 5000), (0, 16), (100, 4196), (8 << 20, (8 << 20) + (1 << 20)), (17, 33),
             (len(DATA) - 7, len(DATA)), (3 << 20, (3 << 20) + (6 << 20))]
    buf, starts = opened.blob.read_spans(spans, bytearray)
    mv = memoryview(buf)
    assert len(starts) == len(spans)
    for (lo, end), at in zip(spans, starts):
        assert bytes(mv[at:at + end - lo]) == DATA[lo:end]


def test_read_packed_lays_the_spans_end_to_end(opened):
    spans = [(9 << 20, (9 << 20) + 5000), (0, 16), (100, 4196), (8 << 20, (8 << 20) + (1 << 20)), (17, 33),
             (len(DATA) - 7, len(DATA)), (3 << 20, (3 << 20) + (6 << 20))]
    out = bytearray(sum(end - lo for lo, end in spans))
    opened.blob.read_packed(spans, memoryview(out))
    assert bytes(out) == b"".join(DATA[lo:end] for lo, end in spans)


def test_read_packed_wants_room_for_exactly_the_spans(opened):
    with pytest.raises(ValueError):
        opened.blob.read_packed([(0, 10), (20, 30)], memoryview(bytearray(19)))


def test_read_packed_past_the_end_is_a_short_read(opened):
    with pytest.raises(ShortRead):
        opened.blob.read_packed([(0, 10), (len(DATA) - 5, len(DATA) + 5)], memoryview(bytearray(20)))


def test_read_scattered_places_every_span(opened):
    spans = [(k * 1_000_003, k * 1_000_003 + 256) for k in range(20)]
    buf, starts = opened.blob.read_scattered(spans, bytearray)
    for (lo, end), at in zip(spans, starts):
        assert bytes(memoryview(buf)[at:at + end - lo]) == DATA[lo:end]


@pytest.mark.parametrize("gap", [0, 16 << 10, None])
def test_read_scattered_with_a_gap_places_every_span(opened, gap):
    spans = [(k * 300_001, k * 300_001 + 2616) for k in range(30)] + [(5, 7), (6, 4000)]
    buf, starts = opened.blob.read_scattered(spans, bytearray, gap)
    for (lo, end), at in zip(spans, starts):
        assert bytes(memoryview(buf)[at:at + end - lo]) == DATA[lo:end]


def test_a_span_past_the_end_is_a_short_read(opened):
    with pytest.raises(ShortRead) as e:
        opened.blob.read_spans([(0, 10), (len(DATA) - 5, len(DATA) + 5)], bytearray)
    assert e.value.k == 1 and e.value.got == 5


def test_will_need_never_waits_nor_fails(opened):
    t0 = time.monotonic()
    opened.blob.will_need(0)
    opened.blob.will_need(len(DATA) - 100, 1 << 30)
    opened.blob.will_need(len(DATA) + 100, 10)
    assert time.monotonic() - t0 < 1.0
    assert opened.blob.read(0, 64) == DATA[:64]


def test_concurrent_reads_each_get_their_bytes(opened):
    errors = []

    def reader(seed):
        rnd = random.Random(seed)
        try:
            for _ in range(20):
                lo = rnd.randrange(0, len(DATA) - 1)
                n = rnd.choice([16, 4096, 70_000, 1 << 20])
                assert opened.blob.read(lo, n) == DATA[lo:lo + n]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_replaced_blob_reports_another_version(opened):
    b = opened.blob
    v = b.version
    opened.replace(DATA[::-1])
    try:
        now = b.current_version()
    except OSError:
        return  # gone counts as changed
    assert now != v


def test_close_can_be_called_twice(opened):
    opened.blob.close()
    opened.blob.close()


@pytest.mark.parametrize("make", [local, region_file])
def test_a_local_file_read_after_close_fails(tmp_path, make):
    o = make(tmp_path, DATA[:1000])
    o.blob.close()
    with pytest.raises((OSError, ValueError)):
        o.blob.read(0, 10)


def test_the_contract_covers_every_backend_module():
    """A new storage module (a backend) must be added to ``BACKENDS`` (or be one of the modules that are not
    backends): the contract is what makes it one."""
    from pathlib import Path

    import ckptfs.storage as pkg

    modules = {p.stem for p in Path(pkg.__file__).parent.glob("*.py")}
    not_blobs = {"__init__", "base", "etag", "locate", "partreads", "rangedfile", "s3client", "s3folder", "s3models",
                 "s3problems", "s3url"}
    blobs = {"local": "local", "memory": "memory", "s3object": "s3"}
    assert modules - not_blobs == set(blobs), modules - not_blobs - set(blobs)
    assert set(blobs.values()) <= set(BACKENDS)


# -- faults, without a server ---------------------------------------------------------------------------------------

def test_read_packed_is_right_when_a_backend_lays_the_spans_out_in_its_own_order():
    """A backend may ask for exactly the spans' bytes and lay them out in the blob's order, not the caller's: the
    default ``read_packed`` then rearranges them without overwriting what it still has to move."""
    class Sorted(MemoryBlob):
        def read_spans(self, spans, scratch, hint=True):
            order = sorted(range(len(spans)), key=lambda k: spans[k])
            buf, starts, at = scratch(sum(e - lo for lo, e in spans)), [0] * len(spans), 0
            for k in order:
                lo, end = spans[k]
                memoryview(buf)[at:at + end - lo] = DATA[lo:end]
                starts[k], at = at, at + end - lo
            return buf, starts

    spans = [(5000, 9000), (0, 3000), (20000, 20500), (100, 4100)]
    out = bytearray(sum(e - lo for lo, e in spans))
    Sorted(DATA).read_packed(spans, memoryview(out))
    assert bytes(out) == b"".join(DATA[lo:end] for lo, end in spans)


def test_a_failing_read_raises_and_the_next_one_works():
    b = FaultyBlob(MemoryBlob(DATA), fail_on={1})
    with pytest.raises(OSError):
        b.read(0, 10)
    assert b.read(0, 10) == DATA[:10]


def test_a_short_read_is_a_short_read_not_fewer_bytes():
    b = FaultyBlob(MemoryBlob(DATA), short_on={1})
    with pytest.raises(ShortRead):
        b.read_spans([(0, 1000)], bytearray)


def test_an_s3_body_cut_short_is_asked_for_again():
    fake = FakeS3({("b", "k"): DATA[:200_000]}, cut={2})
    o = s3_object(fake, "b", "k")  # request 1: HEAD
    assert o.read(1000, 50_000) == DATA[1000:51_000]
    assert fake.count("GetObject") == 2  # the cut answer, then the whole one


def test_an_s3_read_hands_out_each_buffer_once_whole_and_never_writes_it_again():
    """A ranged GET into a list of buffers says as soon as each one is whole; a body cut short is asked for again
    from the first buffer not whole, so a buffer already handed out (a part a reader may be copying) is not written
    again."""
    from helpers.faults import s3_client

    fake = FakeS3({("b", "k"): DATA[:4000]}, cut={1})  # the first answer ends after 2,000 bytes
    bufs = [bytearray(1000) for _ in range(4)]
    seen: list = []

    def filled(k):
        seen.append((k, bytes(bufs[k])))
        bufs[k][:] = b"X" * 1000  # whatever the holder does with it: the retry must not write it again

    got = s3_client(fake).get("b", "k", start=0, end=4000, into=bufs, on_filled=filled)
    assert got.count == 4000
    assert seen == [(k, DATA[k * 1000:(k + 1) * 1000]) for k in range(4)]
    assert all(bytes(b) == b"X" * 1000 for b in bufs)
    assert [kw["Range"] for op, kw in fake.requests if op == "GetObject"] == ["bytes=0-3999", "bytes=2000-3999"]


def test_a_part_of_a_group_is_read_as_soon_as_it_arrived():
    """The parts of one request ahead are each done as they arrive: a reader of the group's first part goes on while
    the others are on their way."""
    from ckptfs.storage.s3object import PartPool

    pool = PartPool(1 << 20)
    rest = threading.Event()

    def get(lo, hi, bufs, filled):
        bufs[0][:] = b"a" * len(bufs[0])
        filled(0)
        rest.wait(10)
        for b in bufs[1:]:
            b[:] = b"b" * len(b)
        return sum(len(b) for b in bufs)

    try:
        keys = [("o", k) for k in range(3)]
        assert pool.ahead(keys, [(k * 100, k * 100 + 100) for k in range(3)], get)
        with pool.lock:
            futures = [pool.parts[key][0] for key in keys]
        assert bytes(futures[0].result(10)) == b"a" * 100
        assert not futures[1].done() and not futures[2].done()
        rest.set()
        assert [bytes(f.result(10)) for f in futures[1:]] == [b"b" * 100] * 2
    finally:
        rest.set()
        pool.close()


def test_an_s3_body_always_cut_short_is_an_error_naming_the_object():
    fake = FakeS3({("b", "k"): DATA[:200_000]}, cut=set(range(2, 50)))
    o = s3_object(fake, "b", "k")
    with pytest.raises(StorageError) as e:
        o.read(1000, 50_000)
    assert "s3://b/k" in str(e.value)


def test_an_s3_object_replaced_mid_read_fails_instead_of_mixing_versions():
    new = bytes(len(DATA))
    fake = FakeS3({("b", "k"): DATA}, replace_after=(2, "b", "k", new))
    o = s3_object(fake, "b", "k")
    with pytest.raises(SourceChangedError):
        o.read_spans([(0, 100), (20 << 20, (20 << 20) + 100)], bytearray)


def test_an_endpoint_that_ignores_if_match_is_caught_by_the_etag():
    fake = FakeS3({("b", "k"): DATA[:100_000]}, ignore_if_match=True)
    o = s3_object(fake, "b", "k")
    fake.objects[("b", "k")] = bytes(100_000)
    with pytest.raises(SourceChangedError):
        o.read(0, 10_000)


def test_s3_errors_are_one_line_naming_the_object():
    for code in ("AccessDenied", "InternalError", "NoSuchKey"):
        fake = FakeS3({("b", "k"): DATA[:100_000]}, errors={n: code for n in range(2, 30)})
        o = s3_object(fake, "b", "k")
        with pytest.raises(CkptfsError) as e:
            o.read(0, 10_000)
        assert "s3://b/k" in str(e.value) and "\n" not in str(e.value), (code, str(e.value))


def test_parts_of_a_large_read_are_fetched_concurrently():
    """A read over three parts has their three requests in flight at once (each answered after 0.3 s)."""
    fake = FakeS3({("b", "k"): DATA})
    o = s3_object(fake, "b", "k")
    fake.latency = 0.3
    assert o.read(0, 3 * (8 << 20)) == DATA[:3 * (8 << 20)]
    assert fake.count("GetObject") >= 3 and fake.most_in_flight >= 3


def test_many_ranges_far_apart_keep_four_requests_in_flight_all_the_way():
    """Forty small ranges far apart (HDF5 metadata fetched ahead) are read four at a time from the first to the last
    (before: the first four together, then the other 36 one after another in the calling thread): nearly every request
    overlaps others, and an object never has more than four of its own in flight."""
    fake = FakeS3({("b", "k"): DATA})
    o = s3_object(fake, "b", "k")
    fake.latency = 0.02
    lives, real = [], fake.get_object

    def timed(**kw):
        t0 = time.monotonic()
        try:
            return real(**kw)
        finally:
            lives.append((t0, time.monotonic()))

    fake.get_object = timed
    spans = [(k * 600_000, k * 600_000 + 2000) for k in range(40)]
    buf, starts = o.read_scattered(spans, bytearray, 0)
    assert [bytes(memoryview(buf)[at:at + 2000]) for at in starts] == [DATA[a:b] for a, b in spans]
    assert len(lives) == 40
    overlapping = sum(any(a < e and b > s for k2, (a, b) in enumerate(lives) if k2 != k) for k, (s, e) in enumerate(lives))
    assert overlapping >= 36, overlapping
    assert fake.most_in_flight <= 4
