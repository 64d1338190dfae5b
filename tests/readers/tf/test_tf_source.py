"""A TensorFlow saver checkpoint as a source (the tensorflow-to-h5 direction), read without TensorFlow: given as its
prefix, its .index file or a folder with a ``checkpoint`` file; TF1 name-based and TF2 object-based (sharded, with
variables TF split into slices across shards). A real FUSE mount serves ``h5/<prefix>.h5`` in the appliance's
H5Saver layout (checked by H5Saver's reading rule against the reference values and the case's own h5/model.h5, and
read back by ckptfs's own reader), and ``tensors/``. Hostile inputs: one line, exit 2, or EIO for the one tensor;
each test is named after the attack."""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import ckptfs
from ckptfs.errors import CheckpointError, TensorReadError
from ckptfs.readers import open_checkpoint, resolve_checkpoint
from ckptfs.catalog.model import TF_SAVER, TensorLeaf, UnreadableLeaf
from ckptfs.tfbundle import encode_header, encode_index, parse_index, write_table
from helpers import needs_fuse, real_env, run_ckptfs
from helpers.fuse import mounted
from helpers.tf_source import (CASES, case_dir, check_h5saver_file, check_tensors_folder, copy_case, manifest, prefix,
                       reference)

pytestmark = pytest.mark.slow  # processes: the CLI, a server, TensorFlow

CASE_PARAMS = [pytest.param(c, id=c) for c in CASES]
#: the cases as their folders (what tests/views/test_view_conformance.py asks of a view's conformance test)
CASE_DIRS = [pytest.param(str(case_dir(c)), id=c) for c in CASES]
H5_NAME = {c: prefix(c).name + ".h5" for c in CASES}


def check_state(ckpt, case):
    """Every variable of ``case`` read from ``ckpt`` equals the reference (bfloat16 as its bits); strings are
    unreadable leaves saying so."""
    ref = reference(case)
    assert set(ckpt.leaves) == set(ref)
    for name, (dt, want) in ref.items():
        leaf = ckpt.leaves[name]
        if want is None:
            assert isinstance(leaf, UnreadableLeaf) and leaf.dtype == "string", name
            continue
        assert isinstance(leaf, TensorLeaf) and leaf.tensor.dtype.name == dt, name
        got = leaf.tensor.read_all()
        assert got.shape == want.shape and got.tobytes() == want.tobytes(), name


# ---- designating a checkpoint -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_prefix_index_and_folder_designate_the_same_checkpoint(case):
    p = prefix(case)
    index = p.with_name(p.name + ".index")
    assert resolve_checkpoint(p) == index
    assert resolve_checkpoint(index) == index
    assert resolve_checkpoint(p.parent) == index  # the folder's checkpoint file names the latest
    with open_checkpoint(p.parent) as c:
        assert c.kind == TF_SAVER
        check_state(c, case)


def test_the_checkpoint_file_picks_the_latest_relative_to_its_folder(tmp_path):
    old = copy_case("tf1_dtypes", tmp_path / "run")
    for f in list(old.parent.iterdir()):  # a second checkpoint of the run, older, under another prefix
        if f.name.startswith(old.name):
            (old.parent / f.name.replace("ckpt-7", "ckpt-3")).write_bytes(f.read_bytes())
    (old.parent / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-3"\n'
                                           'all_model_checkpoint_paths: "model.ckpt-3"\n')
    assert resolve_checkpoint(old.parent) == old.parent / "model.ckpt-3.index"
    (old.parent / "checkpoint").write_text(f'model_checkpoint_path: "{old}"\n')  # absolute, inside: taken
    assert resolve_checkpoint(old.parent) == old.parent / "model.ckpt-7.index"


# ---- the state, in-process --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_every_variable_equals_what_tensorflow_reads(case):
    with open_checkpoint(prefix(case)) as c:
        check_state(c, case)


def test_a_variable_split_into_slices_reads_any_box():
    name = "model/bert/encoder/layer_1/intermediate/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE"  # 4 slices, 2 shards
    want = reference("tf2_bert_sharded")[name][1]
    with open_checkpoint(prefix("tf2_bert_sharded")) as c:
        t = c.leaves[name].tensor
        assert len(t.parts) == 4
        for box in (((20, 25), (5, 12)), ((0, 32), (7, 9)), ((21, 22), (0, 64))):
            sl = tuple(slice(a, b) for a, b in box)
            assert t.read(box).tobytes() == np.ascontiguousarray(want[sl]).tobytes(), box


