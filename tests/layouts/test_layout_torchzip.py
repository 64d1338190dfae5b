"""TorchZipLayout against real torch.save output: byte identity, random ranges, loading, zip tools."""
from __future__ import annotations

import io
import shutil
import struct
import subprocess
import sys
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.utils.serialization
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfs.dtypes import BY_NAME, DType
from ckptfs.errors import CkptfsError
from ckptfs.tensor.base import ArrayTensor, VirtualTensor
from ckptfs.layouts.torchzip.layout import TorchZipLayout
from helpers import FIXTURES

DTYPES = sorted(BY_NAME.values(), key=lambda d: d.name)


# -- helpers ---------------------------------------------------------------------------------------
@dataclass
class CdEntry:
    name: str
    crc: int
    size: int
    header_offset: int
    cd_offset: int  # where this central-directory entry starts


def parse_cd(buf: bytes) -> list[CdEntry]:
    """Central directory of a zip64 archive (as torch writes), parsed independently of ckptfs."""
    assert buf[-22:-18] == b"PK\x05\x06"
    loc = len(buf) - 22 - 20
    assert buf[loc:loc + 4] == b"PK\x06\x07"
    (eocd64,) = struct.unpack_from("<Q", buf, loc + 8)
    n, cd_size, cd_off = struct.unpack_from("<QQQ", buf, eocd64 + 32)
    out, pos = [], cd_off
    for _ in range(n):
        assert buf[pos:pos + 4] == b"PK\x01\x02"
        crc, csize, usize, nlen, xlen, clen = struct.unpack_from("<IIIHHH", buf, pos + 16)
        (hoff,) = struct.unpack_from("<I", buf, pos + 42)
        name = buf[pos + 46:pos + 46 + nlen].decode()
        extra = buf[pos + 46 + nlen:pos + 46 + nlen + xlen]
        if extra:
            vals = list(struct.unpack_from("<" + "Q" * ((len(extra) - 4) // 8), extra, 4))
            if usize == 0xFFFFFFFF:
                usize = vals.pop(0)
                vals.pop(0)
            if hoff == 0xFFFFFFFF:
                hoff = vals.pop(0)
        out.append(CdEntry(name, crc, usize, hoff, pos))
        pos += 46 + nlen + xlen + clen
    assert pos == cd_off + cd_size
    return out


def data_offset(buf: bytes, e: CdEntry) -> int:
    nlen, xlen = struct.unpack_from("<HH", buf, e.header_offset + 26)
    return e.header_offset + 30 + nlen + xlen


def sid_mask(ref: bytes) -> list[tuple[int, int]]:
    """Byte ranges of the serialization_id content and of its CRC fields (descriptor and CD)."""
    (e,) = [e for e in parse_cd(ref) if e.name.endswith("/.data/serialization_id")]
    d = data_offset(ref, e)
    return [(d, d + e.size), (d + e.size + 4, d + e.size + 8), (e.cd_offset + 16, e.cd_offset + 20)]


def masked(data: bytes, start: int, mask) -> bytes:
    b = bytearray(data)
    for lo, hi in mask:
        lo, hi = max(lo - start, 0), min(hi - start, len(b))
        if lo < hi:
            b[lo:hi] = b"\0" * (hi - lo)
    return bytes(b)


def torch_save(obj, crc_mode: str, path=None) -> bytes:
    cfg = torch.utils.serialization.config.save
    old = cfg.compute_crc32
    cfg.compute_crc32 = crc_mode == "exact"
    try:
        if path is not None:
            torch.save(obj, path)
            return open(path, "rb").read()
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()
    finally:
        cfg.compute_crc32 = old


def torch_of(arr: np.ndarray, dt: DType) -> torch.Tensor:
    """A fresh torch tensor with torch's own contiguous strides (numpy gives 0 strides to empty arrays)."""
    src = torch.from_numpy(np.asarray(arr, order="C")).view(getattr(torch, dt.name))
    return torch.empty(arr.shape, dtype=src.dtype).copy_(src)


def to_torch(obj, memo=None):
    """The same structure with VirtualTensor leaves replaced by torch tensors (distinct tensor object per
    appearance, one storage per VirtualTensor — what ``state_dict()`` gives for tied weights); str/int
    objects are kept so that pickle memo identities are the same."""
    memo = {} if memo is None else memo
    if isinstance(obj, ArrayTensor):
        if id(obj) not in memo:
            memo[id(obj)] = torch_of(obj.array, obj.dtype)
        return memo[id(obj)].detach()
    if id(obj) in memo:
        return memo[id(obj)]
    t = type(obj)
    if t in (dict, OrderedDict):
        new = t()
        memo[id(obj)] = new
        for k, v in obj.items():
            new[k] = to_torch(v, memo)
        return new
    if t is list:
        new = []
        memo[id(obj)] = new
        new.extend(to_torch(v, memo) for v in obj)
        return new
    if t is tuple:
        new = tuple(to_torch(v, memo) for v in obj)
        memo[id(obj)] = new
        return new
    if t is set:
        new = {to_torch(v, memo) for v in obj}
        memo[id(obj)] = new
        return new
    return obj


def random_array(shape, dt: DType, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64))
    if dt.name == "bool":
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    raw = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt.storage).reshape(shape)


def layout_bytes(layout, chunk=None) -> bytes:
    chunk = chunk or layout.size
    return b"".join(layout.read(o, chunk) for o in range(0, layout.size, chunk))


@pytest.fixture(scope="module")
def llama_state():
    from safetensors.numpy import load_file

    arrays = load_file(str(FIXTURES / "llama" / "hf" / "model.safetensors"))
    return OrderedDict((k, ArrayTensor(v)) for k, v in arrays.items())


# -- strategies ------------------------------------------------------------------------------------
@st.composite
def tensor_dicts(draw, max_tensors=8):
    n = draw(st.integers(1, max_tensors))
    names = draw(st.lists(st.text(min_size=1, max_size=10), min_size=n, max_size=n, unique=True))
    vts: list[ArrayTensor] = []
    items = []
    for name in names:
        if vts and draw(st.integers(0, 3)) == 0:  # tie: same VirtualTensor again
            items.append((name, vts[draw(st.integers(0, len(vts) - 1))]))
            continue
        dt = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=4)))
        vts.append(ArrayTensor(random_array(shape, dt, draw(st.integers(0, 2**32 - 1))), dt))
        items.append((name, vts[-1]))
    return OrderedDict(items) if draw(st.booleans()) else dict(items)


