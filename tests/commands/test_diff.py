"""``ckptfs diff``: two checkpoints compared key by key (chunks stored alike without decoding), a run's checkpoints by
name, and what two mounts would serve (``--view``); exit codes 0 equal, 1 different, 2 bad input."""
from __future__ import annotations

import json
import shutil

import h5py
import hdf5plugin  # noqa: F401  (the LZ4 filter, to rewrite one dataset of a copy)
import numpy as np
import pytest

from ckptfs.readers import open_checkpoint
from ckptfs.readers.cerebras import dataset_tensor as source_tensors
from ckptfs.catalog.model import TensorLeaf, ValueLeaf
from ckptfs.commands.compare import c_order_boxes, compare_leaves, compare_tensors, diff_checkpoints
from ckptfs.tensor.base import ArrayTensor
from ckptfs.cli import main
from helpers import FIXTURES, run_ckptfs, slow
from helpers.cs import rewrite_checkpoint
from helpers.mapping import RecordingTensor

TRAIN = FIXTURES / "train_gpt2" / "cs" / "checkpoint.mdl"  # a training state: model, optimizer, scheduler, step…
Q = "model.transformer_decoder.layers.0.self_attn.proj_q_dense_layer.weight"  # [32, 32] float32, one chunk


def copy_of(tmp_path, name="copy.mdl", src=TRAIN):
    dst = tmp_path / name
    shutil.copy(src, dst)
    dst.chmod(0o644)
    return dst


def with_one_element_changed(tmp_path, name="one.mdl", src=TRAIN, key=Q, index=(3, 5), delta=1.0):
    dst = copy_of(tmp_path, name, src)
    with h5py.File(dst, "r+") as f:
        values = f[key][...]
        values[index] += delta
        f[key][...] = values
    return dst


def diff_json(capsys, a, b, *args):
    """``ckptfs diff A B --json ARGS`` run in this process (the command's own ``main``): exit code, JSON, stderr."""
    code = main(["diff", str(a), str(b), "--json", *map(str, args)])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if out.out.strip() else None), out.err


def test_identical_copies_are_equal_from_their_stored_chunks_without_decoding(tmp_path, monkeypatch, capsys):
    def no_decoding(self, box):
        raise AssertionError(f"{self.key} was decoded")

    with open_checkpoint(TRAIN) as a, open_checkpoint(copy_of(tmp_path)) as b:
        chunked = {k for k, leaf in a.tensors().items() if leaf.tensor.ndim}
        monkeypatch.setattr(source_tensors.H5DatasetTensor, "read", no_decoding)
        with pytest.raises(AssertionError, match="was decoded"):  # the 0-d tensors (steps) are not chunked
            diff_checkpoints(a, b)
        monkeypatch.undo()
        result = diff_checkpoints(a, b)
    assert result.equal and len(result.keys) == len(a.leaves) == 229
    by_key = {k.key: k for k in result.keys}
    assert all(by_key[k].values.decoded == 0 for k in chunked)
    code, doc, _ = diff_json(capsys, TRAIN, TRAIN)
    assert code == 0 and doc["equal"] and doc["counts"] == {"equal": 229}  # the same file: chunk addresses alike


def test_a_one_element_change_is_found_decoding_only_its_chunk(tmp_path, capsys):
    code, doc, err = diff_json(capsys, TRAIN, with_one_element_changed(tmp_path))
    assert code == 1, err
    changed = [k for k in doc["keys"] if k["status"] != "equal"]
    assert len(changed) == 1
    k = changed[0]
    assert (k["key"], k["status"], k["elements"], k["changed"], k["first_index"]) == (Q, "changed", 1024, 1, [3, 5])
    with open_checkpoint(TRAIN) as ck:
        before = float(ck.leaves[Q].tensor.read_all()[3, 5])
    after = float(np.float32(before) + np.float32(1.0))
    assert k["first_values"] == [before, after] and k["max_abs_diff"] == pytest.approx(1.0, abs=1e-6)
    assert k["fraction_changed"] == 1 / 1024 and k["decoded"] == 1024 and k["equal_by_storage"] == 0
    others = [k for k in doc["keys"] if k["key"].startswith("model.") and k["key"] != Q]
    assert others and all(k["decoded"] == 0 for k in others)
    code, doc, _ = diff_json(capsys, TRAIN, tmp_path / "one.mdl", "--tolerance", "1.5")
    assert code == 0 and doc["equal"]


