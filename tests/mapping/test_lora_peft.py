"""``--lora keep`` (ckptfs/mapping/lora/peft.py): beside the folded model, the base model and the LoRA adapter as
a PEFT adapter directory. PEFT loads it onto the base model; merged, it gives the folded model's weights (bit for
bit on the fixtures); unmerged, the same outputs up to float rounding. Where PEFT cannot hold the LoRA exactly,
there is no adapter and the notes say why."""
from __future__ import annotations

import json
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch
import yaml

from ckptfs.mapping.to_hf import to_hf
from ckptfs.mapping.detect import cs_model_tensors
from ckptfs.mapping.lora.find import find_lora
from ckptfs.mapping.lora.peft import NotExpressible, peft_adapter
from ckptfs.mapping.params.find import find_params
from ckptfs.mapping.lang.families import default_registry
from ckptfs.tensor.base import ArrayTensor
from helpers.mapping import FIXTURES, RecordingTensor, checkpoint_from_model, open_fixture

CASES = {"lora_gpt2": "gpt2", "lora_llama": "llama"}


def _torch(t) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(t.read_all()).copy())


def write_folder(path, config: dict | None, named: list, file="model.safetensors"):
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    save_file({n: _torch(t) for n, t in named}, str(path / file), metadata={"format": "pt"})


def write_keep(hf, root):
    """The --lora keep folders as the HF view writes them: root (folded), base/, adapter/."""
    for folder, model in hf.folders().items():
        write_folder(root / (folder or "folded"), model.config, model.tensors)
    (root / "adapter").mkdir()
    adapter = hf.extra_folders["adapter"]
    (root / "adapter" / "adapter_config.json").write_text(json.dumps(adapter["adapter_config.json"]))
    write_folder(root / "adapter", None, adapter["adapter_model.safetensors"], "adapter_model.safetensors")


@pytest.mark.parametrize("case", CASES)
def test_peft_merges_the_adapter_into_the_folded_model(case, tmp_path):
    import peft
    import transformers

    hf = to_hf(open_fixture(case), model=CASES[case], lora="keep")
    assert set(hf.folders()) == {"", "base"}
    write_keep(hf, tmp_path)
    cls = getattr(transformers, hf.hf_class)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        folded = cls.from_pretrained(tmp_path / "folded").eval()
        model = peft.PeftModel.from_pretrained(cls.from_pretrained(tmp_path / "base"), str(tmp_path / "adapter"))
    model.eval()
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        unmerged, want = model(ids).logits, folded(ids).logits
    assert torch.allclose(unmerged, want, rtol=0, atol=1e-3), "base + adapter computes the folded model"
    merged = model.merge_and_unload().state_dict()
    for name, t in folded.state_dict().items():
        assert torch.equal(merged[name], t), f"{name}: PEFT's merge differs from the fold"


def test_base_folder_is_the_model_before_lora():
    hf = to_hf(open_fixture("lora_llama"), model="llama", lora="keep")
    base = dict(hf.folders()["base"].tensors)
    cs = cs_model_tensors(open_fixture("lora_llama"))
    v_cs = cs["model.transformer_decoder.layers.0.self_attn.proj_v_dense_layer.weight"]
    np.testing.assert_array_equal(base["model.layers.0.self_attn.v_proj.weight"].read_all(), v_cs.read_all())
    assert hf.folders()["base"].config == hf.config, "same config: only the weights differ"
    assert any("adapter/ is a PEFT LoRA adapter of base/ (14 modules" in w for w in hf.warnings)


def test_fused_c_attn_adapter_has_three_times_the_rank_and_alpha():
    hf = to_hf(open_fixture("lora_gpt2"), model="gpt2", lora="keep")
    cfg = hf.extra_folders["adapter"]["adapter_config.json"]
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["fan_in_fan_out"]) == ("LORA", 2, 5, True)
    assert cfg["rank_pattern"] == {"transformer.h.0.attn.c_attn": 6, "transformer.h.1.attn.c_attn": 6}
    assert cfg["alpha_pattern"] == {"transformer.h.0.attn.c_attn": 15, "transformer.h.1.attn.c_attn": 15}
    tensors = dict(hf.extra_folders["adapter"]["adapter_model.safetensors"])
    b = tensors["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"].read_all()
    assert b.shape == (96, 6) and not b[:32, 2:].any() and not b[32:64, :2].any() and not b[32:64, 4:].any()


def test_fold_mode_has_no_base_or_adapter():
    hf = to_hf(open_fixture("lora_gpt2"), model="gpt2")
    assert set(hf.folders()) == {""} and not hf.files and not hf.extra_folders


def test_no_adapter_with_mup_and_the_notes_say_why(tmp_path):
    doc = yaml.safe_load((FIXTURES / "lora_gpt2" / "cs" / "params.yaml").read_text())
    doc["model"].update({"mup_base_hidden_size": 16, "mup_base_filter_size": 64})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(doc))
    hf = to_hf(checkpoint_from_model(tmp_path / "c.mdl", cs_model_tensors(open_fixture("lora_gpt2"))),
               model="gpt2", lora="keep")
    assert not hf.extra_folders and "base" in hf.folders()
    assert any("no PEFT adapter: muP scales are folded into the HF weights" in w for w in hf.warnings)


def test_no_adapter_for_a_family_without_peft_rules():
    from ckptfs.mapping.lora.spec import PeftSpec

    ck = open_fixture("lora_llama")
    spec = default_registry().family("llama")
    spec = replace(spec, lora=replace(spec.lora, peft=PeftSpec()))
    params = find_params(ck)
    cs = cs_model_tensors(ck)
    lora = find_lora(spec, params, cs)
    with pytest.raises(NotExpressible, match="no lora.peft rules"):
        peft_adapter(spec, spec.variant("llama"), lora.params_model, params.path, lora, cs)


def test_block_diag_reads_only_the_blocks_a_region_covers():
    from ckptfs.mapping.transforms.lora import block_diag

    rng = np.random.default_rng(0)
    parts = [RecordingTensor(rng.standard_normal((4, 2)).astype(np.float32)) for _ in range(3)]
    t = block_diag(*parts)
    assert t.shape == (12, 6)
    full = t.read_all()
    for n, p in enumerate(parts):
        np.testing.assert_array_equal(full[4 * n:4 * n + 4, 2 * n:2 * n + 2], p.inner.array)
    assert np.count_nonzero(full) == np.count_nonzero(np.concatenate([p.inner.array for p in parts]))
    for p in parts:
        p.reset()
    t.read(((4, 8), (0, 6)))
    assert parts[0].boxes == [] and parts[2].boxes == [] and parts[1].boxes == [((0, 4), (0, 2))]
    with pytest.raises(Exception, match="2-D"):
        block_diag(ArrayTensor(np.zeros(3, np.float32)))
