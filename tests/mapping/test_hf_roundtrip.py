"""The round trip closes (issue 30, item 4): an HF model mounted as a Cerebras checkpoint, read back through ckptfs's
Cerebras -> HF view, gives the original HF tensors bit for bit — through the files a mount serves (checkpoint.mdl
and params.yaml written out, opened again) for the cases whose converter round trip is exact, and through a
mount of a mount."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.numpy import load_file

import ckptfs
from ckptfs.tree.hf_source import build_hf_tree
from ckptfs.views.options import MountOptions
from ckptfs.mapping.hf_checkpoint import open_hf_checkpoint
from helpers import FIXTURES, needs_fuse
from helpers.fuse import mounted
from helpers.hf import hf_env

#: one case per family whose converter round trip is exact (MANIFEST roundtrip.exact), with the --model it needs
CASES = {"llama": None, "llama_headless": None, "gpt2": None, "mixtral": None, "falcon": None, "bloom": None,
         "starcoder": None, "gptj": None, "gpt_neox": None, "codegen": None, "mpt": None, "mistral": None,
         "dpo_llama": "dpo"}


def _hf_tensors(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_to_cs_to_hf_gives_back_the_hf_tensors(tmp_path, case):
    hf = FIXTURES / case / "hf"
    assert json.loads((FIXTURES / case / "MANIFEST.json").read_text())["roundtrip"]["exact"]
    options = MountOptions(model=CASES[case], views=("cs",))
    model_name = open_hf_checkpoint(hf, options).plan.model_name  # what README.txt tells to mount it back with
    tree = build_hf_tree(hf, options)
    (tmp_path / "checkpoint.mdl").write_bytes(b"".join(tree.iter_blocks("checkpoint.mdl")))
    (tmp_path / "params.yaml").write_bytes(tree.read("params.yaml", 0, 1 << 20))
    back = ckptfs.open(tmp_path / "checkpoint.mdl", config=tmp_path / "params.yaml", model=model_name, views="hf",
                       hf_format="safetensors")
    try:
        got = {}
        for name in back.listdir(""):
            if name.endswith(".safetensors"):
                (tmp_path / name).write_bytes(b"".join(back.iter_blocks(name)))
                got.update(load_file(str(tmp_path / name)))
    finally:
        back.close()
    want = _hf_tensors(hf)
    assert got, case
    missing = set(want) - set(got)
    assert not missing, (case, sorted(missing)[:5])  # what save_pretrained leaves out is left out on both sides
    for k, v in got.items():
        if k in want:
            assert v.dtype == want[k].dtype and v.tobytes() == want[k].tobytes(), (case, k)


@needs_fuse
@pytest.mark.timeout(600)
def test_a_mount_of_a_mount_gives_back_the_hf_model():
    want = _hf_tensors(FIXTURES / "llama" / "hf")
    with mounted(FIXTURES / "llama" / "hf", env=hf_env()) as cs:
        with mounted(cs / "checkpoint.mdl", "--config", cs / "params.yaml", env=hf_env()) as hf:
            got = load_file(str(hf / "model.safetensors"))
            assert set(got) == set(want)
            assert all(got[k].tobytes() == want[k].tobytes() for k in want)
