"""The torch view: torch/<stem>.pt and torch/model.pt written out in full load with weights_only=True and equal
the fixtures' ref.pt (values, dtypes, containers, ties as shared storage); bounded memory."""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from helpers.cs import FIXTURES, RampTensor, copy_view_file_in_subprocess, write_out
from ckptfs.layouts.hdf5.layout import Hdf5Layout
from ckptfs.layouts.hdf5.entries import TensorEntry
from ckptfs.readers import open_checkpoint
from ckptfs.catalog.model import Container, TensorLeaf
from ckptfs.catalog.materialize import Opaque, Unreadable, to_torch
from ckptfs.views import torch as tview
from ckptfs.views.base import MountOptions, ViewContext

EDGE = FIXTURES / "cstorch_edge_cases"


def _loadable_ref(p: Path) -> bool:
    try:
        torch.load(p, weights_only=True)
        return True
    except Exception:
        return False


CASES = [(FIXTURES / f"{c}/cs/checkpoint.mdl", FIXTURES / f"{c}/ref.pt") for c in ("train_gpt2", "bf16_llama",
                                                                                  "tied_and_scalars")]
CASES += [(p, p.with_suffix(".ref.pt")) for p in sorted(EDGE.glob("*.mdl"))
          if p.with_suffix(".ref.pt").exists() and _loadable_ref(p.with_suffix(".ref.pt"))]
CASES += [(FIXTURES / f"legacy_emulated/{n}.mdl", FIXTURES / f"legacy_emulated/{n}.ref.pt") for n in ("legacy03", "legacy04")]


def view(path: Path, options: MountOptions | None = None):
    ck = open_checkpoint(path)
    return ck, tview.build(ViewContext(ck, path, path.stem, options or MountOptions()))


def load(vf, path: Path):
    write_out(vf, path)
    return torch.load(path, weights_only=True)


