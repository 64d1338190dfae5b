"""MPT's config.json as a mount serves it keeps what ``save_pretrained`` of the original writes: MosaicML's settings
that transformers' ``MptConfig`` keeps from the file (``verbose``) or writes as its own (``init_device``,
``embedding_fraction``, ``learned_pos_emb``, ``logit_scale``, ``use_cache``, ``attn_config.model_type``), which the
converter leaves out."""
from __future__ import annotations

import json

import pytest
from transformers import MptConfig

from helpers import FIXTURES
from helpers.fuse import mounted

pytestmark = pytest.mark.needs_fuse  # both tests read the config.json a real mount serves

CASE = FIXTURES / "mpt"
#: keys the fixture's original config.json differs by, and why
#: - layer_norm_epsilon: the fixture's user workaround removed it from the original (MANIFEST hf_config_edit);
#:   ckptfs writes the CS value, MptConfig's default (1e-05)
#: - tie_word_embeddings, torch_dtype: written by ckptfs for every family (tied embeddings; older transformers)
SERVED_ONLY = {"layer_norm_epsilon", "tie_word_embeddings", "torch_dtype"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with mounted(CASE / "cs" / "checkpoint.mdl", "--views", "hf") as mnt:
        raw = (mnt / "config.json").read_bytes()
    folder = tmp_path_factory.mktemp("served")
    (folder / "config.json").write_bytes(raw)
    return folder


def test_served_config_keeps_every_key_of_the_original(served):
    original = json.loads((CASE / "hf" / "config.json").read_text())
    ours = json.loads((served / "config.json").read_text())
    for key, value in original.items():
        if key == "transformers_version":
            continue
        assert key in ours, f"config.json lacks the original's {key!r}"
        assert ours[key] == value, f"{key}: served {ours[key]!r}, original {value!r}"
    assert ours["verbose"] == 0 and ours["attn_config"]["model_type"] == ""
    assert set(ours) - set(original) <= SERVED_ONLY


def test_save_pretrained_writes_what_the_originals_writes(served, tmp_path):
    """A config reloaded from the mount saves as the original's does (``verbose`` included)."""
    out = {}
    for name, src in (("ours", served), ("original", CASE / "hf")):
        MptConfig.from_pretrained(src).save_pretrained(tmp_path / name)
        out[name] = json.loads((tmp_path / name / "config.json").read_text())
        out[name].pop("_name_or_path", None)
    assert "verbose" in out["original"]
    assert out["ours"] == out["original"]
