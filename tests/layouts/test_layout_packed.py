"""Compact layouts (issue 16, memory per key): packed literal content (a large data.pkl or safetensors header) and
the bounded number of kept .npy plans serve exactly the bytes of the plain versions."""
from __future__ import annotations

import io
import random
import threading
from collections import OrderedDict

import numpy as np
import pytest
import safetensors.numpy
import torch

from ckptfs.tensor.cache import BlockCache
from ckptfs.layouts import pieces
from ckptfs.layouts.npy import NpyLayout
from ckptfs.layouts.pieces import PackedBytes
from ckptfs.layouts.safetensors import SafetensorsLayout
from ckptfs.layouts.torchzip.layout import TorchZipLayout
from ckptfs.tensor.base import ArrayTensor
from helpers import read_all


def state(n: int = 300) -> OrderedDict:
    rng = np.random.default_rng(0)
    return OrderedDict((f"model.layers.{i // 7}.mlp.w{i % 7}.weight", ArrayTensor(rng.random((3, 1 + i % 5), "f4")))
                       for i in range(n))


def test_packed_bytes_slice_like_the_bytes(monkeypatch):
    monkeypatch.setattr(PackedBytes, "CHUNK", 97)  # many chunks, slices across their edges
    rng = random.Random(0)
    data = bytes(rng.choice(b"abc\x00\xff") for _ in range(5000))
    p = PackedBytes(data)
    assert len(p) == len(data) and bytes(p) == data and p.packed_size < len(data)
    for _ in range(500):
        a, b = rng.randrange(-10, 5100), rng.randrange(-10, 5100)
        assert p[a:b] == data[a:b], (a, b)
    assert PackedBytes(b"")[0:10] == b""


def test_packed_data_pkl_and_header_serve_the_same_files(monkeypatch):
    obj = state()
    plain_zip = read_all(TorchZipLayout(obj, "pytorch_model", crc="exact"), 4099)
    plain_st = read_all(SafetensorsLayout(list(obj.items())), 4099)
    monkeypatch.setattr(pieces, "PACK_AT", 0)
    monkeypatch.setattr(PackedBytes, "CHUNK", 1000)
    zf = TorchZipLayout(obj, "pytorch_model", crc="exact", cache=BlockCache(1 << 20))
    st = SafetensorsLayout(list(obj.items()), cache=BlockCache(1 << 20))
    assert isinstance(zf._fixed[0][1], PackedBytes) and isinstance(st._header, PackedBytes)
    assert read_all(zf, 4099) == plain_zip and read_all(st, 777) == plain_st
    assert st.header_bytes == plain_st[:st.data_start]
    rng = random.Random(1)
    for _ in range(200):
        a, n = rng.randrange(zf.size), rng.randrange(1, 9000)
        assert zf.read(a, n) == plain_zip[a:a + n]
    loaded = torch.load(io.BytesIO(plain_zip), weights_only=True)
    assert list(loaded) == list(obj) and all(np.array_equal(loaded[k].numpy(), t.array) for k, t in obj.items())
    st_loaded = safetensors.numpy.load(plain_st)
    assert set(st_loaded) == set(obj) and all(np.array_equal(st_loaded[k], t.array) for k, t in obj.items())


def test_only_the_last_npy_plans_are_kept_and_a_dropped_plan_is_made_again(monkeypatch):
    monkeypatch.setattr(pieces, "KEEP_OWN_PLANS", 10)
    obj = state(40)
    files = [NpyLayout(t, name=k, cache=BlockCache(1 << 20)) for k, t in obj.items()]
    first = [f.read(0, f.size) for f in files]
    assert sum(f._plan is not None for f in files) <= 10 and files[-1]._plan is not None
    assert [f.read(0, f.size) for f in files] == first
    for f, t in zip(files, obj.values()):
        assert np.array_equal(np.load(io.BytesIO(f.read(0, f.size))), t.array)


def test_concurrent_readers_of_npy_files_whose_plans_are_dropped_read_the_right_bytes(monkeypatch):
    monkeypatch.setattr(pieces, "KEEP_OWN_PLANS", 3)
    obj = state(60)
    cache = BlockCache(1 << 20)
    files = [NpyLayout(t, name=k, cache=cache) for k, t in obj.items()]
    expected = [NpyLayout(t, name=k).read(0, 1 << 20) for k, t in obj.items()]
    errors = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(400):
                i = rng.randrange(len(files))
                a, n = rng.randrange(files[i].size), rng.randrange(1, 200)
                if files[i].read(a, n) != expected[i][a:a + n]:
                    errors.append(i)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
