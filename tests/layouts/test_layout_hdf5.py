"""ckptfs.layouts.hdf5.layout / hdf5_spec: cstorch key naming and spec JSON, the sparse skeleton, lazy reads."""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import h5py
import numpy as np
import pytest
import torch.utils._pytree as pytree
from hypothesis import given, settings, strategies as st

from helpers import read_all
from helpers.cs import RampTensor, h5_bytes_file
from ckptfs.dtypes import BFLOAT16, FLOAT16
from ckptfs.errors import CheckpointError
from ckptfs.layouts.hdf5 import spec_attr as hdf5_spec
from ckptfs.layouts.hdf5.layout import Hdf5Layout
from ckptfs.layouts.hdf5.buffers import ScratchBuffer, SparseBuffer
from ckptfs.layouts.hdf5.entries import (BytesEntry, FullEntry, LinkEntry, NoneEntry, ScalarEntry, StringEntry,
    TensorEntry, entry_metadata)
from ckptfs.catalog.model import Container
from ckptfs.tensor.base import ArrayTensor


# -- spec encoding against torch's own pytree --------------------------------------------------------
def _to_container(obj):
    """Python structure → Container tree with ScalarEntry leaves (for comparison with torch pytree)."""
    if isinstance(obj, collections.defaultdict):
        return Container("defaultdict", list(obj), [_to_container(v) for v in obj.values()],
                         {"default_factory": "builtins.list"})
    if isinstance(obj, collections.OrderedDict):
        return Container("OrderedDict", list(obj), [_to_container(v) for v in obj.values()])
    if isinstance(obj, dict):
        return Container("dict", list(obj), [_to_container(v) for v in obj.values()])
    if isinstance(obj, (list, tuple)):
        return Container(type(obj).__name__, None, [_to_container(v) for v in obj])
    return ScalarEntry(obj)


keys = st.one_of(st.text(min_size=1, max_size=4), st.integers(0, 5))
trees = st.recursive(
    st.integers(0, 9),
    lambda ch: st.one_of(st.lists(ch, max_size=3), st.lists(ch, max_size=3).map(tuple),
                         st.dictionaries(keys, ch, max_size=3),
                         st.dictionaries(st.text(min_size=1, max_size=3), ch, max_size=3).map(collections.OrderedDict)),
    max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(trees)
def test_treespec_matches_torch_pytree(obj):
    assert hdf5_spec.treespec_dumps(_to_container(obj)) == pytree.treespec_dumps(pytree.tree_structure(obj))


def test_defaultdict_treespec_and_cstorch_naming():
    obj = collections.defaultdict(list, {"a": 1})
    c = _to_container(obj)
    assert hdf5_spec.treespec_dumps(c) == pytree.treespec_dumps(pytree.tree_structure(obj))
    assert [k for k, _ in hdf5_spec.flat_items(c)] == ["<class 'list'>"]  # the cstorch quirk (format doc §2.2)
    two = _to_container(collections.defaultdict(list, {"a": 1, "b": 2, "c": 3}))
    assert hdf5_spec.dropped_children(two)
    with pytest.raises(CheckpointError):
        Hdf5Layout(two)


def test_flat_keys_of_the_format_doc_example():
    state = {"model": {"w": 0, "b": 0}, "optimizer": {"state": {0: {"step": 0, "exp_avg": 0}},
             "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0], "empty": {}}]}, "global_step": 10}
    got = [k for k, _ in hdf5_spec.flat_items(_to_container(state))]
    assert got == ["model.w", "model.b", "optimizer.state.0.step", "optimizer.state.0.exp_avg",
                   "optimizer.param_groups.0.lr", "optimizer.param_groups.0.betas.0",
                   "optimizer.param_groups.0.betas.1", "optimizer.param_groups.0.params.0", "global_step"]


def test_spec_attr_skeleton_null_for_sets():
    c = Container("dict", ["s", "t"], [Container("set", None, [ScalarEntry(1)]), ScalarEntry(2)])
    skel, spec = json.loads(hdf5_spec.spec_attr(c))
    assert skel is None and '"builtins.set"' in spec
    skel, _ = json.loads(hdf5_spec.spec_attr(Container("dict", [0, "x"], [ScalarEntry(1), ScalarEntry(2)])))
    assert skel == {"0": "*", "x": "*"}


# -- skeleton buffers (in memory, and in an unlinked temporary file) ----------------------------------
BUFFERS = {"memory": SparseBuffer, "tempfile": lambda: ScratchBuffer(tempfile.TemporaryFile())}


@pytest.mark.parametrize("kind", list(BUFFERS))
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.binary(min_size=0, max_size=40)), max_size=25),
       st.integers(0, 340))
