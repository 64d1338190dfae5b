"""LoRA checkpoints through a real FUSE mount: ``from_pretrained(mount)`` is the folded model (every tensor equal to
Model Zoo's fold + convert, and to a mount of the fold tool's own output), while ``cs/``, ``torch/`` and
``tensors/`` show the unfolded checkpoint as it is."""
from __future__ import annotations

import hashlib
import json
import warnings

import numpy as np
import pytest
import torch
import yaml

from ckptfs.mapping.detect import cs_model_tensors
from helpers import needs_fuse, real_env
from helpers.fuse import mounted
from helpers.mapping import FIXTURES, open_fixture

pytestmark = [needs_fuse, pytest.mark.timeout(900)]

CASES = {"lora_gpt2": "gpt2", "lora_llama": "llama"}


def load(path, cls):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = cls.from_pretrained(str(path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("case", CASES)
def test_mount_is_the_folded_model_and_the_other_views_the_source(case):
    import transformers

    expected = json.loads((FIXTURES / case / "expected_hf" / "keys.json").read_text())["tensors"]
    cls = getattr(transformers, json.loads((FIXTURES / case / "MANIFEST.json").read_text())["hf_architecture"])
    ckpt = FIXTURES / case / "cs" / "checkpoint.mdl"
    with mounted(ckpt, "--model", CASES[case], env=real_env()) as mnt:
        ours = load(mnt, cls)
        for name, t in ours.state_dict().items():
            assert digest(t) == expected[name]["sha256"], f"{name} differs from fold + convert"
        readme = (mnt / "README.txt").read_text()
        assert "LoRA folded into the weights" in readme
        config = json.loads((mnt / "config.json").read_text())
        assert not any("lora" in k.lower() for k in config)
        source_views_unchanged(mnt, case)

    folded = FIXTURES / case / "cs" / "folded.mdl"
    with mounted(folded, "--model", CASES[case], "--config", str(FIXTURES / case / "cs" / "params_folded.yaml"),
                 "--views", "hf", env=real_env()) as mnt:
        theirs = load(mnt, cls)
    for name, t in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[name], t), f"{name}: mount of the fold tool's output differs"
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(7))
    gen = {"max_new_tokens": 20, "do_sample": False}
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **gen), theirs.generate(ids, **gen))


def source_views_unchanged(mnt, case):
    """cs/ keeps lora_params and the LoRA matrices; torch/ and tensors/ hold every source tensor as stored."""
    cs = cs_model_tensors(open_fixture(case))
    lora_keys = [k for k in cs if k.endswith((".lora_A", ".lora_B"))]
    assert lora_keys
    params = yaml.safe_load((mnt / "cs" / "checkpoint.yaml").read_text())
    model = params.get("model") or params["trainer"]["init"]["model"]
    assert model["lora_params"] == yaml.safe_load((FIXTURES / case / "cs" / "params.yaml").read_text())[
        "model"]["lora_params"]
    from ckptfs.readers import open_checkpoint

    with open_checkpoint(mnt / "cs" / "checkpoint.mdl") as upgraded:
        up = cs_model_tensors(upgraded)
        for key, t in cs.items():
            np.testing.assert_array_equal(up[key].read_all(), t.read_all(), err_msg=f"cs/ {key}")
    state = torch.load(mnt / "torch" / "model.pt", weights_only=True)
    assert set(state) == set(cs)
    for key, t in cs.items():
        assert np.array_equal(state[key].numpy(), t.read_all()), f"torch/ {key}"
        npy = mnt / "tensors" / "model" / (key.replace(".", "/") + ".npy")
        np.testing.assert_array_equal(np.load(npy), t.read_all(), err_msg=f"tensors/ {key}")


@pytest.mark.parametrize("case", CASES)
def test_keep_mount_serves_base_and_a_peft_adapter(case):
    """--lora keep: PeftModel.from_pretrained(base/, adapter/) through the mount, merged, is the root's model."""
    import peft
    import transformers

    cls = getattr(transformers, json.loads((FIXTURES / case / "MANIFEST.json").read_text())["hf_architecture"])
    with mounted(FIXTURES / case / "cs" / "checkpoint.mdl", "--model", CASES[case], "--lora", "keep",
                 "--views", "hf", env=real_env()) as mnt:
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (mnt / "adapter").iterdir()}
        folded = load(mnt, cls)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.PeftModel.from_pretrained(load(mnt / "base", cls), str(mnt / "adapter")).eval()
        assert "adapter/ is a PEFT LoRA adapter of base/" in (mnt / "README.txt").read_text()
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, folded(ids).logits, rtol=0, atol=1e-3)
    merged = model.merge_and_unload().state_dict()
    for name, t in folded.state_dict().items():
        assert torch.equal(merged[name], t), name
