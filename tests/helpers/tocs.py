"""Shared by the Hugging Face -> Cerebras tests: the fixture cases with an original HF model, that model read as the
mapping core takes it (``{folder: (config, {name: tensor})}``, through ``source.hf_folder``), the planned checkpoint
written as a real ``.mdl`` (the HDF5 layout, in memory) and the per-case facts of this direction (``hf_to_cs:`` in
tests/conformance/<case>.yaml).
"""
from __future__ import annotations

import io
from functools import lru_cache

from helpers.cases import CASES, case_facts, case_model
from ckptfs.layouts.hdf5.layout import Hdf5Layout
from ckptfs.layouts.hdf5.entries import TensorEntry
from ckptfs.mapping.to_cs import to_cs
from ckptfs.catalog.model import Container
from ckptfs.readers.hf.folder import open_hf_model
from helpers import FIXTURES


def hf_cases() -> list:
    """Converter cases that have the original HF model (``hf/``)."""
    return [c for c in CASES if (FIXTURES / c / "hf").is_dir()]


HF_CASES = hf_cases()


def hf_facts(case: str) -> dict:
    return case_facts(case).get("hf_to_cs") or {}


def hf_model(case: str) -> str:
    return hf_facts(case).get("model") or case_model(case)


def hf_folders(case: str) -> dict:
    """{folder: (config, tensors)} of the case's HF model ('' for one folder), read by ckptfs's HF folder source
    (tensors read by region from the safetensors files when asked)."""
    model = open_hf_model(FIXTURES / case / "hf")
    return {f: (c.config, c.tensors) for f, c in model.components.items()}


@lru_cache(maxsize=None)
def planned(case: str, added: bool = True):
    return to_cs(hf_folders(case), model=hf_model(case), added=added)


def mdl_bytes(plan) -> bytes:
    """The planned checkpoint as the HDF5 layout writes it (what a mount's ``.mdl`` holds)."""
    keys = [k for k, _ in plan.tensors]
    root = Container("dict", ["model"], [Container("dict", keys, [TensorEntry(t) for _, t in plan.tensors])])
    lay = Hdf5Layout(root)
    return lay.read(0, lay.size)


def h5_file(data: bytes):
    import h5py

    return h5py.File(io.BytesIO(data), "r")


def h5_entries(f) -> dict:
    """{flat key: dataset} of every dataset of a cstorch file (keys with '/' are groups)."""
    out = {}
    f.visititems(lambda name, obj: out.__setitem__(name.replace("/", "."), obj) if hasattr(obj, "dtype") else None)
    return out
