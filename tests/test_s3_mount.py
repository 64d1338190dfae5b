"""Checkpoints in S3 through real mounts, against a real S3-compatible endpoint on 127.0.0.1 that the tests start
(moto's server, ``s3server.py``), holding the genuine objects ``cstorch.save("s3://…")`` wrote (tests/fixtures/s3):
the models and training state equal the local fixtures', a synced ``.mdl`` object mounts byte for byte as the local
file does, peeks cost few requests, and a vanished endpoint or a replaced object gives EIO, never a hang or mixed
bytes."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fusehelp import FIXTURES, is_mounted, mounted, needs_fuse
from s3help import BUCKET, LocalS3, upload_case

pytestmark = [needs_fuse, pytest.mark.timeout(300)]

LLAMA = "s3://ckpts/s3_llama/checkpoint_100.mdl"
SYNCED = "s3://ckpts/s3_run/synced_model_dir/checkpoint_0.mdl"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    srv = LocalS3(tmp_path_factory.mktemp("s3"))
    for case in ("s3_llama", "s3_llama_zstd", "s3_train_gpt2", "s3_run"):
        upload_case(srv, case)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def env(s3, tmp_path_factory):
    return s3.env(CKPTFS_CACHE_DIR=str(tmp_path_factory.mktemp("cache")))


def _files(root: Path) -> dict:
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}


def test_from_pretrained_equals_the_local_model(s3, env):
    import torch
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(FIXTURES / "llama" / "hf").state_dict()
    with mounted(LLAMA, env=env) as mnt:
        got = AutoModelForCausalLM.from_pretrained(mnt).state_dict()
        readme = (mnt / "README.txt").read_text()
    assert list(got) == list(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    assert f"checkpoint:     {LLAMA}" in readme
    assert "params: s3://ckpts/s3_llama/params.yaml" in readme  # found beside the checkpoint in the bucket


def test_training_state_equals_ref_pt(s3, env):
    import torch
    from test_view_torch import assert_same

    expected = torch.load(FIXTURES / "train_gpt2" / "ref.pt", weights_only=True)
    with mounted("s3://ckpts/s3_train_gpt2/checkpoint_100.mdl", "--views", "torch", env=env) as mnt:
        got = torch.load(mnt / "torch" / "checkpoint_100.pt", weights_only=True)
    assert_same(got, expected)


def test_zstd_objects_read_the_same(s3, monkeypatch):
    import ckptfs

    for k, v in s3.env().items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)

    # the torch zips differ in their serialization id only (it names the tensors' sources), as for any two files
    opts = dict(endpoint_url=s3.url, views="hf,tensors", hf_format="safetensors")
    plain = ckptfs.open(LLAMA, **opts)
    packed = ckptfs.open("s3://ckpts/s3_llama_zstd/checkpoint_100.mdl", **opts)
    try:
        names = [p for p in plain.file_paths() if p != "README.txt"]
        assert "model.safetensors" in names and names == [p for p in packed.file_paths() if p != "README.txt"]
        for p in names:
            assert packed.read(p, 0, packed.attr(p).size) == plain.read(p, 0, plain.attr(p).size), p
    finally:
        plain.close()
        packed.close()


def test_synced_mdl_object_mounts_byte_for_byte_as_the_local_file(s3, env, tmp_path):
    local = tmp_path / "synced_model_dir"
    local.mkdir()
    shutil.copy(FIXTURES / "llama" / "cs" / "checkpoint.mdl", local / "checkpoint_0.mdl")
    shutil.copy(FIXTURES / "llama" / "cs" / "params.yaml", local / "params.yaml")
    s3.reset()
    with mounted(SYNCED, env=env) as remote, mounted(local / "checkpoint_0.mdl", env=env) as here:
        a, b = _files(remote), _files(here)
        assert sorted(a) == sorted(b) and "model.safetensors" in a
        for name in a:
            if name != "README.txt":
                assert a[name].read_bytes() == b[name].read_bytes(), name
    seen = s3.requests()
    size = (local / "checkpoint_0.mdl").stat().st_size
    ranges = [r.range for r in seen if r.method == "GET" and r.path.endswith("checkpoint_0.mdl")]
    assert ranges and all(r is not None for r in ranges)  # never fetched whole: always by range
    assert all(int(r.split("=")[1].split("-")[0]) < size for r in ranges)


def _data_offset(npy: Path) -> int:
    with open(npy, "rb") as f:
        head = f.read(10)
    n = int.from_bytes(head[8:10], "little")
    return 10 + n


@pytest.mark.parametrize("url", [LLAMA, SYNCED], ids=["s3-layout", "hdf5-object"])
def test_a_4k_peek_costs_at_most_3_requests(s3, env, url):
    with mounted(url, "--views", "tensors", env=env) as mnt:
        npy = mnt / "tensors" / "model" / "transformer_decoder" / "layers" / "1" / "ffn" / "ffn" / "0" / \
            "linear_layer" / "weight.npy"
        start = _data_offset(npy)  # the header is metadata: no request
        s3.reset()
        with open(npy, "rb") as f:
            f.seek(start + 4096)
            assert len(f.read(4096)) == 4096
        counts = s3.counts()
    assert sum(counts.values()) <= 3, counts


def test_listing_a_1000_key_checkpoint_costs_list_requests(s3, env):
    import json
    import pickle

    client = s3.client()
    prefix = "wide/checkpoint_1.mdl/"
    keys = [f"model.w{i:04d}" for i in range(1000)]
    md = {"__TORCH__": True, "shapes": [[2]], "dtypes": ["torch.float32"], "__TYPE__": "TorchTensorSerializer",
          "__NUMPY__": {"shape": [2], "dtype": "float32"}, "compressed": False, "data_sizes": [8], "boundaries": [8]}
    s3.put_many(BUCKET, [(prefix + k, b"\0" * 8, {"metadata": json.dumps(md)}) for k in keys])
    ctx = json.dumps({k[len("model."):]: "*" for k in keys})
    inner = json.dumps([1, {"type": "builtins.dict", "context": json.dumps(["model"]), "children_spec": [
        {"type": "builtins.dict", "context": json.dumps([k[len("model."):] for k in keys]),
         "children_spec": [{"type": None, "context": None, "children_spec": []}] * len(keys)}]}])
    meta = {"__spec__": json.dumps([{"model": json.loads(ctx)}, inner]), "__version__": 0.5,
            "__cstorch_version__": "2.10.0", "__SUCCESS__": True}
    for k in keys:
        leaf = json.dumps([1, {"type": "builtins.dict", "context": json.dumps([k]),
                               "children_spec": [{"type": None, "context": None, "children_spec": []}]}])
        meta[k + ".__metadata__"] = json.dumps({"__spec__": [{k: "*"}, leaf], "__objects__": [k],
                                                 k + ".__metadata__": md})
    client.put_object(Bucket=BUCKET, Key=prefix + "__METADATA__", Body=pickle.dumps(meta, protocol=4))
    s3.reset()
    r = subprocess.run([sys.executable, "-m", "ckptfs", "ls", "-l", f"s3://{BUCKET}/{prefix}"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("[2] float32") == 1000
    counts = s3.counts()
    # whether it is a run, then the catalog: a HEAD and two pages of listing each, one GET of __METADATA__
    assert counts["GET"] == 1 and counts["HEAD"] <= 2 and sum(counts.values()) <= 8, counts


def test_an_object_replaced_during_the_mount_gives_eio_not_mixed_bytes(s3, env):
    client = s3.client()
    upload_case(s3, "s3_llama", rename=("s3_llama/", "replaced/"))
    key = "replaced/checkpoint_100.mdl/model.transformer_decoder.layers.0.self_attn.proj_q_dense_layer.weight"
    with mounted("s3://ckpts/replaced/checkpoint_100.mdl", "--views", "tensors", env=env) as mnt:
        npy = mnt / "tensors" / "model" / "transformer_decoder" / "layers" / "0" / "self_attn" / \
            "proj_q_dense_layer" / "weight.npy"
        head = client.head_object(Bucket=BUCKET, Key=key)
        body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        client.put_object(Bucket=BUCKET, Key=key, Body=bytes(255 - b for b in body), Metadata=head["Metadata"])
        with pytest.raises(OSError) as e:
            npy.read_bytes()
        assert e.value.errno == errno.EIO
        assert (mnt / "tensors" / "model" / "ln_f" / "weight.npy").read_bytes()  # other files keep working


def test_a_vanished_endpoint_gives_eio_within_a_bound_and_umount_works(tmp_path):
    srv = LocalS3(tmp_path)
    try:
        upload_case(srv, "s3_llama")
        env = srv.env(CKPTFS_CACHE_DIR=str(tmp_path / "cache"))
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        r = subprocess.run([sys.executable, "-m", "ckptfs", "mount", LLAMA, str(mnt), "--views", "tensors"], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        try:
            layer = mnt / "tensors" / "model" / "transformer_decoder" / "layers"
            assert (layer / "0" / "norm1" / "weight.npy").read_bytes()
            srv.stop()
            start = time.monotonic()
            with pytest.raises(OSError) as e:
                (layer / "1" / "ffn" / "ffn" / "1" / "linear_layer" / "weight.npy").read_bytes()
            assert e.value.errno == errno.EIO
            assert time.monotonic() - start < 30
            assert (mnt / "README.txt").read_bytes()  # what needs no endpoint keeps working
        finally:
            u = subprocess.run([sys.executable, "-m", "ckptfs", "umount", str(mnt)], env=env, capture_output=True,
                               text=True, timeout=60)
        assert u.returncode == 0, u.stderr
        assert not is_mounted(mnt)
    finally:
        srv.stop()
