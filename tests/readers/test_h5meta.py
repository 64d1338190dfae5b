"""Fetching HDF5 metadata ahead (``ckptfs.readers.cerebras.h5meta``): the ranges it finds are the ones HDF5 then
reads — every object header HDF5 reads when it opens a dataset, every chunk index node it reads when it lists the
chunks — for the fixtures Cerebras' tools wrote and for a dataset whose chunk index is several levels deep. And
whatever the bytes say, the walk stays bounded and never raises: a wrong range costs a request, never a value."""
from __future__ import annotations

import io
import random
from pathlib import Path

import h5py
import hdf5plugin
import numpy as np
import pytest

from ckptfs.readers.cerebras import h5meta

FIXTURES = Path(__file__).parent.parent / "fixtures"
MDL_FIXTURES = sorted(p for p in FIXTURES.glob("*/cs/*.mdl"))[:12]


class Recording(io.RawIOBase):
    """The bytes of a file as a Python file object for h5py, recording every read HDF5 makes."""

    def __init__(self, raw: bytes):
        super().__init__()
        self.raw, self.pos, self.reads = raw, 0, []

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=io.SEEK_SET):
        self.pos = offset if whence == io.SEEK_SET else (self.pos + offset if whence == io.SEEK_CUR
                                                         else len(self.raw) + offset)
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, b):
        n = max(0, min(len(b), len(self.raw) - self.pos))
        b[:n] = self.raw[self.pos:self.pos + n]
        self.reads.append((self.pos, self.pos + n))
        self.pos += n
        return n


def _walk(raw: bytes, addresses: list):
    """Run both walkers over ``raw``: (layouts, ranges fetched by the header walk, ranges fetched by the node walk,
    number of node rounds)."""
    header_ranges, node_rounds = [], []
    sizes = h5meta.superblock_sizes(raw[:64])

    def headers(spans):
        header_ranges.extend(spans)
        return [raw[a:b] for a, b in spans]

    def nodes(spans):
        node_rounds.append(list(spans))
        return [raw[a:b] for a, b in spans]

    layouts = h5meta.header_spans(addresses, headers, sizes, len(raw))
    roots = [r for r in (h5meta.chunk_index_root(b, sizes) for b in layouts.values() if b) if r]
    h5meta.chunk_index_spans(roots, nodes, sizes, len(raw), 64 << 20)
    return layouts, header_ranges, [s for r in node_rounds for s in r], len(node_rounds)


def _inside(read, ranges) -> bool:
    return any(a <= read[0] and read[1] <= b for a, b in ranges)


def _check_against_hdf5(path: Path):
    raw = path.read_bytes()
    rec = Recording(raw)
    f = h5py.File(rec, "r")
    try:
        addresses, names = [], []
        f.id.links.iterate(lambda n, i: (addresses.append(i.u), names.append(n)) and None, info=True)
        layouts, header_ranges, node_ranges, rounds = _walk(raw, addresses)
        chunked = 0
        for name, at in zip(names, addresses):
            rec.reads.clear()
            obj = f[name.decode()]
            opened = list(rec.reads)
            assert at in layouts, name
            missed = [r for r in opened if not _inside(r, header_ranges)]
            assert not missed, (name, missed)  # every header read HDF5 made was fetched ahead
            if isinstance(obj, h5py.Dataset) and obj.chunks is not None:
                chunked += 1
                rec.reads.clear()
                obj.id.chunk_iter(lambda _info: None)
                missed = [r for r in rec.reads if not _inside(r, node_ranges)]
                assert not missed, (name, missed)  # every node read HDF5 made was fetched ahead
        return chunked, rounds
    finally:
        f.close()


@pytest.mark.parametrize("path", MDL_FIXTURES, ids=lambda p: p.parent.parent.name)
def test_every_header_and_index_node_hdf5_reads_was_fetched_ahead(path):
    chunked, _ = _check_against_hdf5(path)
    assert chunked > 0