# -- byte identity ---------------------------------------------------------------------------------
@pytest.mark.parametrize("crc", ["exact", "zero"])
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=tensor_dicts(), data=st.data())
def test_random_ranges_equal_torch_save(crc, obj, data):
    ref = torch_save(to_torch(obj), crc)
    layout = TorchZipLayout(obj, "archive", crc=crc)
    assert layout.size == len(ref)
    mask = sid_mask(ref)
    for _ in range(data.draw(st.integers(1, 8))):
        a = data.draw(st.integers(0, layout.size))
        n = data.draw(st.integers(0, layout.size))
        assert masked(layout.read(a, n), a, mask) == masked(ref[a:a + n], a, mask)
    assert masked(layout.read(0, layout.size), 0, mask) == masked(ref, 0, mask)


@pytest.mark.parametrize("crc", ["exact", "zero"])
def test_llama_fixture_identical_to_torch_save(llama_state, crc, tmp_path):
    ref = torch_save(to_torch(llama_state), crc, tmp_path / "pytorch_model.bin")
    layout = TorchZipLayout(llama_state, "pytorch_model", crc=crc)
    got = layout_bytes(layout, 4096)
    mask = sid_mask(ref)
    assert masked(got, 0, mask) == masked(ref, 0, mask)
    diff = [i for i in range(len(ref)) if got[i] != ref[i]]
    assert diff and all(any(lo <= i < hi for lo, hi in mask) for i in diff)


def test_tied_and_views_of_every_dtype_identical(tmp_path):
    """Every dtype incl. the v3 path, 0-d and empty tensors, ties, with exact CRCs, read backwards."""
    items, rng = [], np.random.default_rng(7)
    for i, dt in enumerate(DTYPES):
        for shape in [(), (0,), (3, 0, 2), (2, 3), (1, 2, 1, 3, 2)]:
            vt = ArrayTensor(random_array(shape, dt, int(rng.integers(1 << 30))), dt)
            items += [(f"{dt.name}.{len(shape)}.{i}", vt), (f"{dt.name}.{shape}.tied", vt)]
    obj = OrderedDict(items)
    ref = torch_save(to_torch(obj), "exact")
    layout = TorchZipLayout(obj, "archive")
    chunks = [layout.read(o, 1000) for o in reversed(range(0, layout.size, 1000))]
    got = b"".join(reversed(chunks))
    mask = sid_mask(ref)
    assert masked(got, 0, mask) == masked(ref, 0, mask)


