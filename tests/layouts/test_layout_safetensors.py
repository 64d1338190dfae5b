"""SafetensorsLayout against the reference writer (safetensors.torch), on random and real tensors,
and on simulated multi-GiB tensors (layout only, nothing large allocated)."""
from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save, save_file

from ckptfs.tensor.cache import BlockCache
from ckptfs.dtypes import BY_NAME, DType, by_name
from ckptfs.errors import CkptfsError
from ckptfs.layouts.safetensors import DTYPE_ORDER, SafetensorsLayout
from ckptfs.tensor.base import ArrayTensor, VirtualTensor, box_shape
from helpers import FIXTURES


#: every ckptfs dtype the safetensors format can hold
ST_DTYPES = [d for d in BY_NAME.values() if d.safetensors in DTYPE_ORDER]


# -- helpers ----------------------------------------------------------------------------------------
def torch_from_raw(raw: bytes, shape: tuple, dt: DType) -> torch.Tensor:
    tdt = getattr(torch, dt.name)
    if not raw:
        return torch.empty(shape, dtype=tdt)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(tdt).reshape(shape)


def array_tensor_from_torch(t: torch.Tensor) -> ArrayTensor:
    dt = by_name(str(t.dtype))
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return ArrayTensor(np.frombuffer(raw, dt.storage).reshape(tuple(t.shape)), dt)


def random_raw(rng: np.random.Generator, shape: tuple, dt: DType) -> bytes:
    raw = rng.integers(0, 256, math.prod(shape) * dt.itemsize, dtype=np.uint8)
    if dt.name == "bool":
        raw &= 1
    return raw.tobytes()


class PatternTensor(VirtualTensor):
    """A tensor of any size whose byte j is ``(j*131 + seed) % 251`` (bool: that & 1), computed per box.

    Counts ``read`` calls and elements produced, so tests can check what a file read touched.
    """

    def __init__(self, shape, dtype: DType, seed: int = 0):
        super().__init__(shape, dtype)
        self.seed = seed
        self.calls = 0
        self.elements = 0

    def expected(self, start: int, stop: int) -> bytes:
        j = np.arange(start, stop, dtype=np.int64)
        b = ((j * 131 + self.seed) % 251).astype(np.uint8)
        if self.dtype.name == "bool":
            b &= 1
        return b.tobytes()

    def read(self, box):
        self.calls += 1
        shape = box_shape(box)
        flat = np.zeros(shape, dtype=np.int64)
        stride = 1
        for axis in range(self.ndim - 1, -1, -1):
            lo, hi = box[axis]
            idx = np.arange(lo, hi, dtype=np.int64).reshape([-1 if k == axis else 1 for k in range(self.ndim)])
            flat = flat + idx * stride
            stride *= self.shape[axis]
        self.elements += flat.size
        item = self.dtype.itemsize
        j = flat.reshape(-1, 1) * item + np.arange(item, dtype=np.int64)
        b = ((j * 131 + self.seed) % 251).astype(np.uint8)
        if self.dtype.name == "bool":
            b &= 1
        return b.reshape(-1).view(self.dtype.storage).reshape(shape)


# -- random tensor sets vs safetensors.torch.save ------------------------------------------------------
names = st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=12).filter(
    lambda s: s != "__metadata__") | st.from_regex(r"[a-z]{1,3}(\.[a-z0-9]{1,3}){0,3}", fullmatch=True)
tensor_specs = st.tuples(names, st.sampled_from(ST_DTYPES),
                         st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple))
metadatas = st.sampled_from([None, {}, {"format": "pt"}]) | st.dictionaries(
    st.text(max_size=5), st.text(max_size=5), min_size=1, max_size=1)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(tensor_specs, max_size=8, unique_by=lambda s: s[0]), metadata=metadatas,
       seed=st.integers(0, 2**32 - 1), ranges=st.lists(st.tuples(st.floats(0, 1.1), st.integers(0, 300)), max_size=6))
