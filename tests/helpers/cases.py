"""Shared by the conformance and family end-to-end tests: the converter fixture cases, their per-case facts
(tests/conformance/<case>.yaml), the mapping core's result per case, and model inputs/outputs for comparisons.

A *derived* case (its case file has ``derived_from: <converter case>``) is a configuration no converter case holds,
made from a converter case's genuine files by the edits its case file states (params, CS tensors left out or
replaced) and written once per test session as a real checkpoint (``case_checkpoint``); its original HF model and
the converter's output are its parent's.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ckptfs.mapping.to_hf import to_hf
from ckptfs.readers import open_checkpoint

from helpers import FIXTURES
CASE_FILES = Path(__file__).parent.parent / "conformance"
# config keys of the converter that are machine-specific and not a conversion result
IGNORED_CONFIG_KEYS = {"mm_vision_tower"}  # LLaVA: the converter writes its own output path (stored as ../image_model)


def _manifest(case: str) -> dict:
    return json.loads((FIXTURES / case / "MANIFEST.json").read_text())


def converter_cases() -> list:
    out = []
    for d in sorted(FIXTURES.iterdir()):
        if (d / "MANIFEST.json").is_file() and (d / "expected_hf").is_dir() and (d / "cs" / "checkpoint.mdl").is_file():
            if _manifest(d.name).get("converter_model"):
                out.append(d.name)
    return out


@lru_cache(maxsize=None)
def case_facts(case: str) -> dict:
    path = CASE_FILES / f"{case}.yaml"
    facts = yaml.safe_load(path.read_text()) if path.is_file() else {}
    return facts or {}


def derived_cases() -> list:
    return sorted(f.stem for f in CASE_FILES.glob("*.yaml") if case_facts(f.stem).get("derived_from"))


CASES = converter_cases() + derived_cases()


def case_dir(case: str) -> Path:
    """The fixture folder of a case's original HF model and converter output (a derived case's parent's)."""
    return FIXTURES / (case_facts(case).get("derived_from") or case)


def case_model(case: str) -> str:
    return case_facts(case).get("model") or _manifest(case_dir(case).name)["converter_model"]


def case_options(case: str) -> dict:
    """``to_hf`` / mount options of a case: ``--model`` unless the case says the params choose (``detect: params``)."""
    return {} if case_facts(case).get("detect") == "params" else {"model": case_model(case)}


_BUILT = Path(tempfile.mkdtemp(prefix="ckptfs-derived-cases-"))
atexit.register(shutil.rmtree, _BUILT, True)


@lru_cache(maxsize=None)
def case_checkpoint(case: str) -> Path:
    """The case's CS checkpoint: the fixture's, or a derived case's written (with its params.yaml beside it)."""
    facts = case_facts(case)
    parent = facts.get("derived_from")
    if not parent:
        return FIXTURES / case / "cs" / "checkpoint.mdl"
    from helpers.cs import rewrite_checkpoint

    folder = _BUILT / case
    folder.mkdir()
    params = yaml.safe_load((FIXTURES / parent / "cs" / "params.yaml").read_text())
    params["model"].update(facts.get("params") or {})
    (folder / "params.yaml").write_text(yaml.safe_dump(params))
    drop = {f"model.{k}" for k in facts.get("drop_tensors") or ()}
    rng = np.random.default_rng(int(facts.get("seed", 0)))  # new tensors drawn as the fixtures' are: N(0, 0.5²)
    replace = {f"model.{k}": rng.normal(0, 0.5, shape).astype(np.float32)
               for k, shape in (facts.get("replace_tensors") or {}).items()}
    return rewrite_checkpoint(FIXTURES / parent / "cs" / "checkpoint.mdl", folder / "checkpoint.mdl",
                              keep=lambda key: key not in drop, replace=replace)


def has_hf(case: str) -> bool:
    """Whether the case's model has a Hugging Face side (a ``no_hf`` case checks that it is refused instead)."""
    return not case_facts(case).get("no_hf")


def _param(case: str):
    pending = case_facts(case).get("pending")
    marks = [pytest.mark.xfail(reason=pending, strict=False)] if pending else []
    return pytest.param(case, marks=marks, id=case)


PARAMS = [_param(c) for c in CASES if has_hf(c)]


@lru_cache(maxsize=None)
def converted(case: str):
    ckpt = open_checkpoint(case_checkpoint(case))
    hf = to_hf(ckpt, **case_options(case))
    if case_facts(case).get("detect") == "params":
        assert hf.model_name == case_model(case), f"{case}: the params chose {hf.model_name} ({hf.chosen})"
    return hf


