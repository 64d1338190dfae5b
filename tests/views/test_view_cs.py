"""The cs view: cs/<stem>.mdl (format 0.5, upgraded) read back by ckptfs's reader, its HDF5 structure against
files written by cerebras-pytorch 2.10, legacy upgrades, cs/<stem>.yaml, bounded memory."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import h5py
import hdf5plugin  # noqa: F401  (the fixtures' datasets are LZ4-filtered)
import pytest
import yaml

from helpers import read_all
from helpers.cs import (FIXTURES, RampTensor, copy_view_file_in_subprocess, h5_bytes_file, link_groups, renamed_legacy_copy,
                    tree_sig, write_out)
from ckptfs.layouts.hdf5.layout import Hdf5Layout
from ckptfs.layouts.hdf5.entries import TensorEntry
from ckptfs.readers import open_checkpoint
from ckptfs.catalog.model import Container
from ckptfs.upgrade import state_tree as T
from ckptfs.views import cs
from ckptfs.views.base import MountOptions, ViewContext

EDGE = FIXTURES / "cstorch_edge_cases"
CURRENT = [FIXTURES / "train_gpt2/cs/checkpoint.mdl", FIXTURES / "bf16_llama/cs/checkpoint.mdl",
           FIXTURES / "tied_and_scalars/cs/checkpoint.mdl", FIXTURES / "llama/cs/checkpoint.mdl",
           FIXTURES / "t5/cs/checkpoint.mdl"] + \
    sorted(p for p in EDGE.glob("*.mdl") if p.stem not in ("intkeys", "graph")) + sorted((EDGE / "external").glob("*.mdl"))
# written by cstorch.save 2.10 in the plain (not nested, not external) form we write too
SAME_FORM = [p for p in CURRENT if p.stem not in ("lazyemu",) and p.parent.name != "external"]


def view(path: Path, options: MountOptions | None = None):
    ck = open_checkpoint(path)
    return ck, cs.build(ViewContext(ck, path, path.stem, options or MountOptions()))


def out_checkpoint(result, stem, tmp_path):
    (tmp_path / "out").mkdir(exist_ok=True)
    return open_checkpoint(write_out(result.files[f"{stem}.mdl"], tmp_path / "out" / f"{stem}.mdl"))


@pytest.mark.parametrize("path", CURRENT, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_current_release_roundtrips_exactly(path, tmp_path):
    src, r = view(path)
    assert r.missing is None
    out = out_checkpoint(r, path.stem, tmp_path)
    assert (out.format_version, out.release, out.success) == (0.5, "2.10.0", True)
    assert tree_sig(out.root) == tree_sig(src.root)
    assert link_groups(out.root) == link_groups(src.root)


def _datasets(f):
    out = {}
    f.visititems(lambda n, o: out.__setitem__(n, o) if isinstance(o, h5py.Dataset) else None)
    return out


def _attr_sig(attrs, name):
    a = attrs.get_id(name)
    t = a.get_type()
    return (t.get_class(), a.dtype, a.shape, t.get_cset() if hasattr(t, "get_cset") else None, repr(attrs[name]))


@pytest.mark.parametrize("path", SAME_FORM, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_hdf5_structure_matches_cerebras_pytorch(path):
    """Same attribute names, JSON texts (spec, per-key metadata), dataset dtypes/shapes/attributes as cstorch."""
    _, r = view(path)
    ours = h5_bytes_file(read_all(r.files[f"{path.stem}.mdl"]))
    theirs = h5py.File(path, "r")
    assert sorted(ours.attrs) == sorted(theirs.attrs)
    for name in theirs.attrs:
        assert _attr_sig(ours.attrs, name) == _attr_sig(theirs.attrs, name), name
    a, b = _datasets(theirs), _datasets(ours)
    assert sorted(a) == sorted(b)
    for name, x in a.items():
        y = b[name]
        assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        assert x.id.get_type().get_class() == y.id.get_type().get_class(), name
        assert list(x.attrs) == list(y.attrs), name
        for k in x.attrs:
            assert _attr_sig(x.attrs, k) == _attr_sig(y.attrs, k), (name, k)
        if x.shape:
            assert x[...].tobytes() == y[...].tobytes(), name
        elif x.shape == ():
            assert x[()] == y[()]
        assert y.id.get_create_plist().get_nfilters() == 0  # uncompressed, contiguous: served lazily


def test_train_gpt2_spec_and_metadata_json_identical():
    path = FIXTURES / "train_gpt2/cs/checkpoint.mdl"
    _, r = view(path)
    ours = h5_bytes_file(read_all(r.files["checkpoint.mdl"]))
    theirs = h5py.File(path, "r")
    assert ours.attrs["__spec__"] == theirs.attrs["__spec__"]
    metas = [k for k in theirs.attrs if k.endswith(".__metadata__")]
    assert len(metas) == 229
    types = set()
    for k in metas:
        assert ours.attrs[k] == theirs.attrs[k], k
        types.add(json.loads(ours.attrs[k])[k]["__TYPE__"])
    assert types == {"TorchTensorSerializer", "ScalarSerializer", "StringSerializer", "NoneSerializer", "LinkedObject"}


def test_yaml_of_a_current_checkpoint_is_its_params():
    _, r = view(FIXTURES / "train_gpt2/cs/checkpoint.mdl")
    got = yaml.safe_load(r.files["checkpoint.yaml"].read(0, 1 << 20))
    assert got == yaml.safe_load((FIXTURES / "train_gpt2/cs/params.yaml").read_text())


@pytest.mark.parametrize("name", ["legacy01", "legacy03", "legacy04"])
def test_legacy_files_become_format_0_5(name, tmp_path):
    path = FIXTURES / "legacy_emulated" / f"{name}.mdl"
    src, r = view(path)
    assert r.missing is None and f"{name}.yaml" not in r.files
    assert any("no Cerebras params found" in n for n in r.notes)
    assert any(n.startswith(f"{name}.yaml not generated") for n in r.notes)
    f = h5_bytes_file(read_all(r.files[f"{name}.mdl"]))
    assert f.attrs["__version__"] == 0.5 and bool(f.attrs["__SUCCESS__"]) and f.attrs["__spec__"].startswith("[")
    out = out_checkpoint(r, name, tmp_path)
    assert out.format_version == 0.5 and out.release == "2.10.0"
    # the documented upgrade of these states: nothing to rename or repair, one history entry appended
    expected = T.copy_tree(src.root)
    T.put(expected, "__metadata__", T.from_python([{"version": "2.10.0", "model_name": "", "params": {}}]))
    assert tree_sig(out.root) == tree_sig(expected)
    assert link_groups(out.root) == link_groups(src.root)
    if name != "legacy01":
        assert out.links["model.tied"] == "model.w"


RENAMES = {"w": "embedding_layer.word_embeddings.weight", "tied": "lm_head.weight",
           "b": "embedding_layer.position_embeddings.weight", "a/b": "relative_pe_helper.slopes"}


def test_legacy_1_9_renames_and_tie_repair(tmp_path):
    src_path = renamed_legacy_copy(FIXTURES / "legacy_emulated/legacy03.mdl", tmp_path / "old.mdl", RENAMES,
                                   drop=("model.lm_head.weight",))
    src, r = view(src_path)
    assert src.release == "1.9" and T.is_none_leaf(T.get(src.subtree("model"), "lm_head.weight"))
    out = out_checkpoint(r, "old", tmp_path)
    model = out.subtree("model")
    assert model.keys == ["embedding_layer.word_embeddings.weight", "embedding_layer.position_embeddings.embed.weight",
                          "lm_head.weight", "embedding_layer.position_embed_helper.slopes"]
    assert out.links == {"model.lm_head.weight": "model.embedding_layer.word_embeddings.weight"}
    smodel = src.subtree("model")
    for new, old in [("embedding_layer.position_embeddings.embed.weight", "embedding_layer.position_embeddings.weight"),
                     ("lm_head.weight", "embedding_layer.word_embeddings.weight"),
                     ("embedding_layer.position_embed_helper.slopes", "relative_pe_helper.slopes")]:
        a, b = T.get(model, new).tensor, T.get(smodel, old).tensor
        assert (a.dtype, a.shape) == (b.dtype, b.shape) and a.read_all().tobytes() == b.read_all().tobytes()
    # everything outside the model is carried over unchanged
    for k in ("optimizer", "global_step"):
        assert tree_sig(out.subtree(k)) == tree_sig(src.subtree(k))


def test_legacy_0_4_from_2_0_gets_renames_but_no_tie_repair(tmp_path):
    src_path = renamed_legacy_copy(FIXTURES / "legacy_emulated/legacy04.mdl", tmp_path / "r20.mdl", RENAMES,
                                   drop=("model.lm_head.weight",), cstorch_version=None)
    src, r = view(src_path)
    assert src.release == "2.0"
    out = out_checkpoint(r, "r20", tmp_path)
    model = out.subtree("model")
    assert "embedding_layer.position_embeddings.embed.weight" in model.keys
    assert T.is_none_leaf(T.get(model, "lm_head.weight"))  # 2.0 sources are not re-tied
    assert tree_sig(out.subtree("full")) == tree_sig(src.subtree("full"))  # constant fill stays a fill


def test_upgraded_params_yaml_and_history(tmp_path):
    src_path = renamed_legacy_copy(FIXTURES / "legacy_emulated/legacy03.mdl", tmp_path / "old.mdl", RENAMES)
    (tmp_path / "params.yaml").write_text(textwrap.dedent("""\
        model:
          hidden_size: 3
          use_rms_norm: false
          use_position_embedding: true
        optimizer:
          optimizer_type: AdamW
          learning_rate: 0.1
        runconfig:
          max_steps: 10
          num_act_servers: 2
        """))
    _, r = view(src_path, MountOptions(model="gpt2"))
    params = yaml.safe_load(r.files["old.yaml"].read(0, 1 << 20))
    m = params["trainer"]["init"]["model"]
    assert m == {"hidden_size": 3, "norm_type": "layernorm", "name": "gpt2"}
    assert params["trainer"]["init"]["schedulers"] == [{"ConstantLR": {"learning_rate": 0.1}}]
    assert any("runconfig.num_act_servers" in n for n in r.notes)
    assert any("model.use_position_embedding" in n for n in r.notes)
    out = out_checkpoint(r, "old", tmp_path)
    hist = T.to_python(out.subtree("__metadata__"))
    assert len(hist) == 1 and hist[0]["version"] == "2.10.0" and hist[0]["model_name"] == ""
    assert json.loads(json.dumps(hist[0]["params"])) == params


def test_graph_tensor_left_out_and_noted(tmp_path):
    src, r = view(EDGE / "graph.mdl")
    assert any(n.startswith("g: left out") for n in r.notes)
    out = out_checkpoint(r, "graph", tmp_path)
    assert out.root.keys == []


def test_opaque_object_copied_as_bytes(tmp_path):
    src, r = view(EDGE / "obj.mdl")
    out = out_checkpoint(r, "obj", tmp_path)
    assert out.leaves["obj"].data == src.leaves["obj"].data
    f = h5_bytes_file(read_all(r.files["obj.mdl"]))
    assert f["obj"].attrs["__BYTES__"].tobytes() == h5py.File(EDGE / "obj.mdl", "r")["obj"].attrs["__BYTES__"].tobytes()


@pytest.mark.slow  # starts a Python process
def test_memory_bounded_copy_of_a_checkpoint_larger_than_the_cache(tmp_path):
    """64 MiB source, 8 MiB cache: copying cs/<stem>.mdl out keeps the traced peak near the cache size."""
    root = Container("dict", ["model", "global_step"], [
        Container("dict", [f"w{i}" for i in range(4)], [TensorEntry(RampTensor(4 << 20, 1000 * i)) for i in range(4)]),
        TensorEntry(RampTensor(1))])
    src = write_out(Hdf5Layout(root), tmp_path / "big.mdl")
    size, peak = copy_view_file_in_subprocess("cs", src, "big.mdl", tmp_path / "copy.mdl")
    assert size > 64 << 20
    assert peak < 24 << 20, f"peak {peak / 2**20:.1f} MiB"
    out = open_checkpoint(tmp_path / "copy.mdl")
    w3 = out.leaves["model.w3"].tensor
    assert w3.read(((w3.shape[0] - 2, w3.shape[0]),)).tolist() == [(4 << 20) - 2 + 3000, (4 << 20) - 1 + 3000]