def test_the_python_api_loads_it():
    state = ckptfs.load(prefix("tf1_bert_adam"))
    ref = reference("tf1_bert_adam")
    assert set(state) == set(ref)
    assert np.asarray(state["global_step"]).item() == ref["global_step"][1].item() == 100


# ---- the H5Saver file -------------------------------------------------------------------------------------


@pytest.mark.parametrize("folder", CASE_DIRS)
def test_the_h5_file_is_what_tensorflow_to_h5_writes(folder, tmp_path):
    """Export it (the CLI), then read it by H5Saver's rule: every variable equals the reference and the case's own
    h5/model.h5; ckptfs's own reader opens it as a TF-era H5 file with the same values."""
    case = os.path.basename(folder)
    out = tmp_path / "model.h5"
    run_ckptfs("export", prefix(case), f"h5/{H5_NAME[case]}", out, check=True)
    check_h5saver_file(out, case)
    ref = reference(case)
    with open_checkpoint(out) as c:
        assert set(c.leaves) == set(ref) - set(manifest(case)["h5"]["left_out"])
        for name, leaf in c.leaves.items():
            assert leaf.tensor.read_all().tobytes() == ref[name][1].tobytes(), name


def test_the_h5_file_is_the_same_bytes_every_time():
    a, b = ckptfs.open(prefix("tf2_bert_sharded")), ckptfs.open(prefix("tf2_bert_sharded"))
    try:
        path = f"h5/{H5_NAME['tf2_bert_sharded']}"
        assert a.attr(path).size == b.attr(path).size
        assert a.read(path, 0, a.attr(path).size) == b.read(path, 0, b.attr(path).size)
    finally:
        a.close()
        b.close()


def test_tf_files_are_the_sources_own_bytes(tmp_path):
    """Without a mount: the tf/ files of a sharded TF2 checkpoint (slices, a string tensor) equal the source's."""
    case = "tf2_bert_sharded"
    run_ckptfs("export", prefix(case), tmp_path / "out", check=True)
    for name, sha in manifest(case)["tf_file_sha256"].items():
        assert hashlib.sha256((tmp_path / "out" / "tf" / name).read_bytes()).hexdigest() == sha, name


def test_readme_lists_what_the_h5_file_leaves_out():
    tree = ckptfs.open(prefix("tf1_dtypes"))
    try:
        readme = tree.read("README.txt", 0, 1 << 20).decode()
    finally:
        tree.close()
    assert "format:         TensorFlow saver checkpoint" in readme
    assert "h5: dtypes/bf16_matrix: left out (bfloat16: no H5Saver representation)" in readme
    assert "h5: dtypes/string_scalar: left out (string: no H5Saver representation)" in readme
    assert "hf:      missing: not applicable: TensorFlow variable names" in readme


# ---- the command line -------------------------------------------------------------------------------------


def test_cli_info_ls_export_one_liners(tmp_path):
    p = prefix("tf2_bert_sharded")
    r = run_ckptfs("info", p.parent, text=True, check=True)
    assert "format: TensorFlow saver checkpoint" in r.stdout and "variables: 43" in r.stdout
    assert "unreadable _CHECKPOINTABLE_OBJECT_GRAPH: string tensor" in r.stdout
    r = run_ckptfs("ls", "-l", str(p) + ".index", text=True, check=True)
    assert "model/bert/pooler/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE  [32, 32] float32" in r.stdout
    out = tmp_path / "k.npy"
    run_ckptfs("export", p, "tensors/model/bert/pooler/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE.npy", out, check=True)
    want = reference("tf2_bert_sharded")["model/bert/pooler/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE"][1]
    assert np.load(out).tobytes() == want.tobytes()
    r = run_ckptfs("export", p, tmp_path / "all", text=True)
    assert r.returncode == 0, r.stderr
    check_h5saver_file(tmp_path / "all" / "h5" / H5_NAME["tf2_bert_sharded"], "tf2_bert_sharded")


def one_line_exit_2(r, *needles):
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("command", [["info"], ["ls"], ["export", "h5/x.h5", "-"]])
def test_a_prefix_with_no_checkpoint_is_exit_2(tmp_path, command):
    r = run_ckptfs(command[0], tmp_path / "model.ckpt-9", *command[1:], text=True)
    one_line_exit_2(r, "model.ckpt-9", "no such file")


# ---- hostile checkpoints ----------------------------------------------------------------------------------


