"""Exact CRCs of TorchZipLayout: streamed once, hashed on demand once, persisted in CrcStore, thread-safe."""
from __future__ import annotations

import os
import math
import threading
import zipfile
import io
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfs.tensor.cache import BlockCache
from ckptfs.dtypes import BY_NAME, UINT8
from ckptfs.tensor.base import BLOCK_BYTES, VirtualTensor, box_shape
from ckptfs.layouts.torchzip.crc_store import CrcStore, crc32, default_crc_dir
from ckptfs.layouts.torchzip.layout import TorchZipLayout
from helpers import read_all


class Pattern(VirtualTensor):
    """Byte i is (7*i + seed) % 251; counts elements read (to see every byte is produced once)."""

    def __init__(self, shape, dtype, seed=0):
        super().__init__(shape, dtype)
        self.seed = seed
        self.elems = 0

    def read(self, box):
        shape = box_shape(box)
        self.elems += math.prod(shape)
        strides = [math.prod(self.shape[d + 1:]) for d in range(self.ndim)]
        idx = np.zeros(shape, np.int64)
        for d, (a, b) in enumerate(box):
            idx = idx + (np.arange(a, b, dtype=np.int64) * strides[d]).reshape([-1 if i == d else 1 for i in range(len(box))])
        byte_idx = idx[..., None] * self.dtype.itemsize + np.arange(self.dtype.itemsize)
        return ((byte_idx * 7 + self.seed) % 251).astype(np.uint8).view(self.dtype.storage).reshape(shape)

    def describe(self):
        return f"pattern{self.seed}{list(self.shape)}"


def make_obj():
    """Tensors spanning several cache blocks, a tie, an empty one, small ones."""
    a = Pattern((9 << 20,), UINT8, 1)  # 9 MiB: three 4 MiB blocks
    return OrderedDict([
        ("a", a),
        ("b", Pattern((1000, 1300), BY_NAME["float32"], 2)),  # 5.2 MB, blocks of whole rows
        ("e", Pattern((0, 8), BY_NAME["float16"], 3)),
        ("s", Pattern((), BY_NAME["int64"], 4)),
        ("a.tied", a),
        ("c", Pattern((37,), BY_NAME["bfloat16"], 5)),
    ])


def storages(obj):
    out = []
    for t in obj.values():
        if all(t is not u for u in out):
            out.append(t)
    return out


@pytest.fixture
def one_block_cache():
    """A cache that holds one block, so a second pass over a tensor would be seen."""
    return BlockCache(BLOCK_BYTES + 1024)


#: reads of 128 KiB: CRCs are folded in over many reads of each record
STEP = 128 << 10


def zip_is_valid(data: bytes) -> bool:
    return zipfile.ZipFile(io.BytesIO(data)).testzip() is None


def test_sequential_copy_hashes_nothing_twice(one_block_cache):
    obj = make_obj()
    layout = TorchZipLayout(obj, "m", cache=one_block_cache)
    data = read_all(layout, STEP)
    for t in storages(obj):
        assert t.elems == t.numel, t.describe()
    assert zip_is_valid(data)
    assert read_all(layout, 1 << 20) == data  # stable bytes on a second pass


def test_central_directory_first_hashes_once(one_block_cache, tmp_path):
    obj = make_obj()
    store = CrcStore(tmp_path / "crc")
    layout = TorchZipLayout(obj, "m", crc_store=store, identity="ckpt-1",
                              cache=one_block_cache)
    cd = layout.read(layout.cd_offset, layout.size - layout.cd_offset)  # what torch.load reads first
    for t in storages(obj):
        assert t.elems == t.numel
    assert layout.read(layout.cd_offset, layout.size - layout.cd_offset) == cd
    for t in storages(obj):
        assert t.elems == t.numel  # no new hashing
    before = {id(t): t.elems for t in storages(obj)}
    data = read_all(layout, STEP)
    for t in storages(obj):
        assert t.elems - before[id(t)] == t.numel  # only the data itself, no re-hash
    assert zip_is_valid(data)
    assert list(store.directory.glob("*.json")) and not list(store.directory.glob("*.tmp"))

    # a second mount of the same checkpoint: same identity and store → no hashing at all
    obj2 = make_obj()
    layout2 = TorchZipLayout(obj2, "m", crc_store=CrcStore(tmp_path / "crc"), identity="ckpt-1",
                              cache=one_block_cache)
    assert layout2.read(layout2.cd_offset, layout2.size - layout2.cd_offset) == cd
    assert all(t.elems == 0 for t in storages(obj2))
    # another identity (another checkpoint) does not reuse the values
    obj3 = make_obj()
    layout3 = TorchZipLayout(obj3, "m", crc_store=store, identity="ckpt-2", cache=one_block_cache)
    layout3.read(layout3.cd_offset, layout3.size - layout3.cd_offset)
    assert all(t.elems == t.numel for t in storages(obj3))
    # nor does another layout of the same checkpoint (other archive name)
    obj4 = make_obj()
    layout4 = TorchZipLayout(obj4, "other", crc_store=store, identity="ckpt-1",
                              cache=one_block_cache)
    layout4.read(layout4.cd_offset, layout4.size - layout4.cd_offset)
    assert all(t.elems == t.numel for t in storages(obj4))


