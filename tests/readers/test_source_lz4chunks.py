"""The chunk-parallel LZ4 reader (ckptfs/readers/cerebras/lz4chunks/) returns exactly h5py's bytes for every box, raises
TensorReadError on a chunk that does not decode, and leaves everything else to the plain h5py read. No timing."""
from __future__ import annotations

import contextlib
import itertools
import math
import os
import tempfile
from pathlib import Path

import h5py
import hdf5plugin
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfs import env
from ckptfs.tensor.cache import BlockCache
from ckptfs.dtypes import BFLOAT16, BOOL, from_numpy
from ckptfs.errors import TensorReadError
from ckptfs.readers.cerebras import lz4chunks
from ckptfs.readers.cerebras.h5store import H5Store
from ckptfs.readers.cerebras.lz4chunks import batch, frame, index, reader
from ckptfs.readers.cerebras.lz4chunks.batch import BatchRead
from ckptfs.readers.cerebras.lz4chunks.grid import ChunkGrid
from ckptfs.readers.cerebras.lz4filter import LZ4_FILTER_ID
from ckptfs.readers.cerebras.dataset_tensor import H5DatasetTensor
from ckptfs.storage import local
from ckptfs.tensor.base import BLOCK_BYTES, aligned_block_elems

DTYPES = ["<f4", "<f8", "<i2", "<u2", "<f2", "|u1", "|b1", "<i8", ">f4", ">i2"]


@pytest.fixture(autouse=True)
def _threads(monkeypatch):
    monkeypatch.setattr(reader, "MIN_PARALLEL_BYTES", 0)  # split even tiny reads over threads, so the tests exercise it
    monkeypatch.setattr(batch, "BATCH_BYTES", 5000)  # and over several fetch batches
    yield
    lz4chunks.set_decode_threads(None)


def _no_file(dset, coords, offset, size):
    """An ``OpenChunkFile`` that has no file: every chunk comes through HDF5's ``read_direct_chunk``."""
    return None


def _data(rng, shape, dtype, kind):
    dt = np.dtype(dtype)
    n = int(np.prod(shape))
    if dt.kind == "b":
        a = rng.integers(0, 2, n).astype(bool)
    elif kind == "random":  # incompressible: LZ4 stores the blocks raw
        a = np.frombuffer(rng.bytes(n * dt.itemsize), dt).copy()
        if dt.kind == "f":
            a[~np.isfinite(a)] = 0
    elif kind == "smooth":  # compressible
        a = (np.arange(n) % 7).astype(dt)
    else:  # mixed: some LZ4 blocks compressed, some stored raw
        a = np.frombuffer(rng.bytes(n * dt.itemsize), dt).copy()
        a[: n // 2] = 0
    return a.reshape(shape)


def _reader_read(d, box, threads, fetch="direct"):
    """Read ``box`` with a fresh reader; ``fetch="chunks"`` forces read_direct_chunk instead of direct file reads,
    ``fetch="disk"`` makes the page cache look empty, so the file reads bypass it (``O_DIRECT``)."""
    lz4chunks.set_decode_threads(threads)
    r = lz4chunks.plan(d, open_file=_no_file) if fetch == "chunks" else lz4chunks.plan(d)
    assert r is not None, lz4chunks.why_not(d)
    if fetch == "disk":
        assert local.page_cache.works, "this kernel has no cachestat"
        reads = []
        lz4chunks.local_chunk_files.clear()  # a handle opened here, with the file taken as on a local disk
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(local, "file_system_type", lambda dev: "ext4")
            mp.setattr(local, "DIRECT_MIN_BYTES", 1)
            mp.setattr(local.page_cache, "cached", lambda fd, off, n: False)
            mp.setattr(local.LocalFile, "read_into", _recording(local.LocalFile.read_into, reads))
            out = r.read(box)
        if out is not None and out.size and _stored_under(r, box):
            assert r.file and reads and all(direct for _, direct in reads), "the disk reads were not direct"
        return out
    out = r.read(box)
    if fetch == "direct" and out is not None and out.size and _stored_under(r, box):
        assert r.file, "direct file reads were not used"
    return out


def _recording(fn, log: list):
    def wrapper(*a, **k):
        got = fn(*a, **k)
        log.append(got)
        return got
    return wrapper


def _stored_under(r, box) -> bool:
    """Whether ``box`` covers a stored (allocated) chunk: the read then fetched it, with the direct handle."""
    sizes = r.index.arrays()[1]
    return any(sizes[np.ravel_multi_index(idx, r.grid.counts)] >= 0 for idx in itertools.product(*r.grid.ranges(box)))


@st.composite
def cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 24 if ndim > 1 else 300)) for _ in range(ndim))
    chunks = tuple(draw(st.integers(1, n)) for n in shape)
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(["random", "smooth", "mixed"]))
    block = draw(st.sampled_from([0, 0, 8, 100]))  # 0 = default 1 GiB blocks; small = multi-block frames
    written = draw(st.sampled_from(["all", "all", "part", "none"]))
    boxes = []
    for _ in range(4):
        box = []
        for n in shape:
            a = draw(st.integers(0, n))
            b = draw(st.integers(a, n))
            box.append((a, b))
        boxes.append(tuple(box))
    seed = draw(st.integers(0, 2**31))
    return shape, chunks, dtype, kind, block, written, boxes, seed


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_random_boxes_match_h5py(case):
    shape, chunks, dtype, kind, block, written, boxes, seed = case
    rng = np.random.default_rng(seed)
    data = _data(rng, shape, dtype, kind)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.h5"
        with h5py.File(path, "w") as f:
            d = f.create_dataset("x", shape=shape, dtype=data.dtype, chunks=chunks, **hdf5plugin.LZ4(nbytes=block))
            if written == "all":
                d[...] = data
            elif written == "part":  # leave the chunks past the middle of dim 0 unallocated
                cut = max(1, shape[0] // 2)
                d[:cut] = data[:cut]
        with h5py.File(path, "r") as f:
            d = f["x"]
            for box in boxes + [tuple((0, n) for n in shape)]:
                want = d[tuple(slice(a, b) for a, b in box)]
                for threads, fetch in ((1, "direct"), (3, "disk"), (2, "chunks")):
                    got = _reader_read(d, box, threads, fetch)
                    assert got.dtype == want.dtype and got.shape == want.shape
                    assert got.tobytes() == want.tobytes(), (box, threads, fetch)


def _as_storage(arr: np.ndarray, storage: np.dtype) -> np.ndarray:
    """``arr``'s values, little-endian, seen as the tensor's storage type (the same bits: bf16 as int16 bits)."""
    arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    return arr if arr.dtype == storage else arr.view(storage)


@contextlib.contextmanager
def _counting_reads():
    """Counts ``LZ4ChunkReader.read`` calls (a box read by the chunk reader rather than by h5py alone)."""
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lz4chunks.LZ4ChunkReader, "read", _recording(lz4chunks.LZ4ChunkReader.read, calls))
        yield calls