@pytest.mark.slow  # 65,600 records
@pytest.mark.parametrize("kind", [OrderedDict, dict])
def test_many_entries_zip64_counts_and_long_memo(kind):
    """More than 65535 records (16-bit counts saturate) and memo indices past 255 (LONG_BINPUT)."""
    arrays = [np.full((2,), i, "f4") for i in range(65600)]
    obj = kind((f"l.{i}", ArrayTensor(a)) for i, a in enumerate(arrays))
    ref = torch_save(to_torch(obj), "zero")
    layout = TorchZipLayout(obj, "archive", crc="zero")
    mask = sid_mask(ref)
    assert layout.size == len(ref)
    assert masked(layout.read(0, layout.size), 0, mask) == masked(ref, 0, mask)
    assert len(parse_cd(ref)) == 65600 + 6


def test_archive_name_and_unsupported_values():
    layout = TorchZipLayout({"w": ArrayTensor(np.zeros(2, "f4"))}, "pytorch_model-00001-of-00002")
    assert all(e.name.startswith("pytorch_model-00001-of-00002/") for e in layout.entries)
    with pytest.raises(CkptfsError, match="bytes"):
        TorchZipLayout({"w": b"raw"}, "x")
    with pytest.raises(CkptfsError, match="CRC mode"):
        TorchZipLayout({}, "x", crc="sometimes")


# -- loading and zip tools -------------------------------------------------------------------------
def write_out(layout, path, chunk=128 << 10):
    with open(path, "wb") as f:
        for o in range(0, layout.size, chunk):
            f.write(layout.read(o, chunk))
    return path


def check_loaded(loaded, obj):
    assert type(loaded) is type(obj) and list(loaded) == list(obj)
    ptrs = {}
    for k, vt in obj.items():
        t = loaded[k]
        assert t.dtype == getattr(torch, vt.dtype.name) and tuple(t.shape) == vt.shape
        assert t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() == vt.read_bytes(0, vt.nbytes)
        if vt.nbytes:
            ptrs.setdefault(id(vt), t.untyped_storage().data_ptr())
            assert t.untyped_storage().data_ptr() == ptrs[id(vt)]  # ties share storage after load


@settings(max_examples=60, deadline=None)
@given(obj=tensor_dicts(max_tensors=6))
def test_copied_file_loads_with_torch(obj, tmp_path_factory):
    path = write_out(TorchZipLayout(obj, "x"), tmp_path_factory.mktemp("tz") / "x.pt")
    check_loaded(torch.load(path, weights_only=True), obj)
    check_loaded(torch.load(path, weights_only=True, mmap=True), obj)


def zip_tools_ok(path) -> bool:
    res = subprocess.run([sys.executable, "-m", "zipfile", "-t", str(path)], capture_output=True, text=True)
    ok = res.returncode == 0 and "corrupted" not in res.stdout and "Done testing" in res.stdout
    if shutil.which("unzip"):
        res2 = subprocess.run(["unzip", "-t", str(path)], capture_output=True, text=True)
        assert ok == (res2.returncode == 0 and "No errors detected" in res2.stdout)
    return ok


@pytest.mark.slow  # runs the zip tools
def test_exact_crc_copy_passes_zip_tools_zero_does_not(llama_state, tmp_path):
    exact = write_out(TorchZipLayout(llama_state, "m"), tmp_path / "exact.bin")
    zero = write_out(TorchZipLayout(llama_state, "m", crc="zero"), tmp_path / "zero.bin")
    assert zip_tools_ok(exact)
    assert not zip_tools_ok(zero)  # the checker is able to fail
    for p in (exact, zero):
        check_loaded(torch.load(p, weights_only=True), llama_state)
        check_loaded(torch.load(p, weights_only=True, mmap=True), llama_state)


