"""Conformance of every converter case under tests/fixtures: the test that cannot be forgotten.

Every fixture case that went through Cerebras' converter (its MANIFEST names ``converter_model`` and it has
``expected_hf/``) is converted here with the mapping core, and for every HF model folder it gives:

- every tensor ckptfs writes is bit-identical to the converter's output (``expected_hf/**/keys.json``: shape,
  dtype, sha256) or, where the converter is lossy and ckptfs is not, to the original HF model (``hf/``);
- the tensor names are those ``save_pretrained`` of the original model writes: none missing (unless the CS file
  cannot hold it), no tied copy or legacy buffer added (exceptions listed per case with their reason in
  ``tests/conformance/<case>.yaml``);
- ``config.json`` agrees with the converter's, key for key, where it does not agree with the original HF model's
  instead, apart from documented deliberate fixes (each with its reason in the case file);
- where the case has the original HF model (``hf/``), the config.json the hf view serves loads
  (``AutoConfig.from_pretrained``) to the original's configuration, key for key, apart from documented
  differences (each with its reason in the case file);
- where transformers ships the HF class, the model built from ckptfs' config and tensors gives outputs equal
  to the original HF model's.

A case without a mapping fails here; so does a family without a case, and a converter name of the fixtures'
list that ``ckptfs models`` does not know. Per-case facts live in ``tests/conformance/<case>.yaml``:

```yaml
model: NAME                 # --model to use (default: the MANIFEST's converter_model)
detect: params              # no --model: the params must choose NAME (as a mount without options does)
pending: "issue N: why"     # the case is not covered yet: an expected failure until the issue lands
config_differences: {key: reason}       # keys whose value deliberately differs from the converter's (and the original's)
original_config_differences: {key: reason}   # keys of the loaded config that differ from the original's
                                        # ("folder/key"; "folder/*": that folder's whole config)
not_in_checkpoint: {hf tensor: reason}  # original HF tensors the CS file does not hold
extra_tensors: {hf tensor: reason}      # tensors written although save_pretrained of the original leaves them out
outputs: {skip: reason} | {atol: 1e-6, reason: ...} | {ignore: [output name], reason: ...}  # output comparison
```

A configuration no converter case holds is a *derived* case (``casehelp``): a case file that names its parent
converter case and the edits that make it, checked against the parent's original model and converter output:

```yaml
derived_from: CASE          # the converter case whose files it starts from
params: {key: value}        # set in the params' model: section
drop_tensors: [cs key]      # CS model tensors the checkpoint does not hold
replace_tensors: {cs key: shape}   # CS model tensors drawn anew (seed: N), as the fixtures' are
original_config: {key: value}      # the original HF model loaded with these config values (the same configuration)
no_hf: "why"                # the model has no HF side: the case checks that it is refused with its family's reason
```
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from helpers.cases import (ABSENT, CASE_FILES, CASES, FIXTURES, IGNORED_CONFIG_KEYS, PARAMS, case_checkpoint, case_dir,
                      case_facts, case_model, case_options, config_mismatches, converted, expected_folders, has_hf,
                      loaded_config, model_inputs, model_outputs, original_config, original_tensors, raw_bytes,
                      served_configs, sha256, torch_bytes, transformers_class)
from ckptfs.mapping.lang.families import default_registry, list_models

pytestmark = pytest.mark.slow  # every converter case, every tensor, and the models built from them

# -- the case tests ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", PARAMS)
def test_folders_match_converter_layout(case):
    hf = converted(case)
    assert set(expected_folders(case)) <= set(hf.folders()), "every HF folder the converter writes is served"


@pytest.mark.parametrize("case", PARAMS)
def test_every_tensor_bit_identical(case):
    hf = converted(case)
    folders = hf.folders()
    for folder in expected_folders(case):
        model = folders[folder]
        expected = json.loads((case_dir(case) / "expected_hf" / folder / "keys.json").read_text())["tensors"]
        original = original_tensors(case, folder) or {}
        names = [n for n, _ in model.tensors]
        assert len(names) == len(set(names)), f"{folder}: a tensor name is written twice"
        for name, t in model.tensors:
            if name in expected:
                e = expected[name]
                assert list(t.shape) == e["shape"], f"{folder}/{name} shape"
                assert t.dtype.name == e["dtype"], f"{folder}/{name} dtype"
                assert sha256(t) == e["sha256"], f"{folder}/{name} differs from the converter's bytes"
            elif name in original:
                ref = original[name]
                assert list(t.shape) == list(ref.shape), f"{folder}/{name} shape"
                assert raw_bytes(t) == torch_bytes(ref), f"{folder}/{name} differs from the original HF tensor"
            else:
                pytest.fail(f"{folder}/{name}: written by ckptfs but neither the converter nor the original has it")


@pytest.mark.parametrize("case", PARAMS)
def test_tensor_names_as_save_pretrained_writes_them(case):
    hf = converted(case)
    folders = hf.folders()
    allowed = case_facts(case).get("not_in_checkpoint") or {}
    extras = case_facts(case).get("extra_tensors") or {}
    checked = 0
    for folder in expected_folders(case):
        original = original_tensors(case, folder)
        if original is None:
            continue  # trained on CS (LoRA cases): no original HF model
        ours = {n for n, _ in folders[folder].tensors}
        missing = sorted(n for n in original if n not in ours and f"{folder}/{n}".lstrip("/") not in allowed)
        assert not missing, f"{folder}: tensors of the original HF model not written: {missing}"
        extra = sorted(n for n in ours - set(original) if f"{folder}/{n}".lstrip("/") not in extras)
        assert not extra, (f"{folder}: tensors save_pretrained of the original model leaves out (tied copies, "
                           f"buffers) are written: {extra}")
        checked += 1
    assert checked or not (case_dir(case) / "hf").exists()


@pytest.mark.parametrize("case", PARAMS)
def test_config_agrees_with_converter(case):
    hf = converted(case)
    folders = hf.folders()
    differences = case_facts(case).get("config_differences") or {}
    for folder in expected_folders(case):
        expected = json.loads((case_dir(case) / "expected_hf" / folder / "config.json").read_text())
        ours = folders[folder].config
        original = original_config(case, folder)
        for key, value in expected.items():
            label = f"{folder}/{key}".lstrip("/")
            if key in IGNORED_CONFIG_KEYS or label in differences or key in differences:
                continue
            if original is not None and ours.get(key, ABSENT) == original.get(key, ABSENT):
                continue  # ckptfs writes what the original model's config.json says, where the converter does not
            assert key in ours, f"config.json of {folder or 'the root'} lacks {key!r} (converter: {value!r})"
            assert ours[key] == value, f"config.json {label}: ckptfs {ours[key]!r}, converter {value!r}"
        assert ours.get("architectures") == [folders[folder].hf_class]
        assert ours.get("model_type"), "config.json names its model_type"


def original_cases() -> list:
    """Converter cases with an original HF model (a derived case's params differ from its parent's original)."""
    return [c for c in CASES if not case_facts(c).get("derived_from") and (case_dir(c) / "hf").is_dir()]


@pytest.mark.parametrize("case", original_cases())
def test_config_loads_to_the_originals_configuration(case, tmp_path):
    """``AutoConfig.from_pretrained`` of the served config.json gives the original's configuration (for remote-code
    models, whose classes are not here, the generic ``PretrainedConfig``)."""
    documented = case_facts(case).get("original_config_differences") or {}
    served = served_configs(case)
    problems, used = [], set()
    for path in sorted((FIXTURES / case / "hf").rglob("config.json")):
        folder = path.parent.relative_to(FIXTURES / case / "hf").as_posix().strip(".")
        assert folder in served, f"{case}: the hf view serves no {folder}/config.json"
        mine = tmp_path / (folder or "root")
        mine.mkdir(parents=True)
        (mine / "config.json").write_bytes(served[folder])
        found, matched = config_mismatches(case, folder, loaded_config(mine), loaded_config(path.parent))
        problems += found
        used |= matched
    assert not problems, f"{case}: {problems}"
    assert not set(documented) - used, f"{case}: documented differences of no folder: {set(documented) - used}"


# -- outputs equal to the original model -----------------------------------------------------------------------


def output_cases() -> list:
    out = []
    for case in CASES:
        if case_facts(case).get("pending") or (case_facts(case).get("outputs") or {}).get("skip"):
            continue
        if not has_hf(case) or not (case_dir(case) / "hf").is_dir():
            continue
        out.append(case)
    return out


@pytest.mark.parametrize("case", output_cases())
def test_outputs_equal_original_model(case, tmp_path):
    from safetensors.torch import save_file

    hf = converted(case)
    atol = (case_facts(case).get("outputs") or {}).get("atol")
    ignore = (case_facts(case).get("outputs") or {}).get("ignore") or ()
    compared = 0
    for folder, model in hf.folders().items():
        src = case_dir(case) / "hf" / folder
        cls = transformers_class(model.hf_class)
        if cls is None or not (src / "config.json").is_file():
            continue  # remote code (btlm, jais, santacoder) or a component without an original
        out = tmp_path / (folder or "root")
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps(model.config))
        weights = {}
        for name, t in model.tensors:
            raw = t.read_all()
            weights[name] = torch.frombuffer(bytearray(raw.tobytes()) or bytearray(1), dtype=getattr(torch, t.dtype.name))[
                :t.numel].reshape(t.shape).clone()
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        kw = {"attn_implementation": "eager"}
        original = cls.from_pretrained(src, **kw, **(case_facts(case).get("original_config") or {}))
        ours = cls.from_pretrained(out, **kw)
        inputs = model_inputs(original, original.config)
        for a, b in zip(model_outputs(ours, inputs, ignore), model_outputs(original, inputs, ignore),
                        strict=True):
            if atol:
                assert torch.allclose(a, b, rtol=0, atol=atol), folder
            else:
                assert torch.equal(a, b), f"{case}/{folder}: outputs differ from the original model"
        compared += 1
    assert compared, f"{case}: no folder with a transformers class to compare (say why with outputs.skip)"


# -- models without a Hugging Face side ------------------------------------------------------------------------


@pytest.mark.parametrize("case", [c for c in CASES if not has_hf(c)])
def test_models_without_hf_side_are_refused_with_their_reason(case):
    from ckptfs.errors import MappingError
    from ckptfs.mapping.to_hf import to_hf
    from ckptfs.mapping.detect import detect_family
    from ckptfs.mapping.lang.families import default_registry
    from ckptfs.readers import open_checkpoint

    with open_checkpoint(case_checkpoint(case)) as ck:
        det = detect_family(ck, **case_options(case))
        spec = default_registry().family(det.family)
        assert spec.variant(det.model_name) is spec.variant(case_model(case)) and spec.no_hf
        with pytest.raises(MappingError) as e:
            to_hf(ck, **case_options(case))
        assert spec.no_hf in e.value.problem and case_model(case) in e.value.problem


# -- nothing can be left uncovered ---------------------------------------------------------------------------


def test_every_case_has_facts_only_when_needed():
    """Case files name existing cases only (a typo would silently cover nothing)."""
    for f in CASE_FILES.glob("*.yaml"):
        assert f.stem in CASES, f"{f.name} names no converter case under tests/fixtures (nor derives one)"


def test_every_family_has_a_conformance_case():
    registry = default_registry()
    covered = set()
    for case in CASES:
        if case_facts(case).get("pending"):
            continue
        spec = registry.for_model(case_model(case))
        assert spec is not None, f"{case}: model {case_model(case)!r} is not a known model name"
        covered.add(spec.family)
    assert set(registry.families) <= covered, f"families without a conformance case: {set(registry.families) - covered}"


def converter_names() -> list:
    """Every converter name of the fixtures README's "Every converter name -> case" table, plus the seed names
    (bert-summarization too: `ckptfs models` lists it, with no HF class)."""
    text = (FIXTURES / "README.md").read_text()
    names = []
    for title in ("### Every converter name", "Names from the seed documentation"):
        section = text[text.index(title):]
        end = section.index("\n\n", section.index("| "))
        for ln in section[:end].splitlines():
            if not ln.startswith("| ") or ln.startswith("| converter name") or ln.startswith("| seed name"):
                continue
            cells = [c.strip() for c in ln.strip("|").split("|")]
            if set(cells[0]) <= {"-", " "}:
                continue
            names += [n.strip() for n in re.split(r"[/,]", cells[0]) if n.strip()]
    return names


def test_models_lists_every_converter_name():
    known = {m.name for m in list_models()}
    names = converter_names()
    assert len(names) > 50
    missing = sorted(n for n in names if n not in known)
    assert not missing, f"converter names `ckptfs models` does not know: {missing}"
