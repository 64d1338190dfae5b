"""pickle2.dumps2 against CPython's own pickler (protocol 2), and what torch's weights_only loader accepts."""
from __future__ import annotations

import io
import pickle
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfs.layouts.torchzip.pickle_writer import Global, PersistentId, PickleTypeError, Reduce, dumps2

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8)
hashables = st.recursive(st.integers() | st.text(max_size=4) | st.booleans(),
                         lambda c: st.tuples(c) | st.tuples(c, c) | st.lists(c, max_size=5).map(tuple), max_leaves=6)
keys = st.integers(-5, 10**12) | st.text(max_size=6)


def containers(children):
    return (st.lists(children, max_size=6)
            | st.lists(children, max_size=6).map(tuple)
            | st.dictionaries(keys, children, max_size=6)
            | st.dictionaries(keys, children, max_size=6).map(OrderedDict)
            | st.sets(hashables, max_size=5))


values = st.recursive(scalars, containers, max_leaves=25)


@settings(max_examples=400, deadline=None)
@given(values)
def test_same_bytes_as_cpython(obj):
    assert dumps2(obj) == pickle.dumps(obj, protocol=2)


@settings(max_examples=100, deadline=None)
@given(st.lists(scalars | st.lists(scalars, max_size=3), min_size=1, max_size=6), st.data())
def test_shared_objects_memoized_like_cpython(pool, data):
    """The same objects referenced several times (BINGET by identity)."""
    refs = data.draw(st.lists(st.integers(0, len(pool) - 1), max_size=12))
    obj = {"a": [pool[i] for i in refs], "b": tuple(pool[i] for i in refs), "c": OrderedDict((str(i), pool[i]) for i in refs)}
    assert dumps2(obj) == pickle.dumps(obj, protocol=2)


@pytest.mark.parametrize("n", [0, 1, 2, 999, 1000, 1001, 2000, 2001])
def test_batching_like_cpython(n):
    """Batches of 1000; dict, OrderedDict and list each end their batches their own way."""
    for obj in ({i: i for i in range(n)}, OrderedDict((str(i), i) for i in range(n)), list(range(n)),
                set(range(n)), {"k": [str(i) for i in range(n)]}):
        assert dumps2(obj) == pickle.dumps(obj, protocol=2)


def test_ordered_dict_instance_state_and_recursion():
    od = OrderedDict(a=1)
    od._metadata = OrderedDict({"": {"version": 1}})  # like nn.Module.state_dict()
    lst: list = []
    lst.append(lst)
    cyc = [1]
    cyc.append((cyc, 2))
    for obj in (od, lst, cyc, [10**300, -(10**300), -1, -256, -(2**31), 2**31 - 1, 2**31, 65535, 65536]):
        assert dumps2(obj) == pickle.dumps(obj, protocol=2)


def test_markers_and_weights_only_loader():
    import torch

    v2 = Global("torch._utils", "_rebuild_tensor_v2")
    obj = {"x": Reduce(Global("collections", "OrderedDict"), ()), "g": Global("torch", "float32"), "g2": v2,
           "st": {1, 2}, "t": (1.5, None, True), "big": 2**80}
    data = dumps2(obj)
    loaded = torch.load(io.BytesIO(_as_zip(data)), weights_only=True)
    assert loaded == {"x": OrderedDict(), "g": torch.float32, "g2": torch._utils._rebuild_tensor_v2,
                      "st": {1, 2}, "t": (1.5, None, True), "big": 2**80}
    assert type(loaded["x"]) is OrderedDict
    p = dumps2([PersistentId(("storage", 1)), PersistentId(("storage", 1))])
    assert p.count(b"Q") == 2  # persistent ids are never memoized
    with pytest.raises(PickleTypeError):
        dumps2(b"bytes")
    with pytest.raises(PickleTypeError):
        dumps2(frozenset())


def _as_zip(pkl: bytes) -> bytes:
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/version", "3\n")
    return buf.getvalue()
