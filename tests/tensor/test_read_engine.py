"""The read engine (ckptfs.layouts.pieces) and the block cache it reads through: one read loop for every file
format, one cache per mounted tree, cache blocks shared by aliases and aligned to the source's chunks."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

import ckptfs
from ckptfs.tensor.cache import BlockCache
from ckptfs.dtypes import FLOAT32
from ckptfs.errors import TensorReadError
from ckptfs.layouts.hdf5.layout import Hdf5Layout
from ckptfs.layouts.npy import NpyLayout
from ckptfs.layouts.pieces import Computed, Literal, PiecedFile, TensorBytes, Zeros
from ckptfs.layouts.safetensors import SafetensorsLayout
from ckptfs.layouts.torchzip.layout import TorchZipLayout
from ckptfs.tensor import ops
from ckptfs.tensor.base import ArrayTensor, VirtualTensor, box_shape
from ckptfs.layouts.file import VirtualFile, fill
from ckptfs.views.hf.view import weight_files

from helpers import FIXTURES, read_all


class ChunkedTensor(VirtualTensor):
    """A source stored in chunks of ``chunks``: a read decodes every chunk its box touches (counted)."""

    def __init__(self, shape, chunks, dtype=FLOAT32):
        super().__init__(shape, dtype)
        self.chunks = tuple(chunks)
        self.array = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
        self.decoded = 0  # elements of the chunks decoded so far
        self.reads = 0

    def chunk_shape(self):
        return self.chunks

    def read(self, box):
        self.reads += 1
        per_dim = [(-(-b // c) - a // c) * c for (a, b), c in zip(box, self.chunks)]
        self.decoded += math.prod(per_dim) if all(b > a for a, b in box) else 0
        return np.ascontiguousarray(self.array[tuple(slice(a, b) for a, b in box)])


# -- the engine -------------------------------------------------------------------------------------------------


def test_every_layout_is_planned_pieces_read_by_the_one_loop():
    for cls in (SafetensorsLayout, NpyLayout, TorchZipLayout, Hdf5Layout):
        assert issubclass(cls, PiecedFile)
        assert cls.read is VirtualFile.read and cls.readinto is PiecedFile.readinto, cls.__name__


def test_any_range_of_a_pieced_file_is_the_concatenation_of_its_pieces():
    t = ArrayTensor(np.arange(3000, dtype=np.float32).reshape(30, 100))
    computed = bytes(range(200)) * 3
    pieces = [Literal(b"head", "header"), Zeros(13), TensorBytes(t, "t", start=40, size=9000), Literal(b""),
              Computed(len(computed), lambda a, b: computed[a:b], "computed tail")]
    whole = b"head" + bytes(13) + t.array.tobytes()[40:9040] + computed
    f = PiecedFile(pieces, name="file", cache=BlockCache(1 << 20))
    assert f.size == len(whole) and read_all(f, 777) == whole
    rng = random.Random(0)
    for _ in range(300):
        off, n = rng.randrange(f.size + 10), rng.randrange(3000)
        assert f.read(off, n) == whole[off:off + n]
    buf = bytearray(50)  # a read past the end is clipped by the one clipping of every file (virtual_file.fill)
    assert fill(f, f.size - 20, memoryview(buf), "file") == 20 and buf[:20] == whole[-20:]


def test_a_piece_that_produces_the_wrong_count_is_an_error_naming_file_and_piece():
    f = PiecedFile([Literal(b"ok"), Computed(10, lambda a, b: b"short", "the directory")], name="x.bin")
    assert f.read(0, 2) == b"ok"
    with pytest.raises(TensorReadError) as e:
        f.read(0, 12)
    assert "x.bin" in str(e.value) and "the directory" in str(e.value)


def test_a_file_with_a_plan_is_planned_once_on_first_use():
    calls = []

    def plan():
        calls.append(1)
        return [Literal(b"abc"), Zeros(2)]

    f = PiecedFile(name="lazy", plan=plan)
    assert calls == []
    assert f.size == 5 and f.read(1, 10) == b"bc\0\0" and len(calls) == 1


def test_explain_names_the_piece_element_block_and_source_region():
    src = ChunkedTensor((8, 6), (4, 3))
    st = SafetensorsLayout([("w", ops.Transpose(src))], name="model.safetensors")
    e = st.explain(st.data_start + 4 * (2 * 8 + 5))  # element [2, 5] of the transpose = source [5, 2]
    text = e.text()
    assert "model.safetensors" in text and "tensor w" in text and "element [2, 5]" in text
    assert "element [5, 2]" in text and "chunk [1, 0]" in text
    assert "safetensors header" in st.explain(0).text()
    assert "past the end" in st.explain(st.size).text()


# -- one cache per tree ---------------------------------------------------------------------------------------


def test_a_second_open_does_not_change_the_first_trees_cache():
    ckpt = FIXTURES / "llama" / "cs" / "checkpoint.mdl"
    a = ckptfs.open(ckpt, cache_size="1MiB", views="tensors")
    cache_a = a.cache
    b = ckptfs.open(ckpt, cache_size="2MiB", views="tensors")
    try:
        assert a.cache is cache_a and cache_a.max_bytes == 1 << 20 and b.cache.max_bytes == 2 << 20
        path = a.file_paths()[-1]
        a.read(path, 0, a.attr(path).size)
        assert cache_a.size > 0 and b.cache.size == 0  # reads of one tree never fill another's cache
        for f in (a.lookup(p).file for p in a.file_paths()):
            assert getattr(f, "cache", cache_a) is cache_a
    finally:
        a.close()
        b.close()


def test_a_tied_tensor_read_through_both_names_is_decoded_once():
    src = ChunkedTensor((64, 32), (16, 32))
    tied = ops.Transpose(src)  # as the mapping core gives it: one tensor object under two HF names
    cache = BlockCache(64 << 20)
    files = weight_files([("lm_head.weight", tied), ("embed.weight", tied)], max_shard_size=10**9, zip_crc="exact",
                         cache=cache)
    st, pt = files["model.safetensors"], files["pytorch_model.bin"]
    data = read_all(st)
    read_all(pt)
    img = src.array.T.tobytes()
    assert data.count(img) == 2  # both names hold the bytes...
    assert src.decoded == src.numel  # ...decoded once, for safetensors (Alias) and the torch zip alike
    assert len(st.entries) == 2 and st.entries[0].tensor.cache_key == st.entries[1].tensor.cache_key


# -- blocks aligned to the source's chunks ------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda s: ops.Transpose(s),
    lambda s: ops.Cast(ops.Transpose(s), "bfloat16"),
    lambda s: ops.PermuteRows(ops.Transpose(s), heads=8, rotary_dim=64),
], ids=["transpose", "cast", "permute_rows"])
def test_blocks_of_a_transposed_tensor_decode_each_source_chunk_once(make):
    src = ChunkedTensor((1536, 512), (1536, 128))  # column chunks: a transpose's rows are its columns
    t = make(src)
    cache = BlockCache(64 << 20)
    buf = bytearray(t.nbytes)
    assert t.read_into(0, memoryview(buf), cache) == t.nbytes
    assert src.decoded == src.numel, f"{src.decoded / src.numel:.2f}x the source decoded"
    be = t.block_elems()
    assert be % (128 * t.shape[1]) == 0  # whole chunk rows of the transposed tensor


@pytest.mark.parametrize("start,length,reads", [
    (0, 6 << 10, 1),  # a row and a half from a tensor's start: two whole rows, read once over the same chunks
    (4096 - 8, 16, 2),  # a few bytes either side of a row's end: two small reads, not two whole rows
    (15 * 4096 + 2048, 4096 + 1024, 2),  # across a chunk row's end: whole rows would touch more chunks
    (3 * 4096 + 100, 2 * 4096, 1),  # a wrap whose parts cover every column: the same chunks either way
], ids=["head", "row-end", "chunk-row-end", "wrap"])
def test_a_peek_over_parts_of_rows_reads_whole_rows_once_when_that_costs_less(start, length, reads):
    src = ChunkedTensor((64, 1024), (16, 128))  # rows of 4 KiB, 8 chunks across
    cache = BlockCache(64 << 20)
    cache.streaming = True  # as mounted: a small read decodes only the chunks under it
    buf = bytearray(length)
    assert src.read_into(start, memoryview(buf), cache) == length
    assert bytes(buf) == src.array.tobytes()[start:start + length]
    assert src.reads == reads


def test_box_shapes_match(tmp_path):
    """ChunkedTensor counts what a box touches (a check of the test helper itself)."""
    s = ChunkedTensor((10, 10), (4, 4))
    assert s.read(((0, 5), (0, 4))).shape == box_shape(((0, 5), (0, 4))) and s.decoded == 8 * 4


def test_the_explain_command_follows_a_byte_to_its_source_chunk(capsys):
    from ckptfs.cli import main

    ckpt = FIXTURES / "gpt2" / "cs" / "checkpoint.mdl"
    tree = ckptfs.open(ckpt)
    try:
        st = tree.lookup("model.safetensors").file
        entry = next(e for e in st.entries if e.name == "transformer.h.0.mlp.c_fc.weight")  # a transposed tensor
        offset = st.data_start + entry.begin + 4 * 100
    finally:
        tree.close()
    assert main(["explain", str(ckpt), "model.safetensors", hex(offset)]) == 0
    out = capsys.readouterr().out
    assert "tensor transformer.h.0.mlp.c_fc.weight" in out and "transpose" in out
    assert "<- element" in out and "chunk [" in out
    assert main(["explain", str(ckpt), "config.json", "3"]) == 0
    assert "BytesFile: A small file whose whole content is known up front" in capsys.readouterr().out
    assert main(["explain", str(ckpt), "model.safetensor", "3"]) == 2  # close matches, one line
    assert "model.safetensors" in capsys.readouterr().err
