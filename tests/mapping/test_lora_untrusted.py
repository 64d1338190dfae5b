"""A crafted LoRA checkpoint cannot buy work or memory beyond what its data holds (issue 31, attack 10): a rank above
the base weight's dimensions, or one whose fold would not fit the cache, is refused with the reason, as is rank 0
with LoRA matrices."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import pytest
import yaml

from helpers import FIXTURES
from helpers.untrusted import leaf_metadata, tensor_md

pytestmark = pytest.mark.timeout(300)

LORA = FIXTURES / "lora_llama" / "cs"


def craft_rank(folder: Path, r: int) -> Path:
    """lora_llama with its FeedForwardNetwork group at rank ``r``: every ffn lora_A / lora_B turned into a
    constant-filled tensor of that rank (the file stays ~700 KiB whatever ``r``)."""
    folder.mkdir(parents=True)
    ckpt = Path(shutil.copy(LORA / "checkpoint.mdl", folder / "checkpoint.mdl"))
    params = yaml.safe_load((LORA / "params.yaml").read_text())
    group = next(g for g in params["model"]["lora_params"] if g["target_modules"] == ["FeedForwardNetwork"])
    group["r"] = r
    (folder / "params.yaml").write_text(yaml.safe_dump(params))
    with h5py.File(ckpt, "r+") as f:
        for attr in [a for a in f.attrs if ".ffn." in a and ".lora_" in a]:
            key = attr[: -len(".__metadata__")]
            (shape,) = json.loads(f.attrs[attr])[f"{key}.__metadata__"]["shapes"]
            shape = [r, shape[1]] if key.endswith("lora_A") else [shape[0], r]
            md = tensor_md(shape, kind="DeferredFullTensor")
            md["fill_value"] = 0.001
            f.attrs[attr] = json.dumps(leaf_metadata(key, md))
    return ckpt


@pytest.mark.parametrize("r, words", [(1_000_000, ("rank 1000000", "exceeds")), (100, ("rank 100", "exceeds")),
                                      (0, ("r 0", "LoRA matrices"))], ids=["r1e6", "r100", "r0"])
def test_a_crafted_rank_leaves_the_hf_files_out_with_the_reason(tmp_path, r, words):
    import ckptfs

    tree = ckptfs.open(craft_rank(tmp_path / "ck", r), views="hf,tensors")
    try:
        readme = tree.read("README.txt", 0, 1 << 20).decode()
        paths = tree.file_paths()
    finally:
        tree.close()
    assert "model.safetensors" not in paths and any(p.startswith("tensors/") for p in paths)
    line = next(ln for ln in readme.splitlines() if "Hugging Face files not generated" in ln)
    assert all(w in line for w in words) and "internal error" not in line, line


def test_a_fold_larger_than_the_cache_is_refused(tmp_path):
    """The fold of a Linear reads all of lora_A for whole rows: r x columns, held as float32 and float64."""
    from ckptfs.errors import MappingError
    from ckptfs.mapping.lora.find import find_lora
    from ckptfs.mapping.detect import cs_model_tensors
    from ckptfs.mapping.params.find import find_params
    from ckptfs.mapping.lang.families import default_registry
    from helpers.mapping import open_fixture

    ck = open_fixture("lora_llama")
    spec = default_registry().family("llama")
    cs = cs_model_tensors(ck)
    assert find_lora(spec, find_params(ck), cs, ck.path, memory=1 << 20) is not None
    with pytest.raises(MappingError, match="cache"):
        find_lora(spec, find_params(ck), cs, ck.path, memory=1000)