@pytest.mark.parametrize("dtype,ddt", [(BFLOAT16, "<i2"), (BOOL, "|b1"), (from_numpy("<u2"), "<i2")])
def test_tensor_views_stay_exact(tmp_path, dtype, ddt):
    """bf16 as int16 bits, bool enums and same-size integer views: identical to the plain h5py path."""
    rng = np.random.default_rng(1)
    data = _data(rng, (300, 70), ddt, "random")
    path = tmp_path / "v.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("w", data=data, chunks=(32, 16), **hdf5plugin.LZ4())
    with h5py.File(path, "r") as f:
        t = H5DatasetTensor(H5Store(path, path, file=f), "w", "model.w", data.shape, dtype)
        for box in (((0, 300), (0, 70)), ((5, 77), (3, 69)), ((299, 300), (69, 70))):
            want = _as_storage(f["w"][tuple(slice(a, b) for a, b in box)], dtype.storage)
            with _counting_reads() as reads:
                got = t.read(box)
            assert reads, "the tensor did not read through the chunk reader"
            assert got.dtype == dtype.storage and got.tobytes() == want.tobytes()
        assert t.read_bytes(0, t.nbytes, cache=BlockCache(1 << 30)) == _as_storage(data, dtype.storage).tobytes()


def test_unfiltered_chunks_and_user_fill_value(tmp_path):
    """A chunk whose filter mask says LZ4 was skipped is raw; unallocated chunks give the user fill value."""
    path = tmp_path / "m.h5"
    raw = np.arange(16, dtype="<f4").reshape(4, 4)
    with h5py.File(path, "w") as f:
        d = f.create_dataset("x", shape=(12, 8), dtype="<f4", chunks=(4, 4), fillvalue=7.5, **hdf5plugin.LZ4())
        d[0:4, 0:4] = 1.0
        d.id.write_direct_chunk((4, 4), raw.tobytes(), filter_mask=1)
    with h5py.File(path, "r") as f:
        d = f["x"]
        for box in (((0, 12), (0, 8)), ((3, 9), (2, 7))):
            want = d[tuple(slice(a, b) for a, b in box)]
            assert _reader_read(d, box, 2).tobytes() == want.tobytes()
        assert (d[8:12, 0:4] == 7.5).all()


def test_chunks_stored_out_of_order_and_apart(tmp_path):
    """Chunks written in reverse order, with other data in between: reads are regrouped, bytes still exact."""
    rng = np.random.default_rng(9)
    data = _data(rng, (40, 90), "<f4", "mixed")
    path = tmp_path / "r.h5"
    with h5py.File(path, "w") as f:
        d = f.create_dataset("x", shape=data.shape, dtype=data.dtype, chunks=(8, 30), **hdf5plugin.LZ4())
        for i, r0 in enumerate(range(32, -1, -8)):
            for c0 in (60, 30, 0):
                d[r0:r0 + 8, c0:c0 + 30] = data[r0:r0 + 8, c0:c0 + 30]
            f.create_dataset(f"pad{i}", data=np.zeros(25_000 * (i % 2) + 1, "<f4"))  # data between chunks
    with h5py.File(path, "r") as f:
        offs = [i.byte_offset for i in (f["x"].id.get_chunk_info(k) for k in range(f["x"].id.get_num_chunks()))]
        assert offs != sorted(offs)
        for box in (((0, 40), (0, 90)), ((3, 37), (5, 88)), ((8, 16), (0, 90))):
            for threads, fetch in ((1, "direct"), (2, "disk"), (1, "chunks")):
                got = _reader_read(f["x"], box, threads, fetch)
                assert got.tobytes() == data[tuple(slice(a, b) for a, b in box)].tobytes()