@pytest.mark.slow  # runs the CLI
def test_text_report_names_the_change_and_counts_the_rest(tmp_path):
    r = run_ckptfs("diff", TRAIN, with_one_element_changed(tmp_path), text=True)
    lines = r.stdout.splitlines()
    assert r.returncode == 1 and lines[0] == f"A: {TRAIN}" and lines[1] == f"B: {tmp_path / 'one.mdl'}"
    assert lines[2].startswith(f"~ {Q}  [32, 32] float32: 1 of 1,024 elements differ (0.098%), max |a-b| 1, first "
                               "[3, 5]: ")
    assert lines[3].startswith("229 keys: 228 equal, 1 changed (") and len(lines) == 4


def test_a_dtype_change_is_reported_with_the_value_differences(tmp_path, capsys):
    with open_checkpoint(TRAIN) as ck:
        q = ck.leaves[Q].tensor.read_all()
    half = rewrite_checkpoint(TRAIN, tmp_path / "half.mdl", replace={Q: q.astype(np.float16)})
    code, doc, _ = diff_json(capsys, TRAIN, half)
    assert code == 1
    (k,) = [k for k in doc["keys"] if k["status"] != "equal"]
    assert (k["key"], k["status"], k["a"], k["b"]) == (Q, "dtype", "[32, 32] float32", "[32, 32] float16")
    rounded = np.abs(q.astype(np.float16).astype(np.float64) - q.astype(np.float64))
    assert k["changed"] == np.count_nonzero(rounded) and k["max_abs_diff"] == pytest.approx(rounded.max())


def test_a_training_state_against_its_model_only_conversion(tmp_path, capsys):
    """The model keys are equal from their stored chunks (the conversion copied them as stored); everything else
    of the training state is removed — or added, the other way round."""
    model_only = rewrite_checkpoint(TRAIN, tmp_path / "model_only.mdl", keep=lambda key: key.startswith("model."))
    code, doc, _ = diff_json(capsys, TRAIN, model_only)
    assert code == 1
    status = {k["key"]: k for k in doc["keys"]}
    assert {k for k, v in status.items() if v["status"] == "removed"} == {
        k for k in status if not k.startswith("model.")} and doc["counts"] == {"equal": 39, "removed": 190}
    assert all(v["decoded"] == 0 for k, v in status.items() if k.startswith("model."))
    code, doc, _ = diff_json(capsys, model_only, TRAIN)
    assert code == 1 and doc["counts"] == {"equal": 39, "added": 190}
    assert next(k for k in doc["keys"] if k["key"] == "global_step") == {
        "key": "global_step", "status": "added", "a": None, "b": "= 1"}


def test_shape_kind_and_value_changes(tmp_path):
    changed = rewrite_checkpoint(TRAIN, tmp_path / "other.mdl",
                                 replace={Q: np.zeros((16, 32), np.float32),
                                          "optimizer.state.0.exp_avg": np.zeros((128, 32), np.float32)})
    with open_checkpoint(TRAIN) as a, open_checkpoint(changed) as b:
        result = {k.key: k for k in diff_checkpoints(a, b).keys}
        nonzero = np.count_nonzero(a.leaves["optimizer.state.0.exp_avg"].tensor.read_all())
    assert (result[Q].status, result[Q].a, result[Q].b) == ("shape", "[32, 32] float32", "[16, 32] float32")
    avg = result["optimizer.state.0.exp_avg"]
    assert avg.status == "changed" and avg.values.changed == nonzero > 0
    tensor = TensorLeaf("k", ArrayTensor(np.zeros(2, np.float32)))
    assert compare_leaves("k", tensor, ValueLeaf("k", 0.0), tolerance=0, max_elements=8).status == "kind"
    assert compare_leaves("k", ValueLeaf("k", 1), ValueLeaf("k", 2), tolerance=0, max_elements=8).status == "changed"
    assert compare_leaves("k", ValueLeaf("k", 1), ValueLeaf("k", 1.0), tolerance=0, max_elements=8).status == "changed"
    assert compare_leaves("k", ValueLeaf("k", float("nan")), ValueLeaf("k", float("nan")), tolerance=0,
                          max_elements=8).status == "equal"


