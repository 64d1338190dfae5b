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

from helpers import FIXTURES, needs_fuse
from helpers.fuse import is_mounted, mounted, mounted_server
from helpers.s3 import BUCKET, LocalS3, case_objects, upload_case

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


def test_from_pretrained_equals_the_local_model_and_a_peek_costs_few_requests(s3, env):
    import ckptfs
    import torch
    from transformers import AutoModelForCausalLM

    rel = "tensors/model/transformer_decoder/layers/1/ffn/ffn/0/linear_layer/weight.npy"
    local = ckptfs.open(FIXTURES / "llama" / "cs" / "checkpoint.mdl", views="tensors")
    head = local.read(rel, 0, 10)  # where the data starts, without touching the mount's file first (the kernel
    local.close()  # would read its first pages ahead)
    start = 10 + int.from_bytes(head[8:10], "little")
    ref = AutoModelForCausalLM.from_pretrained(FIXTURES / "llama" / "hf").state_dict()
    with mounted(LLAMA, env=env) as mnt:
        s3.reset()
        with open(mnt / rel, "rb") as f:  # a 4 KiB read of one tensor: at most 3 requests (here one ranged GET)
            f.seek(start + 4096)
            assert len(f.read(4096)) == 4096
        peek = s3.requests()
        got = AutoModelForCausalLM.from_pretrained(mnt).state_dict()
        readme = (mnt / "README.txt").read_text()
    assert 1 <= len(peek) <= 3 and all(r.method == "GET" and r.range for r in peek), peek
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
    import ckptfs

    local = tmp_path / "synced_model_dir"
    local.mkdir()
    shutil.copy(FIXTURES / "llama" / "cs" / "checkpoint.mdl", local / "checkpoint_0.mdl")
    shutil.copy(FIXTURES / "llama" / "cs" / "params.yaml", local / "params.yaml")
    here = ckptfs.open(local / "checkpoint_0.mdl")
    s3.reset()
    try:
        with mounted(SYNCED, env=env) as remote:
            a = _files(remote)
            assert sorted(a) == sorted(here.file_paths()) and "model.safetensors" in a
            for name in a:
                if name != "README.txt":
                    assert a[name].read_bytes() == here.read(name, 0, here.attr(name).size), name
    finally:
        here.close()
    seen = s3.requests()
    size = (local / "checkpoint_0.mdl").stat().st_size
    ranges = [r.range for r in seen if r.method == "GET" and r.path.endswith("checkpoint_0.mdl")]
    assert ranges and all(r is not None for r in ranges)  # never fetched whole: always by range
    assert all(int(r.split("=")[1].split("-")[0]) < size for r in ranges)


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
    token = "FwoGZXIvYXdzEXAMPLEsessiontoken0123456789"  # the endpoint takes any token; the log must show none
    with mounted_server("s3://ckpts/replaced/checkpoint_100.mdl", "--views", "tensors", "--debug",
                        env={**env, "AWS_SESSION_TOKEN": token}) as srv:
        mnt = srv.mnt
        npy = mnt / "tensors" / "model" / "transformer_decoder" / "layers" / "0" / "self_attn" / \
            "proj_q_dense_layer" / "weight.npy"
        head = client.head_object(Bucket=BUCKET, Key=key)
        body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        client.put_object(Bucket=BUCKET, Key=key, Body=bytes(255 - b for b in body), Metadata=head["Metadata"])
        with pytest.raises(OSError) as e:
            npy.read_bytes()
        assert e.value.errno == errno.EIO
        assert (mnt / "tensors" / "model" / "ln_f" / "weight.npy").read_bytes()  # other files keep working
        log = srv.log()
    assert "changed since it was opened" in log
    assert token not in log and env["AWS_SECRET_ACCESS_KEY"] not in log


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


