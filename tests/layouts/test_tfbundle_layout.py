"""The TF saver layout (ckptfs/layouts/tfsaver.py) against the files TensorFlow itself wrote: the same variables
give the same bytes — the TF1 Saver fixtures as they are, the dtypes case through a fresh TF1 Saver (ckptfs holds
no string tensor), the sharded TF2 fixture's data shards under TF's MaxShardSizePolicy — and exact sizes before any
tensor is read."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from helpers import FIXTURES, real_env
from ckptfs.dtypes import BY_NAME, DType
from ckptfs.errors import CkptfsError
from ckptfs.layouts.tfsaver import TFSaverLayout
from ckptfs.tfbundle import decode_slice_key, parse_index
from ckptfs.tensor.base import ArrayTensor

pytestmark = pytest.mark.slow  # processes: the CLI, a server, TensorFlow

TF = FIXTURES / "tf"


def _case(name):
    root = TF / name
    manifest = json.loads((root / "MANIFEST.json").read_text())
    return root, manifest, Path(manifest["checkpoint_prefix"]).name


def ref_tensors(name, keep_strings=False) -> dict:
    """``{variable name: ArrayTensor}`` from a case's ref.json + ref/*.npy (bfloat16 as its uint16 bits)."""
    root = TF / name
    ref = json.loads((root / "ref.json").read_text())
    out = {}
    for var, r in ref.items():
        if r["dtype"] == "string":
            continue
        out[var] = ArrayTensor(np.load(root / r["file"]), BY_NAME[r["dtype"]])
    return out


def _read(vf) -> bytes:
    return vf.read(0, vf.size)


def test_tf1_bert_adam_files_are_tensorflows_bytes():
    root, manifest, prefix = _case("tf1_bert_adam")
    tensors = ref_tensors("tf1_bert_adam")
    layout = TFSaverLayout(sorted(tensors.items()), prefix)
    files = layout.files()
    assert sorted(files) == sorted(["checkpoint", f"{prefix}.index", f"{prefix}.data-00000-of-00001"])
    for name, vf in files.items():
        assert _read(vf) == (root / "tf" / name).read_bytes(), name


def test_sizes_are_exact_before_any_tensor_is_read():
    root, manifest, prefix = _case("tf1_bert_adam")
    layout = TFSaverLayout(sorted(ref_tensors("tf1_bert_adam").items()), prefix)
    files = layout.files()
    sizes = {name: vf.size for name, vf in files.items()}
    assert layout._crcs is None  # stat needed no CRC, so no tensor bytes
    for name, size in sizes.items():
        assert size == (root / "tf" / name).stat().st_size
    files[f"{prefix}.index"].read(0, 10)
    assert layout._crcs is not None


def test_random_ranges_of_the_data_file():
    root, manifest, prefix = _case("tf1_bert_adam")
    vf = TFSaverLayout(sorted(ref_tensors("tf1_bert_adam").items()), prefix).files()[
        f"{prefix}.data-00000-of-00001"]
    want = (root / "tf" / f"{prefix}.data-00000-of-00001").read_bytes()
    rng = random.Random(5)
    for _ in range(300):
        a = rng.randrange(len(want))
        n = rng.choice([1, 3, 17, 4096, 70000])
        assert vf.read(a, n) == want[a:a + n]


_TF1_SAVER = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf
    root, out = sys.argv[1], sys.argv[2]
    ref = json.load(open(root + "/ref.json"))
    tf.compat.v1.disable_eager_execution()
    with tf.Graph().as_default():
        var_list = {}
        for i, (name, r) in enumerate(sorted(ref.items())):
            if r["dtype"] == "string":
                continue
            value = np.load(root + "/" + r["file"])
            if r["dtype"] == "bfloat16":
                value = tf.bitcast(tf.constant(value), tf.bfloat16)
            var_list[name] = tf.compat.v1.Variable(value, name=f"v{i}")
        saver = tf.compat.v1.train.Saver(var_list=var_list)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saver.save(sess, "model.ckpt", global_step=7, write_meta_graph=False)  # relative, as the fixture's
