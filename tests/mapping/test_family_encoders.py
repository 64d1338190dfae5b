"""Encoder families (bert, roberta, esm2) beyond the fixture conformance cases: the BERT sequence classifier (no
fixture), the untied and segment-less variants, CS model names, detection from tensor names, and the guards."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import ckptfs
from safetensors import safe_open
from safetensors.torch import save_file

from ckptfs.errors import ConfigError
from ckptfs.mapping.to_hf import to_hf
from ckptfs.mapping.detect import detect_family
from ckptfs.tensor.base import ArrayTensor
from helpers.mapping import (FIXTURES, checkpoint_from_model, model_tensors, open_fixture, open_path, params_of, to_torch,
                         write_yaml)

NUM_LABELS = 3


def original_state(case) -> dict:
    with safe_open(str(FIXTURES / case / "hf" / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def save_hf(hf, folder):
    """ckptfs' config.json and tensors as an HF model folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf.config))
    save_file({n: to_torch(t) for n, t in hf.tensors}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def load_clean(cls, folder):
    """The model from ``folder``; fails unless every weight was found and used."""
    model, info = cls.from_pretrained(folder, output_loading_info=True, attn_implementation="eager")
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(kind), f"{kind}: {info.get(kind)}"
    return model.eval()


def inputs(vocab: int) -> dict:
    g = torch.Generator().manual_seed(3)
    return {"input_ids": torch.randint(3, vocab, (2, 9), generator=g),
            "token_type_ids": torch.randint(0, 2, (2, 9), generator=g)}


# -- BERT sequence classifier: a CS checkpoint made from the bert fixture's encoder plus a classifier ---------------


def sequence_classifier_checkpoint(tmp_path):
    """CS BertForSequenceClassification (`bert.*` + `classifier.*`) built from the bert fixture's encoder tensors."""
    rng = np.random.default_rng(11)
    head = {"classifier.weight": rng.normal(0, 0.5, (NUM_LABELS, 32)).astype(np.float32),
            "classifier.bias": rng.normal(0, 0.5, (NUM_LABELS,)).astype(np.float32)}
    with open_fixture("bert") as ck:
        encoder = {"bert." + k[len("bert_encoder."):]: ArrayTensor(t.read_all())
                   for k, t in model_tensors(ck).items() if k.startswith("bert_encoder.")}
    model = {**encoder, **{k: ArrayTensor(v) for k, v in head.items()}}
    params = params_of("bert")
    section = params["model"]
    for k in ("mlm_nonlinearity", "share_embedding_weights", "freeze_ffn_bias_in_glu"):
        section.pop(k)
    section.update(name="bert/classifier", num_labels=NUM_LABELS, problem_type="single_label_classification",
                   task_dropout=0.2)
    config = write_yaml(tmp_path / "params.yaml", params)
    return checkpoint_from_model(tmp_path / "checkpoint.mdl", model), config, head


def test_sequence_classifier_loads_clean_and_equals_the_same_weights_loaded_directly(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    ckpt, config, head = sequence_classifier_checkpoint(tmp_path)
    hf = to_hf(ckpt, config=config)  # the params name bert/classifier picks the model
    assert (hf.family, hf.model_name, hf.hf_class) == ("bert", "bert/classifier", "BertForSequenceClassification")
    assert hf.config["num_labels"] == NUM_LABELS
    assert hf.config["problem_type"] == "single_label_classification"
    assert hf.config["classifier_dropout"] == 0.2
    names = {n for n, _ in hf.tensors}
    assert {"classifier.weight", "classifier.bias", "bert.pooler.dense.weight"} <= names
    assert not any(n.startswith("cls.") or n.endswith("position_ids") for n in names)
    ours = load_clean(BertForSequenceClassification, save_hf(hf, tmp_path / "hf"))

    # the same weights loaded directly: the original HF BERT encoder plus the classifier
    reference_config = BertConfig.from_pretrained(FIXTURES / "bert" / "hf", num_labels=NUM_LABELS,
                                                  problem_type="single_label_classification",
                                                  classifier_dropout=0.2, attn_implementation="eager")
    reference = BertForSequenceClassification(reference_config).eval()
    state = {k: v for k, v in original_state("bert").items() if k.startswith("bert.")}
    state.update({k: torch.from_numpy(v) for k, v in head.items()})
    reference.load_state_dict(state, strict=True)

    x = inputs(128)
    with torch.no_grad():
        assert torch.equal(ours(**x).logits, reference(**x).logits)


# -- untied and segment-less variants ---------------------------------------------------------------------


def fixture_with_params(case, tmp_path, model=None, drop_tensors=(), **changes):
    """The fixture's CS tensors (minus ``drop_tensors``) with edited params."""
    with open_fixture(case) as ck:
        tensors = {k: ArrayTensor(t.read_all()) for k, t in model_tensors(ck).items() if k not in drop_tensors}
    params = params_of(case)
    params["model"].update(changes)
    config = write_yaml(tmp_path / "params.yaml", params)
    return to_hf(checkpoint_from_model(tmp_path / "checkpoint.mdl", tensors), config=config, model=model)


def test_untied_bert_writes_its_decoder_and_equals_the_untied_original(tmp_path):
    from transformers import BertConfig, BertForPreTraining

    hf = fixture_with_params("bert", tmp_path, share_embedding_weights=False)
    assert hf.config["tie_word_embeddings"] is False
    names = {n for n, _ in hf.tensors}
    assert {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias", "cls.predictions.bias"} <= names
    ours = load_clean(BertForPreTraining, save_hf(hf, tmp_path / "hf"))

    reference = BertForPreTraining(BertConfig.from_pretrained(FIXTURES / "bert" / "hf", tie_word_embeddings=False,
                                                              attn_implementation="eager")).eval()
    state = original_state("bert")
    state["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"]
    state["cls.predictions.decoder.bias"] = state["cls.predictions.bias"]
    reference.load_state_dict(state, strict=True)
    x = inputs(128)
    with torch.no_grad():
        a, b = ours(**x), reference(**x)
    assert torch.equal(a.prediction_logits, b.prediction_logits)
    assert torch.equal(a.seq_relationship_logits, b.seq_relationship_logits)


def test_roberta_without_segments_gets_one_zero_token_type_row(tmp_path):
    from transformers import RobertaForMaskedLM

    hf = fixture_with_params("roberta", tmp_path, model="roberta", num_segments=0,
                             drop_tensors=("bert_encoder.embedding_layer.segment_embeddings.weight",))
    assert hf.config["type_vocab_size"] == 1
    row = to_torch(dict(hf.tensors)["roberta.embeddings.token_type_embeddings.weight"])
    assert row.shape == (1, 32) and not row.any()
    load_clean(RobertaForMaskedLM, save_hf(hf, tmp_path / "hf"))


# -- CS model names, detection and guards ------------------------------------------------------------------


@pytest.mark.parametrize("name,model", [("bert/token_classifier", "bert-token-classifier"),
                                        ("bert/classifier", "bert-sequence-classifier"),
                                        ("bert-qa", "bert-qa"), ("bert-q&a", "bert-qa")])
def test_cs_names_pick_the_bert_head(tmp_path, name, model):
    case = "bert_qa" if model == "bert-qa" else "bert_token_classifier"
    shutil.copy(FIXTURES / case / "cs" / "checkpoint.mdl", tmp_path / "checkpoint.mdl")
    params = params_of(case)
    params["model"]["name"] = name
    params["model"].setdefault("num_labels", 5)
    params["model"].setdefault("task_dropout", 0.1)
    write_yaml(tmp_path / "params.yaml", params)
    with open_path(tmp_path / "checkpoint.mdl") as ck:
        det = detect_family(ck)
        assert det.family == "bert"
        hf = to_hf(ck)
        from ckptfs.mapping.lang.families import default_registry
        assert default_registry().family("bert").variant(hf.model_name).name == model


@pytest.mark.parametrize("case,family", [("bert", "bert"), ("roberta", "roberta"), ("esm2", "esm2"),
                                         ("bert_qa", None), ("bert_token_classifier", None),
                                         ("gpt2", "gpt2"), ("llama", "llama"), ("dragon", None)])
def test_encoders_and_decoders_told_apart_by_tensor_names(tmp_path, case, family):
    """Without a params name: each encoder layout is its own family, decoders never look like encoders, and the
    fine-tuning layouts (same key names for every head) ask for --model."""
    shutil.copy(FIXTURES / case / "cs" / "checkpoint.mdl", tmp_path / "checkpoint.mdl")
    params = params_of(case)
    params["model"].pop("name", None)
    write_yaml(tmp_path / "params.yaml", params)
    with open_path(tmp_path / "checkpoint.mdl") as ck:
        det = detect_family(ck)
        assert det.family == family, det.reason
        if family is None:
            assert "--model" in det.reason


def test_roberta_params_name_bert_is_read_as_roberta_and_model_bert_overrides():
    """RoBERTa checkpoints say name: bert; their trait (positions after the padding index) makes them RoBERTa, with
    the reason for README.txt; --model bert reads one as BERT (its masked-LM class: no NSP head), warning that HF
    BERT numbers positions otherwise."""
    with open_fixture("roberta") as ck:
        hf = to_hf(ck)
        assert (hf.family, hf.model_name, hf.hf_class) == ("roberta", "roberta", "RobertaForMaskedLM")
        assert "mask_padding_in_positional_embed" in hf.chosen and "pad_token_id 1" in hf.chosen
        assert "--model bert" in hf.chosen
        bert = to_hf(ck, model="bert")
        assert (bert.family, bert.model_name, bert.hf_class) == ("bert", "bert-mlm", "BertForMaskedLM")
        assert any("mask_padding_in_positional_embed=True" in w and "converted anyway" in w for w in bert.warnings)
    tree = ckptfs.open(FIXTURES / "roberta" / "cs" / "checkpoint.mdl", views="hf")
    try:
        readme = tree.read("README.txt", 0, 1 << 20).decode()
    finally:
        tree.close()
    assert f"  hf: {hf.chosen}\n" in readme and "family:         roberta (RobertaForMaskedLM)" in readme


def test_bert_with_an_nsp_head_stays_bert_for_pretraining_and_bert_mlm_says_what_it_drops(tmp_path):
    with open_fixture("bert") as ck:
        hf = to_hf(ck)
        assert (hf.model_name, hf.hf_class, hf.chosen) == ("bert", "BertForPreTraining", "")
    with pytest.raises(ConfigError, match="NSP head"):
        fixture_with_params("bert", tmp_path, model="bert-mlm")


@pytest.mark.parametrize("case,model,changes,problem", [
    ("esm2", "esm-2", {"rotary_dim": 4}, "rotary_dim"),
    ("esm2", "esm-2", {"use_final_layer_norm": False}, "use_final_layer_norm"),
    ("esm2", "esm-2", {"mask_token_id": None}, "mask_token_id"),
    ("roberta", "roberta", {"mask_padding_in_positional_embed": False}, "mask_padding_in_positional_embed"),
    ("bert", "bert", {"pooler_nonlinearity": "gelu"}, "tanh"),
    ("bert", "bert", {"norm_first": True}, "post-LN"),
    ("bert", "bert", {"mup_base_hidden_size": 16, "mup_base_filter_size": 32}, "muP"),
])
def test_guards_refuse_what_the_hf_class_cannot_express(tmp_path, case, model, changes, problem):
    with pytest.raises(ConfigError, match=problem):
        fixture_with_params(case, tmp_path, model=model, **changes)


def test_esm2_readme_warnings_name_the_contact_head_and_model_type():
    with open_fixture("esm2") as ck:
        hf = to_hf(ck, model="esm-2")
    text = "\n".join(hf.warnings)
    assert "esm.contact_head.regression" in text and "model_type esm" in text
    assert hf.config["model_type"] == "esm" and hf.generation_config is None


def test_bert_for_masked_lm_goes_to_a_bert_without_nsp_and_back(tmp_path):
    """HF -> CS: a BertForMaskedLM folder is a CS BERT with disable_nsp (its segment table named by num_segments),
    without NSP head or pooler; mounted back, the params choose BertForMaskedLM and every tensor is the original's."""
    from transformers import BertForMaskedLM

    from ckptfs.mapping.to_cs import to_cs
    from ckptfs.readers.hf.folder import open_hf_model

    BertForMaskedLM.from_pretrained(FIXTURES / "bert" / "hf").save_pretrained(tmp_path / "hf")
    hf_model = open_hf_model(tmp_path / "hf")
    plan = to_cs({f: (c.config, c.tensors) for f, c in hf_model.components.items()})
    params = plan.params["model"]
    assert (params["name"], params["disable_nsp"], params["num_segments"]) == ("bert", True, 2)
    keys = [k for k, _ in plan.tensors]
    assert not any(k.startswith(("bert_cls_head.", "bert_encoder.pooler.")) for k in keys)
    config = write_yaml(tmp_path / "cs" / "params.yaml", plan.params)
    back = to_hf(checkpoint_from_model(tmp_path / "cs" / "checkpoint.mdl", dict(plan.tensors)), config=config)
    assert (back.model_name, back.hf_class) == ("bert-mlm", "BertForMaskedLM")
    original = original_state("bert")
    assert {n for n, _ in back.tensors} == {n for n in original if not n.startswith(("cls.seq_relationship.",
                                                                                     "bert.pooler."))}
    for name, t in back.tensors:
        assert torch.equal(to_torch(t), original[name]), name
