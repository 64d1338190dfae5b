"""Shared by the Hugging Face -> Cerebras tests: the fixture cases with an original HF model, that model read as the
mapping core takes it (``{folder: (config, {name: tensor})}``), the planned checkpoint written as a real ``.mdl``
(the HDF5 layout, in memory) and the per-case facts of this direction (``hf_to_cs:`` in tests/conformance/<case>.yaml).
"""
from __future__ import annotations

import io
import json
import struct
from functools import lru_cache

import numpy as np

from casehelp import CASES, case_facts, case_model
from ckptfs.dtypes import by_name
from ckptfs.layouts.hdf5 import Hdf5Layout, TensorEntry
from ckptfs.mapping.tocs import to_cs
from ckptfs.source.catalog import Container
from ckptfs.virtual_tensor import ArrayTensor
from conftest import FIXTURES

# safetensors dtype names -> ckptfs dtype names
ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def read_safetensors(path) -> dict:
    """{name: ArrayTensor} of a safetensors file, in file order (a test-side reader: numpy arrays of the raw bytes)."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    body = memoryview(data)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = by_name(ST_DTYPES[info["dtype"]])
        a, b = info["data_offsets"]
        arr = np.frombuffer(body[a:b], dtype=dtype.storage).reshape(info["shape"])
        out[name] = ArrayTensor(arr, dtype)
    return out


def hf_cases() -> list:
    """Converter cases that have the original HF model (``hf/``)."""
    return [c for c in CASES if (FIXTURES / c / "hf").is_dir()]


HF_CASES = hf_cases()


def hf_facts(case: str) -> dict:
    return case_facts(case).get("hf_to_cs") or {}


def hf_model(case: str) -> str:
    return hf_facts(case).get("model") or case_model(case)


def hf_folders(case: str) -> dict:
    """{folder: (config, tensors)} of the case's HF model ('' for one folder)."""
    root = FIXTURES / case / "hf"
    out = {}
    for cfg in sorted(root.rglob("config.json")):
        folder = str(cfg.parent.relative_to(root)).replace(".", "")
        out[folder] = (json.loads(cfg.read_text()), read_safetensors(cfg.parent / "model.safetensors"))
    return out


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
