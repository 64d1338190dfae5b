"""Whether an HF ``config.json`` can be believed about the weights beside it (HF -> CS).

The params a mounted HF model serves come from its config.json, and Model Zoo builds the model from the params:
a config that says ``num_hidden_layers: 1e9`` beside two layers of weights, ``hidden_size: -32`` or ``"32"``
would make a ``params.yaml`` no run can use. Two rules, each giving one line that names the key:

* types (``structural_problem``): every structural size of the config (``STRUCTURAL_KEYS``, at the top level and
  in nested sections such as ``text_config``) that is set is an integer from 1 to ``MAX_STRUCTURAL`` (not a float,
  a string or a boolean);
* agreement (``agreement_problem``, over the planned CS params and tensors, whose names Model Zoo fixes for every
  family): each ``*num_hidden_layers`` is the depth of some layer stack of the weights (``…layers.<n>.``), each
  ``hidden_size`` the width of some word embedding (when the model has one), and each ``num_experts`` a dimension
  of some expert tensor (a model whose params have experts must have expert weights).
"""
from __future__ import annotations

import re

#: HF config keys that are sizes or counts of the model's structure
STRUCTURAL_KEYS = frozenset({
    "num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers", "hidden_size", "n_embd",
    "d_model", "intermediate_size", "d_ff", "num_attention_heads", "n_head", "num_heads", "num_key_value_heads",
    "head_dim", "d_kv", "vocab_size", "max_position_embeddings", "n_positions", "num_local_experts", "num_experts",
    "num_experts_per_tok",
})
#: the largest structural size taken (int32: larger than any real model's vocabulary or context)
MAX_STRUCTURAL = (1 << 31) - 1

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _sections(config: dict, prefix: str = ""):
    yield prefix, config
    for key, value in config.items():
        if isinstance(value, dict) and not prefix:  # one level: text_config, vision_config…
            yield from _sections(value, f"{key}.")


def structural_problem(config: dict) -> str | None:
    """The first structural size of ``config`` that is not an integer in [1, MAX_STRUCTURAL], as one line."""
    for prefix, section in _sections(config):
        for key in STRUCTURAL_KEYS & set(section):
            value = section[key]
            if value is None:
                continue  # left to the HF class's default
            if isinstance(value, bool) or not isinstance(value, int):
                return f"config.json {prefix}{key}={value!r} is a {type(value).__name__}, not an integer"
            if not 1 <= value <= MAX_STRUCTURAL:
                return f"config.json {prefix}{key}={value} is not a size from 1 to {MAX_STRUCTURAL}"
    return None


def _params_items(params: dict, path: str = ""):
    for key, value in params.items():
        if isinstance(value, dict):
            yield from _params_items(value, f"{path}{key}.")
        else:
            yield f"{path}{key}", str(key), value


def _scoped(tensors: list, path: str) -> list:
    """The tensors of the params section holding ``path`` (``text_model.hidden_size``: the keys under
    ``text_model.``), when the CS keys use the section's name; else all of them."""
    section = path.rpartition(".")[0]
    if section:
        under = [(k, t) for k, t in tensors if k.startswith(section + ".")]
        if under:
            return under
    return tensors


def agreement_problem(params: dict, tensors: list) -> str | None:
    """The first setting of the params ``model:`` section (``params``) the planned CS tensors (``[(key,
    tensor)]``) contradict, as one line naming it; None when they agree. A setting of a nested section
    (``text_model.hidden_size``) is compared with the tensors under that section's name when there are any."""
    for path, key, value in _params_items(params):
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if key.endswith("num_hidden_layers"):
            why = _layers_problem(path, value, _scoped(tensors, path))
        elif key == "hidden_size":
            why = _width_problem(path, value, _scoped(tensors, path))
        elif key == "num_experts" and value > 1:
            why = _experts_problem(path, value, _scoped(tensors, path))
        else:
            why = None
        if why is not None:
            return why + ": the config is not the weights' own"
    return None


def _layers_problem(path: str, value: int, tensors: list) -> str | None:
    stacks: dict = {}
    for key, _ in tensors:
        m = _LAYER.search(key)
        if m is not None:
            prefix = key[:m.start()]
            stacks[prefix] = max(stacks.get(prefix, 0), int(m.group(1)) + 1)
    if not stacks or value in stacks.values():
        return None
    held = ", ".join(f"{n} under {p or '(root)'}" for p, n in sorted(stacks.items()))
    return f"config.json gives {value} layers (params model.{path}), but the weights hold {held}"


def _width_problem(path: str, value: int, tensors: list) -> str | None:
    widths = {t.shape[1] for key, t in tensors if key.endswith("word_embeddings.weight") and len(t.shape) == 2}
    if not widths or value in widths:
        return None
    return (f"config.json gives hidden size {value} (params model.{path}), but the word embeddings are "
            f"{', '.join(map(str, sorted(widths)))} wide")


def _experts_problem(path: str, value: int, tensors: list) -> str | None:
    dims = [set(t.shape) for key, t in tensors if "expert" in key]
    if not dims:
        return f"config.json gives {value} experts (params model.{path}), but the weights hold no expert tensors"
    if not any(value in d for d in dims):
        return f"config.json gives {value} experts (params model.{path}), but no expert tensor holds {value}"
    return None
