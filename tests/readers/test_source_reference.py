"""The source layer against ground truth: every fixture's ref.pt (torch.save of what cstorch.load
returned), the converter fixtures' keys.json / HF safetensors, and the raw HDF5 objects via h5py."""
from __future__ import annotations

import collections
import json
import pickle
from pathlib import Path

import h5py
import hdf5plugin  # noqa: F401
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from ckptfs.catalog.model import OpaqueLeaf, TensorLeaf, UnreadableLeaf, ValueLeaf
from ckptfs.readers import open_checkpoint
from ckptfs.catalog.materialize import Opaque, Unreadable, to_torch
from helpers import FIXTURES as FIX

EDGE = FIX / "cstorch_edge_cases"


class _Stub:
    """Stands in for classes a ref.pt names that are not installed (cerebras' DeferredObject)."""

    def __init__(self, *a, **k):
        pass

    def __setstate__(self, state):
        self.state = state


class _StubUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return type(name, (_Stub,), {})


class _StubPickle:
    Unpickler = _StubUnpickler
    load = pickle.load


def load_ref(p: Path):
    return torch.load(p, weights_only=False, pickle_module=_StubPickle)


def _ref_cases():
    cases = [(p.with_name(p.name[: -len(".ref.pt")] + ".mdl"), p) for p in sorted(EDGE.rglob("*.ref.pt"))]
    cases += [(FIX / n / "cs" / "checkpoint.mdl", FIX / n / "ref.pt") for n in ("train_gpt2", "bf16_llama", "tied_and_scalars")]
    cases += [(FIX / "legacy_emulated" / f"legacy0{i}.mdl", FIX / "legacy_emulated" / f"legacy0{i}.ref.pt") for i in (3, 4)]
    return cases


def raw_bytes_attr(mdl: Path, key: str) -> bytes:
    with h5py.File(mdl, "r") as f:
        return np.asarray(f[key].attrs["__BYTES__"]).tobytes()


def uninitialised_fill(mdl: Path, key: str) -> bool:
    """True if the file stores ``key`` as a DeferredFullTensor with a null fill_value (uninitialised memory)."""
    with h5py.File(mdl, "r") as f:
        text = f.attrs.get(key + ".__metadata__")
    if text is None:
        return False
    md = json.loads(text).get(key + ".__metadata__", {})
    return md.get("__TYPE__") == "DeferredFullTensor" and md.get("fill_value") is None


def spec_type_of_root(mdl: Path) -> str:
    with h5py.File(mdl, "r") as f:
        return json.loads(json.loads(f.attrs["__spec__"])[1])[1]["type"]


def assert_same(ours, ref, mdl: Path, path=()):
    """Exact equality of values, dtypes, shapes, container types and keys (int keys included)."""
    where = "root" + "".join(f"[{k!r}]" for k in path)
    if isinstance(ref, _Stub):  # a pickled numpy scalar cstorch left as a DeferredObject: compare with the file's bytes
        assert isinstance(ours, Opaque), where
        assert ours.data == raw_bytes_attr(mdl, ".".join(str(k) for k in path)), where
        return
    if isinstance(ours, collections.defaultdict) and type(ref) is dict:
        # cstorch.load hands a defaultdict back as a plain dict; the file's spec records the defaultdict
        assert spec_type_of_root(mdl) == "collections.defaultdict" and not path, where
        ours = dict(ours)
    assert type(ours) is type(ref), f"{where}: {type(ours).__name__} != {type(ref).__name__}"
    if isinstance(ref, dict):
        assert list(ours.keys()) == list(ref.keys()), where
        for k in ref:
            assert_same(ours[k], ref[k], mdl, path + (k,))
    elif isinstance(ref, (list, tuple)):
        assert len(ours) == len(ref), where
        for i, (a, b) in enumerate(zip(ours, ref)):
            assert_same(a, b, mdl, path + (i,))
    elif isinstance(ref, torch.Tensor):
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, f"{where}: {ours.dtype}{list(ours.shape)}"
        if uninitialised_fill(mdl, ".".join(str(k) for k in path)):
            # uninitialised fill: the reference holds whatever memory torch.empty returned; ckptfs gives zeros
            assert not ours.any(), where
        else:
            assert torch.equal(ours, ref), where
    elif isinstance(ref, np.ndarray):
        assert ours.dtype == ref.dtype and np.array_equal(ours, ref), where
    else:
        assert type(ours) is type(ref) and ours == ref, f"{where}: {ours!r} != {ref!r}"