def rewrite_index(p, change):
    """Rewrite the copy's ``.index`` with ``change(key, entry) -> entry`` applied to every entry (valid table and
    checksums: only the entries lie)."""
    index = p.with_name(p.name + ".index")
    b = parse_index(index.read_bytes())
    index.write_bytes(encode_index(b.header, [(k, change(k, e)) for k, e in b.entries]))


def test_crc_mismatch(tmp_path):
    """One flipped byte in a variable's data: that tensor fails (EIO in a mount), every other one still reads."""
    p = copy_case("tf1_dtypes", tmp_path / "c")
    b = parse_index(p.with_name(p.name + ".index").read_bytes())
    e = b.tensors()["dtypes/f32_matrix"]
    data = p.with_name(p.name + ".data-00000-of-00001")
    raw = bytearray(data.read_bytes())
    raw[e.offset + 5] ^= 0x40
    data.write_bytes(bytes(raw))
    with open_checkpoint(p) as c:
        with pytest.raises(TensorReadError, match="CRC-32C mismatch"):
            c.leaves["dtypes/f32_matrix"].tensor.read(((0, 1), (0, 1)))  # even a read of one element
        assert c.leaves["dtypes/i32_tensor"].tensor.read_all().tobytes() == \
            reference("tf1_dtypes")["dtypes/i32_tensor"][1].tobytes()
    r = run_ckptfs("export", p, "tensors/dtypes/f32_matrix.npy", tmp_path / "x.npy", text=True)
    assert r.returncode != 0 and "CRC-32C mismatch" in r.stderr and not (tmp_path / "x.npy").exists()


def test_lying_entry_offset(tmp_path):
    """An entry whose bytes lie beyond the end of its shard: that variable is unreadable (and the h5 file is not
    generated without it); the others read."""
    p = copy_case("tf1_bert_adam", tmp_path / "c")
    rewrite_index(p, lambda k, e: dataclasses.replace(e, offset=10**9) if k == b"global_step" else e)
    with open_checkpoint(p) as c:
        assert "lie beyond the end of" in c.leaves["global_step"].reason
        assert c.leaves["bert/pooler/dense/bias"].tensor.read_all().tobytes() == \
            reference("tf1_bert_adam")["bert/pooler/dense/bias"][1].tobytes()
    tree = ckptfs.open(p)
    try:
        readme = tree.read("README.txt", 0, 1 << 20).decode()
        assert "h5:      missing: model.ckpt-100.h5 not generated: variable global_step cannot be read" in readme
    finally:
        tree.close()


def test_lying_entry_offset_into_another_tensor(tmp_path):
    """An entry pointing at another variable's bytes (same size): its CRC does not match, never a wrong byte."""
    p = copy_case("tf1_bert_adam", tmp_path / "c")
    b = parse_index(p.with_name(p.name + ".index").read_bytes())
    other = b.tensors()["bert/pooler/dense/bias/adam_m"]
    rewrite_index(p, lambda k, e: dataclasses.replace(e, offset=other.offset) if k == b"bert/pooler/dense/bias" else e)
    with open_checkpoint(p) as c:
        with pytest.raises(TensorReadError, match="CRC-32C mismatch"):
            c.leaves["bert/pooler/dense/bias"].tensor.read_all()


@pytest.mark.parametrize("field,value,needle", [("size", 12345, "should hold"), ("shard_id", 3, "shard 3 of 1")])
def test_lying_entry_size_or_shard_id(tmp_path, field, value, needle):
    p = copy_case("tf1_dtypes", tmp_path / "c")
    rewrite_index(p, lambda k, e: dataclasses.replace(e, **{field: value}) if k == b"dtypes/f32_matrix" else e)
    for command in (["info"], ["ls"], ["mount", tmp_path / "mnt"]):
        (tmp_path / "mnt").mkdir(exist_ok=True)
        r = run_ckptfs(command[0], p, *command[1:], text=True, timeout=120)
        one_line_exit_2(r, "model.ckpt-7.index", needle)


def test_huge_varint(tmp_path):
    """An index entry whose varint runs past 64 bits (the table and its checksums are valid)."""
    p = copy_case("tf1_dtypes", tmp_path / "c")
    index = p.with_name(p.name + ".index")
    header = parse_index(index.read_bytes()).header
    index.write_bytes(write_table([(b"", encode_header(header)), (b"x", b"\x08" + b"\xff" * 12 + b"\x01")]))
    r = run_ckptfs("info", p, text=True)
    one_line_exit_2(r, "model.ckpt-7.index")