def test_skeleton_buffer_matches_a_bytearray(kind, writes, cut):
    buf, model, written = BUFFERS[kind](), bytearray(), set()
    for off, data in writes:
        buf.seek(off)
        buf.write(data)
        if data:
            if len(model) < off + len(data):
                model.extend(b"\0" * (off + len(data) - len(model)))
            model[off:off + len(data)] = data
            written.update(range(off, off + len(data)))
    assert buf.eof == len(model)
    buf.seek(0)
    out = bytearray(len(model) + 5)  # past the end reads as zeros
    buf.readinto(out)
    assert bytes(out) == bytes(model) + bytes(5)
    buf.truncate(cut)
    model = model[:cut] + b"\0" * max(0, cut - len(model))
    assert buf.eof == cut
    spans = buf.finish()
    assert sorted(spans) == spans and all(a < b for a, b in spans)
    assert all(b0 > a1 for (_, a1), (b0, _) in zip(spans, spans[1:]))  # merged: separate ranges never touch
    assert set().union(*(range(a, b) for a, b in spans)) == {i for i in written if i < cut}
    out = bytearray(cut)
    buf.read_at(0, memoryview(out))
    assert bytes(out) == bytes(model)


# -- the layout ----------------------------------------------------------------------------------------
def _tree():
    w = TensorEntry(ArrayTensor(np.arange(12, dtype=np.float32).reshape(3, 4)))
    one = ScalarEntry(1)
    return Container("dict", ["model", "step", "s", "n", "obj", "lst", "z", "e", "x/y", "mask", "bf", "full", "np"], [
        Container("OrderedDict", ["w", "w2"], [w, w]), one, StringEntry("hi"), NoneEntry(), BytesEntry(b"\x80\x04pickled"),
        Container("list", None, [one, ScalarEntry(2.5), LinkEntry("model.w2")]),
        TensorEntry(ArrayTensor(np.array(3.0, np.float32))), TensorEntry(ArrayTensor(np.zeros((0, 3), np.float32))),
        TensorEntry(ArrayTensor(np.arange(2, dtype=np.int64))), TensorEntry(ArrayTensor(np.array([True, False, True]))),
        TensorEntry(ArrayTensor(np.array([0x3F80, 0xC000], np.uint16), BFLOAT16)), FullEntry((2, 2), FLOAT16, 7.0),
        TensorEntry(ArrayTensor(np.array([0x4000], np.uint16), BFLOAT16), numpy=True)])


def test_layout_reads_back_with_h5py():
    lay = Hdf5Layout(_tree())
    f = h5_bytes_file(read_all(lay))
    assert f.attrs["__version__"] == 0.5 and f.attrs["__cstorch_version__"] == "2.10.0"
    assert f.attrs.get_id("__SUCCESS__").dtype == np.bool_ and bool(f.attrs["__SUCCESS__"])
    np.testing.assert_array_equal(f["model.w"][...], np.arange(12, dtype=np.float32).reshape(3, 4))
    assert "model.w2" not in f  # a repeated entry is a link, not a second dataset
    md = json.loads(f.attrs["model.w2.__metadata__"])["model.w2.__metadata__"]
    assert md == {"key": "model.w", "__LINKED__": True, "__TYPE__": "LinkedObject", "__NONE__": True}
    # an explicit link to a link points at the key that holds the value
    assert json.loads(f.attrs["lst.2.__metadata__"])["lst.2.__metadata__"]["key"] == "model.w"
    assert json.loads(f.attrs["lst.0.__metadata__"])["lst.0.__metadata__"]["key"] == "step"
    assert f["z"].shape == () and f["z"][()] == 3.0 and f["e"].shape == (0, 3)
    assert f["x"]["y"].dtype == np.int64  # "/" in a key makes a group
    assert f["mask"].dtype == np.bool_ and h5py.check_enum_dtype(f["mask"].id.dtype) is None
    assert f["mask"].id.get_type().get_class() == h5py.h5t.ENUM and list(f["mask"][...]) == [True, False, True]
    assert f["bf"].dtype == np.int16 and list(f["bf"][...].view(np.uint16)) == [0x3F80, 0xC000]
    assert list(f["bf"].attrs["dtypes"]) == ["torch.bfloat16"] and list(f["bf"].attrs["rtfx_dtypes"]) == [15]
    assert f["z"].attrs["shapes"].dtype == np.float64 and f["z"].attrs["shapes"].shape == (1, 0)
    assert f["model.w"].attrs["shapes"].tolist() == [[3, 4]]
    assert f["model.w"].id.get_create_plist().get_layout() == h5py.h5d.CONTIGUOUS
    assert f["model.w"].id.get_create_plist().get_nfilters() == 0
    assert f["obj"].attrs["__BYTES__"].tobytes() == b"\x80\x04pickled" and f["obj"].shape is None
    assert list(f["obj"].attrs) == ["__TYPE__", "compressed", "__BYTES__"]
    assert "full" not in f and json.loads(f.attrs["full.__metadata__"])["full.__metadata__"]["fill_value"] == 7.0
    assert dict(f["np"].attrs)["is_bfloat16"] and dict(f["np"].attrs)["__TYPE__"] == "NumpyArraySerializer"