def _is_v05(mdl: Path) -> bool:
    with h5py.File(mdl, "r") as f:
        return float(f.attrs.get("__version__", 0.1)) >= 0.5


def _shared_storage_groups(obj, path=(), out=None):
    out = {} if out is None else out
    if isinstance(obj, dict):
        for k, v in obj.items():
            _shared_storage_groups(v, path + (k,), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _shared_storage_groups(v, path + (i,), out)
    elif isinstance(obj, torch.Tensor) and obj.numel():
        sig = (obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape), obj.stride(), obj.dtype)
        out.setdefault(sig, []).append(path)
    return out


def _get(obj, path):
    for k in path:
        obj = obj[k]
    return obj


@pytest.mark.parametrize("mdl,ref", _ref_cases(), ids=lambda p: str(p.relative_to(FIX)) if isinstance(p, Path) else p)
def test_matches_reference(mdl, ref):
    expected = load_ref(ref)
    with open_checkpoint(mdl) as ckpt:
        ours = to_torch(ckpt)
        links = dict(ckpt.links)
    if mdl.name == "obj.mdl":  # the ref keeps the model and only a repr of the pickled object
        assert list(expected) == ["model", "obj_repr"]
        assert_same(ours["model"], expected["model"], mdl, ("model",))
        assert isinstance(ours["obj"], Opaque) and ours["obj"].data == raw_bytes_attr(mdl, "obj")
        return
    assert_same(ours, expected, mdl)
    # ties: where the reference shares storage, ckptfs gives the very same tensor object
    for paths in _shared_storage_groups(expected).values():
        objs = [_get(ours, p) for p in paths]
        assert all(o is objs[0] for o in objs), paths
    # and every link resolves to the same Python object as its target
    flat = {}

    def collect(o, prefix=""):
        if isinstance(o, dict):
            for k, v in o.items():
                collect(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(o, (list, tuple)):
            for i, v in enumerate(o):
                collect(v, f"{prefix}.{i}" if prefix else str(i))
        else:
            flat[prefix] = o

    collect(ours)
    for alias, target in links.items():
        if alias in flat and target in flat:
            assert flat[alias] is flat[target], alias


def test_tied_leaves_are_one_object():
    with open_checkpoint(FIX / "tied_and_scalars" / "cs" / "checkpoint.mdl") as ckpt:
        a, b = ckpt.leaves["model.embedding.weight"], ckpt.leaves["model.lm_head.weight"]
        assert a is b and isinstance(a, TensorLeaf)
        assert ckpt.links["model.lm_head.weight"] == "model.embedding.weight"
        # links of non-tensor values too (cstorch dedups any repeated Python object)
        assert ckpt.leaves["total_steps"] is ckpt.leaves["global_step"]
        assert ckpt.leaves["nested.list.3"] is ckpt.leaves["nothing"]


def test_legacy_hard_links_and_link_to_self_share_the_leaf():
    with open_checkpoint(FIX / "legacy_emulated" / "legacy04.mdl") as ckpt:
        w = ckpt.leaves["model.w"]
        assert ckpt.leaves["model.tied"] is w  # HDF5 hard link
        assert ckpt.leaves["selflink"] is w  # DeferredH5Tensor link_to_self
        with h5py.File(ckpt.path, "r") as f:
            assert f["model.tied"].id == f["model.w"].id


def test_legacy01_matches_legacy03_content():
    """0.1 (flag attributes, no __version__) holds the same state as 0.3; is_scalar leaves come back as .item()."""
    ref = load_ref(FIX / "legacy_emulated" / "legacy03.ref.pt")
    p = FIX / "legacy_emulated" / "legacy01.mdl"
    with open_checkpoint(p) as ckpt:
        assert ckpt.format_version == 0.1 and ckpt.release == "1.7" and ckpt.success
        ours = to_torch(ckpt)
    assert_same(ours["model"], ref["model"], p, ("model",))
    assert ours["global_step"] == ref["global_step"] and type(ours["global_step"]) is int
    assert ours["optimizer"]["param_groups"] == ref["optimizer"]["param_groups"]
    step = ours["optimizer"]["state"][0]["step"]
    assert type(step) is float and step == ref["optimizer"]["state"][0]["step"].item()
    with h5py.File(p, "r") as f:  # the constructible (fill) tensor, as its attributes describe it
        a = f["full"].attrs
        expect = np.full(tuple(a["shape"]), a["fill_value"], dtype=f["full"].dtype)
    assert np.array_equal(ours["full"].numpy(), expect) and ours["full"].numpy().dtype == expect.dtype


def test_release_from_version_map_and_attribute():
    with open_checkpoint(FIX / "legacy_emulated" / "legacy03.mdl") as c3, \
            open_checkpoint(FIX / "legacy_emulated" / "legacy04.mdl") as c4, \
            open_checkpoint(FIX / "train_gpt2" / "cs" / "checkpoint.mdl") as c5:
        assert (c3.format_version, c3.release) == (0.3, "1.9")
        with h5py.File(c4.path, "r") as f:
            assert c4.release == f.attrs["__cstorch_version__"]
        with h5py.File(c5.path, "r") as f:
            assert c5.release == f.attrs["__cstorch_version__"]


def test_release_from_metadata_history(tmp_path):
    """Without __cstorch_version__, the last entry of the state dict's __metadata__ history names the release."""
    dst = tmp_path / "ck.mdl"
    dst.write_bytes((FIX / "train_gpt2" / "cs" / "checkpoint.mdl").read_bytes())
    with h5py.File(dst, "a") as f:
        del f.attrs["__cstorch_version__"]
        hist = json.loads(f.attrs["__metadata__.0.version.__metadata__"])
        expected = hist["__metadata__.0.version.__metadata__"]["string_value"]
    with open_checkpoint(dst) as ckpt:
        assert ckpt.release == expected


CONVERTER_CASES = sorted(p.parent.parent.name for p in FIX.glob("*/cs/keys.json"))


@pytest.mark.parametrize("case", CONVERTER_CASES)
def test_catalog_matches_keys_json(case):
    """Every entry cstorch.load returned (keys.json) is a leaf with the same kind, value, shape, dtype and link."""
    entries = json.loads((FIX / case / "cs" / "keys.json").read_text())["entries"]
    with open_checkpoint(FIX / case / "cs" / "checkpoint.mdl") as ckpt:
        assert list(ckpt.leaves) == list(entries)
        for key, e in entries.items():
            leaf = ckpt.leaves[key]
            if e["kind"] == "tensor":
                assert isinstance(leaf, TensorLeaf), key
                assert list(leaf.tensor.shape) == e["shape"] and leaf.tensor.dtype.name == e["dtype"], key
            else:
                assert isinstance(leaf, ValueLeaf), key
                assert type(leaf.value).__name__ == {"none": "NoneType"}.get(e["kind"], e["kind"]), key
                assert leaf.value == e.get("value"), key
            if e.get("serializer") == "LinkedObject":
                assert ckpt.links[key] == e["linked_to"] and leaf is ckpt.leaves[e["linked_to"]], key
            else:
                assert key not in ckpt.links


@pytest.mark.parametrize("case", sorted(p.parent.parent.name for p in FIX.glob("*/hf/model.safetensors")))
def test_identical_tensors_match_hf_safetensors(case):
    """Where the manifest says a CS tensor is identical to an HF tensor, the bytes read must equal safetensors'."""
    manifest = json.loads((FIX / case / "MANIFEST.json").read_text())
    hf = load_file(str(FIX / case / "hf" / "model.safetensors"))
    checked = 0
    with open_checkpoint(FIX / case / "cs" / "checkpoint.mdl") as ckpt:
        for hf_name, rel in manifest["hf_to_cs_relations"].items():
            if not rel.startswith("identical to ") or hf_name not in hf:
                continue
            text = rel[len("identical to "):].strip()  # "key" or "key (also key2, key3)"
            first, _, also = text.partition(" (also ")
            for cs_key in [first] + [k.strip() for k in also.rstrip(")").split(",") if k.strip()]:
                t = ckpt.leaves[cs_key].tensor
                assert np.array_equal(t.read_all(), hf[hf_name].view(t.dtype.storage)), cs_key
                assert t.read_bytes(0, t.nbytes) == hf[hf_name].tobytes(), cs_key
                checked += 1
    assert checked > 0


@pytest.mark.parametrize("mdl", sorted(p for p in FIX.rglob("*.mdl") if _is_v05(p) and p.name != "intkeys.mdl"),
                         ids=lambda p: str(p.relative_to(FIX)))
def test_leaf_keys_are_the_files_metadata_keys(mdl):
    """cstorch named every top-level key by its recurse_spec rule; the file's `<key>.__metadata__` attributes
    are exactly those names, and the spec structure agrees with torch's own pytree decoder."""
    from torch.utils._pytree import treespec_loads

    with h5py.File(mdl, "r") as f:
        names = [a[: -len(".__metadata__")] for a in f.attrs if a.endswith(".__metadata__")]
        spec_text = json.loads(f.attrs["__spec__"])[1]
    with open_checkpoint(mdl) as ckpt:
        assert sorted(ckpt.leaves) == sorted(names)
        n = sum(1 for _ in ckpt.leaves)
    try:
        ts = treespec_loads(spec_text)
    except Exception:  # a type this torch cannot rebuild (e.g. cstorch's set registration)
        return
    assert ts.num_leaves == n


def test_bf16_and_numpy_leaves():
    with open_checkpoint(EDGE / "numpy.mdl") as ckpt:
        arr, bfarr = ckpt.leaves["arr"], ckpt.leaves["bfarr"]
        assert isinstance(arr, TensorLeaf) and arr.numpy and arr.tensor.dtype.name == "int32"
        assert bfarr.numpy and bfarr.tensor.dtype.name == "bfloat16" and bfarr.tensor.dtype.storage == np.dtype("<u2")
        assert isinstance(ckpt.leaves["f32"], OpaqueLeaf) and isinstance(ckpt.leaves["f64"], ValueLeaf)
    with open_checkpoint(EDGE / "bf16model.mdl") as ckpt, h5py.File(EDGE / "bf16model.mdl", "r") as f:
        t = ckpt.leaves["model.weight"].tensor
        assert t.dtype.name == "bfloat16"
        assert np.array_equal(t.read_all(), f["model.weight"][()].view(np.uint16))


def test_graph_tensor_is_unreadable_not_a_crash():
    with open_checkpoint(EDGE / "graph.mdl") as ckpt:
        leaf = ckpt.leaves["g"]
        assert isinstance(leaf, UnreadableLeaf) and "TorchScript" in leaf.reason
        with h5py.File(EDGE / "graph.mdl", "r") as f:
            graph_md = json.loads(f.attrs["g.__metadata__"])["g.1.__metadata__"]
        assert list(leaf.shape) == graph_md["shape"] and "torch." + leaf.dtype == graph_md["dtype"]
        assert isinstance(to_torch(ckpt)["g"], Unreadable)


def test_external_references_resolve_against_the_checkpoint_folder(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # not the checkpoint's folder
    ext = EDGE / "external"
    with open_checkpoint(ext / "ext.mdl") as ckpt, open_checkpoint(ext / "src.mdl") as src:
        assert np.array_equal(ckpt.leaves["model.a"].tensor.read_all(), src.leaves["model.a"].tensor.read_all())
    st = load_file(str(ext / "m.safetensors"))
    with open_checkpoint(ext / "from_st.mdl") as ckpt:
        for name in ("v", "w"):
            t = ckpt.leaves[f"model.{name}"].tensor
            assert t.shape == st[name].shape and np.array_equal(t.read_all(), st[name])
            assert t.read((( 1, 3),) + tuple((0, n) for n in t.shape[1:])).tobytes() == st[name][1:3].tobytes()
