"""A real Cerebras checkpoint through the real mount: every file's bytes, and loaders that mmap the files."""
from __future__ import annotations

import subprocess

import pytest

from helpers import needs_fuse, real_env
from helpers.fuse import FIXTURES_CKPT, mounted

pytestmark = [needs_fuse, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def tree():
    from ckptfs.tree.assemble import build_tree

    t = build_tree(FIXTURES_CKPT)
    yield t
    t.close()


@pytest.fixture(scope="module")
def mnt():
    with mounted(FIXTURES_CKPT, env=real_env()) as m:
        yield m


def test_every_file_copies_to_the_tree_bytes(mnt, tree, tmp_path):
    paths = tree.file_paths()
    assert "config.json" in paths and "model.safetensors" in paths
    r = subprocess.run(["cp", "-r", f"{mnt}/.", str(tmp_path / "copy")], capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr
    copied = sorted(str(p.relative_to(tmp_path / "copy")) for p in (tmp_path / "copy").rglob("*") if p.is_file())
    assert copied == sorted(paths)
    for p in paths:
        assert (tmp_path / "copy" / p).read_bytes() == tree.read(p, 0, tree.attr(p).size), p


def test_loaders_read_the_mount(mnt, tree):
    import torch
    from safetensors import safe_open
    from safetensors.torch import load as st_load

    st = mnt / "model.safetensors"
    assert st.exists(), "the hf view serves model.safetensors for the fixture"
    want = st_load(tree.read("model.safetensors", 0, tree.attr("model.safetensors").size))
    with safe_open(str(st), "pt") as f:  # mmap over FUSE
        assert sorted(f.keys()) == sorted(want)
        for k in f.keys():
            assert torch.equal(f.get_tensor(k), want[k]), k
    binf = mnt / "bin" / "pytorch_model.bin"  # --hf-format both: the .bin format's own HF folder
    if binf.exists():
        sd = torch.load(binf, mmap=True, weights_only=True, map_location="cpu")
        assert sorted(sd) == sorted(want) and all(torch.equal(sd[k], want[k]) for k in want)


def test_from_pretrained_loads_the_mounted_hf_directory(mnt, tree):
    import torch
    import transformers
    from safetensors.torch import load as st_load

    assert (mnt / "config.json").exists(), "the hf view serves config.json for the fixture"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(mnt))
    want = st_load(tree.read("model.safetensors", 0, tree.attr("model.safetensors").size))
    sd = model.state_dict()
    for k, v in want.items():
        assert torch.equal(sd[k], v), k
