"""NpyLayout against numpy.save / np.load, for every dtype, 0-d, empty, raw-bit dtypes and huge shapes."""
from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib import format as npformat

from ckptfs.tensor.cache import BlockCache
from ckptfs.dtypes import BY_NAME, by_name
from ckptfs.layouts.npy import NpyLayout, npy_header, npy_suffix
from ckptfs.tensor.base import ArrayTensor
from test_layout_safetensors import PatternTensor, random_raw, torch_from_raw

NATIVE = [d for d in BY_NAME.values() if d.npy_native]
RAW_BITS = [d for d in BY_NAME.values() if not d.npy_native]
shapes = st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple)


def numpy_save_bytes(arr: np.ndarray) -> bytes:
    f = io.BytesIO()
    np.save(f, arr)
    return f.getvalue()


@settings(max_examples=200, deadline=None)
@given(dt=st.sampled_from(NATIVE), shape=shapes, seed=st.integers(0, 2**32 - 1),
       ranges=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 200)), max_size=5))
def test_npy_byte_identical(dt, shape, seed, ranges):
    arr = np.frombuffer(random_raw(np.random.default_rng(seed), shape, dt), dt.storage).reshape(shape)
    ref = numpy_save_bytes(arr)
    layout = NpyLayout(ArrayTensor(arr, dt), cache=BlockCache(1 << 20))
    assert layout.size == len(ref)
    data = layout.read(0, layout.size + 3)
    assert data == ref
    loaded = np.load(io.BytesIO(data))
    assert loaded.dtype == arr.dtype and loaded.shape == arr.shape
    assert loaded.tobytes() == arr.tobytes()
    for off, n in ranges:
        assert layout.read(off, n) == ref[off:off + n]


@pytest.mark.parametrize("dt", NATIVE + RAW_BITS, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (4, 7), (2, 3, 5)], ids=str)
def test_mmap_load_of_copied_file(dt, shape, tmp_path):
    arr = np.frombuffer(random_raw(np.random.default_rng(7), shape, dt), dt.storage).reshape(shape)
    layout = NpyLayout(ArrayTensor(arr, dt))
    path = tmp_path / f"t{npy_suffix(dt)}"
    with open(path, "wb") as f:  # copied the way cp does, in small pieces
        for off in range(0, layout.size, 37):
            f.write(layout.read(off, 37))
    m = np.load(path, mmap_mode="r")
    assert m.shape == shape and m.dtype == dt.storage
    assert np.asarray(m).tobytes() == arr.tobytes()
    del m


@pytest.mark.parametrize("dt", RAW_BITS, ids=lambda d: d.name)
def test_raw_bit_dtypes_documented_form(dt, tmp_path):
    """bf16 / float8 are stored as their raw bits; the documented torch view gives the tensor back."""
    shape = (3, 4)
    raw = random_raw(np.random.default_rng(3), shape, dt)
    ref = torch_from_raw(raw, shape, dt)
    layout = NpyLayout(ArrayTensor(np.frombuffer(raw, dt.storage).reshape(shape), dt))
    path = tmp_path / f"w{npy_suffix(dt)}"
    path.write_bytes(layout.read(0, layout.size))
    a = np.load(path)
    assert a.dtype == dt.storage
    back = torch.from_numpy(a).view(getattr(torch, dt.name))
    assert back.dtype == ref.dtype and torch.equal(back.view(torch.uint8), ref.view(torch.uint8))
    assert layout.read(0, layout.size) == numpy_save_bytes(np.frombuffer(raw, dt.storage).reshape(shape))


def test_npy_suffix():
    for dt in NATIVE:
        assert npy_suffix(dt) == ".npy"
    assert npy_suffix(BY_NAME["bfloat16"]) == ".bf16.npy"
    for dt in RAW_BITS:  # the middle part names the real dtype
        s = npy_suffix(dt)
        assert s.endswith(".npy") and by_name(s[1:-len(".npy")]) is dt


def test_header_versions_match_numpy():
    """Version 2.0 (header > 64 KiB) and 3.0 (non-latin-1 text) are chosen exactly as numpy.save does."""
    cases = [np.dtype([(f"field{i}", "<f4") for i in range(4000)]),  # 2.0
             np.dtype([("\u03b1\u4e2d", "<i2"), ("b", "<f8")]),  # 3.0
             np.dtype([("x", "<u1")])]  # 1.0
    for dt in cases:
        arr = np.zeros((2, 3), dtype=dt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            ref = numpy_save_bytes(arr)
        hdr = npy_header(npformat.dtype_to_descr(dt), arr.shape)
        assert ref[:len(hdr)] == hdr and len(ref) == len(hdr) + arr.nbytes


def test_huge_simulated_npy(tmp_path):
    t = PatternTensor((3, 1 << 30), BY_NAME["float16"], seed=9)  # 6 GiB, never allocated
    layout = NpyLayout(t, cache=BlockCache(16 << 20))
    f = io.BytesIO()
    npformat.write_array_header_1_0(f, {"descr": "<f2", "fortran_order": False, "shape": t.shape})
    assert layout.header_bytes == f.getvalue()
    assert layout.size == len(f.getvalue()) + t.nbytes
    n = 1 << 20
    tail = layout.read(layout.size - n, n)
    assert t.calls > 0 and t.elements * 2 <= n + 2 * t.block_elems() * 2
    assert tail == t.expected(t.nbytes - n, t.nbytes)
    assert layout.read(layout.data_start - 10, 20) == layout.header_bytes[-10:] + t.expected(0, 10)
    path = tmp_path / "huge.npy"  # sparse file: header and last MiB only
    with open(path, "wb") as fh:
        fh.truncate(layout.size)
        fh.write(layout.header_bytes)
        fh.seek(layout.size - n)
        fh.write(tail)
    m = np.load(path, mmap_mode="r")
    assert m.shape == t.shape and m.dtype == np.float16
    assert m[-1, -1000:].tobytes() == t.expected(t.nbytes - 2000, t.nbytes)
    del m


@settings(max_examples=300, deadline=None)
@given(dt=st.sampled_from(NATIVE + RAW_BITS),
       shape=st.lists(st.integers(0, 10**18) | st.integers(0, 300), min_size=0, max_size=32).map(tuple))
def test_header_matches_numpy_for_any_shape(dt, shape):
    """Header text (incl. numpy's growth room and 64-byte padding) for shapes too big to allocate."""
    f = io.BytesIO()
    npformat.write_array_header_1_0(f, {"descr": dt.storage.str, "fortran_order": False, "shape": shape})
    assert npy_header(dt.storage.str, shape) == f.getvalue()