def test_a_deep_chunk_index_is_fetched_level_by_level(tmp_path):
    """4,096 chunks need a chunk index of three levels (64 children a node): every node HDF5 reads was fetched, one
    round per level for all the datasets together."""
    p = tmp_path / "deep.h5"
    with h5py.File(p, "w") as f:
        for k in range(3):
            d = f.create_dataset(f"t{k}", shape=(256, 256), dtype="<i2", chunks=(4, 4), **hdf5plugin.LZ4())
            d[...] = np.arange(256 * 256, dtype="<i2").reshape(256, 256) + k
    raw = p.read_bytes()
    sizes = h5meta.superblock_sizes(raw[:64])
    f = h5py.File(p, "r")
    levels = set()
    for k in range(3):
        at = f.id.links.get_info(f"t{k}".encode()).u
        layout = h5meta.header_spans([at], lambda spans: [raw[a:b] for a, b in spans], sizes, len(raw))[at]
        root = h5meta.chunk_index_root(layout, sizes)
        levels.add(h5meta.node_children(raw[root.address:root.address + 4096], sizes, root.dims)[0])
    f.close()
    assert levels == {2}
    chunked, rounds = _check_against_hdf5(p)
    assert chunked == 3 and rounds == 3


def test_the_node_walk_keeps_within_its_byte_budget(tmp_path):
    path = MDL_FIXTURES[0]
    raw = path.read_bytes()
    sizes = h5meta.superblock_sizes(raw[:64])
    with h5py.File(path, "r") as f:
        addresses = []
        f.id.links.iterate(lambda n, i: addresses.append(i.u) and None, info=True)
    layouts = h5meta.header_spans(addresses, lambda spans: [raw[a:b] for a, b in spans], sizes, len(raw))
    roots = [r for r in (h5meta.chunk_index_root(b, sizes) for b in layouts.values() if b) if r]
    one = h5meta.node_bytes(sizes, roots[0].dims)
    asked = []
    got = h5meta.chunk_index_spans(roots, lambda s: asked.extend(s) or [raw[a:b] for a, b in s], sizes, len(raw),
                                   2 * one)
    assert got == len(asked) <= 2


def _garbage_walks(raw: bytes, rng: random.Random):
    """The walkers over ``raw`` with bytes flipped at random: (fetch calls, bytes asked for)."""
    data = bytearray(raw)
    for _ in range(rng.randrange(1, 200)):
        data[rng.randrange(64, len(data))] = rng.randrange(256)
    data = bytes(data)
    calls, asked = [0], [0]

    def fetch(spans):
        calls[0] += 1
        asked[0] += sum(b - a for a, b in spans)
        return [data[a:b] for a, b in spans]

    sizes = h5meta.superblock_sizes(data[:64])
    addresses = list(range(0, len(data), max(1, len(data) // 50)))
    layouts = h5meta.header_spans(addresses, fetch, sizes, len(data))
    roots = [r for r in (h5meta.chunk_index_root(b, sizes) for b in layouts.values() if b) if r]
    h5meta.chunk_index_spans(roots, fetch, sizes, len(data), 1 << 20)
    return calls[0], asked[0]


def test_flipped_bytes_never_raise_and_stay_bounded():
    raw = MDL_FIXTURES[0].read_bytes()
    rng = random.Random(3)
    for _ in range(200):
        calls, asked = _garbage_walks(raw, rng)
        assert calls <= h5meta.MAX_HEADER_ROUNDS + h5meta.MAX_LEVELS + 1
        assert asked <= 51 * (h5meta.HEADER_GUESS + h5meta.HEADER_BEFORE) * (1 + h5meta.MAX_CONTINUATIONS) + (2 << 20)


def test_a_node_pointing_at_itself_is_fetched_once():
    sizes = h5meta.Sizes(8, 8)
    n = h5meta.node_bytes(sizes, 3)
    node = bytearray(n)
    node[:8] = b"TREE\x01\x01\x01\x00"  # a chunk index node of level 1 with one child...
    node[8 + 16 + 32:8 + 16 + 40] = (0).to_bytes(8, "little")  # ... itself, at address 0
    asked = []
    got = h5meta.chunk_index_spans([h5meta.ChunkIndexRoot(0, 3)], lambda s: asked.extend(s) or [bytes(node)], sizes,
                                   n, 1 << 20)
    assert got == 1 and len(asked) == 1


@pytest.mark.parametrize("blob", [b"", b"\x00" * 64, b"\x89HDF\r\n\x1a\n" + b"\xff" * 56, random.Random(1).randbytes(64)])
def test_what_is_not_a_superblock_says_none(blob):
    assert h5meta.superblock_sizes(blob) is None