def test_fill_time_never_falls_back_for_unallocated_chunks(tmp_path):
    path = tmp_path / "n.h5"
    with h5py.File(path, "w") as f:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((4,))
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        dcpl.set_filter(LZ4_FILTER_ID, 1, (0,))
        sid = h5py.h5s.create_simple((16,))
        h5py.h5d.create(f.id, b"x", h5py.h5t.NATIVE_FLOAT, sid, dcpl=dcpl)
        f["x"][0:4] = 3.0
    with h5py.File(path, "r") as f:
        r = lz4chunks.plan(f["x"])
        assert r is not None and not r.fill_ok
        assert r.read(((0, 4),)).tobytes() == f["x"][0:4].tobytes()
        assert r.read(((0, 16),)) is None  # touches unallocated chunks: the caller uses h5py


def _corrupt(tmp_path, how):
    path = tmp_path / f"c_{how}.h5"
    with h5py.File(path, "w") as f:
        d = f.create_dataset("x", data=np.zeros((64, 64), "<f4"), chunks=(16, 32), **hdf5plugin.LZ4())
        mask, raw = d.id.read_direct_chunk((16, 0))
        raw = bytearray(raw)
        if how == "truncated":
            raw = raw[:-3]
        elif how == "header":
            raw[7] ^= 1  # total size no longer matches the chunk
        elif how == "garbage":
            raw = bytearray(b ^ 0xFF for b in raw)
        elif how == "payload":
            raw[16:] = b"\xff" * (len(raw) - 16)  # literal run longer than the output
        elif how == "unfiltered_size":
            raw, mask = bytes(100), 1
        d.id.write_direct_chunk((16, 0), bytes(raw), filter_mask=mask)
    return path


@pytest.mark.parametrize("how", ["truncated", "header", "garbage", "payload", "unfiltered_size"])
def test_corrupt_chunk_raises_tensor_read_error(tmp_path, how):
    path = _corrupt(tmp_path, how)
    with h5py.File(path, "r") as f:
        t = H5DatasetTensor(H5Store(path, path, file=f), "x", "model.x", (64, 64), from_numpy("<f4"))
        for threads, box in ((1, ((0, 64), (0, 64))), (2, ((0, 64), (0, 64))), (1, ((20, 30), (5, 40)))):
            lz4chunks.set_decode_threads(threads)  # 8 chunks: numpy path (1 or 2 threads); 2 chunks: chunk by chunk
            with pytest.raises(TensorReadError) as ei:
                t.read(box)
            assert ei.value.problem == "tensor model.x: corrupt LZ4 chunk at (16, 0)"
            assert ei.value.path == str(path)
        assert t.read(((0, 16), (0, 64))).tobytes() == bytes(16 * 64 * 4)  # other chunks still read


def _frame(payload: bytes, block: int, stored: list | None = None) -> bytes:
    """An HDF5-LZ4 frame of ``payload`` in blocks of ``block`` bytes, each stored raw (``stored`` overrides the
    stored sizes written)."""
    blocks = [payload[i:i + block] for i in range(0, len(payload), block)]
    sizes = stored or [len(b) for b in blocks]
    return frame.HEADER.pack(len(payload), block) + b"".join(frame.BLOCK.pack(n) + b for n, b in zip(sizes, blocks))


def test_frame_decoding_is_exact_or_raises_without_any_file():
    """The codec alone, on frames in memory: blocks stored raw are copied, a frame that does not hold exactly the
    chunk's bytes raises CorruptChunkError naming the chunk; the batch's header check agrees."""
    payload = bytes(range(256)) * 3
    out = bytearray(len(payload))
    good = bytearray(_frame(payload, 100))
    frame.decode_frame(good, frame.address(good), len(payload), frame.address(out), (4, 8))
    assert bytes(out) == payload
    bad = {"short": good[:10], "truncated": good[:-5], "size": bytearray(_frame(payload[:-1], 100)),
           "block": bytearray(_frame(payload, 100, [100] * 7 + [120]))}
    for what, raw in bad.items():
        with pytest.raises(frame.CorruptChunkError) as ei:
            frame.decode_frame(raw, frame.address(raw), len(payload), frame.address(out), (4, 8))
        assert ei.value.coords == (4, 8), what
    one = bytearray(_frame(payload, 1 << 30))  # one block, stored raw: what most weights are
    assert frame.stored_raw(one, 0, len(one), 0, len(payload))
    assert not frame.stored_raw(one, 0, len(one), 1, len(payload))  # filter mask: the filter was skipped
    assert not frame.stored_raw(good, 0, len(good), 0, len(payload))
    buf = bytearray(one + good)
    single, raw, stored = frame.frame_heads(buf, np.array([0, len(one)]), np.array([len(one), len(good)]),
                                            np.array([0, 0]), len(payload))
    assert single.tolist() == [True, False] and raw.tolist() == [True, False] and stored[0] == len(payload)


