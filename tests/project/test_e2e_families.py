"""One case of every family, end to end through a real FUSE mount, as a user would: ``from_pretrained(mount)``
(each sub-folder of a multi-component model too) gives the original model's state dict, and greedy ``generate()``
of 20 tokens gives the original model's ids (EOS respected) — or, for models that do not generate, the same outputs.

The cases are chosen from the registry, so a family added later is covered here without editing this file: for each
family, the first conformance case that is not pending and whose HF class transformers ships.
"""
from __future__ import annotations

import pytest
import torch

from helpers.cases import (CASES, case_checkpoint, case_dir, case_facts, case_model, case_options, config_mismatches,
                      converted, has_hf, loaded_config, model_inputs, model_outputs, state_dicts_equal,
                      transformers_class)
from ckptfs.mapping.lang.families import default_registry
from helpers import needs_fuse, real_env
from helpers.fuse import mounted

pytestmark = [needs_fuse, pytest.mark.timeout(900)]


def family_cases() -> list:
    registry = default_registry()
    chosen: dict = {}
    for case in CASES:
        facts = case_facts(case)
        if facts.get("pending") or not has_hf(case) or not (case_dir(case) / "hf").is_dir():
            continue
        spec = registry.for_model(case_model(case))
        if spec is None or spec.family in chosen:
            continue
        variant = spec.variant(case_model(case))
        if transformers_class(variant.hf_class) is None and not spec_has_components(case):
            continue  # remote code: the conformance test checks its bytes
        chosen[spec.family] = case
    return sorted(chosen.values())


def spec_has_components(case: str) -> bool:
    return any(folder for folder in converted(case).folders())


def compare_through_the_mount(case: str, mnt, folder: str, cls) -> None:
    """``cls.from_pretrained`` of the mounted folder equals the original: state dict, then greedy generation of 20
    tokens (or, for models that do not generate, every output)."""
    kw = {"attn_implementation": "eager"}
    src = case_dir(case) / "hf" / folder
    original = cls.from_pretrained(src, **kw).eval()
    ours = cls.from_pretrained(str(mnt / folder), **kw).eval()
    facts = case_facts(case)
    atol = (facts.get("outputs") or {}).get("atol")  # documented per case (gemma2: 1-2 ulp)
    ignore = (facts.get("outputs") or {}).get("ignore") or ()
    absent = {k.split("/", 1)[1] if "/" in k else k for k in facts.get("not_in_checkpoint") or {}
              if (k.split("/", 1)[0] if "/" in k else "") == folder}
    state_dicts_equal(ours.state_dict(), original.state_dict(), f"{case}/{folder}", atol, absent)
    # the mounted config.json loads to the original's configuration (issue 34; documented differences aside)
    problems, _ = config_mismatches(case, folder, loaded_config(mnt / folder), loaded_config(src))
    assert not problems, f"{case}/{folder}: {problems}"
    inputs = model_inputs(original, original.config)
    if original.can_generate():
        ids = inputs.get("input_ids")
        gen = {"max_new_tokens": 20, "do_sample": False}
        if original.config.is_encoder_decoder and original.generation_config.decoder_start_token_id is None:
            gen["decoder_start_token_id"] = original.config.pad_token_id  # T5: decoding starts at pad
        with torch.no_grad():
            want = original.generate(ids, **gen)
            got = ours.generate(ids, **gen)
        assert torch.equal(got, want), f"{case}/{folder}: greedy generation differs"
    else:
        for a, b in zip(model_outputs(ours, inputs, ignore), model_outputs(original, inputs, ignore), strict=True):
            same = torch.allclose(a, b, rtol=0, atol=atol) if atol else torch.equal(a, b)
            assert same, f"{case}/{folder}: outputs differ"


def mount_case(case: str, views: str = "hf"):
    model = case_options(case).get("model")
    return mounted(case_checkpoint(case), *(["--model", model] if model else []), "--views", views, env=real_env())


@pytest.mark.parametrize("case", family_cases())
def test_from_pretrained_and_generate_through_the_mount(case):
    hf = converted(case)
    with mount_case(case) as mnt:
        compared = 0
        for folder, model in hf.folders().items():
            cls = transformers_class(model.hf_class)
            if cls is None or not (case_dir(case) / "hf" / folder / "config.json").is_file():
                continue
            compare_through_the_mount(case, mnt, folder, cls)
            compared += 1
        assert compared, f"{case}: no folder loaded through the mount"


# cases the issues name that the per-family choice above does not pick, with the class a user loads them with
# (LLaVA's text model is LLaVA's own LlavaLlamaForCausalLM, not in transformers: its Llama part loads as Llama;
# bert_mlm, a BERT without NSP mounted without --model, against the bert case's model loaded as BertForMaskedLM)
NAMED = [("t5", "", "T5ForConditionalGeneration"), ("llava", "text_model", "LlamaForCausalLM"),
         ("mmsimple_llava", "text_model", "LlamaForCausalLM"), ("llama", "", "LlamaForCausalLM"),
         ("bert_mlm", "", "BertForMaskedLM")]


@pytest.mark.parametrize("case,folder,cls_name", NAMED, ids=[f"{c}-{f or 'root'}" for c, f, _ in NAMED])
def test_named_models_through_the_mount(case, folder, cls_name):
    with mount_case(case) as mnt:
        compare_through_the_mount(case, mnt, folder, transformers_class(cls_name))


def test_every_family_with_a_transformers_class_is_mounted_here():
    """A family whose HF class transformers ships must have a case above (guards the selection itself)."""
    registry = default_registry()
    mounted_families = {registry.for_model(case_model(c)).family for c in family_cases()}
    for spec in registry.families.values():
        if any(transformers_class(m.hf_class) for m in spec.models) and any(
                registry.for_model(case_model(c)) is spec and not case_facts(c).get("pending") for c in CASES):
            assert spec.family in mounted_families, spec.family


def test_a_model_without_hf_side_mounts_with_the_views_that_apply():
    """bert-summarization: README.txt says why there is no HF view; cs/, torch/ and tensors/ serve the checkpoint."""
    import numpy as np

    from ckptfs.mapping.lang.families import default_registry
    from ckptfs.readers import open_checkpoint

    case = "bert_summarization"
    reason = default_registry().family("bert-summarization").no_hf
    with mount_case(case, views="hf,cs,torch,tensors") as mnt:
        readme = (mnt / "README.txt").read_text()
        assert "missing: Hugging Face files not generated: model bert/extractive_summarization (family " \
               "bert-summarization) has no Hugging Face counterpart" in readme
        assert " ".join(reason.split()) in " ".join(readme.split())
        assert not (mnt / "config.json").exists() and (mnt / "cs" / "checkpoint.mdl").is_file()
        state = torch.load(mnt / "torch" / "model.pt", weights_only=True)
        with open_checkpoint(case_checkpoint(case)) as ck:
            source = {k[len("model."):]: leaf.tensor.read_all() for k, leaf in ck.tensors().items()}
        assert state.keys() == source.keys() and state["classifier.weight"].shape == (2, 32)
        for key, value in source.items():
            assert np.array_equal(state[key].numpy(), value), key
        head = np.load(mnt / "tensors" / "model" / "classifier" / "weight.npy")
        assert np.array_equal(head, source["classifier.weight"])
        with open_checkpoint(mnt / "cs" / "checkpoint.mdl") as upgraded:
            assert {k: leaf.tensor.read_all().tobytes() for k, leaf in upgraded.tensors().items()} == \
                {f"model.{k}": v.tobytes() for k, v in source.items()}