def test_random_tensors_byte_identical(specs, metadata, seed, ranges):
    assume(specs or metadata != {})  # the reference writes invalid JSON there: see test_empty_metadata_no_tensors
    rng = np.random.default_rng(seed)
    ref_tensors, named = {}, []
    for name, dt, shape in specs:
        raw = random_raw(rng, shape, dt)
        ref_tensors[name] = torch_from_raw(raw, shape, dt)
        named.append((name, ArrayTensor(np.frombuffer(raw, dt.storage).reshape(shape), dt)))
    ref = save(ref_tensors, metadata=metadata)
    layout = SafetensorsLayout(named, metadata, cache=BlockCache(1 << 20))
    assert layout.size == len(ref)
    assert layout.read(0, layout.size + 5) == ref
    (n,) = struct.unpack("<Q", ref[:8])
    assert layout.header_bytes == ref[:8 + n]
    header = json.loads(ref[8:8 + n])
    assert layout.data_offsets == {k: tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__"}
    for frac, length in ranges:
        off = int(frac * len(ref))
        assert layout.read(off, length) == ref[off:off + length]


def test_default_metadata_and_save_file(tmp_path):
    """Default metadata is {"format": "pt"}, identical to save_file as transformers calls it."""
    rng = np.random.default_rng(1)
    ref_tensors, named = {}, []
    for i, dt in enumerate(ST_DTYPES):
        shape = (i % 3 + 1, 2)
        raw = random_raw(rng, shape, dt)
        ref_tensors[f"t{i}.{dt.name}"] = torch_from_raw(raw, shape, dt)
        named.append((f"t{i}.{dt.name}", ArrayTensor(np.frombuffer(raw, dt.storage).reshape(shape), dt)))
    save_file(ref_tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    ref = (tmp_path / "ref.safetensors").read_bytes()
    layout = SafetensorsLayout(named)
    assert layout.size == len(ref) and layout.read(0, layout.size) == ref
    assert layout.read(layout.size, 10) == b"" and layout.read(3, 0) == b""
    with pytest.raises(ValueError):
        layout.read(-1, 4)


def test_empty_metadata_no_tensors():
    """safetensors 0.8 writes the invalid header '{},"__metadata__":{}}' for this case (its own reader
    refuses it); the layout writes the valid JSON instead, which the reference reader accepts."""
    from safetensors.torch import load

    with pytest.raises(Exception, match="invalid JSON"):
        load(save({}, metadata={}))
    layout = SafetensorsLayout([], {})
    assert load(layout.read(0, layout.size)) == {}
    assert json.loads(layout.read(8, layout.size)) == {"__metadata__": {}}


def test_rejections():
    t = ArrayTensor(np.zeros(2, np.float32))
    with pytest.raises(ValueError):
        SafetensorsLayout([("a", t), ("a", t)])
    with pytest.raises(ValueError):
        SafetensorsLayout([("__metadata__", t)])
    with pytest.raises(ValueError):
        SafetensorsLayout([("a", t)], {"format": 1})
    with pytest.raises(CkptfsError, match="c128"):
        SafetensorsLayout([("c128", ArrayTensor(np.zeros(2, np.complex128)))])
    with pytest.raises(KeyError):  # the reference library refuses complex128 too
        save({"c128": torch.zeros(2, dtype=torch.complex128)})


# -- real tensors ---------------------------------------------------------------------------------------
def fixture_state_dicts():
    cases = [(p.parent.parent.name, load_file(p)) for p in sorted(FIXTURES.glob("*/hf/model.safetensors"))]
    for ref_pt in sorted(FIXTURES.glob("*/ref.pt")):
        model = torch.load(ref_pt, weights_only=False)["model"]
        cases.append((ref_pt.parent.name, {k: v.clone() for k, v in model.items()}))
    return cases


@pytest.mark.parametrize("case,tensors", fixture_state_dicts(), ids=lambda x: x if isinstance(x, str) else "")
def test_fixture_tensors_byte_identical(case, tensors, tmp_path):
    out = tmp_path / "ref.safetensors"
    save_file(tensors, out, metadata={"format": "pt"})
    ref = out.read_bytes()
    layout = SafetensorsLayout([(k, array_tensor_from_torch(v)) for k, v in tensors.items()])
    assert layout.size == len(ref)
    assert layout.read(0, layout.size) == ref
    original = FIXTURES / case / "hf" / "model.safetensors"
    if original.exists():  # written by save_pretrained (safetensors 0.4.5): identical too
        assert original.read_bytes() == ref
    step = 4093
    for off in range(0, layout.size, step):
        assert layout.read(off, step) == ref[off:off + step]


# -- simulated multi-GiB tensors ----------------------------------------------------------------------
def huge_named():
    return [
        ("model.embed.weight", PatternTensor((1 << 17, 1 << 14), BY_NAME["float16"], seed=1)),  # 4 GiB
        ("model.big.weight", PatternTensor((3, 1 << 29), BY_NAME["float32"], seed=2)),  # 6 GiB
        ("model.mask", PatternTensor(((1 << 32) + 3,), BY_NAME["bool"], seed=3)),  # 4 GiB + 3
        ("model.norm", PatternTensor((7,), BY_NAME["bfloat16"], seed=4)),
        ("model.scalar", PatternTensor((), BY_NAME["int64"], seed=5)),
        ("model.empty", PatternTensor((0, 1 << 20), BY_NAME["float32"], seed=6)),
        ("lm_head.weight", PatternTensor((1 << 15, 1 << 15), BY_NAME["bfloat16"], seed=7)),  # 2 GiB
    ]


def expected_file_bytes(layout: SafetensorsLayout, off: int, n: int) -> bytes:
    """Independent oracle: header bytes, then each tensor's pattern at its offsets."""
    out = bytearray()
    end = min(off + n, layout.size)
    pos = off
    while pos < end:
        if pos < layout.data_start:
            chunk = layout.header_bytes[pos:min(end, layout.data_start)]
        else:
            rel = pos - layout.data_start
            e = next(e for e in layout.entries if e.begin <= rel < e.end)
            chunk = e.tensor.expected(rel - e.begin, min(end - layout.data_start, e.end) - e.begin)
        out += chunk
        pos += len(chunk)
    return bytes(out)


def test_huge_layout_is_valid_safetensors(tmp_path):
    named = huge_named()
    layout = SafetensorsLayout(named, cache=BlockCache(16 << 20))
    total = sum(t.nbytes for _, t in named)
    assert layout.size == layout.data_start + total and layout.size > 16 << 30
    assert layout.data_start % 8 == 0
    # order and contiguity: dtype size descending (safetensors enum order), then name
    ranks = [DTYPE_ORDER.index(e.tensor.dtype.safetensors) for e in layout.entries]
    assert ranks == sorted(ranks, reverse=True)
    assert [e.begin for e in layout.entries[1:]] == [e.end for e in layout.entries[:-1]]
    assert layout.entries[0].begin == 0 and layout.entries[-1].end == total
    # The reference reader validates header, offsets and file size on a sparse file of the right size
    # holding our bytes near the start and the end; nothing is allocated on disk in between.
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.truncate(layout.size)
        for off, n in [(0, layout.data_start + 4096), (layout.size - (3 << 20) - 17, (3 << 20) + 17)]:
            f.seek(off)
            f.write(layout.read(off, n))
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == sorted(n for n, _ in named)
        for name, t in named:
            sl = f.get_slice(name)
            assert tuple(sl.get_shape()) == t.shape
            assert sl.get_dtype() == t.dtype.safetensors
        last = layout.entries[-1].tensor  # 1-D bool, 4 GiB + 3
        assert last.ndim == 1
        tail = f.get_slice(layout.entries[-1].name)[last.numel - 100:last.numel]
        got = tail.contiguous().view(torch.uint8).numpy().tobytes()
        assert got == last.expected(last.nbytes - 100, last.nbytes)
        first = layout.entries[0]
        head = f.get_slice(first.name)[()]  # the 0-d int64 comes first
        assert head.reshape(1).view(torch.uint8).numpy().tobytes() == first.tensor.expected(0, 8)


def test_huge_reads_near_the_end_and_boundaries():
    named = huge_named()
    layout = SafetensorsLayout(named, cache=BlockCache(16 << 20))
    probes = [(layout.size - 1, 1), (layout.size - 4097, 8192), (0, layout.data_start + 3)]
    for e in layout.entries:  # every tensor boundary, including empty and 0-d tensors
        probes.append((layout.data_start + e.begin - 5, 11))
    for off, n in probes:
        got = layout.read(off, n)
        assert got == expected_file_bytes(layout, off, n)
        assert len(got) == min(off + n, layout.size) - off


def test_last_mib_touches_only_last_tensor():
    named = huge_named()
    layout = SafetensorsLayout(named, cache=BlockCache(16 << 20))
    last = layout.entries[-1]
    n = 1 << 20
    assert last.end - last.begin > n
    data = layout.read(layout.size - n, n)
    assert data == expected_file_bytes(layout, layout.size - n, n)
    for e in layout.entries:
        if e == last:  # entries are made on demand: equal, not the same object
            assert e.tensor.calls > 0
            # at most the cache blocks overlapping the range were produced
            block = e.tensor.block_elems() * e.tensor.dtype.itemsize
            assert e.tensor.elements * e.tensor.dtype.itemsize <= n + 2 * block
        else:
            assert e.tensor.calls == 0, e.name