""")


def test_tf1_dtypes_same_bytes_as_a_tf1_saver(tmp_path):
    """Every dtype of the fixture but the string (ckptfs's tensors have none): a real TF1 Saver writes them."""
    root, _, _ = _case("tf1_dtypes")
    subprocess.run([sys.executable, "-c", _TF1_SAVER, str(root), str(tmp_path)], check=True, env=real_env(),
                   capture_output=True, timeout=300, cwd=tmp_path)
    layout = TFSaverLayout(sorted(ref_tensors("tf1_dtypes").items()), "model.ckpt-7")
    files = layout.files()
    assert sorted(files) == sorted(p.name for p in tmp_path.iterdir())
    for name, vf in files.items():
        assert _read(vf) == (tmp_path / name).read_bytes(), name


def test_tf2_sharded_data_matches_max_shard_size_policy():
    """TF's own MaxShardSizePolicy(24 KiB) over the fixture's variables in TF's order: the same slices, the same data
    shards byte for byte (the last one up to the object graph, a string ckptfs does not have), the same entries."""
    root, manifest, prefix = _case("tf2_bert_sharded")
    theirs = parse_index((root / "tf" / f"{prefix}.index").read_bytes())
    records = []
    for key, e in theirs.entries:
        if not e.slices:
            name = decode_slice_key(key)[0] if key[:1] == b"\0" else key.decode()
            records.append((e.shard_id, e.offset, name))
    order = list(dict.fromkeys(name for _, _, name in sorted(records)))
    tensors = ref_tensors("tf2_bert_sharded")
    graph = "_CHECKPOINTABLE_OBJECT_GRAPH"
    layout = TFSaverLayout([(n, tensors[n]) for n in order if n != graph], prefix, max_shard_size=24 << 10)
    files = layout.files()
    ours = parse_index(_read(files[f"{prefix}.index"]))
    assert ours.header == theirs.header
    assert [(k, e) for k, e in ours.entries] == [(k, e) for k, e in theirs.entries if k != graph.encode()]
    g = theirs.tensors()[graph]
    for i, name in enumerate(layout.data_names()):
        want = (root / "tf" / name).read_bytes()
        if i == g.shard_id:
            assert want[g.offset + g.size:] == b""
            want = want[:g.offset]
        assert _read(files[name]) == want, name


class _Unsupported(ArrayTensor):
    def __init__(self):
        super().__init__(np.zeros(2, np.float32))
        self.dtype = DType("complex32", np.dtype("<u4"), "C32", None, False)


def test_shard_by_prefix_groups_and_unsupported_dtype_refused():
    t = {n: ArrayTensor(np.arange(6, dtype=np.float32).reshape(2, 3)) for n in
         ("a/x/w", "a/x/b", "a/y/w", "b.x.w", "b.x.v")}
    layout = TFSaverLayout(sorted(t.items()), "p", shard_by=2)
    groups = [[r.name for r in recs] for recs in layout.shard_records]
    assert groups == [["a/x/b", "a/x/w"], ["a/y/w"], ["b.x.v", "b.x.w"]]
    assert layout.data_names() == [f"p.data-0000{i}-of-00003" for i in range(3)]
    both = TFSaverLayout(sorted(t.items()), "p", shard_by=1, max_shard_size=40)
    # a/x/w (24 bytes) fills the first shard's 16 bytes left: a row (12), then one element (4); its last 2 elements
    # open the second shard, where a/y/w fits whole; each group starts shards of its own
    assert [[(r.name, r.extents) for r in recs] for recs in both.shard_records] == [
        [("a/x/b", None), ("a/x/w", ((0, 1), (0, 3))), ("a/x/w", ((1, 1), (0, 1)))],
        [("a/x/w", ((1, 1), (1, 2))), ("a/y/w", None)],
        [("b.x.v", None), ("b.x.w", ((0, 1), (0, 3))), ("b.x.w", ((1, 1), (0, 1)))],
        [("b.x.w", ((1, 1), (1, 2)))]]
    data = [_read(vf) for name, vf in sorted(both.files().items()) if ".data-" in name]
    assert data[1][:8] == np.float32([4, 5]).tobytes()  # the slice [1, 1:3] of a/x/w, as its rows' bytes
    with pytest.raises(CkptfsError, match="complex32|cannot be stored"):
        TFSaverLayout([("q", _Unsupported())], "p")


class _Counting(ArrayTensor):
    """An in-memory tensor that counts the reads of its bytes."""

    reads = 0

    def read_into(self, start, out, cache=None):
        type(self).reads += 1
        return super().read_into(start, out, cache)


def test_crcs_are_computed_once_and_persisted(tmp_path):
    from ckptfs.layouts.torchzip.crc_store import CrcStore

    tensors = [(f"w{i}", _Counting(np.arange(i + 1, dtype=np.float32))) for i in range(5)]
    store = CrcStore(tmp_path)
    first = TFSaverLayout(tensors, "model.ckpt", crc_store=store, identity="ckpt-A").files()["model.ckpt.index"]
    _Counting.reads = 0
    data = _read(first)
    assert _Counting.reads == 5  # one read per tensor, for its CRC
    assert [first.read(a, 7) for a in range(0, first.size, 7)] and _Counting.reads == 5  # not again
    again = TFSaverLayout(tensors, "model.ckpt", crc_store=store, identity="ckpt-A").files()["model.ckpt.index"]
    assert _read(again) == data and _Counting.reads == 5  # a later mount: from the store
    other = TFSaverLayout(tensors, "model.ckpt", crc_store=store, identity="ckpt-B").files()["model.ckpt.index"]
    assert _read(other) == data and _Counting.reads == 10  # another checkpoint: computed
