"""ckptfs.upgrade: release hops and the checkpoint-state rules (renames, tie repair, last_epoch, sparsity)."""
from __future__ import annotations

import numpy as np
import pytest

from ckptfs.dtypes import INT64
from ckptfs.catalog.model import Checkpoint, Container, TensorLeaf, ValueLeaf
from ckptfs.tensor.base import ArrayTensor
from ckptfs.upgrade import hops, upgrade_checkpoint
from ckptfs.upgrade import state_tree as T
from ckptfs.upgrade.state_rules import EMBEDDING_REFACTOR_2_1, StateEdit, upgrade_state


def tleaf(key, *shape, value=1.0):
    return TensorLeaf(key, ArrayTensor(np.full(shape or (2,), value, np.float32)))


def d(**kv):
    return Container("dict", list(kv), list(kv.values()))


def ckpt(root, release, tmp_path):
    return Checkpoint(tmp_path / "ckpt.mdl", 0.4, release, True, root, {})


@pytest.mark.parametrize("src,first,n", [("2.10.0", None, 0), ("2.9", ("2.9", "2.10"), 1), ("2.0", ("2.0", "2.1"), 10),
                                         ("1.7", ("1.7", "1.8"), 13), ("1.5", ("1.7", "1.8"), 13), ("3.1", None, 0),
                                         (None, None, 0), ("cs-2.3", ("2.3", "2.4"), 7)])
def test_hops(src, first, n):
    h = hops(src)
    assert len(h) == n
    if n:
        assert h[0] == first and h[-1] == ("2.9", "2.10")
        assert all(a[1] == b[0] for a, b in zip(h, h[1:]))


@pytest.mark.parametrize("key,new", [
    ("embedding_layer.position_embeddings.weight", "embedding_layer.position_embeddings.embed.weight"),
    ("model.embedding_layer.position_embeddings.weight", "model.embedding_layer.position_embeddings.embed.weight"),
    ("embedding_layer.position_embeddings", "embedding_layer.position_embeddings.fpe"),
    ("bert_encoder.embedding_layer.position_embeddings.weight",
     "bert_encoder.embedding_layer.position_embeddings.embed.weight"),
    ("encoder_embeddings.position_embeddings", "encoder_embeddings.position_embeddings.fpe"),
    ("relative_pe_helper.slopes", "embedding_layer.position_embed_helper.slopes"),
    ("relative_pe_helper.relative_attention_bias.weight",
     "embedding_layer.position_embed_helper.relative_attention_bias.weight"),
    ("relative_position_decoder.relative_attention_bias.weight",
     "decoder_embeddings.position_embed_helper.relative_attention_bias.weight"),
    ("embedding_layer.position_embeddings.embed.weight", None),
    ("transformer_decoder.layers.0.norm1.weight", None),
])
def test_embedding_refactor_rules(key, new):
    got = next((r.apply(key) for r in EMBEDDING_REFACTOR_2_1 if r.apply(key) is not None), None)
    assert got == new


def test_2_0_source_renames_model_keys_only(tmp_path):
    pe, fixed, wte = tleaf("a"), tleaf("b"), tleaf("c")
    root = d(model=Container("OrderedDict", ["embedding_layer.word_embeddings.weight",
                                             "embedding_layer.position_embeddings.weight",
                                             "embedding_layer.position_embeddings"], [wte, pe, fixed]),
             optimizer=d(state=Container("dict", [0, 1], [d(exp_avg=tleaf("x")), d(exp_avg=tleaf("y"))])),
             global_step=ValueLeaf("global_step", 5))
    c = ckpt(root, "2.0", tmp_path)
    up = upgrade_checkpoint(c)
    model = T.get(up.root, "model")
    assert model.keys == ["embedding_layer.word_embeddings.weight", "embedding_layer.position_embeddings.embed.weight",
                          "embedding_layer.position_embeddings.fpe"]
    assert model.children == [wte, pe, fixed]  # same leaves, new names
    assert T.get(up.root, "optimizer").children[0].keys == [0, 1]  # optimizer state is never renamed
    # the source checkpoint is untouched
    assert c.root.children[0].keys[1] == "embedding_layer.position_embeddings.weight"
    meta = T.to_python(T.get(up.root, "__metadata__"))
    assert meta == [{"version": "2.10.0", "model_name": "", "params": {}}]