def test_streamed_boxes_cover_every_element_once_in_c_order():
    for shape, most in [((5, 7, 3), 4), ((5, 7, 3), 21), ((5, 7, 3), 1000), ((10,), 3), ((2, 1, 9), 2), ((), 5)]:
        seen = []
        for box, start in c_order_boxes(shape, most):
            n = int(np.prod([b - a for a, b in box]))
            assert n <= max(most, shape[-1] if shape else 1)
            seen.append((start, n))
        assert [s for s, _ in seen] == list(np.cumsum([0] + [n for _, n in seen])[:-1])
        assert sum(n for _, n in seen) == int(np.prod(shape))


def test_values_compared_in_small_boxes_find_the_first_difference_and_nan_rules():
    a = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    b = a.copy()
    b[2, 1, 3] += 0.5
    b[1, 3, 0] = np.nan
    a[0, 0, 0] = b[0, 0, 0] = np.nan
    ra, rb = RecordingTensor(a), RecordingTensor(b)
    d = compare_tensors(ra, rb, max_elements=3)  # memory: one box of at most 3 elements (or a row) per side
    assert (d.changed, d.first_index, d.max_abs_diff) == (2, (1, 3, 0), float("inf"))
    assert ra.boxes == rb.boxes and max(np.prod([hi - lo for lo, hi in box]) for box in ra.boxes) == 3
    assert ra.bytes_read == a.nbytes
    assert d.first_values[0] == 35.0 and np.isnan(d.first_values[1])
    d = compare_tensors(ArrayTensor(a), ArrayTensor(np.where(np.isnan(b), a, b)), tolerance=0.5)
    assert d.equal and d.max_abs_diff == 0.5
    bf = compare_tensors(ArrayTensor(np.array([0x3F80], np.uint16), dtype=_bf16()),
                         ArrayTensor(np.array([0x3FC0], np.uint16), dtype=_bf16()))
    assert (bf.changed, bf.first_values, bf.max_abs_diff) == (1, (1.0, 1.5), 0.5)


def _bf16():
    from ckptfs.dtypes import BFLOAT16

    return BFLOAT16


def test_a_run_s_checkpoints_by_name(tmp_path, capsys):
    from helpers.run import model_dir, save

    run = model_dir(tmp_path / "run")
    save(run, 1000)
    save(run, 2000)
    code, doc, _ = diff_json(capsys, run / "checkpoint_1000", run / "latest")
    assert code == 1 and doc["b"] == str(run / "checkpoint_2000.mdl")
    (k,) = [k for k in doc["keys"] if k["status"] != "equal"]
    assert (k["key"], k["first_values"]) == ("model.transformer_decoder.norm.weight", [1000.0, 2000.0])
    code, doc, _ = diff_json(capsys, run, run / "checkpoint_2000.mdl")  # a model_dir is its latest checkpoint
    assert code == 0 and doc["equal"]


