"""Conformance of the Hugging Face -> Cerebras direction on every fixture case that has the original HF model.

Each case's ``hf/`` model is planned with the mapping core (``mapping.tocs.to_cs``, the same mapping files read the
other way), written as the HDF5 layout writes a mount's ``.mdl``, and compared with the converter's own HF -> CS
output, ``cs/checkpoint.mdl`` and ``cs/params.yaml`` (both read with h5py / yaml):

- the same keys (none missing, none extra), the same HDF5 dtypes and shapes, every tensor bit for bit;
- the params ``model:`` section equal to the converter's, key for key and type for type;
- the round trip: the Cerebras -> HF mapping of the planned checkpoint and params gives back every original HF
  tensor bit for bit (where the converter's own round trip is exact) under its name.

Exceptions are facts of the case, each with its reason, under ``hf_to_cs:`` in ``tests/conformance/<case>.yaml``:

```yaml
hf_to_cs:
  model: NAME                       # --model to use (default: the case's)
  tensors_differ: {key: reason}     # CS keys whose values differ (the converter draws random values there)
  params_differences: {key: reason} # params keys (dotted) whose value deliberately differs
  missing_keys: {key: reason}       # converter keys ckptfs does not write
  not_round_trip: {hf name: reason} # original HF tensors that do not come back bit for bit (fnmatch patterns)
```

A case without an inverse fails here. Two cases also go through a real FUSE mount of their HF folder.
"""
from __future__ import annotations

import fnmatch

import numpy as np
import pytest
import yaml

from helpers import FIXTURES, needs_fuse, real_env
from helpers.tocs import HF_CASES, h5_entries, h5_file, hf_facts, hf_folders, mdl_bytes, planned

pytestmark = pytest.mark.slow  # every fixture case with an HF model, every tensor, both ways



def _reference(case: str):
    return h5_file((FIXTURES / case / "cs" / "checkpoint.mdl").read_bytes())


@pytest.mark.parametrize("case", HF_CASES)
def test_checkpoint_equals_converter_output(case):
    facts = hf_facts(case)
    plan = planned(case)
    ours = h5_entries(h5_file(mdl_bytes(plan)))
    theirs = h5_entries(_reference(case))
    missing_ok = facts.get("missing_keys") or {}
    differ_ok = facts.get("tensors_differ") or {}
    missing = sorted(k for k in theirs if k not in ours and k not in missing_ok)
    extra = sorted(k for k in ours if k not in theirs)
    assert not missing, f"converter keys not written: {missing}"
    assert not extra, f"keys the converter does not write: {extra}"
    for key, d in ours.items():
        ref = theirs.get(key)
        if ref is None:
            continue
        assert d.dtype == ref.dtype, f"{key}: HDF5 dtype {d.dtype}, converter {ref.dtype}"
        assert d.shape == ref.shape, f"{key}: shape {d.shape}, converter {ref.shape}"
        assert dict(d.attrs)["dtypes"].tolist() == dict(ref.attrs)["dtypes"].tolist(), f"{key}: torch dtype"
        if key in differ_ok:
            continue
        a, b = np.asarray(d[()]), np.asarray(ref[()])
        assert a.tobytes() == b.tobytes(), f"{key} differs from the converter's tensor"


def _same(a, b, path=""):
    """Equal values of equal types (1 and 1.0 differ in a params file), dicts and lists walked."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            yield from _same(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{path}.{k}".lstrip("."))
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _same(x, y, f"{path}.{i}")
    elif type(a) is not type(b) or a != b:
        yield path, a, b


@pytest.mark.parametrize("case", HF_CASES)
def test_params_equal_converter_params(case):
    facts = hf_facts(case)
    ok = facts.get("params_differences") or {}
    theirs = yaml.safe_load((FIXTURES / case / "cs" / "params.yaml").read_text())
    ours = planned(case).params
    diffs = [(p, a, b) for p, a, b in _same(ours["model"], theirs["model"], "") if p not in ok]
    assert not diffs, "params model: differs from the converter's (key, ckptfs, converter): " + "; ".join(
        f"{p}: {a!r} vs {b!r}" for p, a, b in diffs)


@pytest.mark.parametrize("case", HF_CASES)
def test_round_trip_gives_back_the_hf_tensors(case):
    from ckptfs.mapping.to_hf import to_hf
    from ckptfs.catalog.model import Checkpoint, Container, TensorLeaf

    facts = hf_facts(case)
    plan = planned(case)
    keys = [k for k, _ in plan.tensors]
    inner = Container("dict", keys, [TensorLeaf("model." + k, t) for k, t in plan.tensors])
    leaves = {"model." + k: leaf for k, leaf in zip(keys, inner.children)}
    ckpt = Checkpoint(path=FIXTURES / case / "planned.mdl", format_version=0.5, release="2.10.0", success=True,
                      root=Container("dict", ["model"], [inner]), leaves=leaves)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        params = Path(tmp) / "params.yaml"
        params.write_text(yaml.safe_dump(plan.params))
        hf = to_hf(ckpt, config=params, model=plan.model_name)
    skip = facts.get("not_round_trip") or {}
    folders = hf.folders()
    for folder, (_, tensors) in hf_folders(case).items():
        back = dict(folders[folder].tensors)
        for name, t in tensors.items():
            label = f"{folder}/{name}".lstrip("/")
            if any(fnmatch.fnmatchcase(label, pattern) for pattern in skip):
                continue
            assert name in back, f"{label} does not come back from the planned checkpoint"
            assert back[name].read_all().tobytes() == t.read_all().tobytes(), f"{label} comes back changed"


def test_every_case_file_names_a_case():
    from helpers.cases import CASE_FILES

    for f in CASE_FILES.glob("*.yaml"):
        facts = yaml.safe_load(f.read_text()) or {}
        if "hf_to_cs" in facts:
            assert f.stem in HF_CASES, f"{f.name}: hf_to_cs facts for a case without hf/"


@needs_fuse
@pytest.mark.parametrize("case", ["llama_headless", "llava"])
def test_a_mounted_hf_folder_serves_the_converters_checkpoint(case):
    """The mount of a fixture's hf/ folder (the real mapping, not a test planner): checkpoint.mdl read with h5py
    holds the converter's keys, dtypes and tensors, params.yaml is the converter's, README.txt says what was added."""
    from helpers.fuse import mounted

    facts = hf_facts(case)
    with mounted(FIXTURES / case / "hf", "--model", planned(case).model_name, env=real_env()) as mnt:
        with open(mnt / "checkpoint.mdl", "rb") as f:
            ours = h5_entries(h5_file(f.read()))
        params = yaml.safe_load((mnt / "params.yaml").read_text())
        readme = (mnt / "README.txt").read_text()
    theirs = h5_entries(_reference(case))
    assert set(ours) == set(theirs)
    for key, d in ours.items():
        assert d.dtype == theirs[key].dtype, key
        if key not in (facts.get("tensors_differ") or {}):
            assert np.asarray(d[()]).tobytes() == np.asarray(theirs[key][()]).tobytes(), key
    assert params == yaml.safe_load((FIXTURES / case / "cs" / "params.yaml").read_text())
    for note in planned(case).notes:
        assert note in readme
