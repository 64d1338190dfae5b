"""Issue #5 acceptance, end to end on real FUSE with genuine Cerebras checkpoints: from_pretrained through the
mount (safetensors and .bin), cp of every weight file, zipfile -t, np.load(mmap) of tensors/, concurrent readers,
and a corrupted tensor giving EIO only where it is needed."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import hdf5plugin  # noqa: F401  (LZ4 filter for the independent h5py reads below)
import numpy as np
import pytest

from helpers import FIXTURES, needs_fuse, real_env, run_ckptfs
from helpers.fuse import concurrent_random_reads, mounted

pytestmark = [needs_fuse, pytest.mark.timeout(900)]

CASES = ["gpt2", "llama", "mistral", "mixtral"]


def weight_files(mnt: Path) -> list:
    """Weight files relative to the mount: safetensors at the root, the .bin format in its HF folder bin/."""
    return sorted(str(p.relative_to(mnt)) for d in (mnt, mnt / "bin") for p in d.iterdir()
                  if p.suffix in (".safetensors", ".bin"))


@pytest.mark.parametrize("case", CASES)
def test_from_pretrained_through_the_mount_equals_the_original(case):
    import torch
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(FIXTURES / case / "hf").eval()
    ids = torch.tensor([[1, 5, 17, 42, 99, 3, 64, 127]])
    with torch.no_grad():
        want_logits = ref(ids).logits
    want_sd = ref.state_dict()
    with mounted(FIXTURES / case / "cs" / "checkpoint.mdl", env=real_env()) as mnt:
        for use_safetensors in (None, False):  # the .bin files are a complete HF folder of their own: bin/
            folder = mnt if use_safetensors is None else mnt / "bin"
            model = AutoModelForCausalLM.from_pretrained(str(folder), use_safetensors=use_safetensors).eval()
            sd = model.state_dict()
            assert sd.keys() == want_sd.keys()
            for k, v in want_sd.items():
                assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), (case, use_safetensors, k)
            with torch.no_grad():
                assert torch.equal(model(ids).logits, want_logits), (case, use_safetensors)
            del model


@pytest.mark.parametrize("case", ["gpt2", "mixtral"])
def test_cp_of_every_weight_file_loads_and_equals_export(case, tmp_path):
    import torch
    from safetensors.torch import load_file

    ckpt = FIXTURES / case / "cs" / "checkpoint.mdl"
    with mounted(ckpt, "--max-shard-size", "40KB", env=real_env()) as mnt:
        names = weight_files(mnt)
        assert any(n.startswith("model-00001-of-") for n in names), names  # really sharded
        assert any(n.startswith("bin/pytorch_model-00001-of-") for n in names), names
        names += ["model.safetensors.index.json", "bin/pytorch_model.bin.index.json", "config.json"]
        (tmp_path / "bin").mkdir()
        for n in names:
            subprocess.run(["cp", str(mnt / n), str(tmp_path / n)], check=True, timeout=120)
    tensors = {}
    for n in names:
        exported = tmp_path / f"export-{n.replace('/', '_')}"
        run_ckptfs("export", ckpt, n, exported, "--max-shard-size", "40KB", check=True)
        assert exported.read_bytes() == (tmp_path / n).read_bytes(), n
        if n.endswith(".safetensors"):
            tensors.update(load_file(tmp_path / n))
        elif n.endswith(".bin"):
            r = subprocess.run([sys.executable, "-m", "zipfile", "-t", str(tmp_path / n)], capture_output=True)
            assert r.returncode == 0 and b"Done testing" in r.stdout, r.stdout + r.stderr
            a = torch.load(tmp_path / n, weights_only=True)
            b = torch.load(tmp_path / n, weights_only=True, mmap=True)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            for k, v in a.items():
                tensors.setdefault(f"bin:{k}", v)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    for k, shard in index["weight_map"].items():
        assert torch.equal(tensors[k], tensors[f"bin:{k}"]), k
    bin_index = json.loads((tmp_path / "bin" / "pytorch_model.bin.index.json").read_text())
    assert bin_index["weight_map"].keys() == index["weight_map"].keys()
    # the converter's own output, as recorded by the fixture (sha256 of every tensor's raw bytes)
    import hashlib
    expected = json.loads((FIXTURES / case / "expected_hf" / "keys.json").read_text())
    entries = expected.get("tensors", expected)
    written = 0
    for k, meta in (entries.items() if isinstance(entries, dict) else [(e["name"], e) for e in entries]):
        if k not in tensors:
            continue  # a tied copy or legacy buffer the converter adds and save_pretrained leaves out
        written += 1
        t = tensors[k].contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert hashlib.sha256(raw).hexdigest() == meta["sha256"], k
    assert written == len(index["weight_map"])  # every tensor served is one the converter wrote, bit for bit


def test_npy_files_mmap_equal_the_source_tensors():
    ckpt = FIXTURES / "train_gpt2" / "cs" / "checkpoint.mdl"
    with mounted(ckpt, "--views", "tensors", env=real_env()) as mnt, h5py.File(ckpt, "r") as f:
        checked = 0
        for path in sorted((mnt / "tensors").rglob("*.npy")):
            key = ".".join(path.relative_to(mnt / "tensors").with_suffix("").parts)
            if key not in f or not isinstance(f[key], h5py.Dataset):
                continue  # aliases (LinkedObject) have no dataset of their own
            a = np.load(path, mmap_mode="r")
            want = f[key][()]
            assert a.shape == want.shape and a.dtype == want.dtype, key
            assert np.array_equal(np.asarray(a), want), key
            checked += 1
        assert checked > 50


def test_eight_threads_random_ranges_of_every_real_file_equal_export(tmp_path):
    ckpt = FIXTURES / "llama" / "cs" / "checkpoint.mdl"
    with mounted(ckpt, env=real_env()) as mnt:
        paths = sorted(str(p.relative_to(mnt)) for p in mnt.rglob("*") if p.is_file())
        exported = {}
        for p in paths:
            if p.startswith("hub/"):
                continue  # the repository folder serves the root's files: their export below
            out = tmp_path / "x"
            run_ckptfs("export", ckpt, p, out, check=True)
            exported[p] = out.read_bytes()
        exported.update({p: exported[p[4:]] for p in paths if p.startswith("hub/")})
        errors, _ = concurrent_random_reads(mnt, exported, threads=8, seconds=3)
        assert not errors, errors[:5]


def _corrupt_one_dataset(path: Path, key: str) -> None:
    with h5py.File(path, "r") as f:
        info = f[key].id.get_chunk_info(0)
    # Break the chunk's LZ4 framing (sizes): random weights are stored as raw LZ4 blocks with no checksum, so
    # flipping payload bytes would be undetectable by anyone; a broken frame is what a reader can and must catch.
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset)
        fh.write(b"\xff" * 16)


def test_corrupted_tensor_gives_eio_only_where_needed(tmp_path):
    ckpt = tmp_path / "checkpoint.mdl"
    shutil.copy(FIXTURES / "llama" / "cs" / "checkpoint.mdl", ckpt)
    shutil.copy(FIXTURES / "llama" / "cs" / "params.yaml", tmp_path / "params.yaml")
    ckpt.chmod(0o644)
    bad = "model.transformer_decoder.layers.1.ffn.ffn.1.linear_layer.weight"  # -> down_proj of layer 1
    _corrupt_one_dataset(ckpt, bad)
    with mounted(ckpt, env=real_env()) as mnt:
        with pytest.raises(OSError) as e:
            (mnt / "model.safetensors").read_bytes()
        assert e.value.errno == errno.EIO
        with pytest.raises(OSError) as e:
            (mnt / "tensors" / "model" / "transformer_decoder" / "layers" / "1" / "ffn" / "ffn" / "1"
             / "linear_layer" / "weight.npy").read_bytes()
        assert e.value.errno == errno.EIO
        # every file that does not need the tensor is intact
        good = mnt / "tensors" / "model" / "embedding_layer" / "word_embeddings" / "weight.npy"
        with h5py.File(FIXTURES / "llama" / "cs" / "checkpoint.mdl", "r") as f:
            assert np.array_equal(np.load(good), f["model.embedding_layer.word_embeddings.weight"][()])
        cfg = json.loads((mnt / "config.json").read_text())
        assert cfg["model_type"] == "llama"
        # the safetensors header (before any tensor data) still reads
        with open(mnt / "model.safetensors", "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            assert json.loads(fh.read(n))["__metadata__"] == {"format": "pt"}
