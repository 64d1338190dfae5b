"""The special token ids transformers' config classes give when a config.json names none.

``generate()`` stops at ``eos_token_id`` and pads with ``pad_token_id``; a config.json without them makes the
converted model generate differently from the original (which carried its class defaults). The table holds, per
HF ``model_type`` a mapping writes, the ids that ``transformers.CONFIG_MAPPING[model_type]()`` sets (transformers
5.23; ``tests/views/test_token_ids.py`` checks it against the installed transformers). A ``model_type`` whose class sets
none, or that is not part of transformers (remote code), has no entry: nothing is filled in for it.

It is a table, not an import of transformers, so that the generated files do not depend on whether (or which)
transformers is installed where ckptfs runs.
"""
from __future__ import annotations

import re

TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")

CLASS_TOKEN_IDS: dict = {
    "bert": {"pad_token_id": 0},
    "bloom": {"bos_token_id": 1, "eos_token_id": 2},
    "codegen": {"bos_token_id": 50256, "eos_token_id": 50256},
    "dpr": {"pad_token_id": 0},
    "esm": {"eos_token_id": 2},
    "falcon": {"bos_token_id": 11, "eos_token_id": 11},
    "gemma2": {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0},
    "gpt2": {"bos_token_id": 50256, "eos_token_id": 50256},
    "gpt_bigcode": {"bos_token_id": 50256, "eos_token_id": 50256},
    "gpt_neox": {"bos_token_id": 0, "eos_token_id": 2},
    "gptj": {"bos_token_id": 50256, "eos_token_id": 50256},
    "llama": {"bos_token_id": 1, "eos_token_id": 2},
    "mistral": {"bos_token_id": 1, "eos_token_id": 2},
    "mixtral": {"bos_token_id": 1, "eos_token_id": 2},
    "roberta": {"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1},
    "t5": {"eos_token_id": 1, "pad_token_id": 0},
}

#: model types of the mappings whose transformers config class sets no token id (listed so the test can tell
#: "checked, none" from "forgotten")
NO_CLASS_TOKEN_IDS = ("clip_vision_model", "llava", "mllama", "mpt", "vit")


def class_token_ids(model_type: str | None) -> dict:
    """{token id key: id} the transformers config class of ``model_type`` defaults to ({} when none or unknown)."""
    return dict(CLASS_TOKEN_IDS.get(model_type or "", {}))


#: HF class names of models with a language-model head that ``generate()`` drives (transformers'
#: ``can_generate()``: ``*ForCausalLM``, ``*LMHeadModel``, ``*ForConditionalGeneration``, and the remote-code
#: ``*LMHeadCustomModel``); encoders, classifiers and headless base models do not generate
_GENERATING = re.compile(r"(ForCausalLM|LMHeadModel|LMHeadCustomModel|ForConditionalGeneration)$")


def generates(hf_class: str | None) -> bool:
    """Whether ``hf_class`` is a model ``generate()`` runs on (so save_pretrained writes generation_config.json)."""
    return bool(hf_class and _GENERATING.search(hf_class))
