"""Chunk-count bombs: an HDF5 checkpoint holding one small tensor cut into 262,144 one-element LZ4 chunks once drove
the server's memory from 51 MiB to 1.7 GiB (and a 1 MiB read to 17 s) through the chunk reader's index. The rule
(``validate.chunking_problem``): a tensor may have at most one chunk per 4 KiB of its data (at least 4,096 chunks);
such a tensor is unreadable with the reason, the rest of the checkpoint is served, and a genuine checkpoint's
chunking reads as before."""
from __future__ import annotations

import os
import time
from pathlib import Path

import h5py
import hdf5plugin
import numpy as np
import pytest

from ckptfs.readers import open_checkpoint
from helpers import FIXTURES, needs_fuse, real_env, run_ckptfs
from helpers.fuse import mounted_server
from helpers.rss import measure_ckptfs
from helpers.untrusted import add_leaves, copy_llama, leaf_metadata, tensor_md

pytestmark = pytest.mark.slow  # processes: the CLI, a server, TensorFlow

BOMB_SHAPE = (512, 512)  # 1 MiB of float32 ...
BOMB_CHUNKS = (1, 1)  # ... in 262,144 chunks
MAX_GROWTH_MIB = 256


def bomb_checkpoint(folder: Path) -> Path:
    ckpt = copy_llama(folder)
    with h5py.File(ckpt, "a") as f:
        f.create_dataset("bomb", data=np.arange(np.prod(BOMB_SHAPE), dtype=np.float32).reshape(BOMB_SHAPE),
                         chunks=BOMB_CHUNKS, **hdf5plugin.LZ4())
    add_leaves(ckpt, {"bomb": leaf_metadata("bomb", tensor_md(BOMB_SHAPE))})
    return ckpt


def vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_the_rule_admits_genuine_chunkings_and_refuses_bombs():
    from ckptfs.catalog.validate import chunking_problem

    assert chunking_problem((512, 512), (1, 1), 4, "x") is not None
    assert chunking_problem((262144,), (1,), 4, "x") is not None
    assert chunking_problem((8,), (1,), 4, "x") is None  # small tensors may be cut small
    assert chunking_problem((50304, 4096), (393, 64), 2, "x") is None  # h5py's guess for a bf16 embedding
    assert chunking_problem((4096, 4096), (128, 256), 4, "x") is None
    for folder in sorted(FIXTURES.glob("*/cs")):  # every genuine fixture's chunking
        for mdl in folder.glob("*.mdl"):
            with h5py.File(mdl, "r") as f:
                found = []
                f.visititems(lambda n, o: found.append(chunking_problem(o.shape, o.chunks, o.dtype.itemsize, n))
                             if isinstance(o, h5py.Dataset) and o.chunks else None)
            assert not any(found), (mdl, found)


def test_a_tensor_of_262144_one_element_chunks_is_unreadable_with_the_reason(tmp_path):
    ckpt = bomb_checkpoint(tmp_path / "c")
    with open_checkpoint(ckpt) as c:
        leaf = c.leaves["bomb"]
        assert not hasattr(leaf, "tensor")
        assert "262144 chunks" in leaf.reason and "4096" in leaf.reason
        good = c.leaves["model.embedding_layer.word_embeddings.weight"].tensor.read_all()
    with h5py.File(FIXTURES / "llama" / "cs" / "checkpoint.mdl", "r") as f:
        assert good.tobytes() == f["model.embedding_layer.word_embeddings.weight"][()].tobytes()


def test_cli_names_the_tensor_in_one_line_and_memory_stays_bounded(tmp_path):
    ckpt = bomb_checkpoint(tmp_path / "c")
    base = measure_ckptfs("export", FIXTURES / "llama" / "cs" / "checkpoint.mdl", "model.safetensors",
                          tmp_path / "a.safetensors")
    r = measure_ckptfs("export", ckpt, "tensors/bomb.npy", tmp_path / "bomb.npy", timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "bomb" in r.stderr
    assert r.peak_mib - base.peak_mib < MAX_GROWTH_MIB
    info = run_ckptfs("info", ckpt, text=True)
    assert info.returncode == 0 and "unreadable bomb:" in info.stdout and "262144 chunks" in info.stdout
    r = measure_ckptfs("export", ckpt, "model.safetensors", tmp_path / "m.safetensors", timeout=120)
    assert r.returncode == 0 and r.peak_mib - base.peak_mib < MAX_GROWTH_MIB
    assert (tmp_path / "m.safetensors").read_bytes() == (tmp_path / "a.safetensors").read_bytes()


@needs_fuse
@pytest.mark.timeout(300)
def test_mount_keeps_serving_the_rest_with_bounded_memory(tmp_path):
    ckpt = bomb_checkpoint(tmp_path / "c")
    with mounted_server(ckpt) as srv:
        mnt = srv.mnt
        start = vm_hwm_mib(srv.proc.pid)
        t0 = time.monotonic()
        assert not (mnt / "tensors" / "bomb.npy").exists()
        readme = (mnt / "README.txt").read_text()
        assert "bomb" in readme and "262144 chunks" in readme
        for name in ("model.safetensors", "cs/checkpoint.mdl"):
            with open(mnt / name, "rb") as f:
                assert len(f.read(1 << 20)) > 0
        emb = np.load(mnt / "tensors" / "model" / "embedding_layer" / "word_embeddings" / "weight.npy")
        with h5py.File(FIXTURES / "llama" / "cs" / "checkpoint.mdl", "r") as f:
            assert emb.tobytes() == f["model.embedding_layer.word_embeddings.weight"][()].tobytes()
        assert time.monotonic() - t0 < 30
        assert vm_hwm_mib(srv.proc.pid) - start < MAX_GROWTH_MIB
        assert os.path.ismount(mnt)


def test_the_same_bomb_as_an_s3_object_is_refused_the_same_way(tmp_path):
    from helpers.s3 import BUCKET, LocalS3

    ckpt = bomb_checkpoint(tmp_path / "c")
    srv = LocalS3(tmp_path / "s3")
    try:
        client = srv.client()
        client.create_bucket(Bucket=BUCKET)
        client.put_object(Bucket=BUCKET, Key="bomb/checkpoint.mdl", Body=ckpt.read_bytes())
        url = f"s3://{BUCKET}/bomb/checkpoint.mdl"
        env = srv.env(CKPTFS_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=real_env()["PYTHONPATH"])
        info = run_ckptfs("info", url, env=env, text=True, timeout=120)
        assert info.returncode == 0, info.stderr
        assert "unreadable bomb:" in info.stdout and "262144 chunks" in info.stdout
        base = measure_ckptfs("info", url, env=env, timeout=120)
        r = measure_ckptfs("export", url, "tensors/bomb.npy", tmp_path / "bomb.npy", env=env, timeout=120)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "bomb" in r.stderr, r.stderr
        assert r.peak_mib - base.peak_mib < MAX_GROWTH_MIB
        emb = "tensors/model/embedding_layer/word_embeddings/weight.npy"
        r = measure_ckptfs("export", url, emb, tmp_path / "emb.npy", env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        with h5py.File(FIXTURES / "llama" / "cs" / "checkpoint.mdl", "r") as f:
            want = f["model.embedding_layer.word_embeddings.weight"][()]
        assert np.load(tmp_path / "emb.npy").tobytes() == want.tobytes()
    finally:
        srv.stop()