def test_gzip_and_contiguous_datasets_use_h5py(tmp_path):
    path = tmp_path / "g.h5"
    data = np.arange(400, dtype="<f4").reshape(20, 20)
    with h5py.File(path, "w") as f:
        f.create_dataset("gz", data=data, chunks=(7, 5), compression="gzip")
        f.create_dataset("lz4_shuffle", data=data, chunks=(7, 5), shuffle=True, **hdf5plugin.LZ4())
        f.create_dataset("plain", data=data)
        f.create_dataset("scalar", data=np.float32(3))
    with h5py.File(path, "r") as f:
        assert "filters" in lz4chunks.why_not(f["gz"]) and "filters" in lz4chunks.why_not(f["lz4_shuffle"])
        assert lz4chunks.why_not(f["plain"]) == lz4chunks.why_not(f["scalar"]) == "not chunked"
        for name in ("gz", "lz4_shuffle", "plain"):
            t = H5DatasetTensor(H5Store(path, path, file=f), name, name, data.shape, from_numpy("<f4"))
            with _counting_reads() as reads:
                assert t.read(((3, 17), (2, 19))).tobytes() == data[3:17, 2:19].tobytes()
            assert not reads


def test_library_unavailable_falls_back(tmp_path, monkeypatch):
    path = tmp_path / "l.h5"
    data = np.arange(100, dtype="<i8")
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data, chunks=(9,), **hdf5plugin.LZ4())
    monkeypatch.setattr(frame, "lz4_decompress_safe", lambda: None)
    with h5py.File(path, "r") as f:
        assert lz4chunks.why_not(f["x"]) == "LZ4 library unavailable"
        t = H5DatasetTensor(H5Store(path, path, file=f), "x", "x", data.shape, from_numpy("<i8"))
        assert t.read(((5, 95),)).tobytes() == data[5:95].tobytes()


def test_threads_env_and_setting(monkeypatch):
    monkeypatch.setenv(env.DECODE_THREADS, "3")
    assert lz4chunks.decode_threads() == 3
    monkeypatch.setenv(env.DECODE_THREADS, "0")
    assert lz4chunks.decode_threads() == 1
    monkeypatch.setenv(env.DECODE_THREADS, "x")
    assert lz4chunks.decode_threads() == (os.cpu_count() or 1)
    lz4chunks.set_decode_threads(5)
    assert lz4chunks.decode_threads() == 5


def test_large_read_single_and_multi_thread_equal(tmp_path):
    """Big enough to be split over threads (and to decode straight into the output for 1-d chunks)."""
    rng = np.random.default_rng(3)
    path = tmp_path / "big.h5"
    a = _data(rng, (512, 384), "<f4", "mixed")
    b = _data(rng, (300_001,), "<i2", "smooth")
    with h5py.File(path, "w") as f:
        f.create_dataset("a", data=a, chunks=(64, 96), **hdf5plugin.LZ4())
        f.create_dataset("b", data=b, chunks=(7_813,), **hdf5plugin.LZ4())
    with h5py.File(path, "r") as f:
        for name, src in (("a", a), ("b", b)):
            box = tuple((0, n) for n in src.shape)
            one = _reader_read(f[name], box, 1)
            two = _reader_read(f[name], box, 2)
            four = _reader_read(f[name], box, 4)
            assert one.tobytes() == two.tobytes() == four.tobytes() == src.tobytes()


def test_index_budget_drops_and_rebuilds(tmp_path, monkeypatch):
    path = tmp_path / "i.h5"
    with h5py.File(path, "w") as f:
        for k in "abc":
            f.create_dataset(k, data=np.arange(100, dtype="<f4"), chunks=(10,), **hdf5plugin.LZ4())
    monkeypatch.setattr(index.indexes, "budget", 25)
    with h5py.File(path, "r") as f:
        rs = [lz4chunks.plan(f[k]) for k in "abc"]
        for r in rs + rs:
            assert r.read(((3, 97),)).tobytes() == np.arange(3, 97, dtype="<f4").tobytes()
        assert not rs[0].index.indexed and rs[2].index.indexed


def test_out_of_range_box_is_left_to_h5py(tmp_path):
    path = tmp_path / "o.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(40, dtype="<f4").reshape(4, 10), chunks=(2, 5), **hdf5plugin.LZ4())
    with h5py.File(path, "r") as f:
        r = lz4chunks.plan(f["x"])
        assert r.read(((0, 5), (0, 10))) is None and r.read(((0, 4), (0, 11))) is None


