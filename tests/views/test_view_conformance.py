"""Every registered view (ckptfs.views.registry) has a conformance test over fixtures: the files it serves, read
as a user reads them, equal what Cerebras' and Hugging Face's own tools produce.

``VIEW_CONFORMANCE`` names that test per view; a view registered without one fails here. The hf and tensors
views' tests are below (the hf files as served — safetensors and pytorch_model.bin — against the converter's
keys.json over every converter case, or the original model's where the converter is lossy; every .npy against cstorch.load's ref.pt); the cs and torch views' live
with their other tests.
"""
from __future__ import annotations

import hashlib
import importlib
import io
import json

import numpy as np
import pytest
import torch

import ckptfs
from helpers.cases import (PARAMS, case_checkpoint, case_dir, case_options, expected_folders, original_tensors,
                      torch_bytes)
from ckptfs.views.registry import names
from helpers import FIXTURES

pytestmark = pytest.mark.slow  # every view of every fixture

#: view name -> (test module, test function) of its conformance test over fixtures
VIEW_CONFORMANCE = {
    "hf": ("test_view_conformance", "test_hf_files_hold_the_converters_tensors"),
    "cs": ("test_view_cs", "test_current_release_roundtrips_exactly"),
    "torch": ("test_view_torch", "test_pt_equals_ref"),
    "tensors": ("test_view_conformance", "test_npy_files_equal_cstorch_load"),
    "tf": ("test_tf_view", "test_tf_files_hold_the_source_tensors"),
    "h5": ("test_tf_source", "test_the_h5_file_is_what_tensorflow_to_h5_writes"),
}


def test_every_registered_view_has_a_conformance_test_over_fixtures():
    assert sorted(VIEW_CONFORMANCE) == sorted(names()), "a registered view has no conformance test (or vice versa)"
    for view, (module, func) in VIEW_CONFORMANCE.items():
        test = getattr(importlib.import_module(module), func, None)
        assert callable(test), f"{view}: {module}.{func} does not exist"
        params = [m for m in getattr(test, "pytestmark", []) if m.name == "parametrize"]
        assert params, f"{view}: {module}.{func} is not parametrized over fixtures"
        cases = [str(getattr(c, "values", [c])[0]) for c in params[0].args[1]]
        assert cases and all(str(FIXTURES) in c or case_dir(c).is_dir() for c in cases), view


# -- hf: the served files against the converter ------------------------------------------------------------------


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return torch_bytes(t.contiguous().reshape(-1)) if t.numel() else b""


@pytest.mark.parametrize("case", PARAMS)
def test_hf_files_hold_the_converters_tensors(case):
    from safetensors.torch import load as load_safetensors

    tree = ckptfs.open(case_checkpoint(case), views="hf", **case_options(case))
    try:
        for folder in expected_folders(case):
            base = f"{folder}/" if folder else ""
            expected = json.loads((case_dir(case) / "expected_hf" / folder / "keys.json").read_text())["tensors"]
            original = original_tensors(case, folder) or {}
            by_format = {}
            for fmt, suffix in (("safetensors", ".safetensors"), ("bin", ".bin")):
                served: dict = {}
                for path in tree.file_paths():
                    folder_of = path.rsplit("/", 1)[0] + "/" if "/" in path else ""
                    if path.endswith(suffix) and folder_of in (base, base + "bin/"):
                        data = tree.read(path, 0, tree.attr(path).size)
                        served.update(load_safetensors(data) if fmt == "safetensors"
                                      else torch.load(io.BytesIO(data), weights_only=True))
                for name, t in served.items():
                    raw = _tensor_bytes(t)
                    if name in expected:
                        assert hashlib.sha256(raw).hexdigest() == expected[name]["sha256"], f"{fmt}: {base}{name}"
                    else:
                        assert name in original, f"{fmt}: {base}{name} is neither the converter's nor the original's"
                        assert raw == torch_bytes(original[name]), f"{fmt}: {base}{name}"
                by_format[fmt] = sorted(served)
            assert by_format["safetensors"], f"{base}: no safetensors weights served"
            if by_format["bin"]:  # when both formats are served, they hold the same tensors
                assert by_format["bin"] == by_format["safetensors"], base
    finally:
        tree.close()


# -- tensors: every .npy against cstorch.load ------------------------------------------------------------------


def _loadable(ref) -> bool:
    try:
        torch.load(ref, weights_only=True)
        return True
    except Exception:
        return False


EDGE = FIXTURES / "cstorch_edge_cases"


def _ref_path(ckpt):
    return ckpt.with_suffix(".ref.pt") if ckpt.parent == EDGE else ckpt.parent.parent / "ref.pt"


def _has_tensors(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return any(_has_tensors(v) for v in values)


NPY_CASES = [FIXTURES / f"{c}/cs/checkpoint.mdl" for c in ("train_gpt2", "bf16_llama", "tied_and_scalars")]
NPY_CASES += [p for p in sorted(EDGE.glob("*.mdl")) if p.with_suffix(".ref.pt").exists()
              and _loadable(p.with_suffix(".ref.pt")) and _has_tensors(torch.load(p.with_suffix(".ref.pt")))]


def _ref_by_tensor(node, ref, out: dict) -> dict:
    """``{id(source tensor): the ref.pt tensor at the same place}``, walking the checkpoint's tree and ref.pt
    together (so a key cstorch stores under another name, e.g. a defaultdict's, still finds its tensor)."""
    from ckptfs.catalog.model import Container, TensorLeaf

    if isinstance(node, Container):
        keys = node.keys if node.keys is not None else range(len(node.children))
        for k, child in zip(keys, node.children):
            if isinstance(child, (Container, TensorLeaf)):  # values and pickled objects have no tensor to find
                _ref_by_tensor(child, ref[k], out)
    elif isinstance(node, TensorLeaf):
        out[id(node.tensor)] = ref
    return out


@pytest.mark.parametrize("ckpt", NPY_CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_npy_files_equal_cstorch_load(ckpt):
    from ckptfs.readers import open_checkpoint
    from ckptfs.tensor.regions import FullTensor

    tree = ckptfs.open(ckpt, views="tensors")
    source = open_checkpoint(ckpt)
    try:
        leaves = source.tensors()
        ref = _ref_by_tensor(source.root, torch.load(_ref_path(ckpt), weights_only=True), {})
        served = {}
        for path in tree.file_paths():
            if path.startswith("tensors/"):
                f = tree.lookup(path).file
                served[f.name] = (path, f)
        assert sorted(served) == sorted(leaves), "one .npy per source tensor"
        for key, (path, f) in served.items():
            arr = np.load(io.BytesIO(tree.read(path, 0, tree.attr(path).size)), allow_pickle=False)
            want = ref[id(leaves[key].tensor)]
            assert tuple(arr.shape) == tuple(want.shape), key
            t = leaves[key].tensor
            if isinstance(t, FullTensor) and t.fill is None:
                assert not arr.any(), key  # uninitialised: cstorch leaves the values undefined; ckptfs writes zeros
                continue
            assert arr.tobytes() == _tensor_bytes(want), key
    finally:
        tree.close()
        source.close()
