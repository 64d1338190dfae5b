"""T5 (and its aliases), ViT, CLIP vision and Mllama: what the conformance test does not already pin down.

Alias names give the same bytes; T5 checkpoints whose tied embeddings were stored as None still give
``shared.weight``; the one CS name ``vision_transformer`` is told apart between ViT and CLIP; Mllama's
sub-configs differ from the converter's only where documented; the patch-embedding view reads only the rows
it needs.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import yaml

from ckptfs.errors import MappingError
from ckptfs.mapping.to_hf import to_hf
from ckptfs.mapping.detect import detect_family
from ckptfs.mapping.lang.families import Registry, default_registry, mapping_dirs
from ckptfs.mapping.transforms.mllama import patch_linear_to_conv
from helpers.mapping import FIXTURES, RecordingTensor, checkpoint_from_model, model_tensors, open_fixture


def _bytes(model) -> dict:
    return {name: t.read_all().tobytes() for name, t in model.tensors}


@pytest.mark.parametrize("case", ["t5", "ul2"])
def test_t5_alias_names_give_identical_output(case):
    ck = open_fixture(case)
    outs = [to_hf(ck, model=name) for name in ("t5", "transformer", "ul2", "flan-ul2")]
    first = outs[0]
    for other in outs[1:]:
        assert other.family == "t5" and other.hf_class == first.hf_class
        assert other.config == first.config
        assert _bytes(other) == _bytes(first)


def test_t5_tied_embeddings_stored_as_none_still_give_shared(tmp_path):
    """Old CS checkpoints stored the tied copies as None: shared.weight comes from whichever copy exists."""
    full = model_tensors(open_fixture("t5"))
    params = FIXTURES / "t5" / "cs" / "params.yaml"
    expected = full["encoder_embeddings.word_embeddings.weight"].read_all()
    for missing in (["encoder_embeddings.word_embeddings.weight"],
                    ["encoder_embeddings.word_embeddings.weight", "decoder_embeddings.word_embeddings.weight"]):
        cs = {k: t for k, t in full.items() if k not in missing}
        hf = to_hf(checkpoint_from_model(tmp_path / "x.mdl", cs), config=params)
        names = {n: t for n, t in hf.tensors}
        assert "shared.weight" in names and "lm_head.weight" not in names
        assert not any(n.endswith("embed_tokens.weight") for n in names)
        assert np.array_equal(names["shared.weight"].read_all(), expected)


def test_t5_untied_keeps_lm_head_and_gated_ffn_names():
    hf = to_hf(open_fixture("ul2"), model="ul2")
    names = {n for n, _ in hf.tensors}
    assert "lm_head.weight" in names and "shared.weight" in names
    assert "encoder.block.0.layer.1.DenseReluDense.wi_0.weight" in names
    assert "decoder.block.1.layer.2.DenseReluDense.wi_1.weight" in names
    assert not any(".DenseReluDense.wi.weight" in n for n in names)
    assert hf.config["feed_forward_proj"] == "gated-silu" and hf.config["tie_word_embeddings"] is False


def test_t5_rejects_settings_hf_cannot_express(tmp_path):
    from ckptfs.errors import ConfigError

    params = yaml.safe_load((FIXTURES / "t5" / "cs" / "params.yaml").read_text())
    for change, words in (({"decoder_nonlinearity": "gelu"}, "one activation"),
                          ({"position_embedding_type": "fixed"}, "position_embedding_type"),
                          ({"tgt_vocab_size": 64}, "one vocabulary"),
                          ({"mup_base_d_model": 16}, "muP")):
        doc = {"model": {**params["model"], **change}}
        path = tmp_path / "params.yaml"
        path.write_text(yaml.safe_dump(doc))
        with pytest.raises(ConfigError, match=words):
            to_hf(open_fixture("t5"), config=path)


# -- ViT / CLIP: one CS name, two HF classes ----------------------------------------------------------------


@pytest.mark.parametrize("case,family", [("vit", "vit"), ("clip_vit", "clip-vit")])
def test_vision_transformer_name_is_told_apart(case, family):
    det = detect_family(open_fixture(case))
    assert det.family == family, det.reason
    assert default_registry().for_cs_name("vision_transformer") is None  # shared: no single answer
    assert {s.family for s in default_registry().families_for_cs_name("vision_transformer")} == {"vit", "clip-vit"}


def test_sharing_a_cs_name_needs_detect_config(tmp_path):
    for d in mapping_dirs():
        for f in d.glob("*.yaml"):
            shutil.copy(f, tmp_path / f.name)
        break
    doc = yaml.safe_load((tmp_path / "vit.yaml").read_text())
    del doc["detect"]["config"]
    (tmp_path / "vit.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(MappingError, match="vision_transformer.*detect.config"):
        Registry([tmp_path])


def test_vit_labels_and_cls_layout():
    hf = to_hf(open_fixture("vit"))
    cfg = hf.config
    assert cfg["num_labels"] == 5
    assert cfg["id2label"] == {str(i): f"LABEL_{i}" for i in range(5)}
    assert cfg["label2id"] == {f"LABEL_{i}": i for i in range(5)}
    cs = model_tensors(open_fixture("vit"))
    names = dict(hf.tensors)
    pos = cs["vit_model.embedding_layer.position_embeddings.weight"].read_all()
    ours = names["vit.embeddings.position_embeddings"].read_all()
    assert ours.shape == (1,) + pos.shape
    assert np.array_equal(ours[0, 0], pos[-1]) and np.array_equal(ours[0, 1:], pos[:-1])
    assert names["vit.embeddings.cls_token"].shape == (1, 1, pos.shape[1])
    assert not any("image_size" in w for w in hf.warnings)  # read through image_size[0]: not "unused"


# -- Mllama -------------------------------------------------------------------------------------------------


def test_mllama_sub_configs_differ_from_the_converter_only_by_model_type():
    ours = to_hf(open_fixture("mllama")).config
    conv = json.loads((FIXTURES / "mllama" / "expected_hf" / "config.json").read_text())
    for section, model_type in (("text_config", "mllama_text_model"), ("vision_config", "mllama_vision_model")):
        mine = dict(ours[section])
        assert mine.pop("model_type") == model_type
        theirs = {k: v for k, v in conv[section].items() if k != "model_type"}
        assert mine == theirs, section
    assert ours["model_type"] == "mllama" and ours["architectures"] == ["MllamaForConditionalGeneration"]


def test_patch_linear_to_conv_reads_only_the_rows_of_a_box():
    h, p, c = 6, 4, 3
    w = np.random.default_rng(0).standard_normal((h, p * p * c)).astype(np.float32)
    src = RecordingTensor(w)
    conv = patch_linear_to_conv(src, [p, p], c)
    ref = w.reshape(h, p, p, c).transpose(0, 3, 1, 2)
    assert conv.shape == (h, c, p, p)
    assert np.array_equal(conv.read_all(), ref)
    src.reset()
    box = ((2, 4), (1, 3), (0, 2), (1, 4))
    assert np.array_equal(conv.read(box), ref[2:4, 1:3, 0:2, 1:4])
    assert src.boxes == [((2, 4), (0, p * p * c))]
    with pytest.raises(MappingError):
        patch_linear_to_conv(src, [p, p], c + 1)


def test_mllama_is_recognised_from_tensor_names_only():
    det = detect_family(open_fixture("mllama"))
    assert det.family == "mllama", det.reason
    assert "inferred from the CS tensor names" in det.reason