# -- block alignment ---------------------------------------------------------------------------------------------
def test_aligned_block_elems():
    block_bytes = 4 << 20  # the function is pure: explicit sizes, independent of the current BLOCK_BYTES
    base = block_bytes // 4
    cap = 4 * block_bytes
    # 4096x4096 fp32, chunks 128 rows: the default 256 rows is already 2 chunk rows
    assert aligned_block_elems((4096, 4096), (128, 128), 4, base, cap) == base
    # 11008x4096 bf16, chunks (344, 128): default 512 rows -> 344 rows (one chunk row, not above 4 MiB)
    assert aligned_block_elems((11008, 4096), (344, 128), 2, block_bytes // 2, cap) == 344 * 4096
    # 1-d: whole chunks
    assert aligned_block_elems((3_000_017,), (7813,), 4, base, cap) == (base // 7813) * 7813
    # one chunk row bigger than the base but under the cap: one chunk row per block
    assert aligned_block_elems((8192, 8192), (256, 64), 4, base, cap) == 256 * 8192
    # one chunk row above the cap, small tensors and chunkless tensors keep the default
    assert aligned_block_elems((100_000, 65536), (100, 8), 4, base, cap) == base
    assert aligned_block_elems((10, 10), (3, 3), 4, base, cap) == base
    assert aligned_block_elems((10, 10), None, 4, base, cap) == base


def test_tensor_blocks_fall_on_chunk_rows_and_bytes_are_exact(tmp_path):
    rng = np.random.default_rng(5)
    data = _data(rng, (1100, 1500), "<f4", "mixed")  # 6.6 MB; default block = 699 rows, chunk rows of 100
    path = tmp_path / "b.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("w", data=data, chunks=(100, 256), **hdf5plugin.LZ4())
    with h5py.File(path, "r") as f:
        t = H5DatasetTensor(H5Store(path, path, file=f), "w", "w", data.shape, from_numpy("<f4"))
        be = t.block_elems()
        assert be % (100 * 1500) == 0 and be * 4 <= BLOCK_BYTES and be == t.block_elems()
        cache = BlockCache(64 << 20)
        img = data.tobytes()
        for lo, hi in ((0, len(img)), (12345, 4_500_001), (len(img) - 7, len(img))):
            assert t.read_bytes(lo, hi, cache=cache) == img[lo:hi]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_parallel_reads_work_in_a_forked_child(tmp_path):
    """The pool's threads do not survive fork: the child must start its own instead of waiting forever."""
    rng = np.random.default_rng(11)
    data = _data(rng, (256, 256), "<i2", "smooth")
    path = tmp_path / "f.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data, chunks=(16, 64), **hdf5plugin.LZ4())
    box = ((0, 256), (0, 256))
    with h5py.File(path, "r") as f:
        assert _reader_read(f["x"], box, 2).tobytes() == data.tobytes()  # the parent's pool exists now
        pid = os.fork()
        if pid == 0:  # child: exit 0 only if the parallel read works
            code = 1
            try:
                code = 0 if _reader_read(f["x"], box, 2).tobytes() == data.tobytes() else 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


# -- small reads of a dataset not indexed: chunks looked up one by one ---------------------------------------------
@pytest.mark.parametrize("shape, chunks", [((40, 90), (8, 30)), ((37, 23), (5, 7)), ((9, 10, 11), (4, 3, 5)),
                                           ((301,), (17,))])
@pytest.mark.parametrize("kind", ["random", "smooth", "mixed"])
def test_peek_by_chunk_lookup_equals_whole_read(tmp_path, monkeypatch, shape, chunks, kind):
    """A small read of a dataset not yet indexed looks its chunks up (no index is built) and gives the same bytes
    as the whole read: partial edge chunks, several dimensions, chunks stored raw or compressed (neighbours stored
    raw placed as one run), a chunk stored without the filter (mask bit 0), an unallocated chunk (fill value),
    direct file reads or read_direct_chunk."""
    rng = np.random.default_rng(len(shape) * 100 + sum(chunks))
    data = _data(rng, shape, "<f4", kind)
    path = tmp_path / "p.h5"
    last = tuple((n - 1) // c * c for n, c in zip(shape, chunks))  # the corner chunk (partial where n % c)
    hole = tuple(c if n > c else 0 for n, c in zip(shape, chunks))
    with h5py.File(path, "w") as f:
        d = f.create_dataset("x", shape=shape, dtype=data.dtype, chunks=chunks, fillvalue=-3.0, **hdf5plugin.LZ4())
        d[...] = data
        corner = np.zeros(chunks, "<f4")
        corner[tuple(slice(0, n - a) for n, a in zip(shape, last))] = data[tuple(slice(a, None) for a in last)]
        d.id.write_direct_chunk(last, corner.tobytes(), filter_mask=1)  # LZ4 skipped for this chunk
    with h5py.File(path, "a") as f:  # one chunk never written: reads give the fill value
        want = f["x"][...]
        want[tuple(slice(a, a + c) for a, c in zip(hole, chunks))] = -3.0
        f["x"][tuple(slice(a, a + c) for a, c in zip(hole, chunks))] = -3.0
    with h5py.File(path, "r") as f:
        d = f["x"]
        whole = lz4chunks.plan(d).read(tuple((0, n) for n in shape))
        assert whole.tobytes() == want.tobytes() == d[...].tobytes()
        boxes = [tuple((0, min(n, 2)) for n in shape),  # a peek at the start
                 tuple((a, n) for a, n in zip(last, shape)),  # the corner chunk, unfiltered and partial
                 tuple((max(a - 1, 0), min(a + c + 1, n)) for a, c, n in zip(hole, chunks, shape)),  # around the hole
                 tuple((n // 3, n // 3 + 1) for n in shape),
                 tuple((0, 1) for n in shape[:-1]) + ((0, shape[-1]),),  # a first row: a run of raw chunks
                 tuple((0, 1) for n in shape[:-1]) + ((chunks[-1] // 2, shape[-1] - 1),)]  # cut at both ends
        runs = []
        real_run = ChunkGrid.place_run
        monkeypatch.setattr(ChunkGrid, "place_run", lambda grid, *a: runs.append(a[-1]) or real_run(grid, *a))
        for box in boxes:
            for fetch in ("direct", "chunks"):
                r = lz4chunks.plan(d, open_file=_no_file) if fetch == "chunks" else lz4chunks.plan(d)
                assert r is not None
                got = r.read(box)
                n = math.prod((b - 1) // c - a // c + 1 for (a, b), c in zip(box, chunks))
                assert (not r.index.indexed) == (2 * n <= r.grid.nchunks), "small reads look up, larger ones index"
                assert got.tobytes() == want[tuple(slice(a, b) for a, b in box)].tobytes(), (box, fetch)
                if fetch == "direct":
                    assert r.file, "direct file reads were not used"
        if kind == "random" and shape[-1] >= 3 * chunks[-1]:
            assert max(runs) >= 2, "neighbouring raw chunks were not placed as a run"


class _CountingLookups:
    """A dataset whose chunk lookups in HDF5 (``get_chunk_info_by_coord``) are counted; the rest is ``dset``'s."""

    def __init__(self, dset, calls: list):
        self._dset = dset
        self.id = _CountingLookups._Id(dset.id, calls)

    def __getattr__(self, name):
        return getattr(self._dset, name)

    class _Id:
        def __init__(self, did, calls):
            self._did, self._calls = did, calls

        def __getattr__(self, name):
            return getattr(self._did, name)

        def get_chunk_info_by_coord(self, coords):
            self._calls.append(coords)
            return self._did.get_chunk_info_by_coord(coords)


def test_chunks_looked_up_are_remembered_until_indexing_is_cheaper(tmp_path, monkeypatch):
    """Row-by-row small reads look each chunk up once; past ``LOOKUP_CHUNKS`` looked up the dataset is indexed
    (and the lookups dropped); every read gives h5py's bytes."""
    monkeypatch.setattr(index, "LOOKUP_CHUNKS", 12)
    data = _data(np.random.default_rng(5), (60, 40), "<f4", "mixed")
    path = tmp_path / "l.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data, chunks=(6, 10), **hdf5plugin.LZ4())  # 10 x 4 chunks
    with h5py.File(path, "r") as f:
        first = f["x"].id.get_chunk_info_by_coord((0, 0))
        file = lz4chunks.local_chunk_files.open(f["x"], (0, 0), first.byte_offset, first.size)  # the real dataset
        assert file
        calls = []
        r = lz4chunks.LZ4ChunkReader(_CountingLookups(f["x"], calls), open_file=lambda *a: file)
        for row in range(6):  # rows of chunk row 0: its 4 chunks looked up once
            assert r.read(((row, row + 1), (0, 40))).tobytes() == data[row:row + 1].tobytes()
        assert len(calls) == 4 and not r.index.indexed
        assert r.read(((6, 14), (0, 40))).tobytes() == data[6:14].tobytes()  # 8 more: 12 looked up
        assert len(calls) == 12 and not r.index.indexed and r.index.looked_up == 12
        assert r.read(((20, 21), (0, 40))).tobytes() == data[20:21].tobytes()  # 4 more, past the cap: indexed
        assert len(calls) == 12 and r.index.indexed and r.index.looked_up == 0
        assert r.read(((0, 60), (0, 40))).tobytes() == data.tobytes()


@pytest.mark.parametrize("rows", [1024, 2048])  # 64 chunks: read chunk by chunk (FEW_RAW_CHUNKS); 128: batched
def test_block_reads_hint_the_next_bytes_of_the_file_and_peeks_do_not(tmp_path, monkeypatch, rows):
    """A fetch of a cache block's worth of stored bytes from the page cache asks the kernel for the file bytes after
    it (WILLNEED); a small read does not (a peek must not read megabytes ahead), nor does a block read straight from
    the disk (that would fill the page cache the direct read avoids). Bytes are h5py's either way."""
    rng = np.random.default_rng(11)
    path = tmp_path / "hint.h5"
    a = _data(rng, (rows, 512), "<f4", "random")  # 2 or 4 MiB, stored raw
    with h5py.File(path, "w") as f:
        f.create_dataset("a", data=a, chunks=(64, 128), **hdf5plugin.LZ4())
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: calls.append((off, n, advice)), raising=False)
    monkeypatch.setattr(batch, "BATCH_BYTES", 8 << 20)  # one batch
    with h5py.File(path, "r") as f:
        d = f["a"]
        stored_end = max(i.byte_offset + i.size for i in [d.id.get_chunk_info(k) for k in range(d.id.get_num_chunks())])
        peek = _reader_read(d, ((0, 1), (0, 16)), 1)
        assert peek.tobytes() == a[:1, :16].tobytes()
        assert calls == []
        with monkeypatch.context() as mp:
            mp.setattr(local.page_cache, "cached", lambda fd, off, n: True)
            whole = _reader_read(d, ((0, rows), (0, 512)), 1)
        assert whole.tobytes() == a.tobytes()
        assert calls == [(stored_end, local.HINT_AHEAD, os.POSIX_FADV_WILLNEED)]
        lz4chunks.local_chunk_files.clear()  # a fresh handle: its hint window starts empty
        cold = _reader_read(d, ((0, rows), (0, 512)), 1, "disk")
        assert cold.tobytes() == a.tobytes()
        assert calls == [(stored_end, local.HINT_AHEAD, os.POSIX_FADV_WILLNEED)]


@pytest.mark.parametrize("kind,batched", [("random", False), ("smooth", True)])
def test_a_block_of_raw_chunks_is_read_chunk_by_chunk_and_compressed_ones_in_a_batch(tmp_path, monkeypatch, kind,
                                                                                     batched):
    """A cache block over 32 chunks stored raw (incompressible weights) goes the plain-Python way, which costs less
    than numpy's set-up; the same block of LZ4-compressed chunks keeps the batch, whose decoding threads share, and
    so does a read over more than a few compressed chunks (here the padded edge chunks of random data)."""
    rng = np.random.default_rng(5)
    a = _data(rng, (512, 2048), "<i2", kind)
    path = tmp_path / "k.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("a", data=a, chunks=(500, 64), **hdf5plugin.LZ4())  # cstorch's bf16 chunk shape
    batches = []
    monkeypatch.setattr(BatchRead, "run", _recording(BatchRead.run, batches))
    with h5py.File(path, "r") as f:
        r = lz4chunks.plan(f["a"])
        r.index.arrays()
        block = r.read(((0, 500), (0, 2048)))  # one chunk row: 32 chunks
        assert block.tobytes() == a[:500].tobytes()
        assert bool(batches) is batched
        assert r.read(((0, 512), (0, 2048))).tobytes() == a.tobytes()  # 64 chunks, the edge row compressed
        assert batches


@pytest.mark.slow  # starts a Python process
def test_reading_a_checkpoint_registers_only_the_lz4_filter(tmp_path):
    """Opening a checkpoint's store makes HDF5 read LZ4 datasets (its own filter pipeline, not ours) without
    importing hdf5plugin, whose import loads every filter library it ships (a fifth of a cold mount)."""
    import subprocess
    import sys

    a = np.arange(6000, dtype="<f4").reshape(60, 100) * np.float32(0.5)
    path = tmp_path / "lz4.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("a", data=a, chunks=(16, 32), **hdf5plugin.LZ4())
    code = f"""if True:
        import sys, h5py, hashlib
        import ckptfs.readers.cerebras.h5store
        assert "hdf5plugin" not in sys.modules
        with h5py.File({str(path)!r}, "r") as f:
            print(hashlib.sha256(f["a"][...].tobytes()).hexdigest(), "hdf5plugin" in sys.modules)
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    import hashlib

    assert r.stdout.split() == [hashlib.sha256(a.tobytes()).hexdigest(), "False"]


def _recording_args(fn, log: list):
    def wrapper(self, view, offset, need):
        log.append((offset, need))
        return fn(self, view, offset, need)
    return wrapper


@pytest.mark.parametrize("rows,spans_per_chunk", [((0, 2), 1), ((999, 1000), 2)])  # a tensor's head; its tail
def test_a_peek_at_raw_chunks_reads_only_its_rows_of_each_all_announced_at_once(tmp_path, monkeypatch, rows,
                                                                                 spans_per_chunk):
    """A peek over a row of 32 raw chunks of a bf16 matrix reads the frame header and the needed rows of each chunk
    (not 2 MB of whole chunks), every range announced to the kernel first so that a cold disk reads them together."""
    rng = np.random.default_rng(3)
    a = _data(rng, (1000, 2048), "<i2", "random")
    path = tmp_path / "p.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("a", data=a, chunks=(500, 64), **hdf5plugin.LZ4())
    reads, hints = [], []
    monkeypatch.setattr(local.LocalFile, "read_into", _recording_args(local.LocalFile.read_into, reads))
    monkeypatch.setattr(local, "hint_will_need", lambda fd, off, n: hints.append((off, n)))
    box = (rows, (0, 2048))
    with h5py.File(path, "r") as f:
        got = _reader_read(f["a"], box, 1)
    assert got.tobytes() == a[rows[0]:rows[1]].tobytes()
    whole = 500 * 64 * 2 + 16  # the one read that checks the file's chunk addresses when it is opened: a whole chunk
    assert [n for _, n in reads].count(whole) == 1
    reads = [r for r in reads if r[1] != whole]
    assert len(reads) == len(hints) == 32 * spans_per_chunk
    assert sum(n for _, n in reads) == 32 * (16 + (rows[1] - rows[0]) * 64 * 2)
    assert sorted(hints) == sorted(reads)


def test_a_raw_sized_chunk_that_is_compressed_is_decoded_whole(tmp_path):
    """A compressed frame padded with trailing bytes to exactly the size of a raw one (valid: HDF5's filter ignores
    what follows the last block) is not taken for raw rows: its header is checked, and it is decoded whole."""
    a = _data(None, (1000, 64), "<i2", "smooth")
    path = tmp_path / "c.h5"
    with h5py.File(path, "w") as f:
        d = f.create_dataset("a", data=a, chunks=(500, 64), **hdf5plugin.LZ4())
        nbytes = 500 * 64 * 2
        _, frame = d.id.read_direct_chunk((0, 0))
        assert len(frame) < nbytes + 16
        d.id.write_direct_chunk((0, 0), frame + bytes(nbytes + 16 - len(frame)))
    with h5py.File(path, "r") as f:
        d = f["a"]
        assert d.id.get_chunk_info(0).size == nbytes + 16
        for box in (((0, 2), (0, 64)), ((499, 500), (0, 64)), ((0, 1000), (0, 64))):
            want = d[tuple(slice(*b) for b in box)]
            assert _reader_read(d, box, 1).tobytes() == want.tobytes() == a[slice(*box[0])].tobytes()


def test_a_peek_at_rows_past_the_end_of_a_truncated_file_names_the_chunk(tmp_path):
    """A file cut short after it was opened: a small read whose rows lie past the new end raises CorruptChunkError
    for the chunk holding them (never zeros, never another chunk's bytes)."""
    rng = np.random.default_rng(8)
    a = _data(rng, (1000, 2048), "<i2", "random")
    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("a", data=a, chunks=(500, 64), **hdf5plugin.LZ4())
    with h5py.File(path, "r") as f:
        r = lz4chunks.plan(f["a"])
        offs = r.index.arrays()[0]
        last = max(offs)  # the chunk stored last in the file
        k = int(np.flatnonzero(offs == last)[0])
        coords = r.grid.coords(r.grid.chunk_idx(k))
        assert r.read(((0, 1), (0, 2048))).tobytes() == a[:1].tobytes()  # the direct handle is checked and kept
        os.truncate(path, int(last) + 1000)
        assert coords[1] >= 64
        box = ((coords[0] + 499, coords[0] + 500), (coords[1] - 64, coords[1] + 64))  # its neighbour first
        with pytest.raises(lz4chunks.CorruptChunkError) as ei:
            r.read(box)
        assert ei.value.coords == coords and "file ends inside the chunk" in ei.value.detail


@pytest.mark.parametrize("gap", [0, 3000, 100_000])
def test_whole_rows_of_raw_chunks_are_read_at_once_and_exact(tmp_path, monkeypatch, gap):
    """A box of whole chunk rows over chunks stored raw in grid order (a cache block of incompressible weights) is
    read with one file read and placed without Python per chunk, also with a little other data between chunk rows
    and in 3-D; chunks further apart, boxes cutting chunk rows or columns take the other paths, all exact."""
    rng = np.random.default_rng(11)
    a = _data(rng, (200, 512), "<i2", "random")
    b = _data(rng, (6, 40, 96), "<f4", "random")
    path = tmp_path / "w.h5"
    with h5py.File(path, "w") as f:
        d = f.create_dataset("a", shape=a.shape, dtype=a.dtype, chunks=(50, 64), **hdf5plugin.LZ4())
        for i, r0 in enumerate(range(0, 200, 50)):
            for c0 in range(0, 512, 64):  # stored at once (h5py's own writes wait in HDF5's chunk cache)
                payload = a[r0:r0 + 50, c0:c0 + 64].tobytes()
                d.id.write_direct_chunk((r0, c0), _frame(payload, len(payload)))
            if gap:
                f.create_dataset(f"pad{i}", data=np.ones(gap, "u1"))  # other data between chunk rows
        f.create_dataset("b", data=b, chunks=(2, 8, 32), **hdf5plugin.LZ4())
    fast = []
    monkeypatch.setattr(reader.LZ4ChunkReader, "_read_raw_rows",
                        _recording(reader.LZ4ChunkReader._read_raw_rows, fast))
    monkeypatch.setattr(reader, "FEW_RAW_CHUNKS", 0)  # blocks of raw chunks would otherwise go chunk by chunk first
    monkeypatch.setattr(index, "LOOKUP_CHUNKS", 0)  # index the datasets (a block is read from an indexed one)
    with h5py.File(path, "r") as f:
        for name, box in (("a", ((0, 200), (0, 512))), ("a", ((50, 150), (0, 512))), ("a", ((50, 100), (0, 512))),
                          ("a", ((7, 133), (0, 512))), ("b", ((0, 6), (0, 40), (0, 96))),
                          ("b", ((2, 6), (0, 40), (0, 96))), ("b", ((1, 5), (0, 40), (0, 96)))):
            want = f[name][tuple(slice(*x) for x in box)].tobytes()
            for threads, fetch in ((1, "direct"), (2, "disk"), (1, "chunks")):
                fast.clear()
                assert _reader_read(f[name], box, threads, fetch).tobytes() == want
                whole = box[0][0] % f[name].chunks[0] == 0 and box[0][1] % f[name].chunks[0] == 0
                near = name == "b" or gap < reader.MAX_GAP or box[0][0] // 50 == (box[0][1] - 1) // 50
                # chunks further apart than MAX_GAP, or read through HDF5 (no file): the general path
                assert fast == [whole and near and fetch != "chunks"]
        fast.clear()
        assert _reader_read(f["a"], ((3, 60), (64, 512)), 1).tobytes() == a[3:60, 64:].tobytes()  # not whole rows
        assert fast == [False]
