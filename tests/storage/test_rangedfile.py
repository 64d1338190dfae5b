"""``RangedFile``: HDF5's file object over a blob. Ranges fetched ahead (``keep``) answer the reads inside them with
no request, ranges held already cost none, and what is kept stays within ``KEEP_BYTES``."""
from __future__ import annotations

import random

from ckptfs.storage import rangedfile
from ckptfs.storage.memory import MemoryBlob
from ckptfs.storage.rangedfile import RangedFile

from helpers.faults import FakeS3, FaultyBlob, s3_object

DATA = random.Random(11).randbytes(3 << 20)


class Counting(FaultyBlob):
    """A blob counting the reads that reach it."""

    def __init__(self, inner):
        super().__init__(inner)
        self.reads = 0

    def read_into(self, view, offset, need):
        self.reads += 1
        return super().read_into(view, offset, need)


def test_reads_inside_kept_ranges_cost_no_request():
    blob = Counting(MemoryBlob(DATA, "memory:k"))
    f = RangedFile(blob)
    spans = [(5000, 9000), (1 << 20, (1 << 20) + 2616), (len(DATA) - 100, len(DATA) + 50), (len(DATA) + 5, len(DATA) + 9)]
    got = f.keep(spans)
    assert got == [DATA[5000:9000], DATA[1 << 20:(1 << 20) + 2616], DATA[-100:], b""]
    fetched = blob.reads
    for lo, n in ((5000, 512), (8000, 1000), ((1 << 20) + 100, 2516), (len(DATA) - 60, 60)):
        f.seek(lo)
        assert f.read(n) == DATA[lo:lo + n]
    assert blob.reads == fetched
    f.seek(9000 - 10)  # crosses the end of a kept range: read as before
    assert f.read(20) == DATA[8990:9010]
    assert blob.reads > fetched


def test_a_range_held_already_is_not_fetched_again():
    blob = Counting(MemoryBlob(DATA, "memory:k"))
    f = RangedFile(blob)
    f.seek(70000)
    f.read(10)  # its 64 KiB block is held now
    before = blob.reads
    assert f.keep([(65536 + 10, 65536 + 3000), (70000, 70100)]) == [DATA[65546:68536], DATA[70000:70100]]
    assert f.keep([(65546, 68536)]) == [DATA[65546:68536]]
    assert blob.reads == before


def test_kept_ranges_stay_within_their_budget(monkeypatch):
    monkeypatch.setattr(rangedfile, "KEEP_BYTES", 10_000)
    blob = Counting(MemoryBlob(DATA, "memory:k"))
    f = RangedFile(blob)
    for k in range(10):
        f.keep([(k * 200_000, k * 200_000 + 4000)])
    assert sum(len(v) for v in f._kept.values()) <= 10_000
    before = blob.reads
    f.seek(9 * 200_000)
    f.read(100)  # the newest is kept
    assert blob.reads == before
    f.seek(0)
    f.read(100)  # the oldest was let go of
    assert blob.reads > before


def test_ranges_of_an_s3_object_are_fetched_together_not_merged_across_data():
    """Kept from an S3 object: one request per range far apart (data between two index nodes is not fetched), the
    requests in flight together."""
    fake = FakeS3({("b", "k"): DATA})
    f = RangedFile(s3_object(fake, "b", "k"))
    fake.latency = 0.05
    spans = [(k * 100_000, k * 100_000 + 2616) for k in range(20)]
    assert f.keep(spans) == [DATA[a:b] for a, b in spans]
    gets = [kw for op, kw in fake.requests if op == "GetObject"]
    assert len(gets) == 20
    assert fake.most_in_flight >= 4
