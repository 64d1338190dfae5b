"""Size parsing, shard planning, shard file names and index JSON, against huggingface_hub / transformers."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from huggingface_hub import split_torch_state_dict_into_shards
from huggingface_hub.serialization._base import parse_size_to_int
from safetensors.torch import load_file
from transformers.utils.hub import convert_file_size_to_int

from ckptfs.dtypes import BY_NAME
from ckptfs.layouts.safetensors import SafetensorsLayout
from ckptfs.views.hf.shards import index_filename, index_json, plan_shards, shard_filenames, total_size
from ckptfs.units import parse_size
from ckptfs.tensor.base import ArrayTensor
from test_layout_safetensors import PatternTensor, array_tensor_from_torch
from helpers import FIXTURES

LLAMA = FIXTURES / "llama" / "hf"


# -- units ----------------------------------------------------------------------------------------------
@given(value=st.integers(0, 10**6), unit=st.sampled_from(["KB", "MB", "GB", "TB", "kb", "Gb"]),
       space=st.sampled_from(["", " "]))
def test_decimal_units_like_huggingface_hub(value, unit, space):
    s = f"{value}{space}{unit}"
    assert parse_size(s) == parse_size_to_int(s)


@given(value=st.integers(0, 10**6), unit=st.sampled_from(["KiB", "MiB", "GiB", "kib", "GIB"]))
def test_binary_units_like_transformers(value, unit):
    s = f"{value}{unit}"
    assert parse_size(s) == convert_file_size_to_int(s)


@given(value=st.integers(0, 10**15))
def test_plain_bytes(value):
    assert parse_size(value) == parse_size(str(value)) == parse_size(f"{value}B") == parse_size(f" {value} b ")
    assert parse_size(f"{value}TiB") == parse_size(f"{value * 1024}GiB")


def test_fractions():
    assert parse_size("1.5GB") == parse_size_to_int("1.5GB")
    assert parse_size("0.5KiB") * 2 == parse_size("1KiB")


@pytest.mark.parametrize("junk", ["", "GB", "5XB", "5 G B", "-5GB", "5GBB", "1e9", "0.1B", "5.GiBx", "five", -1,
                                  True, None, 5.0])
def test_junk_is_refused(junk):
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(junk)


# -- planning vs huggingface_hub ------------------------------------------------------------------------
@st.composite
def state_dicts(draw):
    """(named VirtualTensors, same-structure torch state dict): some names share one tensor object."""
    named, ref, objects = [], {}, []
    for i, (size, alias) in enumerate(draw(st.lists(st.tuples(st.integers(1, 120), st.integers(-3, 30)),
                                                    max_size=30))):
        name = f"layer{i}.weight"
        if alias >= 0 and objects:
            vt, tt = objects[alias % len(objects)]
        else:
            vt, tt = PatternTensor((size,), BY_NAME["uint8"]), torch.empty(size, dtype=torch.uint8)
            objects.append((vt, tt))
        named.append((name, vt))
        ref[name] = tt
    return named, ref


@settings(max_examples=400, deadline=None)
@given(sd=state_dicts(), max_size=st.integers(0, 300),
       kind=st.sampled_from([("model", ".safetensors"), ("pytorch_model", ".bin")]))
def test_plan_matches_huggingface_hub(sd, max_size, kind):
    named, ref = sd
    stem, ext = kind
    split = split_torch_state_dict_into_shards(ref, filename_pattern=stem + "{suffix}" + ext, max_shard_size=max_size)
    shards = plan_shards(named, max_size)
    files = shard_filenames(stem, ext, len(shards))
    assert {f: [n for n, _ in s] for f, s in zip(files, shards)} == split.filename_to_tensors
    assert list(split.filename_to_tensors) == files
    assert total_size(named) == split.metadata["total_size"]
    idx = json.loads(index_json(shards, files))
    assert idx == {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    # invariants
    assert all(shards)
    assert sorted(n for s in shards for n, _ in s) == sorted(n for n, _ in named)
    for s in shards:
        distinct = {id(t): t.nbytes for _, t in s}
        assert sum(distinct.values()) <= max_size or len(distinct) == 1


def test_edge_cases_of_planning():
    t = [PatternTensor((n,), BY_NAME["uint8"]) for n in (10, 50, 10, 0, 10)]
    named = [(f"t{i}", x) for i, x in enumerate(t)]
    shards = plan_shards(named, 30)
    own = [s for s in shards if any(x is t[1] for _, x in s)]
    assert own == [[("t1", t[1])]]  # oversized: a shard of its own
    assert all(shards)
    assert plan_shards([], 10) == [] and shard_filenames("model", ".safetensors", 0) == []
    assert plan_shards(named, "1KB") == [named] == plan_shards(named, 1000)
    with pytest.raises(ValueError):
        plan_shards([("a", t[0]), ("a", t[2])], 100)
    with pytest.raises(ValueError):
        plan_shards(named, "lots")
    with pytest.raises(ValueError):
        index_json(shards, ["x"])
    with pytest.raises(ValueError):
        index_json([[("a", t[0])], [("a", t[2])]], ["x", "y"])


def test_index_filename_and_single_shard_names():
    assert shard_filenames("model", "safetensors", 1) == ["model.safetensors"]
    assert shard_filenames("pytorch_model", ".bin", 1) == ["pytorch_model.bin"]
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

    assert index_filename("model", ".safetensors") == SAFE_WEIGHTS_INDEX_NAME
    assert index_filename("pytorch_model", "bin") == WEIGHTS_INDEX_NAME
    assert shard_filenames("model", ".safetensors", 1) == [SAFE_WEIGHTS_NAME]
    assert shard_filenames("pytorch_model", ".bin", 1) == [WEIGHTS_NAME]


# -- end to end with transformers -------------------------------------------------------------------------
def write_files(out: Path, named, max_size) -> list[str]:
    shards = plan_shards(named, max_size)
    files = shard_filenames("model", ".safetensors", len(shards))
    for shard, fname in zip(shards, files):
        layout = SafetensorsLayout(shard)
        with open(out / fname, "wb") as f:
            for off in range(0, layout.size, 65536):
                f.write(layout.read(off, 65536))
    (out / index_filename("model", ".safetensors")).write_bytes(index_json(shards, files))
    return files


def test_same_bytes_as_save_pretrained(tmp_path, monkeypatch):
    """Given the state dict save_pretrained shards (captured), our plan, files and index are its bytes."""
    import transformers.modeling_utils as mu
    from transformers import AutoModelForCausalLM

    captured = {}

    def spy(state_dict, **kw):
        captured.update(state_dict)
        return split_torch_state_dict_into_shards(state_dict, **kw)

    monkeypatch.setattr(mu, "split_torch_state_dict_into_shards", spy)
    model = AutoModelForCausalLM.from_pretrained(LLAMA)
    ref_dir = tmp_path / "ref"
    model.save_pretrained(ref_dir, max_shard_size="30KB")
    named = [(k, array_tensor_from_torch(v)) for k, v in captured.items()]
    shards = plan_shards(named, "30KB")
    files = shard_filenames("model", ".safetensors", len(shards))
    assert len(files) > 2
    assert sorted(files) == sorted(p.name for p in ref_dir.glob("*.safetensors"))
    ref_index = (ref_dir / index_filename("model", ".safetensors")).read_bytes()
    assert index_json(shards, files, total_parameters=model.num_parameters()) == ref_index
    for shard, fname in zip(shards, files):
        layout = SafetensorsLayout(shard)
        assert layout.read(0, layout.size) == (ref_dir / fname).read_bytes(), fname


@pytest.mark.parametrize("max_size", ["20KB", "5GB"])
def test_from_pretrained_loads_our_shards(tmp_path, max_size):
    from transformers import AutoModelForCausalLM

    original = load_file(LLAMA / "model.safetensors")
    named = [(k, array_tensor_from_torch(v)) for k, v in original.items()]
    out = tmp_path / "model"
    out.mkdir()
    shutil.copy(LLAMA / "config.json", out)
    files = write_files(out, named, max_size)
    assert (len(files) > 1) == (max_size == "20KB")  # one shard: model.safetensors + index, both present
    model = AutoModelForCausalLM.from_pretrained(out)
    sd = model.state_dict()
    for k, v in original.items():
        assert torch.equal(sd[k], v), k
    assert torch.equal(sd["lm_head.weight"], original["model.embed_tokens.weight"])  # tied
    if len(files) > 1:  # the loader really used our index: all shards, nothing else
        (out / files[-1]).unlink()
        with pytest.raises(Exception):
            AutoModelForCausalLM.from_pretrained(out)


def test_total_size_counts_shared_once():
    a = ArrayTensor(np.zeros((4, 4), np.float32))
    b = ArrayTensor(np.zeros(3, np.int64))
    shards = plan_shards([("a", a), ("tied", a), ("b", b)], 1000)
    idx = json.loads(index_json(shards, shard_filenames("model", ".bin", len(shards))))
    ta = torch.zeros(4, 4)
    ref = split_torch_state_dict_into_shards({"a": ta, "tied": ta, "b": torch.zeros(3, dtype=torch.int64)},
                                             max_shard_size=1000)
    assert idx["metadata"] == ref.metadata
