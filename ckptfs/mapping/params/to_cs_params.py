"""HF ``config.json`` -> the params ``model:`` section the Model Zoo converter writes for it (HF -> CS).

A family's ``config.cs`` gives each params key as an expression over the HF config (``vocab_size``,
``get('tie_word_embeddings', True)``, ``lookup('hidden_act', {'silu': 'swiglu'})``); ``omit`` leaves a key out.
Names resolve to the model's vars, ``model_name`` (the converter name chosen) and ``headless``, then to HF config
keys (``rope_scaling.factor`` reads into a dict). A key the expression needs but config.json lacks is a
ConfigError naming it, as is a value the CS model cannot take (``lookup``, ``error``).

What the section cannot express is found by converting it back (``config.convert_config``) and comparing with the
HF config key by key: ``cs_differences`` gives one line per HF setting that does not come back, with the reason
the family's ``config.hf_notes`` gives (an empty reason: nothing is lost, the key is no model setting or other
params carry it; never reported).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import ConfigError, MappingError
from .to_hf_config import ConfigScope, default_id2label, default_label2id, translate
from ..lang.expr import BASE_FUNCTIONS, OMIT, ExprError, MissingName, evaluate
from ..lang.spec import FamilySpec, ModelVariant

#: HF config keys that describe the file or the runtime, not the model: never reported as lost
HF_BOOKKEEPING = frozenset({
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "_name_or_path", "use_cache",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "_attn_implementation_autoset",
    "auto_map", "_commit_hash", "chunk_size_feed_forward", "pruned_heads", "tie_encoder_decoder",
    "is_decoder", "add_cross_attention", "problem_type", "finetuning_task", "tokenizer_class", "prefix",
    "task_specific_params", "id2label", "label2id", "bos_token_id", "eos_token_id", "pad_token_id",
    "sep_token_id", "decoder_start_token_id", "gradient_checkpointing", "output_router_logits",
})


@dataclass
class CSSection:
    """One params section converted from an HF config, and which HF keys it read."""

    section: dict
    used: set = field(default_factory=set)  # HF config paths read (tuples)


def hf_functions(hf: ConfigScope, where: str, path) -> dict:
    """Functions ``config.cs`` expressions may call, besides the basic ones."""

    def lookup(key: str, mapping: dict):
        return translate(hf.get(key) if hf.has(key) else None, mapping, key, "Cerebras", path, where)

    def pick(value, mapping: dict, what: str = "value"):
        return translate(value, mapping, what, "Cerebras", path, where)

    def fail(message: str):
        raise ConfigError(path, f"{message} [{where}]")

    def without(mapping: dict, keys) -> dict:
        return {k: v for k, v in mapping.items() if k not in keys}

    return {**BASE_FUNCTIONS, "lookup": lookup, "pick": pick, "error": fail, "has": hf.has, "get": hf.get,
            "without": without, "default_id2label": default_id2label, "default_label2id": default_label2id}


def set_path(section: dict, path: tuple, value) -> None:
    """``section[path[0]][path[1]]… = value``, making dicts (lists for integer parts) on the way."""
    node = section
    for part, nxt in zip(path, path[1:]):
        if isinstance(node, list):
            while len(node) <= part:
                node.append(None)
            if node[part] is None:
                node[part] = [] if isinstance(nxt, int) else {}
            node = node[part]
        else:
            node = node.setdefault(part, [] if isinstance(nxt, int) else {})
    if isinstance(node, list):
        while len(node) <= path[-1]:
            node.append(None)
        node[path[-1]] = value
    else:
        node[path[-1]] = value


def dotted_path(key: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in key.split("."))


def hf_to_section(spec: FamilySpec, variant: ModelVariant, hf_config: dict, *, model_name: str,
                  config_path: Path | None = None, problems: list | None = None) -> CSSection:
    """The params section ``spec.config.cs`` makes of ``hf_config``; the first obstacle raises ConfigError unless
    ``problems`` collects them (one message each)."""
    if not spec.config.cs:
        raise MappingError(spec.path, f"{spec.family}: no config.cs entries: the Hugging Face -> Cerebras direction "
                                      f"is not written for {variant.name}")
    hf = ConfigScope(copy.deepcopy(hf_config))
    scope = hf.child({"headless": variant.headless, "model_name": model_name, **variant.vars})
    funcs = hf_functions(hf, spec.path.name, config_path)
    section: dict = {}
    entries = [(f"cs_derive.{k}", k, t) for k, t in spec.config.cs_derive.items()]
    entries += [(f"cs.{k}", k, t) for k, t in spec.config.cs.items()]
    for part, key, text in entries:
        where = f"{spec.path.name}: config.{part}"
        try:
            value = evaluate(text, scope, funcs)
        except MissingName as e:
            error = ConfigError(config_path, f"config.json lacks {e.name}, needed for params model.{key} [{where}]")
        except ConfigError as e:
            error = e
        except ExprError as e:
            raise MappingError(spec.path, f"config.{part}: {e}") from None
        except (TypeError, ValueError, ZeroDivisionError, OverflowError) as e:
            error = ConfigError(config_path, f"cannot compute params model.{key}: {e} [{where}]")
        else:
            if part.startswith("cs_derive."):
                scope.values[key] = value
            elif value is not OMIT:
                set_path(section, dotted_path(key), value)
            continue
        if problems is None:
            raise error
        if error.problem not in problems:
            problems.append(error.problem)
    return CSSection(section, set(hf.used))


def cs_differences(hf_config: dict, back: dict, used: set, notes: dict, hf_class: str, prefix: str = "") -> list:
    """One line per setting of ``hf_config`` that the params do not carry: ``back`` is the HF config the params
    convert back to; a key read by the conversion whose value does not come back, or a key nothing read, is lost
    (``HF_BOOKKEEPING`` keys aside; a nested section is compared key by key)."""
    read = {p[0] for p in used if p}
    out = []
    for key, value in hf_config.items():
        name = prefix + str(key)
        if key in HF_BOOKKEEPING or str(key).startswith("_") or value is None:
            continue  # bookkeeping, or a setting left to its default
        if key in back and back[key] == value:
            continue
        note = notes.get(name)
        if note == "":
            continue  # declared carried or no model setting (hf_notes: key: "")
        if key in read and key not in back:
            continue  # read into the params; the CS -> HF config leaves it to the HF default
        if key in read and isinstance(value, dict) and isinstance(back[key], dict):
            inner = {p[1:] for p in used if len(p) > 1 and p[0] == key} or {(k,) for k in value}
            out += cs_differences(value, back[key], inner, notes, hf_class, name + ".")
        elif key in read:
            why = f" ({note})" if note else ""
            out.append(f"config.json {name}={value!r} comes back as {back[key]!r} from the Cerebras params{why}")
        elif note:
            out.append(f"config.json {name}={value!r} is not in the Cerebras params: {note}")
        else:
            out.append(f"config.json {name}={value!r} has no counterpart in the Cerebras params of {hf_class}; "
                       f"not converted")
    return out