def _wait_for(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def test_a_run_in_a_bucket_is_mounted_live(s3, env):
    import numpy as np
    from safetensors.numpy import load as st_load

    upload_case(s3, "s3_run", rename=("s3_run/model_dir/", "live/model_dir/"))
    base = st_load((FIXTURES / "llama" / "hf" / "model.safetensors").read_bytes())
    client = s3.client()
    with mounted("s3://ckpts/live/model_dir/", env=env) as mnt:
        assert sorted(os.listdir(mnt)) == ["README.txt", "checkpoint_0", "checkpoint_100", "checkpoint_200", "latest"]
        assert os.readlink(mnt / "latest") == "checkpoint_200"
        readme = (mnt / "README.txt").read_text()
        assert "model_dir:   s3://ckpts/live/model_dir" in readme and "checkpoint_300.mdl: no __METADATA__" in readme
        got = st_load((mnt / "latest" / "model.safetensors").read_bytes())  # the weights of llama plus the step
        name = "model.layers.0.mlp.up_proj.weight"
        assert np.array_equal(got[name], base[name] + np.float32(200))

        # a save to S3: the tensor objects, then __METADATA__; hidden until that last object is there
        objects = [o for o in case_objects("s3_run", ("s3_run/model_dir/checkpoint_200.mdl/",
                                                      "live/model_dir/checkpoint_400.mdl/"))
                   if o[0].startswith("live/model_dir/checkpoint_400.mdl/")]
        objects.sort(key=lambda o: o[0].endswith("/__METADATA__"))
        for key, body, metadata in objects[:-1]:
            client.put_object(Bucket=BUCKET, Key=key, Body=body, Metadata=metadata)
        time.sleep(2.5)  # past the rescan interval and the kernel's entry timeout
        assert "checkpoint_400" not in os.listdir(mnt)
        key, body, metadata = objects[-1]
        client.put_object(Bucket=BUCKET, Key=key, Body=body, Metadata=metadata)
        assert _wait_for(lambda: "checkpoint_400" in os.listdir(mnt))
        assert _wait_for(lambda: os.readlink(mnt / "latest") == "checkpoint_400")

        # KeepNCheckpoints deletes the oldest checkpoint's objects: its folder goes
        for o in client.list_objects_v2(Bucket=BUCKET, Prefix="live/model_dir/checkpoint_0.mdl/")["Contents"]:
            client.delete_object(Bucket=BUCKET, Key=o["Key"])
        assert _wait_for(lambda: "checkpoint_0" not in os.listdir(mnt))


@pytest.fixture
def iam_keys(s3):
    """Access keys of an IAM user with no permission at all (the endpoint checks credentials while this runs)."""
    import boto3

    iam = boto3.client("iam", endpoint_url=s3.url, aws_access_key_id="x", aws_secret_access_key="y",
                       region_name="us-east-1")
    iam.create_user(UserName="nobody")
    key = iam.create_access_key(UserName="nobody")["AccessKey"]
    s3.set_auth(True)
    try:
        yield key["AccessKeyId"], key["SecretAccessKey"]
    finally:
        s3.set_auth(False)


def test_one_line_errors_and_nothing_mounted(s3, env, iam_keys, tmp_path):
    nobody_id, nobody_secret = iam_keys
    bogus_secret = "Bogus/Secret+Key0123456789abcdefghijklmn"
    cases = [("s3://no-such-bucket/run/checkpoint_1.mdl", {}, "s3://no-such-bucket: no such bucket"),
             ("s3://ckpts/nothing/here.mdl", {}, "s3://ckpts/nothing/here.mdl: no such object or prefix"),
             (LLAMA, {"AWS_ACCESS_KEY_ID": nobody_id, "AWS_SECRET_ACCESS_KEY": nobody_secret}, "access denied"),
             (LLAMA, {"AWS_ACCESS_KEY_ID": "AKIDNOSUCHKEY0000000", "AWS_SECRET_ACCESS_KEY": bogus_secret},
              "refused the credentials")]
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for url, creds, expected in cases:
        if not creds:  # the endpoint checks credentials now: the keys of a user allowed nothing still get 404s
            creds = {"AWS_ACCESS_KEY_ID": nobody_id, "AWS_SECRET_ACCESS_KEY": nobody_secret}
            s3.set_auth(False)
        else:
            s3.set_auth(True)
        r = subprocess.run([sys.executable, "-m", "ckptfs", "mount", url, str(mnt)], env={**env, **creds},
                           capture_output=True, text=True, timeout=120)
        out = r.stdout + r.stderr
        assert r.returncode == 2, out
        assert len(r.stderr.strip().splitlines()) == 1 and expected in r.stderr, r.stderr
        assert creds["AWS_SECRET_ACCESS_KEY"] not in out and not is_mounted(mnt)
        for log in (Path(env["CKPTFS_CACHE_DIR"]) / "logs").glob("*.log"):
            assert creds["AWS_SECRET_ACCESS_KEY"] not in log.read_text(errors="replace")


def test_untrusted_metadata_is_refused_or_checked(s3, monkeypatch):
    """``__METADATA__`` is decoded without running anything; what it says of each object is checked against the
    object the listing shows and, on first read, against the object's own metadata."""
    import json
    import pickle

    from ckptfs.errors import CheckpointError, TensorReadError
    from ckptfs.readers import open_checkpoint
    from ckptfs.catalog.model import TensorLeaf, UnreadableLeaf
    from ckptfs.storage.s3url import S3Settings, parse_s3_url

    for k, v in s3.env().items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    settings = S3Settings(s3.url)
    client = s3.client()
    upload_case(s3, "s3_llama", rename=("s3_llama/", "crafted/"))
    prefix = "crafted/checkpoint_100.mdl/"

    class Boom:  # any object that is not a plain value pickles as a global: refused, never run
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    client.put_object(Bucket=BUCKET, Key="evil/checkpoint_1.mdl/__METADATA__",
                      Body=pickle.dumps({"__spec__": "[]", "x": Boom()}, protocol=4))
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(parse_s3_url("s3://ckpts/evil/checkpoint_1.mdl", settings))
    assert "s3://ckpts/evil/checkpoint_1.mdl/__METADATA__: refused" in str(e.value) and "\n" not in str(e.value)

    # an object shorter than its metadata says; an object whose own metadata disagrees with __METADATA__ (same
    # size, another dtype)
    short = prefix + "model.ln_f.weight"
    client.put_object(Bucket=BUCKET, Key=short, Body=b"\0" * 64, Metadata={"metadata": "{}"})
    odd = prefix + "model.transformer_decoder.norm.weight"
    own = json.loads(client.head_object(Bucket=BUCKET, Key=odd)["Metadata"]["metadata"])
    own["dtypes"] = ["torch.int32"]
    body = client.get_object(Bucket=BUCKET, Key=odd)["Body"].read()
    client.put_object(Bucket=BUCKET, Key=odd, Body=body, Metadata={"metadata": json.dumps(own)})

    ck = open_checkpoint(parse_s3_url("s3://ckpts/crafted/checkpoint_100.mdl", settings))
    try:
        assert isinstance(ck.leaves["model.ln_f.weight"], UnreadableLeaf)
        assert "stored size 128 but the object holds 64 bytes" in ck.leaves["model.ln_f.weight"].reason
        leaf = ck.leaves["model.transformer_decoder.norm.weight"]
        assert isinstance(leaf, TensorLeaf)
        with pytest.raises(TensorReadError, match="own metadata .* disagrees with its entry in __METADATA__"):
            leaf.tensor.read_all()
        assert ck.leaves["model.transformer_decoder.layers.0.norm1.weight"].tensor.read_all().size == 32
    finally:
        ck.close()


def test_params_beside_a_bucket_checkpoint_are_fetched_and_never_trusted_from_the_cache(s3, monkeypatch, tmp_path):
    from ckptfs.errors import StorageError
    from ckptfs.readers.s3.params import fetch_params
    from ckptfs.storage.s3url import S3Settings, parse_s3_url

    for k, v in s3.env().items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    loc = parse_s3_url(LLAMA, S3Settings(s3.url))
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    local, where = fetch_params(loc, cache)
    want = (FIXTURES / "llama" / "cs" / "params.yaml").read_bytes()
    assert str(where) == "s3://ckpts/s3_llama/params.yaml" and local.read_bytes() == want
    local.write_bytes(b"model: {name: gpt2}\n")  # a cached copy edited behind ckptfs's back is not used
    again, _ = fetch_params(loc, cache)
    assert again == local and again.read_bytes() == want
    (cache / "s3-params").chmod(0o777)  # a folder others may write to: refused, not used
    with pytest.raises(StorageError, match="can be changed by other users"):
        fetch_params(loc, cache)


def test_cp_from_an_s3_mount_fetches_the_next_objects_ahead(tmp_path):
    """``cp model.safetensors`` from a mount of a generated checkpoint in Cerebras' S3 layout gives the local mount's
    bytes, and the objects after the first are asked for ahead, by groups of parts: their first request already
    spans more than one part (a read waiting for an object asks for the part under it alone)."""
    import re

    from helpers.s3 import generated_checkpoint

    from ckptfs.storage.s3object import PART_BYTES

    mdl, params = generated_checkpoint(tmp_path / "ck", ffn=5120)
    from benchlib import s3 as bench_s3  # importable once generated_checkpoint has put scripts/ on the path
    srv = LocalS3(tmp_path / "s3")
    try:
        env = srv.env(CKPTFS_CACHE_DIR=str(tmp_path / "cache"))
        bench_s3.upload(srv, mdl, "run/checkpoint_0.mdl")
        with mounted(mdl, "--config", params, env=env) as here:
            want = (here / "model.safetensors").read_bytes()
        url = f"s3://{bench_s3.BUCKET}/run/checkpoint_0.mdl"
        with mounted(url, "--config", params, env=env) as mnt:
            srv.reset()
            subprocess.run(["cp", str(mnt / "model.safetensors"), str(tmp_path / "copy")], check=True, timeout=120)
            first: dict = {}
            for r in srv.requests():
                if r.kind == "GET" and r.range:
                    lo, hi = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", r.range).groups())
                    first.setdefault(r.path, (lo, hi))
        assert (tmp_path / "copy").read_bytes() == want
        sizes = {f"/{bench_s3.BUCKET}/run/checkpoint_0.mdl/{k}": len(body)
                 for k, body, _ in bench_s3.s3_objects(mdl) if k != "__METADATA__"}
        large = [p for p in first if sizes.get(p, 0) > PART_BYTES]
        ahead = [p for p in large if first[p][0] == 0 and first[p][1] + 1 > PART_BYTES]
        assert len(large) >= 6 and len(ahead) >= len(large) - 2, {p: first[p] for p in large}
    finally:
        srv.stop()
