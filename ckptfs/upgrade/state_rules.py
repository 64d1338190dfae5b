"""Release rules for checkpoint *state* (the tree written to ``cs/<stem>.mdl``), one table entry per hop.

From Model Zoo's CS→CS converters (its ``checkpoint_converters`` for each release hop) and its
``fix_checkpoint_spec.py``:

* 1.9→2.0 (and every older source, which passes through this hop):
  - tie repair (``tie_none_weights`` / ``maybe_tie_lm_head``): in ``model``, when one of
    ``lm_head.weight`` ↔ ``embedding_layer.word_embeddings.weight`` (only if the params do not set
    ``share_embedding_weights: false``), ``ln_f.{weight,bias}`` ↔ ``transformer_decoder.norm.{…}``
    is present and the other is missing or None, the other becomes the *same* leaf (a link);
  - ``lr_scheduler.last_epoch`` = ``global_step`` when they differ; a SequentialLR
    (``_schedulers`` + ``_milestones``) gives sub-scheduler ``i`` ``max(global_step − m[i−1], 0)``
    (``m[−1]`` = 0), other sub-schedulers get ``global_step``. Model Zoo assigns 1-tuples here by
    mistake (and on its input dict); we write the integers it means.
* 2.0→2.1: the embedding refactor renames of model keys (first matching rule wins; an optional
  ``model.`` prefix is kept): ``…embedding_layer.position_embeddings.weight`` →
  ``….embed.weight``, a fixed ``…embedding_layer.position_embeddings`` buffer → ``….fpe`` (likewise
  ``encoder_embeddings``/``decoder_embeddings`` of T5), ``relative_pe_helper.{relative_attention_bias.*,slopes}``
  → ``embedding_layer.position_embed_helper.…``, T5 ``relative_position_{encoder,decoder}.relative_attention_bias.*``
  → ``{encoder,decoder}_embeddings.position_embed_helper.relative_attention_bias.*``.
* every hop (``post_checkpoint_convert``): sparsity state moves out of ``optimizer.sparsity``
  (masks to ``model[<name>_mask]``, a top-level ``sparsity`` with ``step`` and per-parameter ``index``).

Optimizer state is keyed by parameter index and is never renamed (as in Model Zoo).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from ..catalog.model import Container, ValueLeaf
from . import state_tree as T


@dataclass(frozen=True)
class KeyRename:
    """Rename a model key that fully matches ``pattern`` to ``pattern.sub(replacement)``."""

    pattern: str
    replacement: str

    def apply(self, key: str) -> str | None:
        m = re.fullmatch(self.pattern, key)
        return m.expand(self.replacement) if m else None


@dataclass
class StateEdit:
    """What a state rule works on: the (copied) root, the params dict, and notes to report."""

    root: object
    params: dict | None
    notes: list = field(default_factory=list)


_P = r"(?P<p>(?:model\.)?)"
EMBEDDING_REFACTOR_2_1 = (
    KeyRename(_P + r"(?P<m>(?:bert_encoder\.|bert\.)?embedding_layer|encoder_embeddings|decoder_embeddings)"
              r"\.position_embeddings\.weight", r"\g<p>\g<m>.position_embeddings.embed.weight"),
    KeyRename(_P + r"(?P<m>(?:bert_encoder\.|bert\.)?embedding_layer|encoder_embeddings|decoder_embeddings)"
              r"\.position_embeddings", r"\g<p>\g<m>.position_embeddings.fpe"),
    KeyRename(_P + r"relative_pe_helper\.relative_attention_bias\.(?P<s>weight|bias)",
              r"\g<p>embedding_layer.position_embed_helper.relative_attention_bias.\g<s>"),
    KeyRename(_P + r"relative_pe_helper\.slopes", r"\g<p>embedding_layer.position_embed_helper.slopes"),
    KeyRename(_P + r"relative_position_(?P<w>encoder|decoder)\.relative_attention_bias\.(?P<s>weight|bias)",
              r"\g<p>\g<w>_embeddings.position_embed_helper.relative_attention_bias.\g<s>"),
)

#: (a, b, needs share_embedding_weights) alias pairs repaired for pre-2.0 sources
TIE_PAIRS = (
    ("lm_head.weight", "embedding_layer.word_embeddings.weight", True),
    ("embedding_layer.word_embeddings.weight", "lm_head.weight", True),
    ("transformer_decoder.norm.weight", "ln_f.weight", False),
    ("transformer_decoder.norm.bias", "ln_f.bias", False),
    ("ln_f.weight", "transformer_decoder.norm.weight", False),
    ("ln_f.bias", "transformer_decoder.norm.bias", False),
)


def rename_model_keys(edit: StateEdit, rules) -> None:
    model = T.get(edit.root, "model")
    if not T.is_dict(model):
        return
    for i, key in enumerate(list(model.keys)):
        if not isinstance(key, str):
            continue
        for rule in rules:
            new = rule.apply(key)
            if new is not None:
                if new != key:
                    if new in model.keys:
                        edit.notes.append(f"model.{key}: not renamed to {new}, which already exists")
                    else:
                        model.keys[i] = new
                        edit.notes.append(f"renamed model.{key} -> model.{new}")
                break


def _model_params(params) -> dict:
    if not isinstance(params, dict):
        return {}
    tr = params.get("trainer")
    if isinstance(tr, dict):
        m = (tr.get("init") or {}).get("model")
        return m if isinstance(m, dict) else {}
    m = params.get("model")
    return m if isinstance(m, dict) else {}


def tie_repair(edit: StateEdit) -> None:
    """Model Zoo ``tie_none_weights`` over TIE_PAIRS, for keys with or without the ``model.`` prefix."""
    model = T.get(edit.root, "model")
    if not T.is_dict(model):
        return
    share = _model_params(edit.params).get("share_embedding_weights", True) is not False
    for key in list(model.keys):
        if not isinstance(key, str):
            continue
        for a, b, needs_share in TIE_PAIRS:
            prefix = key[:-len(a)] if key.endswith(a) else None
            if prefix not in ("", "model."):
                continue
            if needs_share and not share:
                break
            partner = prefix + b
            mine = T.get(model, key)
            other = T.get(model, partner)
            if mine is not None and not T.is_none_leaf(mine) and (other is None or T.is_none_leaf(other)):
                T.put(model, partner, mine, after=key)
                edit.notes.append(f"tied model.{partner} to model.{key} (was {'None' if other is not None else 'missing'})")
            elif T.is_none_leaf(mine) and other is not None and not T.is_none_leaf(other):
                T.put(model, key, other)
                edit.notes.append(f"tied model.{key} to model.{partner} (was None)")
            break


def lr_scheduler_last_epoch(edit: StateEdit) -> None:
    root = edit.root
    sched, gs_leaf = T.get(root, "lr_scheduler"), T.get(root, "global_step")
    if not T.is_dict(sched) or gs_leaf is None:
        return
    gs = T.scalar_of(gs_leaf)
    last = T.get(sched, "last_epoch")
    if gs is None or last is None or T.scalar_of(last) is None:
        return
    gs = int(gs)
    if int(T.scalar_of(last)) == gs:
        return
    T.put(sched, "last_epoch", T.same_kind_scalar(last, gs, "lr_scheduler.last_epoch"))
    edit.notes.append(f"lr_scheduler.last_epoch set to global_step {gs} (pre-2.0 checkpoint)")
    subs = T.get(sched, "_schedulers")
    if not T.is_seq(subs):
        return
    ms_node = T.get(sched, "_milestones")
    milestones = None
    if T.is_seq(ms_node):
        milestones = [T.scalar_of(c) for c in ms_node.children]
        if any(m is None for m in milestones):
            milestones = None
    starts = [0] + [int(m) for m in milestones] if milestones is not None else None
    for i, sub in enumerate(subs.children):
        old = T.get(sub, "last_epoch")
        if old is None:
            continue
        value = max(gs - starts[i], 0) if starts is not None and i < len(starts) else gs
        T.put(sub, "last_epoch", T.same_kind_scalar(old, value, f"lr_scheduler._schedulers.{i}.last_epoch"))
        edit.notes.append(f"lr_scheduler._schedulers.{i}.last_epoch set to {value}")


def move_sparsity_state(edit: StateEdit) -> None:
    root = edit.root
    model, opt = T.get(root, "model"), T.get(root, "optimizer")
    sp = T.get(opt, "sparsity")
    if not (T.is_dict(model) and T.is_dict(sp) and T.has(sp, "state")):
        return
    state = T.get(sp, "state")
    if T.is_dict(state):
        for name, st in zip(list(state.keys), list(state.children)):
            mask = T.get(st, "mask")
            if mask is not None and name in model.keys:
                T.put(model, f"{name}_mask", mask)
                edit.notes.append(f"moved optimizer.sparsity.state.{name}.mask -> model.{name}_mask")
    T.pop(opt, "sparsity")
    new = Container("dict", [], [])
    if T.has(sp, "step"):
        T.put(new, "step", T.get(sp, "step"))
    schedule = Container("dict", [], [])
    groups = T.get(sp, "param_groups")
    for group in (groups.children if T.is_seq(groups) else []):
        gsp, names = T.get(group, "sparsity"), T.get(group, "param_names")
        if T.is_dict(gsp) and T.has(gsp, "step") and T.is_seq(names):
            for n in names.children:
                if isinstance(n, ValueLeaf) and isinstance(n.value, str):
                    T.put(schedule, n.value, Container("dict", ["index"], [T.get(gsp, "step")]))
    if schedule.keys:
        T.put(new, "sparsity", schedule)
    T.put(root, "sparsity", new)
    edit.notes.append("moved optimizer.sparsity to top-level sparsity (masks into model)")


@dataclass(frozen=True)
class StateHop:
    src: str
    dst: str
    renames: tuple = ()
    fixes: tuple = ()  # functions StateEdit -> None, after the renames


STATE_HOPS = {
    ("1.9", "2.0"): StateHop("1.9", "2.0", fixes=(tie_repair, lr_scheduler_last_epoch)),
    ("2.0", "2.1"): StateHop("2.0", "2.1", renames=EMBEDDING_REFACTOR_2_1),
}

#: rules run once after the hops whenever at least one hop was applied
EVERY_UPGRADE: tuple[Callable, ...] = (move_sparsity_state,)


def upgrade_state(edit: StateEdit, hop_list) -> None:
    """Apply the rules of each ``(src, dst)`` hop in order, then EVERY_UPGRADE."""
    for hop in hop_list:
        rules = STATE_HOPS.get(tuple(hop))
        if rules is None:
            continue
        if rules.renames:
            rename_model_keys(edit, rules.renames)
        for fix in rules.fixes:
            fix(edit)
    if hop_list:
        for fix in EVERY_UPGRADE:
            fix(edit)