def test_pre_2_0_tie_repair_links_missing_and_none(tmp_path):
    wte, norm_w = tleaf("wte"), tleaf("norm")
    model = Container("dict", ["embedding_layer.word_embeddings.weight", "lm_head.weight",
                               "transformer_decoder.norm.weight", "ln_f.bias", "transformer_decoder.norm.bias"],
                      [wte, ValueLeaf("lm", None), norm_w, tleaf("lnb"), ValueLeaf("nb", None)])
    up = upgrade_checkpoint(ckpt(d(model=model), "1.9", tmp_path))
    m = T.get(up.root, "model")
    assert T.get(m, "lm_head.weight") is wte
    assert T.get(m, "ln_f.weight") is norm_w  # was missing: added right after its partner
    assert m.keys.index("ln_f.weight") == m.keys.index("transformer_decoder.norm.weight") + 1
    assert T.get(m, "transformer_decoder.norm.bias") is T.get(m, "ln_f.bias")
    assert any("tied model.lm_head.weight" in n for n in up.notes)


def test_tie_repair_respects_share_embedding_weights(tmp_path):
    wte = tleaf("wte")
    root = d(model=Container("dict", ["embedding_layer.word_embeddings.weight", "lm_head.weight"],
                             [wte, ValueLeaf("lm", None)]))
    c = ckpt(root, "1.9", tmp_path)
    (tmp_path / "params.yaml").write_text("model:\n  share_embedding_weights: false\n")
    up = upgrade_checkpoint(c)
    assert T.is_none_leaf(T.get(T.get(up.root, "model"), "lm_head.weight"))


def test_no_tie_repair_or_renames_for_current_release(tmp_path):
    wte = tleaf("wte")
    root = d(model=Container("dict", ["embedding_layer.word_embeddings.weight",
                                      "embedding_layer.position_embeddings.weight"], [wte, tleaf("p")]))
    up = upgrade_checkpoint(ckpt(root, "2.10.0", tmp_path))
    assert T.get(up.root, "model").keys == root.children[0].keys and not T.has(up.root, "__metadata__")
    assert up.hops == []


def test_last_epoch_fix_sequential_lr(tmp_path):
    gs = ValueLeaf("global_step", 250)
    sched = d(last_epoch=ValueLeaf("le", 3), _milestones=Container("list", None, [ValueLeaf("m", 100)]),
              _schedulers=Container("list", None, [d(last_epoch=ValueLeaf("a", 3)), d(last_epoch=ValueLeaf("b", 0))]))
    up = upgrade_checkpoint(ckpt(d(lr_scheduler=sched, global_step=gs), "1.9", tmp_path))
    s = T.get(up.root, "lr_scheduler")
    assert T.scalar_of(T.get(s, "last_epoch")) == 250
    subs = T.get(s, "_schedulers").children
    assert [T.scalar_of(T.get(x, "last_epoch")) for x in subs] == [250, 150]
    assert T.scalar_of(T.get(sched, "last_epoch")) == 3  # source untouched


def test_last_epoch_keeps_tensor_form_and_skips_2_0_sources(tmp_path):
    gs = TensorLeaf("global_step", ArrayTensor(np.array(7, np.int64)))
    le = TensorLeaf("le", ArrayTensor(np.array(2, np.int64)))
    up = upgrade_checkpoint(ckpt(d(lr_scheduler=d(last_epoch=le), global_step=gs), "1.8", tmp_path))
    new = T.get(T.get(up.root, "lr_scheduler"), "last_epoch")
    assert isinstance(new, TensorLeaf) and new.tensor.dtype == INT64 and new.tensor.shape == ()
    assert int(new.tensor.read_all()) == 7
    up = upgrade_checkpoint(ckpt(d(lr_scheduler=d(last_epoch=le), global_step=gs), "2.0", tmp_path))
    assert T.get(T.get(up.root, "lr_scheduler"), "last_epoch") is le


def test_sparsity_state_moves_to_model(tmp_path):
    mask = tleaf("mask")
    step = ValueLeaf("step", 9)
    sp = d(state=d(**{"fc.weight": d(mask=mask)}), step=ValueLeaf("s", 4),
           param_groups=Container("list", None, [d(param_names=Container("list", None, [ValueLeaf("n", "fc.weight")]),
                                                   sparsity=d(step=step))]))
    root = d(model=d(**{"fc.weight": tleaf("w")}), optimizer=d(state=d(), sparsity=sp))
    up = upgrade_checkpoint(ckpt(root, "2.1", tmp_path))
    assert T.get(T.get(up.root, "model"), "fc.weight_mask") is mask
    assert not T.has(T.get(up.root, "optimizer"), "sparsity")
    new = T.to_python(T.get(up.root, "sparsity"))
    assert new == {"step": 4, "sparsity": {"fc.weight": {"index": 9}}}


def test_upgrade_state_is_table_driven():
    edit = StateEdit(d(model=d(**{"relative_pe_helper.slopes": tleaf("s")})), None)
    upgrade_state(edit, [("2.1", "2.2")])
    assert T.get(edit.root, "model").keys == ["relative_pe_helper.slopes"]
    upgrade_state(edit, [("2.0", "2.1")])
    assert T.get(edit.root, "model").keys == ["embedding_layer.position_embed_helper.slopes"]
