"""Fetching ahead from object storage, counted at a real S3-compatible endpoint on 127.0.0.1 (moto's server,
``s3server.py``): a FUSE open of a generated file announces the whole file's tensor bytes, so ``from_pretrained``
through a mount (a memory map read in the model's order, by page faults) fetches each part of each object once;
``ckptfs export`` announces its blocks ahead of the ones queued, fetching each object's bytes once; a tree whose
tensors are not remote announces nothing when a file is opened."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import FIXTURES, needs_fuse
from helpers.fuse import mounted
from helpers.s3 import LocalS3, case_objects, generated_checkpoint, upload_case

pytestmark = [pytest.mark.slow, needs_fuse, pytest.mark.timeout(600)]

LLAMA = "s3://ckpts/s3_llama/checkpoint_100.mdl"
#: where the generated checkpoint's objects are put (bucket ``bench``: ``benchlib.s3.upload``)
GENERATED = "run/checkpoint_0.mdl"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    srv = LocalS3(tmp_path_factory.mktemp("s3"))
    upload_case(srv, "s3_llama")
    yield srv
    srv.stop()


def _generated(s3: LocalS3, folder: Path, ffn: int) -> tuple:
    """A generated checkpoint (``ffn`` wide) in the S3 layout on ``s3``: ``(local .mdl, params, s3 URL, {object
    path at the endpoint: size})``."""
    mdl, params = generated_checkpoint(folder, ffn=ffn)
    from benchlib import s3 as bench_s3  # importable once generated_checkpoint has put scripts/ on the path

    bench_s3.upload(s3, mdl, GENERATED)
    sizes = {f"/{bench_s3.BUCKET}/{GENERATED}/{k}": len(body) for k, body, _ in bench_s3.s3_objects(mdl)}
    return mdl, params, f"s3://{bench_s3.BUCKET}/{GENERATED}", sizes


def _ranges(s3: LocalS3) -> list:
    """``(object path, first byte, end)`` of every ranged GET counted since the last reset."""
    out = []
    for r in s3.requests():
        if r.kind == "GET" and r.range:
            lo, hi = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", r.range).groups())
            out.append((r.path, lo, hi + 1))
    return out


def _parts_fetched_twice(ranges: list) -> list:
    """The (object, part) pairs that more than one large request (a part's worth of bytes or more) fetched."""
    from ckptfs.storage.s3object import PART_BYTES, PART_MIN

    seen: dict = {}
    for path, lo, end in ranges:
        if end - lo >= PART_MIN:
            for part in range(lo // PART_BYTES, (end - 1) // PART_BYTES + 1):
                seen[(path, part)] = seen.get((path, part), 0) + 1
    return [k for k, n in seen.items() if n > 1]


def _load_all(mnt: Path) -> dict:
    """``from_pretrained`` through ``mnt`` and every weight read (transformers keeps the safetensors memory map: a
    weight is read when used), as {name: tensor}."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(mnt, dtype=torch.bfloat16)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_from_pretrained_of_the_fixture_fetches_each_object_once(s3):
    """The genuine ``cstorch.save`` objects: the weights equal the fixture's HF model, each object fetched once."""
    import torch
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(FIXTURES / "llama" / "hf").state_dict()
    tensors = sum(len(body) for key, body, _ in case_objects("s3_llama")
                  if key.startswith("s3_llama/checkpoint_100.mdl/") and not key.endswith("__METADATA__"))
    with mounted(LLAMA, env=s3.env(CKPTFS_CACHE_DIR=str(s3.tmp / "cache"))) as mnt:
        s3.reset()
        got = AutoModelForCausalLM.from_pretrained(mnt).state_dict()
        for k in ref:
            assert torch.equal(got[k], ref[k]), k
        ranges = _ranges(s3)
    fetched = sum(end - lo for _, lo, end in ranges)
    assert fetched <= 1.05 * tensors, (fetched, tensors)
    objects = [path for path, _, _ in ranges if not path.endswith("__METADATA__")]
    assert len(objects) == len(set(objects)), sorted(objects)  # one request each: every object is smaller than a part


def test_from_pretrained_of_a_large_checkpoint_fetches_each_part_once(s3, tmp_path):
    """64 MiB objects, read by a loader (the safetensors memory map: a first pass touches the first pages of every
    tensor, a second reads them in the model's order): the whole file announced when opened is fetched ahead in the
    file's order, by groups of parts, and kept until read, so no part is fetched twice and the requests are fewer
    than half the parts (before: the parts asked for one by one as reads needed them, 46 requests for 57 parts, up
    to 1.07× the objects' bytes: the parts a read used are kept within an eighth of ``--cache-size`` only)."""
    import torch

    mdl, params, url, sizes = _generated(s3, tmp_path / "ck", ffn=32768)
    total = sum(n for path, n in sizes.items() if not path.endswith("__METADATA__"))
    env = s3.env(CKPTFS_CACHE_DIR=str(tmp_path / "cache"))
    with mounted(url, "--config", params, "--cache-size", "2GiB", env=env) as mnt:
        s3.reset()
        got = _load_all(mnt)
        ranges = _ranges(s3)
    fetched = sum(end - lo for _, lo, end in ranges)
    assert fetched <= 1.05 * total, (fetched / total, len(ranges))
    assert not _parts_fetched_twice(ranges), _parts_fetched_twice(ranges)
    from ckptfs.storage.s3object import PART_BYTES

    parts = sum(-(-n // PART_BYTES) for n in sizes.values())
    assert len(ranges) <= parts // 2, (len(ranges), parts)  # fetched ahead by groups of parts, not part by part
    with mounted(mdl, "--config", params, env=env) as here:
        want = _load_all(here)
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_export_from_s3_fetches_each_object_once_and_ahead(s3, tmp_path):
    """``ckptfs export s3://… OUT``: every object's bytes fetched once; the objects after the first are asked for
    ahead, while the blocks before them decode (their first request spans more than the part a read waiting for
    them would ask for); the exported file is the mount's, byte for byte."""
    from ckptfs.storage.s3object import PART_BYTES

    mdl, params, url, sizes = _generated(s3, tmp_path / "ck", ffn=5120)
    total = sum(n for path, n in sizes.items() if not path.endswith("__METADATA__"))
    env = {**s3.env(CKPTFS_CACHE_DIR=str(tmp_path / "cache")), "PYTHONPATH": os.pathsep.join(sys.path)}
    out = tmp_path / "out"
    s3.reset()
    subprocess.run([sys.executable, "-m", "ckptfs", "export", "--views", "hf", "--hf-format", "safetensors",
                    "--config", str(params), url, str(out)], env=env, check=True, timeout=300, capture_output=True)
    ranges = _ranges(s3)
    fetched = sum(end - lo for path, lo, end in ranges if not path.endswith("__METADATA__"))
    assert fetched <= 1.05 * total, (fetched / total, len(ranges))
    first: dict = {}
    for path, lo, end in ranges:
        first.setdefault(path, (lo, end))
    large = [p for p in first if sizes.get(p, 0) > PART_BYTES]
    ahead = [p for p in large if first[p][0] == 0 and first[p][1] > PART_BYTES]
    assert len(large) >= 6 and len(ahead) >= len(large) - 2, {p: first[p] for p in large}
    with mounted(url, "--config", params, env=env) as mnt:
        assert (out / "model.safetensors").read_bytes() == (mnt / "model.safetensors").read_bytes()


def test_an_open_announces_only_when_the_tensors_are_remote(s3, monkeypatch):
    """Opening ``model.safetensors`` through the FUSE adapter of a tree over the endpoint fetches parts ahead of any
    read; the same tree told its tensors are local (``cache.remote`` False, as every local tree has) asks for
    nothing; and a local tree's cache says local."""
    import ckptfs
    from ckptfs.fuse.operations import CkptfsOperations

    for k, v in s3.env(CKPTFS_CACHE_DIR=str(s3.tmp / "cache")).items():
        monkeypatch.setenv(k, v)
    local = ckptfs.open(FIXTURES / "llama" / "cs" / "checkpoint.mdl")
    try:
        assert local.cache is not None and not local.cache.remote
        ops = CkptfsOperations(local)
        ops.release("/model.safetensors", ops.open("/model.safetensors", os.O_RDONLY))
    finally:
        local.close()

    tree = ckptfs.open(LLAMA)
    try:
        ops = CkptfsOperations(tree)
        tree.cache.remote = False
        s3.reset()
        ops.release("/model.safetensors", ops.open("/model.safetensors", os.O_RDONLY))
        time.sleep(1)
        assert _ranges(s3) == []
        tree.cache.remote = True
        s3.reset()
        ops.release("/model.safetensors", ops.open("/model.safetensors", os.O_RDONLY))
        deadline = time.monotonic() + 30
        while not _ranges(s3) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len({path for path, _, _ in _ranges(s3)}) > 5
    finally:
        tree.close()