def test_descriptor_after_partial_sequential_read_hashes_only_the_rest(one_block_cache):
    obj = OrderedDict(a=Pattern((10 << 20,), UINT8, 7))
    layout = TorchZipLayout(obj, "m", cache=one_block_cache)
    ent = [e for e in layout.entries if e.name == "m/data/0"][0]
    layout.read(0, ent.data_offset + (5 << 20))  # first 5 MiB of the data, in order (block 0 then evicted)
    layout.read(ent.data_offset + ent.size, 16)  # the data descriptor needs the CRC now
    assert obj["a"].elems == obj["a"].numel  # the 5 MiB already folded in are not read again
    assert zip_is_valid(read_all(layout, STEP))


def test_unwritable_store_still_serves_right_crcs(tmp_path, one_block_cache):
    (tmp_path / "file").write_text("not a directory")
    store = CrcStore(tmp_path / "file" / "crc")
    obj = make_obj()
    layout = TorchZipLayout(obj, "m", crc_store=store, identity="x", cache=one_block_cache)
    layout.read(layout.cd_offset, 100)
    assert zip_is_valid(read_all(layout, STEP))
    assert store.save("k", {"a": 1}) is False
    assert store.load("k") == {}


@pytest.mark.slow  # many threads reading at random
def test_concurrent_random_reads_give_valid_crcs():
    obj = make_obj()
    layout = TorchZipLayout(obj, "m")
    ref = read_all(TorchZipLayout(make_obj(), "m"), STEP)
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(40):
                a = int(rng.integers(0, layout.size))
                n = int(rng.integers(1, 3 << 20))
                if layout.read(a, n) != ref[a:a + n]:
                    errors.append((a, n))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert read_all(layout, STEP) == ref and zip_is_valid(ref)


# -- CrcStore --------------------------------------------------------------------------------------
def test_crc_store_round_trip_merge_and_corruption(tmp_path):
    store = CrcStore(tmp_path)
    key = CrcStore.key("ident", "sig")
    assert key != CrcStore.key("ident", "sig2") and key != CrcStore.key("ident2", "sig")
    assert store.load(key) == {}
    assert store.save(key, {"m/data/0": 5, "m/data/1": 0xFFFFFFFF})
    assert store.save(key, {"m/data/2": 7})
    assert CrcStore(tmp_path).load(key) == {"m/data/0": 5, "m/data/1": 0xFFFFFFFF, "m/data/2": 7}
    assert [p.name for p in store.directory.iterdir()] == [f"{key}.json"]  # no temporary files left
    path = store.directory / f"{key}.json"
    lines = path.read_bytes().splitlines()
    path.write_bytes(b"\n".join([lines[0], b'{"m/data/0": 6, "m/data/1": 4294967295, "m/data/2": 7}', lines[2]]))
    assert store.load(key) == {}  # edited: its seal no longer verifies
    path.write_text("{not json")
    assert store.load(key) == {}
    assert store.save(key, {"m/data/0": 5})
    os.chmod(path, 0o644)  # readable by others: not a file ckptfs wrote
    assert store.load(key) == {}


def test_default_crc_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("CKPTFS_CACHE_DIR", str(tmp_path))
    assert default_crc_dir() == tmp_path / "crc"
    monkeypatch.delenv("CKPTFS_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_crc_dir() == tmp_path / "x" / "ckptfs" / "crc"


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=3000), st.integers(0, 0xFFFFFFFF), st.integers(0, 3000))
def test_the_crc_function_is_zlibs_crc32_running_or_not(data, start, cut):
    """``crc32`` (zlib-ng's when installed) is zlib's CRC-32, also when folded in pieces from a running value."""
    import zlib

    assert crc32(data) == zlib.crc32(data)
    assert crc32(data[cut:], crc32(data[:cut], start)) == zlib.crc32(data, start)


def test_the_fast_crc_is_installed():
    """zlib-ng is a dependency: the fallback to the standard library is for broken installs, not the norm."""
    import zlib_ng.zlib_ng

    assert crc32 is zlib_ng.zlib_ng.crc32


def test_hashing_for_the_central_directory_reads_ahead_like_a_sequential_read(monkeypatch):
    """With the cache's read-ahead on (the FUSE server's), the hasher queues the blocks after the one it reads —
    into the next tensor at a tensor's end — so they decode while it hashes; every element is still produced once
    and the directory is the one computed without read-ahead."""
    from ckptfs.tensor import readahead

    queued = []
    real = readahead.READ_AHEAD.submit
    monkeypatch.setattr(readahead.READ_AHEAD, "submit", lambda cache, key, compute, done=None: queued.append(key) or
                        real(cache, key, compute, done))
    cache = BlockCache(256 << 20)
    cache.read_ahead = 4 << 20
    obj = make_obj()
    layout = TorchZipLayout(obj, "m", cache=cache)
    cd = layout.read(layout.cd_offset, layout.size - layout.cd_offset)
    assert readahead.READ_AHEAD.wait_idle(30)
    plain = TorchZipLayout(make_obj(), "m")
    assert cd == plain.read(plain.cd_offset, plain.size - plain.cd_offset)
    a, b = obj["a"], obj["b"]
    assert (a.cache_key, 1) in queued and (a.cache_key, 2) in queued  # the blocks after the first
    assert (b.cache_key, 0) in queued  # the next tensor's first block, queued from a's end
    for t in storages(obj):
        assert t.elems == t.numel, t.describe()
