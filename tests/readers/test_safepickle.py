"""The restricted pickle decoder: plain values of every protocol decode as pickle does; torch.save's data.pkl
decodes to descriptions whose bytes are torch.load's; everything else — globals, classes, sets, cycles, bombs,
truncation — is one line of PickleRefused, never another exception, never a hang."""
from __future__ import annotations

import io
import math
import pickle
import pickletools
import struct
import zipfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from ckptfs.guard import safepickle as sp
from ckptfs.guard.safepickle import Limits, PickleRefused, loads_plain, loads_torch


def same(a, b) -> bool:
    """Deep equality that also checks types (True is not 1) and treats NaN as equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 200), max_value=1 << 200),
                    st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=20))
keys = st.one_of(st.text(max_size=10), st.integers(), st.booleans(), st.none(), st.binary(max_size=5),
                 st.tuples(st.integers(), st.text(max_size=3)))
plain = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.tuples(inner, inner), st.tuples(inner),
    st.dictionaries(keys, inner, max_size=6)), max_leaves=40)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plain, st.integers(min_value=0, max_value=5))
def test_plain_values_decode_as_pickle_does(value, protocol):
    data = pickle.dumps(value, protocol)
    assert same(loads_plain(data), value)
    assert same(loads_plain(data), pickle.loads(data))


def test_shared_parts_stay_shared():
    inner = [1, 2]
    out = loads_plain(pickle.dumps({"a": inner, "b": inner}, 2))
    assert out == {"a": [1, 2], "b": [1, 2]} and out["a"] is out["b"]


class _OnlyBytesGlobals(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in (("_codecs", "encode"), ("builtins", "bytes"), ("__builtin__", "bytes")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError("refused")


def _mutants(data: bytes, draw):
    """A few byte-level edits of a valid pickle."""
    b = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.integers(0, 3))
        i = draw(st.integers(0, max(len(b) - 1, 0)))
        if kind == 0 and b:
            b[i] = draw(st.integers(0, 255))
        elif kind == 1:
            b.insert(i, draw(st.integers(0, 255)))
        elif kind == 2 and b:
            del b[i]
        else:
            b = b[:i]
    return bytes(b)


@settings(max_examples=600, deadline=2000, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(plain, st.integers(min_value=0, max_value=5), st.data())
def test_mutated_pickles_decode_like_pickle_or_are_refused(value, protocol, data):
    """Any byte string gives a value or PickleRefused; a value it gives is what pickle itself gives."""
    raw = _mutants(pickle.dumps(value, protocol), data.draw)
    try:
        out = loads_plain(raw)
    except PickleRefused as e:
        assert "\n" not in str(e)
        return
    try:
        ref = _OnlyBytesGlobals(io.BytesIO(raw)).load()
    except MemoryError:  # pickle itself allocates a mutated frame length up front: no reference to compare with
        return
    assert same(out, ref)


def test_an_opcode_crossing_its_frames_end_is_refused():
    """A frame shorter than the opcodes in it (CPython's C reader reads on past the frame and gives another value
    than its pure-Python reader, which refuses) or a frame inside a frame is refused, never decoded."""
    good = pickle.dumps(((0.0,), None), 4)
    assert good[2] == 0x95 and loads_plain(good) == ((0.0,), None)
    for size in (1, 2, 3, 8):  # the frame ends inside BINFLOAT's 8 bytes
        bad = good[:3] + struct.pack("<Q", size) + good[11:]
        with pytest.raises(PickleRefused, match="crosses the end of its frame"):
            loads_plain(bad)
    inner = good[:11] + b"\x95" + struct.pack("<Q", 9) + good[11:]
    with pytest.raises(PickleRefused, match="before the end of the current frame"):
        loads_plain(good[:3] + struct.pack("<Q", len(inner) - 12) + inner[11:])
    two = good[:3] + struct.pack("<Q", 9) + good[11:20] + b"\x95" + struct.pack("<Q", len(good) - 20) + good[20:]
    assert loads_plain(two) == ((0.0,), None)  # one frame after another is fine


@pytest.mark.parametrize("raw", [b"I010\n.", b"I-07\n.", b"L0000000001L\n.", b"L010\n.", b"I0x10\n.", b"I 1\n."])
def test_integers_in_text_are_decimal_as_pickle_writes_them(raw):
    """Only the spelling pickle writes: C's reader takes 010 for octal 8 and Python's int(.., 0) refuses it."""
    with pytest.raises(PickleRefused, match="is not a decimal integer"):
        loads_plain(raw)
    assert loads_plain(b"I10\n.") == 10 and loads_plain(b"I-3\n.") == -3 and loads_plain(b"L0L\n.") == 0


@settings(max_examples=500, deadline=2000)
@given(st.binary(max_size=300))
def test_random_bytes_are_refused_or_plain(raw):
    for load in (loads_plain, lambda d: loads_torch(d)):
        try:
            load(raw)
        except PickleRefused as e:
            assert "\n" not in str(e)


class _Evil:
    def __reduce__(self):
        import os
        return (os.system, ("echo pwned",))


class _Obj:
    def __init__(self):
        self.x = 1


@pytest.mark.parametrize("protocol", range(6))
@pytest.mark.parametrize("value, pattern", [
    (_Evil(), r"global posix\.system is not allowed"),
    (_Obj(), r"global (copy_reg\._reconstructor|test_safepickle\._Obj) is not allowed"),
    ({1, 2}, r"global (__builtin__|builtins)\.set is not allowed|opcode EMPTY_SET makes a set"),
    (frozenset([1]), r"global (__builtin__|builtins)\.frozenset is not allowed|opcode FROZENSET makes a frozenset"),
    (bytearray(b"x"), r"global (__builtin__|builtins)\.bytearray is not allowed|opcode BYTEARRAY8 makes a bytearray"),
    (range(3), r"global (__builtin__|builtins)\.(x?range) is not allowed"),
    (np.int64(3), r"global numpy\..* is not allowed"),
])
def test_plain_mode_refuses_objects_in_one_line(value, pattern, protocol):
    data = pickle.dumps(value, protocol)
    with pytest.raises(PickleRefused, match=pattern) as e:
        loads_plain(data)
    assert "\n" not in str(e.value) and "pickle byte" in str(e.value)


def test_refused_opcodes():
    cases = {
        b"(i__main__\nX\n.": "opcode INST instantiates a class",
        b"(c__builtin__\ndict\no.": "global __builtin__.dict is not allowed",
        b"\x80\x02}\x81.": "opcode NEWOBJ instantiates a class",
        b"\x80\x02\x82\x01.": "opcode EXT1",
        b"\x80\x05\x97.": "opcode NEXT_BUFFER reads an out-of-band buffer",
        b"\x80\x02X\x01\x00\x00\x00aQ.": "persistent id 'a'",
        b"\x80\x02}}b.": "BUILD on a dict",
        b"\x80\x06N.": "protocol 6",
        b"\x80\x02N": "truncated: no STOP",
        b"\x80\x02NN.": "STOP with 2 values",
        b"\x80\x02h\x05.": "memo entry 5 does not exist",
        b"\x80\x02X\xff\x00\x00\x00ab.": "truncated",
        b"\xff.": "unknown opcode",
        b"\x80\x02(.": "STOP with 0 values on the stack and an open MARK",
        b"\x80\x02}]a.": "APPEND(S) on a dict",
        b"\x80\x02]N]s.": "SETITEM(S) on a list",
        b"Ix10\n.": "is not a decimal integer",
        b"\x80\x02X\x02\x00\x00\x00\xc3(.": "not UTF-8",
    }
    for raw, words in cases.items():
        with pytest.raises(PickleRefused, match=None) as e:
            loads_plain(raw)
        assert words in str(e.value), (raw, str(e.value))


def test_cycles_are_refused():
    a = []
    a.append(a)
    with pytest.raises(PickleRefused, match="cycle"):
        loads_plain(pickle.dumps(a, 2))
    d = {}
    d["self"] = [d]
    with pytest.raises(PickleRefused, match="cycle"):
        loads_plain(pickle.dumps(d, 4))


def test_shared_tuple_bomb_is_refused_quickly():
    """A tuple of two references to the previous one, 80 times: 2^80 leaves as a tree, 160 opcodes."""
    out = bytearray(b"\x80\x02N")
    for _ in range(80):
        out += b"\x94"[0:0] + b"q\x00" + b"h\x00" + b"\x86"  # BINPUT 0, BINGET 0, TUPLE2
    out += b"."
    with pytest.raises(PickleRefused, match="expands to more than"):
        loads_plain(bytes(out))
    # … and as a dict key (hashing it would take 2^k steps) it is refused before it is hashed
    key = bytearray(b"\x80\x02}N")
    for _ in range(60):
        key += b"q\x00h\x00\x86"
    key += b"Ns."
    with pytest.raises(PickleRefused, match="dict key of more than"):
        loads_plain(bytes(key))


def test_limits_bound_depth_memo_containers_and_size():
    deep = b"\x80\x02" + b"]" * 50 + b"a" * 49 + b"."
    with pytest.raises(PickleRefused, match="nests deeper than 20"):
        loads_plain(deep, limits=Limits(max_depth=20))
    assert loads_plain(deep, limits=Limits(max_depth=60))
    marks = b"\x80\x02" + b"(" * 30
    with pytest.raises(PickleRefused, match="MARKs nested deeper than 20"):
        loads_plain(marks, limits=Limits(max_depth=20))
    memo = b"\x80\x02N" + b"".join(b"r" + struct.pack("<I", i) for i in range(100)) + b"."
    with pytest.raises(PickleRefused, match="more than 50 memo entries"):
        loads_plain(memo, limits=Limits(max_memo=50))
    with pytest.raises(PickleRefused, match="list of more than 100 items"):
        loads_plain(b"\x80\x02]" + b"Na" * 200 + b".", limits=Limits(max_container=100))
    with pytest.raises(PickleRefused, match="dict of more than 100 items"):
        loads_plain(b"\x80\x02}" + b"".join(b"J" + struct.pack("<i", i) + b"Ns" for i in range(200)) + b".",
                    limits=Limits(max_container=100))
    big = pickle.dumps(list(range(1000)), 2)
    with pytest.raises(PickleRefused, match="exceeds the 100-byte limit"):
        loads_plain(big, limits=Limits(max_bytes=100))
    with pytest.raises(PickleRefused, match="integer of 2000 bytes"):
        loads_plain(b"\x80\x02\x8b" + struct.pack("<i", 2000) + b"\x01" * 2000 + b".")
    with pytest.raises(PickleRefused, match="more than 500 objects"):
        loads_plain(pickle.dumps([[i] for i in range(1000)], 2), limits=Limits(max_items=500))
    # a DUP loop growing the stack
    with pytest.raises(PickleRefused, match="stack deeper than 100"):
        loads_plain(b"\x80\x02N" + b"2" * 200 + b".", limits=Limits(max_container=100))


# -- torch ---------------------------------------------------------------------------------------------------

def _state_dict():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.LayerNorm(3), torch.nn.Embedding(7, 3))
    sd = m.state_dict()
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sd["bf16"] = torch.randn(3, 4).to(torch.bfloat16)
    sd["f16"] = torch.randn(2, 2).half()
    sd["f64"] = torch.randn(2).double()
    sd["i64"] = torch.tensor([1, -2, 3])
    sd["i32"] = torch.tensor([[7]], dtype=torch.int32)
    sd["u8"] = torch.tensor([255, 0], dtype=torch.uint8)
    sd["bool"] = torch.tensor([True, False])
    sd["f8"] = torch.randn(4).to(torch.float8_e4m3fn)
    sd["u16"] = torch.tensor([1, 65535], dtype=torch.uint16)
    sd["scalar"] = torch.tensor(2.5)
    sd["empty"] = torch.zeros(0, 3)
    sd["transposed"] = base.t()
    sd["row_view"] = base[1:3]
    sd["col_view"] = base[:, 2:4]
    sd["tied"] = sd["2.weight"]  # the same tensor object under two names
    return sd


def _torch_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _view_bytes(zf: zipfile.ZipFile, prefix: str, d: sp.TorchTensor) -> bytes:
    raw = zf.read(f"{prefix}/data/{d.storage.key}")
    storage_dtype = d.storage.dtype or d.dtype
    assert len(raw) == d.storage.numel * (storage_dtype.itemsize if d.storage.dtype else 1)
    arr = np.frombuffer(raw, dtype=d.dtype.storage)
    assert sp.tensor_extent(d) <= len(arr)
    view = np.lib.stride_tricks.as_strided(arr[d.offset:] if arr.size else arr, shape=d.shape,
                                           strides=tuple(s * d.dtype.itemsize for s in d.stride))
    return np.ascontiguousarray(view).tobytes()


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_torch_save_state_dict_decodes_to_torch_load(tmp_path, protocol):
    sd = _state_dict()
    path = tmp_path / "pytorch_model.bin"
    torch.save(sd, path, pickle_protocol=protocol)
    with zipfile.ZipFile(path) as zf:
        pkl = [n for n in zf.namelist() if n.endswith("/data.pkl")][0]
        prefix = pkl[:-len("/data.pkl")]
        desc = loads_torch(zf.read(pkl))
        ref = torch.load(path, weights_only=False)  # our own file; weights_only reads no FRAME
        assert list(desc) == list(ref)
        assert desc._metadata == ref._metadata
        for name, t in ref.items():
            d = desc[name]
            assert isinstance(d, sp.TorchTensor), name
            assert d.dtype.name == str(t.dtype).removeprefix("torch."), name
            assert d.shape == tuple(t.shape) and d.stride == t.stride() and d.offset == t.storage_offset(), name
            assert _view_bytes(zf, prefix, d) == _torch_bytes(t), name
        assert desc["tied"] is desc["2.weight"]
        assert desc["row_view"].storage == desc["transposed"].storage  # one storage, three views


def test_torch_parameters_and_plain_containers(tmp_path):
    m = torch.nn.Linear(2, 2)
    path = tmp_path / "p.bin"
    torch.save({"params": dict(m.named_parameters()), "step": 3, "names": ["a", "b"], "t": (1.5, None)}, path)
    with zipfile.ZipFile(path) as zf:
        desc = loads_torch(zf.read("p/data.pkl"))
    assert desc["step"] == 3 and desc["names"] == ["a", "b"] and desc["t"] == (1.5, None)
    w = desc["params"]["weight"]
    assert w.requires_grad and w.shape == (2, 2) and w.dtype.name == "float32"


def test_torch_mode_refuses_a_whole_module_and_code(tmp_path):
    path = tmp_path / "m.bin"
    torch.save(torch.nn.Linear(2, 2), path)
    with zipfile.ZipFile(path) as zf:
        with pytest.raises(PickleRefused, match="global torch.nn.modules.linear.Linear is not allowed"):
            loads_torch(zf.read("m/data.pkl"))
    with pytest.raises(PickleRefused, match="global posix.system is not allowed"):
        loads_torch(pickle.dumps({"w": _Evil()}, 2))
    # a storage type called as a function, a dtype as a storage, an untyped storage without a dtype
    calls = b"\x80\x02ctorch\nFloatStorage\n)R."
    with pytest.raises(PickleRefused, match="REDUCE calls a StorageType"):
        loads_torch(calls)
    bad_pid = b"\x80\x02(X\x07\x00\x00\x00storagectorch\nfloat32\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x01tQ."
    with pytest.raises(PickleRefused, match="not a torch storage class"):
        loads_torch(bad_pid)


def _tensor_pickle(size=(2, 3), stride=(3, 1), offset=0, hooks=b"ccollections\nOrderedDict\n)R"):
    """data.pkl of one tensor, written by hand (to vary what torch.save would never write)."""
    def tup(xs):
        return b"(" + b"".join(b"J" + struct.pack("<i", x) for x in xs) + b"t"
    return (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(" +
            b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x06tQ" +
            b"J" + struct.pack("<i", offset) + tup(size) + tup(stride) + b"\x89" + hooks + b"tR.")


def test_torch_tensor_arguments_are_checked():
    d = loads_torch(_tensor_pickle())
    assert d.shape == (2, 3) and d.stride == (3, 1) and sp.tensor_extent(d) == 6
    with pytest.raises(PickleRefused, match="negative size or stride"):
        loads_torch(_tensor_pickle(stride=(-3, 1)))
    with pytest.raises(PickleRefused, match="differ in length"):
        loads_torch(_tensor_pickle(stride=(3,)))
    with pytest.raises(PickleRefused, match="storage offset -1"):
        loads_torch(_tensor_pickle(offset=-1))
    with pytest.raises(PickleRefused, match="backward hooks"):
        loads_torch(_tensor_pickle(hooks=b"K\x01"))


def test_torch_pickle_names_only_the_allowed_globals(tmp_path):
    """Every global torch.save writes for these state dicts is one the decoder knows (guards the allow-list)."""
    path = tmp_path / "a.bin"
    torch.save(_state_dict(), path)
    with zipfile.ZipFile(path) as zf:
        ops = pickletools.genops(zf.read("a/data.pkl"))
        names = {arg.replace(" ", ".") for op, arg, _ in ops if op.name == "GLOBAL"}
    assert names <= set(sp._TORCH_GLOBALS), names - set(sp._TORCH_GLOBALS)
    assert "torch._utils._rebuild_tensor_v3" in names and "torch.BFloat16Storage" in names
