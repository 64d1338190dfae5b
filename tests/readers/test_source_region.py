"""Tensor data is read lazily and by region: a box read touches only the chunks under the box, the
catalog reads no tensor data at all, and a damaged chunk fails only the tensor it belongs to."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import hdf5plugin
import numpy as np
import pytest

from ckptfs.tensor.cache import BlockCache
from ckptfs.commands.info import summarize
from ckptfs.errors import TensorReadError
from ckptfs.catalog.model import TensorLeaf, UnreadableLeaf
from ckptfs.readers import open_checkpoint
from ckptfs.tensor.base import BLOCK_BYTES
from helpers import FIXTURES as FIX


ROWS, COLS, CHUNK_ROWS = 4096, 512, 128  # 8 MiB float32, 32 chunks of 128 rows


def _flip_chunk(path: Path, offset: int, size: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        raw = bytearray(fh.read(size))
        fh.seek(offset)
        fh.write(bytes(b ^ 0xFF for b in raw))


def _chunks(path: Path, name: str):
    with h5py.File(path, "r") as f:
        d = f[name]
        return [d.id.get_chunk_info(i) for i in range(d.id.get_num_chunks())]


@pytest.fixture
def big_checkpoint(tmp_path):
    """A real cstorch file (src.mdl) whose tensor 'a' is replaced by a large chunked LZ4 dataset."""
    ck = tmp_path / "big.mdl"
    shutil.copy(FIX / "cstorch_edge_cases" / "src.mdl", ck)
    data = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    with h5py.File(ck, "a") as f:
        attrs = dict(f["a"].attrs)
        del f["a"]
        d = f.create_dataset("a", data=data, chunks=(CHUNK_ROWS, COLS), **hdf5plugin.LZ4())
        for k, v in attrs.items():
            d.attrs[k] = v
        d.attrs["shapes"] = np.array([[ROWS, COLS]])
        md = json.loads(f.attrs["a.__metadata__"])
        md["a.__metadata__"]["shapes"] = [[ROWS, COLS]]
        f.attrs["a.__metadata__"] = json.dumps(md, indent=4)
    return ck, data


def test_row_range_decompresses_only_its_chunks(big_checkpoint):
    ck, data = big_checkpoint
    lo, hi = 2300, 2600
    keep = {r // CHUNK_ROWS for r in range(lo, hi)}
    for info in _chunks(ck, "a"):
        if info.chunk_offset[0] // CHUNK_ROWS not in keep:
            _flip_chunk(ck, info.byte_offset, info.size)  # every other chunk is now undecodable
    with open_checkpoint(ck) as ckpt:
        t = ckpt.leaves["a"].tensor
        assert t.shape == (ROWS, COLS)
        got = t.read(((lo, hi), (0, COLS)))
        assert np.array_equal(got, data[lo:hi])
        got = t.read(((lo + 5, lo + 9), (100, 300)))
        assert np.array_equal(got, data[lo + 5:lo + 9, 100:300])
        with pytest.raises(TensorReadError) as ei:
            t.read(((0, 1), (0, COLS)))
        assert "tensor a:" in ei.value.problem and str(ck) == ei.value.path
        assert np.array_equal(ckpt.leaves["b"].tensor.read_all(), h5py.File(ck, "r")["b"][()])


class _SpyDataset:
    """Wraps an h5py Dataset and records every selection asked of it."""

    def __init__(self, d):
        self._d = d
        self.selections = []

    def __getitem__(self, sel):
        self.selections.append(sel)
        return self._d[sel]

    def __getattr__(self, name):
        return getattr(self._d, name)


def test_reads_ask_h5py_for_exactly_the_box(big_checkpoint, monkeypatch):
    ck, data = big_checkpoint
    with open_checkpoint(ck) as ckpt:
        t = ckpt.leaves["a"].tensor
        spy = _SpyDataset(t.dataset())
        monkeypatch.setattr(type(t), "dataset", lambda self: spy)  # source tensors have slots, no instance dict
        t.read(((10, 20), (3, 7)))
        assert spy.selections == [(slice(10, 20), slice(3, 7))]
        # byte reads go through bounded blocks: never a selection larger than one cache block
        spy.selections.clear()
        row = COLS * 4
        out = t.read_bytes(2300 * row + 12, 2600 * row - 8, cache=BlockCache(64 << 20))
        assert out == data.tobytes()[2300 * row + 12:2600 * row - 8]
        assert spy.selections
        for sel in spy.selections:
            n = np.prod([s.stop - s.start for s in sel])
            assert n * 4 <= BLOCK_BYTES
            assert sel[0].start < 2600 and sel[0].stop > 2300


def test_catalog_reads_no_tensor_data(tmp_path):
    """With every chunk of every dataset destroyed, the catalog, info and ls still work; reads then fail."""
    ck = tmp_path / "train.mdl"
    shutil.copy(FIX / "train_gpt2" / "cs" / "checkpoint.mdl", ck)
    with h5py.File(ck, "r") as f:
        names = [k for k in f.keys() if isinstance(f[k], h5py.Dataset) and f[k].chunks]
        n_datasets = sum(1 for k in f.keys() if isinstance(f[k], h5py.Dataset))
    for name in names:
        for info in _chunks(ck, name):
            _flip_chunk(ck, info.byte_offset, info.size)
    with open_checkpoint(ck) as ckpt:
        s = summarize(ckpt)
        assert s.tensors == n_datasets  # every dataset of this file is one tensor
        for name in names[:5]:
            with pytest.raises(TensorReadError):
                ckpt.leaves[name].tensor.read_all()


@pytest.mark.parametrize("case,key", [("tied_and_scalars", "model.dense.weight"), ("gpt2", "model.lm_head.weight")])
def test_corrupted_chunk_fails_only_its_tensor(tmp_path, case, key):
    ck = tmp_path / "ck.mdl"
    shutil.copy(FIX / case / "cs" / "checkpoint.mdl", ck)
    with h5py.File(ck, "r") as f:
        original = {k: f[k][()] for k in f.keys() if isinstance(f[k], h5py.Dataset) and f[k].shape}
    (info, *_) = _chunks(ck, key)
    _flip_chunk(ck, info.byte_offset, info.size)
    with open_checkpoint(ck) as ckpt:
        with pytest.raises(TensorReadError) as ei:
            ckpt.leaves[key].tensor.read_all()
        assert ei.value.path == str(ck) and ei.value.problem.startswith(f"tensor {key}:")
        assert "\n" not in str(ei.value)
        for k, v in original.items():
            if k == key or ckpt.leaves[k] is ckpt.leaves[key]:
                continue
            leaf = ckpt.leaves[k]
            assert isinstance(leaf, TensorLeaf)
            assert np.array_equal(leaf.tensor.read_all(), v.view(leaf.tensor.dtype.storage)), k


def test_missing_dataset_and_shape_mismatch_are_unreadable_from_the_catalog(tmp_path):
    """Checked when the catalog is built (issue 16): the tensor is unreadable with a reason, the others are fine."""
    ck = tmp_path / "src.mdl"
    shutil.copy(FIX / "cstorch_edge_cases" / "src.mdl", ck)
    with h5py.File(ck, "a") as f:
        del f["a"]
        b = f["b"][()]
        del f["b"]
        f.create_dataset("b", data=np.concatenate([b, b]))
    with open_checkpoint(ck) as ckpt:
        a, b = ckpt.leaves["a"], ckpt.leaves["b"]
        assert isinstance(a, UnreadableLeaf) and "missing" in a.reason
        assert isinstance(b, UnreadableLeaf) and "metadata says" in b.reason
        assert summarize(ckpt).unreadable == {"a": a.reason, "b": b.reason}


def test_zero_size_and_0d_tensors(tmp_path):
    with open_checkpoint(FIX / "tied_and_scalars" / "cs" / "checkpoint.mdl") as ckpt:
        e = ckpt.leaves["model.empty"].tensor
        assert e.shape == (0, 4) and e.read_all().shape == (0, 4) and e.read_bytes(0, 10) == b""
        s = ckpt.leaves["model.scalar_tensor"].tensor
        with h5py.File(ckpt.path, "r") as f:
            raw = f["model.scalar_tensor"][()]
        assert s.shape == () and s.read(()).shape == () and s.read_bytes(0, 4) == np.asarray(raw).tobytes()


def test_open_datasets_are_bounded_and_reopen_identically(monkeypatch):
    """A store keeps at most MAX_OPEN_DATASETS datasets open (HDF5 holds memory for each); a tensor whose dataset
    was closed to make room opens it again and reads the same bytes."""
    from ckptfs.readers.cerebras import h5store

    monkeypatch.setattr(h5store, "MAX_OPEN_DATASETS", 2)
    ck = FIX / "llama" / "cs" / "checkpoint.mdl"
    with open_checkpoint(ck) as ckpt, h5py.File(ck, "r") as f:
        tensors = [leaf.tensor for leaf in ckpt.tensors().values()]
        store = tensors[0].store
        assert len(tensors) > 4
        for _ in range(2):  # the second pass reads tensors whose datasets were closed in between
            for t in tensors:
                cache = BlockCache(1 << 20)
                assert t.read_bytes(0, t.nbytes, cache) == np.ascontiguousarray(f[t.name][()]).tobytes()
                assert store.open_datasets() <= 2
        assert sum(t._open is not None for t in tensors) <= 2