def diff_text(capsys, *args):
    code = main(["diff", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow  # runs the CLI
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys):
    r = run_ckptfs("diff", TRAIN, tmp_path / "nope.mdl", text=True)
    assert r.returncode == 2 and r.stderr.strip() == f"ckptfs: error: {tmp_path / 'nope.mdl'}: no such file or directory"
    (tmp_path / "junk.mdl").write_bytes(b"not hdf5")
    code, _, err = diff_text(capsys, tmp_path / "junk.mdl", TRAIN)
    assert code == 2 and len(err.splitlines()) == 1 and str(tmp_path / "junk.mdl") in err
    broken = with_one_element_changed(tmp_path, "broken.mdl")
    with h5py.File(broken, "r") as f:
        where = f[Q].id.get_chunk_info(0).byte_offset
    with open(broken, "r+b") as fh:  # a broken LZ4 frame: the chunk cannot be decoded
        fh.seek(where)
        fh.write(b"\xff" * 16)
    code, out, err = diff_text(capsys, TRAIN, broken)
    assert code == 2 and err.count("\n") == 1
    assert str(broken) in err and Q in err and "corrupt LZ4 chunk" in err
    assert f"? {Q}  unreadable:" in out
    graph = FIXTURES / "cstorch_edge_cases" / "graph.mdl"  # a TorchScript graph tensor: ckptfs never runs one
    code, out, err = diff_text(capsys, graph, graph)
    assert code == 2 and err.startswith(f"ckptfs: error: {graph}: ") and "TorchScript" in err and err.count("\n") == 1


# -- what two mounts would serve -------------------------------------------------------------------------------


GPT2 = FIXTURES / "gpt2" / "cs"


@slow  # builds the HF view of four checkpoints
def test_view_hf_equal_for_copies_and_names_the_tensor_that_differs(tmp_path, capsys):
    shutil.copy(GPT2 / "params.yaml", tmp_path / "params.yaml")
    copy = copy_of(tmp_path, "copy.mdl", GPT2 / "checkpoint.mdl")
    code, doc, err = diff_json(capsys, GPT2 / "checkpoint.mdl", copy, "--view", "hf")
    assert code == 0, err
    assert {f["path"] for f in doc["files"]} == {"config.json", "generation_config.json", "model.safetensors",
                                                 "bin/config.json", "bin/generation_config.json",
                                                 "bin/pytorch_model.bin", "hub/config.json",
                                                 "hub/generation_config.json", "hub/model.safetensors"}
    one = with_one_element_changed(tmp_path, "one.mdl", GPT2 / "checkpoint.mdl")
    code, doc, _ = diff_json(capsys, GPT2 / "checkpoint.mdl", one, "--view", "hf")
    assert code == 1
    changed = {f["path"]: f for f in doc["files"] if f["status"] != "equal"}
    assert set(changed) == {"model.safetensors", "bin/pytorch_model.bin", "hub/model.safetensors"}
    # GPT-2 fuses q, k, v into c_attn and transposes it: CS q element [3, 5] is HF c_attn element [5, 3]
    assert changed["model.safetensors"]["where"] == "tensor transformer.h.0.attn.c_attn.weight, element [5, 3]"
    assert changed["model.safetensors"]["differing_bytes"] <= 4


@slow  # builds the cs, torch and hf views of two checkpoints
def test_views_pair_the_files_named_after_each_checkpoint_and_a_missing_view_is_bad_input(tmp_path, capsys):
    a = copy_of(tmp_path, "checkpoint_1.mdl", GPT2 / "checkpoint.mdl")
    b = copy_of(tmp_path, "checkpoint_2.mdl", GPT2 / "checkpoint.mdl")
    shutil.copy(GPT2 / "params.yaml", tmp_path / "params.yaml")
    code, out, err = diff_text(capsys, a, b, "--view", "cs", "--equal")
    assert code == 0, err
    assert "= cs/checkpoint_1.mdl (B: cs/checkpoint_2.mdl)" in out
    code, out, _ = diff_text(capsys, a, b, "--view", "torch", "--equal")  # a torch zip names its records after it
    assert code == 1 and "= torch/model.pt" in out
    assert "~ torch/checkpoint_1.pt (B: torch/checkpoint_2.pt)  " in out
    assert "first at byte 41: zip local header of checkpoint_1/data.pkl" in out
    (tmp_path / "params.yaml").unlink()
    code, _, err = diff_text(capsys, a, b, "--view", "hf")
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"ckptfs: error: {a}: view hf is missing: Hugging Face files not generated:")