def test_every_leaf_gets_its_metadata_attribute():
    lay = Hdf5Layout(_tree())
    f = h5_bytes_file(read_all(lay))
    for key, entry in lay.items:
        got = json.loads(f.attrs[key + ".__metadata__"])
        assert got["__objects__"] == [key] and got["__spec__"][0] == {key: "*"}
        assert got[key + ".__metadata__"] == json.loads(json.dumps(entry_metadata(entry)))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_byte_range_equals_the_whole_file(data):
    lay = _LAYOUT
    whole = _WHOLE
    off = data.draw(st.integers(0, lay.size + 10))
    n = data.draw(st.integers(0, lay.size + 10))
    assert lay.read(off, n) == whole[off:off + n]


_LAYOUT = Hdf5Layout(_tree())
_WHOLE = read_all(_LAYOUT, 7919)


def test_bytes_are_stable_across_builds():
    assert read_all(Hdf5Layout(_tree())) == _WHOLE


def test_metadata_is_kept_in_a_temporary_file_and_read_back_from_it():
    lay = Hdf5Layout(_tree())
    assert read_all(lay) == _WHOLE
    body = lay.plan().pieces[0]
    assert isinstance(body.buffer, ScratchBuffer)
    assert os.fstat(body.buffer.scratch.fileno()).st_nlink == 0  # unlinked: gone with the layout
    assert "HDF5 metadata" in lay.explain(0).text()
    key, t = "model.w", lay.root.children[0].children[0].tensor
    assert f"tensor {key}" in lay.explain(body.starts[body.tensors.index(t)] + 5).text()


def test_without_a_temporary_file_the_skeleton_is_kept_in_memory(monkeypatch):
    def no_tempfile(*a, **k):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", no_tempfile)
    lay = Hdf5Layout(_tree())
    assert read_all(lay) == _WHOLE
    assert isinstance(lay.plan().pieces[0].buffer, SparseBuffer)


def test_a_temporary_file_that_fails_while_written_falls_back_to_memory(monkeypatch):
    def full_disk(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full_disk)
    lay = Hdf5Layout(_tree())
    assert lay.size == len(_WHOLE)
    monkeypatch.undo()
    assert read_all(lay) == _WHOLE
    assert isinstance(lay.plan().pieces[0].buffer, SparseBuffer)


def test_skeleton_holds_no_tensor_data():
    big = Container("dict", ["a", "b"], [TensorEntry(RampTensor(8 << 20)), TensorEntry(RampTensor(8 << 20, 5))])
    lay = Hdf5Layout(big)
    assert lay.size > 64 << 20
    assert lay.metadata_bytes < 64 << 10
    f = h5_bytes_file(read_all(lay, 4 << 20))
    assert f["b"][(8 << 20) - 1] == (8 << 20) + 4 and f["a"][123] == 123


def test_large_and_empty_pickles_are_carried_as_bytes():
    import os

    blob = os.urandom(300_000)  # larger than an HDF5 compact attribute (64 KiB)
    f = h5_bytes_file(read_all(Hdf5Layout(Container("dict", ["a", "b"], [BytesEntry(b""), BytesEntry(blob)]))))
    assert f["a"].attrs["__BYTES__"].tobytes() == b"" and f["b"].attrs["__BYTES__"].tobytes() == blob


def test_key_collision_and_bad_link_raise_with_path():
    c = Container("dict", [1, "1"], [ScalarEntry(1), ScalarEntry(2)])
    with pytest.raises(CheckpointError) as e:
        Hdf5Layout(c, path="/x/ckpt.mdl")
    assert e.value.path == "/x/ckpt.mdl" and "'1'" in str(e.value)
    with pytest.raises(CheckpointError):
        Hdf5Layout(Container("dict", ["a"], [LinkEntry("nope")]))


@pytest.mark.slow  # starts a Python process
def test_memory_stays_bounded_while_copying_out(tmp_path):
    """64 MiB of tensors through an 8 MiB cache: the traced peak stays near the cache size."""
    script = textwrap.dedent("""
        import sys, tracemalloc
        sys.path.insert(0, %r)
        from helpers.cs import RampTensor
        from ckptfs.tensor.cache import BlockCache
        from ckptfs.layouts.hdf5.layout import Hdf5Layout
        from ckptfs.layouts.hdf5.entries import TensorEntry
        from ckptfs.catalog.model import Container
        root = Container("dict", [f"t{i}" for i in range(4)], [TensorEntry(RampTensor(4 << 20, i)) for i in range(4)])
        tracemalloc.start()
        lay = Hdf5Layout(root, cache=BlockCache(8 << 20))
        n = 0
        with open(%r, "wb") as f:
            for off in range(0, lay.size, 1 << 20):
                n += f.write(lay.read(off, 1 << 20))
        print(n, lay.size, tracemalloc.get_traced_memory()[1])
    """) % (str(__import__("pathlib").Path(__file__).parent.parent), str(tmp_path / "out.mdl"))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    written, size, peak = map(int, out)
    assert written == size > 64 << 20
    assert peak < 20 << 20, f"peak {peak / 2**20:.1f} MiB"
    f = h5py.File(tmp_path / "out.mdl", "r")
    assert f["t3"][(4 << 20) - 1] == (4 << 20) + 2 and f["t0"][0] == 0