def test_truncated_data_file(tmp_path):
    """A data shard cut short: the variables whose bytes are gone are unreadable, saying so; those before the cut
    read; the h5 file is not generated without them."""
    p = copy_case("tf1_bert_adam", tmp_path / "c")
    data = p.with_name(p.name + ".data-00000-of-00001")
    size = data.stat().st_size
    os.truncate(data, size // 2)
    with open_checkpoint(p) as c:
        bad = [k for k, v in c.leaves.items() if isinstance(v, UnreadableLeaf)]
        good = [k for k, v in c.leaves.items() if isinstance(v, TensorLeaf)]
        assert bad and good
        assert all("data file is truncated or the index lies" in c.leaves[k].reason for k in bad)
        ref = reference("tf1_bert_adam")
        for k in good:
            assert c.leaves[k].tensor.read_all().tobytes() == ref[k][1].tobytes()
    r = run_ckptfs("info", p, text=True, check=True)
    assert "variable(s) cannot be read" in r.stdout


def test_truncated_data_file_after_open(tmp_path):
    """A shard cut short after the checkpoint was opened: reads fail (the file changed), never a wrong byte."""
    p = copy_case("tf1_dtypes", tmp_path / "c")
    data = p.with_name(p.name + ".data-00000-of-00001")
    with open_checkpoint(p) as c:
        os.truncate(data, 10)
        with pytest.raises(TensorReadError):
            c.leaves["dtypes/i32_tensor"].tensor.read_all()


def test_missing_shard(tmp_path):
    p = copy_case("tf2_bert_sharded", tmp_path / "c")
    p.with_name(p.name + ".data-00002-of-00004").unlink()
    r = run_ckptfs("info", p.parent, text=True)
    one_line_exit_2(r, "ckpt-1.index", "data shard 2 of 4 (ckpt-1.data-00002-of-00004) is missing")


def test_shard_symlink_leading_outside_the_folder(tmp_path):
    p = copy_case("tf1_dtypes", tmp_path / "c")
    data = p.with_name(p.name + ".data-00000-of-00001")
    outside = tmp_path / "elsewhere.data"
    data.rename(outside)
    data.symlink_to(outside)
    r = run_ckptfs("ls", p, text=True)
    one_line_exit_2(r, "outside the checkpoint's folder")


@pytest.mark.parametrize("named", ["../other/model.ckpt-7", "ABSOLUTE"])
def test_checkpoint_file_naming_a_prefix_outside_the_folder(tmp_path, named):
    """The folder's ``checkpoint`` file names a real checkpoint outside the folder: refused in one line, for every
    command, nothing mounted."""
    other = copy_case("tf1_dtypes", tmp_path / "other")
    run = tmp_path / "run"
    run.mkdir()
    text = str(other) if named == "ABSOLUTE" else named
    (run / "checkpoint").write_text(f'model_checkpoint_path: "{text}"\n')
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for command in (["info"], ["ls"], ["export", "h5/model.ckpt-7.h5", tmp_path / "out.h5"], ["mount", mnt]):
        r = run_ckptfs(command[0], run, *command[1:], text=True, timeout=120)
        one_line_exit_2(r, "outside the checkpoint's folder", "refused")
    assert not (tmp_path / "out.h5").exists() and not os.listdir(mnt)


def test_checkpoint_file_naming_a_missing_prefix(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-5"\n')
    one_line_exit_2(run_ckptfs("info", run, text=True), "model.ckpt-5.index is missing")


def test_oversized_checkpoint_file(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint").write_bytes(b'model_checkpoint_path: "a"\n' + b"#" * (2 << 20))
    one_line_exit_2(run_ckptfs("ls", run, text=True), "more than the")


# ---- through a real FUSE mount ----------------------------------------------------------------------------


@needs_fuse
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_mount_serves_the_h5_file_and_tensors(case):
    ref = reference(case)
    with mounted(prefix(case)) as mnt:
        assert {"README.txt", "h5", "tensors"} <= set(os.listdir(mnt))
        h5 = mnt / "h5" / H5_NAME[case]
        size = os.stat(h5).st_size
        with open(h5, "rb") as f:
            assert len(f.read()) == size  # exact from the first stat
        check_h5saver_file(h5, case)
        with open_checkpoint(h5) as c:  # read back by ckptfs's own TF-era H5 reader
            for name, leaf in c.leaves.items():
                assert leaf.tensor.read_all().tobytes() == ref[name][1].tobytes(), name
        check_tensors_folder(mnt / "tensors", ref)
        assert "left out" in (mnt / "README.txt").read_text() or not manifest(case)["h5"]["left_out"]
        # tf/: the source's own index and data files, byte for byte (what TensorFlow wrote: MANIFEST.json)
        shas = manifest(case)["tf_file_sha256"]
        assert sorted(os.listdir(mnt / "tf")) == sorted([*shas, "checkpoint"])
        for name, sha in shas.items():
            assert hashlib.sha256((mnt / "tf" / name).read_bytes()).hexdigest() == sha, name
            assert (mnt / "tf" / name).read_bytes() == (prefix(case).parent / name).read_bytes(), name
        assert (mnt / "tf" / "checkpoint").read_text() == (prefix(case).parent / "checkpoint").read_text()


@needs_fuse
@pytest.mark.timeout(300)
def test_mount_gives_eio_for_the_tensor_whose_crc_mismatches(tmp_path):
    p = copy_case("tf1_dtypes", tmp_path / "c")
    b = parse_index(p.with_name(p.name + ".index").read_bytes())
    e = b.tensors()["dtypes/i32_tensor"]
    data = p.with_name(p.name + ".data-00000-of-00001")
    raw = bytearray(data.read_bytes())
    raw[e.offset] ^= 1
    data.write_bytes(bytes(raw))
    ref = reference("tf1_dtypes")
    with mounted(p.parent) as mnt:
        with pytest.raises(OSError) as ei:
            (mnt / "tensors" / "dtypes" / "i32_tensor.npy").read_bytes()
        assert ei.value.errno == errno.EIO
        with pytest.raises(OSError) as ei:
            (mnt / "h5" / "model.ckpt-7.h5").read_bytes()
        assert ei.value.errno == errno.EIO
        with pytest.raises(OSError) as ei:  # the pass-through data file too: never the corrupt bytes
            (mnt / "tf" / "model.ckpt-7.data-00000-of-00001").read_bytes()
        assert ei.value.errno == errno.EIO
        assert (mnt / "tf" / "model.ckpt-7.index").read_bytes() == p.with_name(p.name + ".index").read_bytes()
        assert np.load(mnt / "tensors" / "dtypes" / "f32_matrix.npy").tobytes() == \
            ref["dtypes/f32_matrix"][1].tobytes()


# ---- a checkpoint written by TensorFlow itself, now ---------------------------------------------------------

TF_WRITER = r"""
import sys, numpy as np, tensorflow as tf
out = sys.argv[1]
rng = np.random.default_rng(5)
v = {"embeddings": tf.Variable(rng.standard_normal((300, 48)).astype(np.float32)),
     "bias": tf.Variable(rng.standard_normal(48).astype(np.float16)),
     "step": tf.Variable(np.int64(42)),
     "mask": tf.Variable(rng.integers(0, 2, (7, 3)).astype(bool))}
ckpt = tf.train.Checkpoint(**v)
opts = tf.train.CheckpointOptions(experimental_sharding_callback=tf.train.experimental.MaxShardSizePolicy(16 << 10))
path = ckpt.write(out + "/ckpt", options=opts)
r = tf.train.load_checkpoint(path)
np.savez(out + "/values.npz", **{k.replace("/", "|"): r.get_tensor(k) for k in r.get_variable_to_shape_map()
                                 if k != "_CHECKPOINTABLE_OBJECT_GRAPH"})
print(path)
"""


@pytest.mark.timeout(600)
def test_a_sharded_checkpoint_tensorflow_writes_now(tmp_path):
    """Real TensorFlow writes a TF2 checkpoint split into 16 KiB shards; the h5 file ckptfs exports from it holds
    exactly the values TensorFlow reads back."""
    r = subprocess.run([sys.executable, "-c", TF_WRITER, str(tmp_path)], capture_output=True, text=True,
                       env=real_env(TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES=""), timeout=500)
    assert r.returncode == 0, r.stderr[-2000:]
    path = r.stdout.strip().splitlines()[-1]
    assert len(list(tmp_path.glob("ckpt.data-*"))) > 1
    want = {k.replace("|", "/"): v for k, v in np.load(tmp_path / "values.npz").items()}
    out = tmp_path / "out.h5"
    run_ckptfs("export", path, "h5/ckpt.h5", out, check=True)
    import h5py
    from urllib.parse import unquote

    with h5py.File(out, "r") as f:
        got = {unquote(k): np.asarray(f[k][...]) for k in f.keys()}
        assert all(f[k].attrs["__H5_TYPE__"] == "NumpyArrayH5Type" for k in f.keys())
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and got[k].tobytes() == v.tobytes(), k
