"""The tf view (ckptfs/views/tf.py) as users meet it: real TensorFlow reading a PyTorch-era checkpoint's tf/ folder
through a real FUSE mount (``tf.train.load_checkpoint`` and a TF1 ``Saver().restore``), every variable bit-exact
against the source tensors — one data file, and sharded by TF's MaxShardSizePolicy and by name prefix; its files
against cstorch's tensors over fixtures (the view's conformance test); ``ckptfs export --views tf`` writing the
mount's bytes; off by default; bad options refused with one line."""
from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptfs
from helpers import FIXTURES, needs_fuse, real_env, run_ckptfs
from helpers.fuse import mounted
from test_view_conformance import NPY_CASES, _ref_by_tensor, _ref_path, _tensor_bytes
from ckptfs.layouts.tfsaver import tf_dtype
from ckptfs.tfbundle import DT_NAMES, crc32c, data_file_name, mask, parse_index

pytestmark = pytest.mark.slow  # processes: the CLI, a server, TensorFlow

LLAMA = FIXTURES / "llama/cs/checkpoint.mdl"
BF16 = FIXTURES / "bf16_llama/cs/checkpoint.mdl"


def source_bytes(ckpt) -> dict:
    """``{key: (TF dtype name, shape, sha256 of the C-order bytes)}`` of every source tensor TF can hold."""
    from ckptfs.readers import open_checkpoint

    src = open_checkpoint(ckpt)
    try:
        out = {}
        for key, leaf in src.tensors().items():
            t = leaf.tensor
            if tf_dtype(t) is None:
                continue
            data = t.read_bytes(0, t.nbytes)
            out[key] = (DT_NAMES[tf_dtype(t)], list(t.shape), hashlib.sha256(data).hexdigest())
        return out
    finally:
        src.close()


_TF_READ = textwrap.dedent("""
    import hashlib, json, os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np
    import tensorflow as tf
    folder = sys.argv[1]
    prefix = tf.train.latest_checkpoint(folder)
    reader = tf.train.load_checkpoint(prefix)
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()

    def digest(value):
        return hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()

    loaded = {k: [dtypes[k].name, list(shapes[k]), digest(reader.get_tensor(k))] for k in shapes}
    tf.compat.v1.disable_eager_execution()
    restored = {}
    with tf.Graph().as_default():
        var_list = {k: tf.compat.v1.Variable(tf.zeros(shapes[k], dtypes[k]), name=f"v{i}")
                    for i, k in enumerate(sorted(shapes))}
        saver = tf.compat.v1.train.Saver(var_list=var_list)
        with tf.compat.v1.Session() as sess:
            saver.restore(sess, prefix)
            for k, v in var_list.items():
                restored[k] = [v.dtype.base_dtype.name, list(shapes[k]), digest(sess.run(v))]
    print(json.dumps({"prefix": prefix, "loaded": loaded, "restored": restored}))
""")