def expected_folders(case: str) -> list:
    """HF model folders of the converter's output, relative to expected_hf ('' = the root)."""
    root = case_dir(case) / "expected_hf"
    return sorted(str(p.parent.relative_to(root)).replace(".", "") for p in root.rglob("keys.json"))


#: a key a config does not have (None is a value)
ABSENT = "<absent>"


def original_config(case: str, folder: str) -> dict | None:
    """The original HF model's config.json as written (None when the case has no original for the folder)."""
    path = case_dir(case) / "hf" / folder / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


@lru_cache(maxsize=None)
def served_configs(case: str) -> dict:
    """{folder: bytes of the config.json the hf view serves there} for the case, as a mount serves them."""
    import ckptfs

    tree = ckptfs.open(case_checkpoint(case), views=("hf",), **case_options(case))
    try:
        return {p.rpartition("/")[0] if "/" in p else "": tree.read(p, 0, 1 << 20) for p in tree.file_paths()
                if p.rpartition("/")[2] == "config.json" and not p.startswith(("bin/",)) and "/bin/" not in p}
    finally:
        tree.close()


def loaded_config(folder: Path) -> dict:
    """The folder's configuration as transformers loads it (``to_dict``): ``AutoConfig``, or the generic
    ``PretrainedConfig`` for a remote-code config (``auto_map``), whose class is not installed."""
    from transformers import AutoConfig, PretrainedConfig

    raw = json.loads((folder / "config.json").read_text())
    cls = PretrainedConfig if "auto_map" in raw else AutoConfig
    return cls.from_pretrained(str(folder)).to_dict()


def config_mismatches(case: str, folder: str, ours: dict, theirs: dict) -> tuple:
    """(undocumented differences between two loaded configurations ``ours`` and the original's ``theirs`` of
    ``folder``, the documented ``original_config_differences`` entries that matched). A documented key that does
    not differ is reported too: a stale reason would hide nothing but mislead."""
    documented = case_facts(case).get("original_config_differences") or {}
    prefix = f"{folder}/" if folder else ""
    if f"{prefix}*" in documented:
        return [], {f"{prefix}*"}
    problems, used = [], set()
    for key in sorted(set(ours) | set(theirs)):
        if key in ("_name_or_path", "transformers_version"):
            continue
        a, b = ours.get(key, ABSENT), theirs.get(key, ABSENT)
        label = prefix + key
        if label in documented:
            used.add(label)
            if a == b:
                problems.append(f"{label} is documented as different but equals the original's ({a!r})")
        elif a != b:
            problems.append(f"{label}: ckptfs loads to {a!r}, the original to {b!r}")
    return problems, used


def raw_bytes(t) -> bytes:
    return t.read_all().tobytes()


def sha256(t) -> str:
    return hashlib.sha256(raw_bytes(t)).hexdigest()


def original_tensors(case: str, folder: str) -> dict | None:
    path = case_dir(case) / "hf" / folder / "model.safetensors"
    if not path.is_file():
        return None
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), "pt") as f:
        for k in f.keys():
            out[k] = f.get_tensor(k)
    return out


def torch_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def transformers_class(name: str):
    import transformers

    return getattr(transformers, name, None)


def model_inputs(model, config) -> dict:
    g = torch.Generator().manual_seed(7)
    name = getattr(model, "main_input_name", "input_ids")
    if name == "pixel_values":
        size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
        return {"pixel_values": torch.randn(2, getattr(config, "num_channels", 3), size, size, generator=g)}
    vocab = getattr(config, "vocab_size", 128)
    ids = torch.randint(3, vocab, (2, 11), generator=g)
    out = {name: ids}
    if getattr(config, "is_encoder_decoder", False):
        out["decoder_input_ids"] = torch.randint(3, vocab, (2, 7), generator=g)
    return out


def model_outputs(model, inputs, ignore=()) -> list:
    """The model's output tensors for ``inputs`` (eval mode), leaving out the named outputs in ``ignore``."""
    model.eval()
    with torch.no_grad():
        out = model(**inputs)
    items = out.items() if hasattr(out, "items") else [("output", out)]
    return [v for k, v in items if isinstance(v, torch.Tensor) and k not in ignore]


def state_dicts_equal(a: dict, b: dict, where: str = "", atol: float | None = None, absent=()) -> None:
    """Equal state dicts (same keys, dtypes and values; within ``atol`` when given), but for tensors the checkpoint
    cannot hold (``absent``: initialised by the loader)."""
    assert a.keys() == b.keys(), where
    for k, v in b.items():
        if k in absent:
            continue
        assert a[k].dtype == v.dtype, f"{where}: {k}"
        same = torch.allclose(a[k], v, rtol=0, atol=atol) if atol else torch.equal(a[k], v)
        assert same, f"{where}: {k}"