def assert_same(a, b, path="root", undefined=()):
    """Exactly equal: container types and order, int keys, tensor dtype/shape/bits, Python scalar types.

    ``undefined``: paths of uninitialised constant-fill tensors, whose values cstorch leaves undefined.
    """
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        if path not in undefined:
            assert a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist(), path
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]", undefined)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]", undefined)
    elif isinstance(a, set):
        assert a == b, path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def storage_groups(obj) -> list:
    """Paths of tensors grouped by the storage they share (groups of two or more)."""
    groups: dict[int, list] = {}

    def walk(x, path):
        if isinstance(x, torch.Tensor):
            groups.setdefault(x.untyped_storage().data_ptr(), []).append(path) if x.numel() else None
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}.{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{path}.{i}")

    walk(obj, "")
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


def catalog_tensor_groups(node) -> list:
    """Paths of tensor leaves (non-empty) that are one Leaf object in the catalog, as storage_groups spells them."""
    groups: dict[int, list] = {}

    def walk(n, path):
        if isinstance(n, Container):
            keys = n.keys if n.keys is not None else range(len(n.children))
            for k, c in zip(keys, n.children):
                walk(c, f"{path}.{k}")
        elif isinstance(n, TensorLeaf) and n.tensor.numel:
            groups.setdefault(id(n.tensor), []).append(path)

    walk(node, "")
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


def _drop(obj, dotted: str):
    """Remove the entry at a dotted key (ref side of a leaf the view reports as left out)."""
    parts = dotted.split(".")
    for p in parts[:-1]:
        obj = obj[int(p) if isinstance(obj, (list, tuple)) or (isinstance(obj, dict) and int(p) in obj
                                                                  if p.isdigit() else False) else p]
    last = parts[-1]
    if isinstance(obj, dict):
        obj.pop(int(last) if last.isdigit() and int(last) in obj else last)
    else:
        obj.pop(int(last))


@pytest.mark.parametrize("src,ref", CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_pt_equals_ref(src, ref, tmp_path):
    ck, r = view(src)
    assert r.missing is None
    ours = load(r.files[f"{src.stem}.pt"], tmp_path / "ours.pt")
    expected = torch.load(ref, weights_only=True)
    left_out = [n.split(": left out")[0] for n in r.notes if ": left out" in n]
    if src.stem == "obj":
        expected.pop("obj_repr")  # the ref holds the object's repr; we leave the pickled object out
        assert left_out == ["obj"]
    for k in left_out:
        if src.stem != "obj":
            _drop(expected, k)
    undefined = {"root" + "".join(f"[{k!r}]" for k in key.split("."))
                 for key, leaf in ck.tensors().items() if getattr(leaf.tensor, "fill", 0) is None}
    assert_same(ours, expected, undefined=undefined)
    assert storage_groups(ours) == catalog_tensor_groups(ck.root)  # ties of the source = shared storage
    if ref.name == "ref.pt":  # these refs kept ties (the edge-case refs were materialised tensor by tensor)
        assert storage_groups(ours) == storage_groups(expected)
    if "model" in (expected if isinstance(expected, dict) else {}):
        model = load(r.files["model.pt"], tmp_path / "model.pt")
        assert_same(model, expected["model"], "root['model']", undefined)
        assert storage_groups(model) == catalog_tensor_groups(ck.subtree("model"))
    else:
        assert "model.pt" not in r.files


def test_ties_are_shared_storage(tmp_path):
    _, r = view(EDGE / "tied.mdl")
    ours = load(r.files["tied.pt"], tmp_path / "t.pt")
    w = ours["model"]["emb.weight"]
    assert ours["model"]["lm_head.weight"].data_ptr() == w.data_ptr() == ours["x"][0].data_ptr() == ours["x"][1].data_ptr()


def _as_torch_view_expects(x, bf16: set, path: str = ""):
    """materialize.to_torch output adjusted to what the torch view writes: numpy arrays become tensors (bf16
    numpy leaves, int16 bits there, become bfloat16 tensors), opaque and unreadable leaves are left out."""
    import numpy as np

    def sub(k, v):
        return _as_torch_view_expects(v, bf16, f"{path}.{k}" if path else str(k))

    if isinstance(x, dict):
        items = [(k, sub(k, v)) for k, v in x.items() if not isinstance(v, (Opaque, Unreadable))]
        return OrderedDict(items) if type(x) is OrderedDict else dict(items)
    if isinstance(x, (list, tuple, set)):
        vals = [sub(i, v) for i, v in enumerate(x) if not isinstance(v, (Opaque, Unreadable))]
        return vals if isinstance(x, list) else type(x)(vals)
    if isinstance(x, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(x))
        return t.view(torch.bfloat16) if path in bf16 else t
    return x


@pytest.mark.parametrize("path", [FIXTURES / "legacy_emulated/legacy01.mdl", EDGE / "numpy.mdl", EDGE / "misc.mdl"],
                         ids=lambda p: p.stem)
def test_pt_without_loadable_ref_equals_the_readers_materialisation(path, tmp_path):
    ck, r = view(path)
    ours = load(r.files[f"{path.stem}.pt"], tmp_path / "o.pt")
    bf16 = {k for k, leaf in ck.tensors().items() if leaf.numpy and leaf.tensor.dtype.name == "bfloat16"}
    assert_same(ours, _as_torch_view_expects(to_torch(ck), bf16))


def test_opaque_objects_left_out_and_noted(tmp_path):
    _, r = view(EDGE / "numpy.mdl")
    ours = load(r.files["numpy.pt"], tmp_path / "n.pt")
    assert set(ours) == {"arr", "bfarr", "f64"}  # np.float64 is a float: a scalar, kept
    assert any(n.startswith("f32: left out (pickled Python object") for n in r.notes)
    assert any(n.startswith("i64: left out") for n in r.notes)
    assert ours["bfarr"].dtype == torch.bfloat16


def test_crc_mode_follows_options(tmp_path):
    _, r = view(EDGE / "src.mdl", MountOptions(zip_crc="zero"))
    vf = r.files["src.pt"]
    assert vf.crc_mode == "zero"
    assert_same(load(vf, tmp_path / "z.pt"), torch.load(EDGE / "src.ref.pt", weights_only=True))


@pytest.mark.slow  # starts a Python process
def test_memory_bounded_copy_of_a_checkpoint_larger_than_the_cache(tmp_path):
    root = Container("dict", ["model", "optimizer"], [
        Container("dict", [f"w{i}" for i in range(2)], [TensorEntry(RampTensor(4 << 20, i)) for i in range(2)]),
        Container("dict", ["state"], [Container("dict", [0, 1], [TensorEntry(RampTensor(4 << 20, 7 + i))
                                                                 for i in range(2)])])])
    src = write_out(Hdf5Layout(root), tmp_path / "big.mdl")
    size, peak = copy_view_file_in_subprocess("torch", src, "big.pt", tmp_path / "big.pt")
    assert size > 64 << 20
    assert peak < 24 << 20, f"peak {peak / 2**20:.1f} MiB"
    got = torch.load(tmp_path / "big.pt", weights_only=True, mmap=True)
    assert got["optimizer"]["state"][1][-1].item() == (4 << 20) - 1 + 8 and got["model"]["w0"][5].item() == 5