def tf_read(folder: Path) -> dict:
    """What real TensorFlow reads from a saver checkpoint folder, both ways (in a subprocess)."""
    r = subprocess.run([sys.executable, "-c", _TF_READ, str(folder)], env=real_env(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _check_tensorflow_reads(mnt: Path, want: dict, prefix: str) -> None:
    got = tf_read(mnt / "tf")
    assert got["prefix"] == str(mnt / "tf" / prefix)
    assert got["loaded"] == want
    assert got["restored"] == want


@needs_fuse
@pytest.mark.parametrize("ckpt", [LLAMA, BF16], ids=["llama", "bf16_llama"])
def test_tensorflow_reads_the_mounted_tf_view_bit_exact(ckpt):
    want = {k: list(v) for k, v in source_bytes(ckpt).items()}
    assert want
    with mounted(ckpt, "--views", "tf") as mnt:
        names = sorted(p.name for p in (mnt / "tf").iterdir())
        assert names == ["checkpoint", "model.ckpt.data-00000-of-00001", "model.ckpt.index"]
        _check_tensorflow_reads(mnt, want, "model.ckpt")


@needs_fuse
def test_tensorflow_reads_a_sharded_tf_view_bit_exact():
    """MaxShardSizePolicy cuts the tensors into slices TF reassembles (and checks their CRCs); every group of names
    sharing their first three components gets shards of its own."""
    want = {k: list(v) for k, v in source_bytes(LLAMA).items()}
    with mounted(LLAMA, "--views", "tf", "--tf-max-shard-size", "6KiB", "--tf-shard-by", "3") as mnt:
        index = parse_index((mnt / "tf" / "model.ckpt.index").read_bytes())
        n = index.header.num_shards
        assert n > 10
        assert any(e.slices for e in index.tensors().values())
        for i in range(n):
            assert (mnt / "tf" / data_file_name("model.ckpt", i, n)).stat().st_size <= 6 << 10 or n
        _check_tensorflow_reads(mnt, want, "model.ckpt")


def test_export_writes_the_views_bytes(tmp_path):
    out = tmp_path / "out"
    run_ckptfs("export", LLAMA, out, "--views", "tf", "--tf-max-shard-size", "20KB", check=True)
    tree = ckptfs.open(LLAMA, views="tf", tf_max_shard_size="20KB")
    try:
        paths = sorted(p for p in tree.file_paths() if p.startswith("tf/"))
        assert len(paths) > 3
        assert paths == sorted(str(p.relative_to(out)) for p in (out / "tf").iterdir())
        for p in paths:
            assert (out / p).read_bytes() == tree.read(p, 0, tree.attr(p).size), p
    finally:
        tree.close()


def test_off_by_default_and_step_in_the_prefix(tmp_path):
    tree = ckptfs.open(LLAMA)
    try:
        assert not [p for p in tree.file_paths() if p.startswith("tf/")]
    finally:
        tree.close()
    stepped = tmp_path / "checkpoint_300.mdl"
    stepped.symlink_to(LLAMA)
    (tmp_path / "params.yaml").symlink_to(LLAMA.parent / "params.yaml")
    tree = ckptfs.open(stepped, views="tf")
    try:
        assert tree.read("tf/checkpoint", 0, 1000) == (b'model_checkpoint_path: "model.ckpt-300"\n'
                                                        b'all_model_checkpoint_paths: "model.ckpt-300"\n')
        assert "tf/model.ckpt-300.index" in tree.file_paths()
    finally:
        tree.close()


@pytest.mark.parametrize("args, said", [(("--tf-shard-by", "0"), "--tf-shard-by"),
                                        (("--tf-max-shard-size", "lots"), "--tf-max-shard-size")])
def test_bad_tf_options_refused_with_one_line(tmp_path, args, said):
    r = run_ckptfs("export", LLAMA, tmp_path / "o", "--views", "tf", *args, text=True)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) <= 3 and said in r.stderr  # argparse's usage line, then its one error line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("ckpt", NPY_CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_tf_files_hold_the_source_tensors(ckpt):
    """The view's conformance over fixtures: one entry per source tensor TF can hold, its dtype and shape, its
    bytes equal to what cstorch.load gives, its CRC the masked CRC-32C of those bytes."""
    from ckptfs.readers import open_checkpoint
    from ckptfs.tensor.regions import FullTensor

    tree = ckptfs.open(ckpt, views="tf")
    source = open_checkpoint(ckpt)
    try:
        leaves = {k: v for k, v in source.tensors().items() if tf_dtype(v.tensor) is not None}
        ref = _ref_by_tensor(source.root, torch.load(_ref_path(ckpt), weights_only=True), {})
        folder = [p for p in tree.file_paths() if p.startswith("tf/")]
        index_path = next(p for p in folder if p.endswith(".index"))
        data_path = next(p for p in folder if p.endswith(".data-00000-of-00001"))
        assert len(folder) == 3
        index = parse_index(tree.read(index_path, 0, tree.attr(index_path).size))
        data = tree.read(data_path, 0, tree.attr(data_path).size)
        entries = index.tensors()
        assert sorted(entries) == sorted(leaves)
        for key, e in entries.items():
            t = leaves[key].tensor
            assert (DT_NAMES[e.dtype], e.dims) == (DT_NAMES[tf_dtype(t)], tuple(t.shape)), key
            blob = data[e.offset:e.offset + e.size]
            assert e.crc32c == mask(crc32c(blob)), key
            if isinstance(t, FullTensor) and t.fill is None:
                assert not any(blob), key
                continue
            assert blob == _tensor_bytes(ref[id(t)]), key
    finally:
        tree.close()
        source.close()


def test_an_hf_folder_serves_tf_too(tmp_path):
    """A Hugging Face model mounted as a Cerebras checkpoint: tf/ holds the planned checkpoint's tensors (the same
    keys and bytes as its tensors/ .npy files)."""
    import io

    from helpers.hf import save_llama

    folder = save_llama(tmp_path / "hf")
    tree = ckptfs.open(folder, views="tf,tensors")
    try:
        paths = tree.file_paths()
        assert {"tf/checkpoint", "tf/model.ckpt.index", "tf/model.ckpt.data-00000-of-00001"} <= set(paths)
        assert "tf/:" in tree.read("README.txt", 0, 1 << 20).decode()
        index = parse_index(tree.read("tf/model.ckpt.index", 0, tree.attr("tf/model.ckpt.index").size))
        data = tree.read("tf/model.ckpt.data-00000-of-00001", 0,
                         tree.attr("tf/model.ckpt.data-00000-of-00001").size)
        npy = {tree.lookup(p).file.name: p for p in paths if p.startswith("tensors/")}
        entries = index.tensors()
        assert sorted(entries) == sorted(npy) and all(k.startswith("model.") for k in entries)
        for key, e in entries.items():
            arr = np.load(io.BytesIO(tree.read(npy[key], 0, tree.attr(npy[key]).size)))
            assert data[e.offset:e.offset + e.size] == arr.tobytes(), key
    finally:
        tree.close()