@pytest.mark.slow  # runs the zip tools
def test_exact_crc_after_random_reads_passes_zip_tools(llama_state, tmp_path):
    """CRCs assembled from out-of-order partial reads and on-demand hashing are still right."""
    layout = TorchZipLayout(llama_state, "m")
    rng = np.random.default_rng(3)
    for _ in range(200):
        layout.read(int(rng.integers(0, layout.size)), int(rng.integers(1, 5000)))
    assert zip_tools_ok(write_out(layout, tmp_path / "m.bin", chunk=777))


# -- nested structures -----------------------------------------------------------------------------
def assert_same(a, b):
    """Equal values and equal types, recursively; tensors compared by dtype, shape and bytes."""
    if isinstance(b, ArrayTensor):
        assert isinstance(a, torch.Tensor) and tuple(a.shape) == b.shape
        assert a.dtype == getattr(torch, b.dtype.name)
        assert a.contiguous().view(-1).view(torch.uint8).numpy().tobytes() == b.read_bytes(0, b.nbytes)
        return
    assert type(a) is type(b), (a, b)
    if isinstance(b, dict):
        assert list(a) == list(b)
        for k in b:
            assert type(k) is type(next(x for x in a if x == k))
            assert_same(a[k], b[k])
    elif isinstance(b, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def nested_checkpoint():
    w = ArrayTensor(np.arange(6, dtype="f4").reshape(2, 3))
    m = ArrayTensor(np.arange(6, dtype="<u2").reshape(3, 2), BY_NAME["bfloat16"])
    model = OrderedDict([("w", w), ("m", m), ("tied", w)])
    return {
        "model": model,
        "optimizer": {"state": {0: {"step": ArrayTensor(np.array(3.0, "f4")), "exp_avg": w},
                                1: {"exp_avg": ArrayTensor(np.zeros((0, 4), "f8"))}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1]}]},
        "global_step": 10, "s": "x", "n": None, "flag": True, "st": {1, 2},
        "big": 2**70, "neg": -5, "t4": (1, 2, 3, 4), "e": (), "l": [], "f8": ArrayTensor(
            np.arange(4, dtype="u1"), BY_NAME["float8_e4m3fn"]),
    }


@pytest.mark.parametrize("mmap", [False, True])
def test_nested_structure_round_trips_weights_only(tmp_path, mmap):
    obj = nested_checkpoint()
    path = write_out(TorchZipLayout(obj, "ckpt"), tmp_path / "ckpt.pt")
    loaded = torch.load(path, weights_only=True, mmap=mmap)
    assert_same(loaded, obj)
    assert loaded["model"]["w"].untyped_storage().data_ptr() == loaded["model"]["tied"].untyped_storage().data_ptr()
    # the pickle writer follows CPython, so even the nested file equals torch.save's
    (tmp_path / "ref").mkdir()
    ref = torch_save(to_torch(obj), "exact", tmp_path / "ref" / "ckpt.pt")
    mask = sid_mask(ref)
    assert masked(open(path, "rb").read(), 0, mask) == masked(ref, 0, mask)


def test_torch_state_dict_of_module_with_tied_weights(tmp_path):
    """A real module's state_dict (distinct tensors over one storage) against our tied VirtualTensors."""
    emb = torch.nn.Embedding(7, 4)
    lin = torch.nn.Linear(4, 7, bias=False)
    lin.weight = emb.weight
    sd = OrderedDict([("emb.weight", emb.weight.detach()), ("lm_head.weight", lin.weight.detach())])
    vt = ArrayTensor(emb.weight.detach().numpy().copy())
    obj = OrderedDict([("emb.weight", vt), ("lm_head.weight", vt)])
    obj_keys = list(obj)  # the same key objects in both dicts
    sd = OrderedDict(zip(obj_keys, sd.values()))
    ref = torch_save(sd, "exact")
    got = TorchZipLayout(obj, "archive").read(0, 1 << 20)
    mask = sid_mask(ref)
    assert masked(got, 0, mask) == masked(ref, 0, mask)


class _Odd(VirtualTensor):
    def read(self, box):
        raise AssertionError("not expected")


def test_size_known_without_reading():
    vt = _Odd((1000, 1000), BY_NAME["float32"])
    layout = TorchZipLayout(OrderedDict(a=vt), "a", crc="zero")
    assert layout.size > 4_000_000
    assert layout.read(0, 64)[:4] == b"PK\x03\x04"
