"""Special token ids (``bos_token_id``, ``eos_token_id``, ``pad_token_id``) of one HF model folder: one value per
id, which every generated file of the folder (config.json, generation_config.json, and those of its ``bin/``) carries.

Per id, the first source that states it decides (README "Tokenizer and generation settings"):

1. the folder's own ``config.json`` laid over by ``--overlay`` (the user's model configuration), else its
   ``generation_config.json`` from the overlay (the original model's generation settings): that file is served as
   given, so it decides every id — one it does not name stays unset;
2. else, per id, the tokenizer's special tokens: ``tokenizer_config.json`` (``bos_token``… as text or as an AddedToken
   ``{"content": …}``), then ``special_tokens_map.json``, each text made an id through the folder's vocabulary:
   ``added_tokens_decoder`` of tokenizer_config.json, ``added_tokens`` and ``model.vocab`` of tokenizer.json,
   ``added_tokens.json``, ``vocab.json`` or ``vocab.txt`` (``tokenizer.model`` alone, a sentencepiece protobuf, is
   not read: such a folder normally has a tokenizer.json too),
3. else what the mapping made without them (``fallback``): the params YAML, the family's mapping, the transformers
   config class's defaults (``ckptfs.mapping.params.to_hf_config``).

An unset id is left out of the generated files.
A file above ``MAX_FILE_BYTES`` is not read for ids (it may still be served, by range): parsing reads it whole.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

from ...mapping.params.hf_defaults import TOKEN_ID_KEYS

#: overlay files whose ids (numbers) decide before the tokenizer's, in this order
NUMERIC_SOURCES = ("config.json", "generation_config.json")
#: tokenizer files whose special token texts decide next, in this order
TEXT_SOURCES = ("tokenizer_config.json", "special_tokens_map.json")
#: the largest tokenizer file read for token ids (the largest tokenizer.json on the Hub are ~35 MB; a file is read
#: whole and parsed, which takes several times its size in memory while the view is built)
MAX_FILE_BYTES = 64 << 20


@dataclass
class TokenIds:
    """The ids decided (None: unset), where each came from, and problems worth a README.txt line."""

    ids: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)  # key -> what gave it: a file and what in it, or the fallback's source
    files: dict = field(default_factory=dict)  # key -> the name of the folder's file that gave it (not for fallbacks)
    problems: list = field(default_factory=list)


def _json(read: Callable, name: str, problems: list):
    data = read(name)
    if data is None:
        return None
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        problems.append(f"{name} is not valid JSON ({e}); its token ids are not used")
        return None


def _token_text(value):
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Vocabulary:
    """Token text -> id, built on first use from the folder's tokenizer files."""

    def __init__(self, read: Callable, problems: list):
        self._read, self._problems, self._map = read, problems, None

    def _build(self) -> dict:
        out: dict = {}
        vocab_txt = self._read("vocab.txt")
        if vocab_txt is not None:
            for i, line in enumerate(vocab_txt.decode("utf-8", "replace").splitlines()):
                out.setdefault(line.rstrip("\r"), i)
        for name in ("vocab.json", "added_tokens.json"):
            doc = _json(self._read, name, self._problems)
            if isinstance(doc, dict):
                out.update({k: v for k, v in doc.items() if isinstance(v, int)})
        tok = _json(self._read, "tokenizer.json", self._problems)
        if isinstance(tok, dict):
            vocab = (tok.get("model") or {}).get("vocab")
            if isinstance(vocab, dict):
                out.update({k: v for k, v in vocab.items() if isinstance(v, int)})
            elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], the index is the id
                out.update({p[0]: i for i, p in enumerate(vocab) if isinstance(p, list) and p and isinstance(p[0], str)})
            for t in tok.get("added_tokens") or []:
                if isinstance(t, dict) and isinstance(t.get("content"), str) and isinstance(t.get("id"), int):
                    out[t["content"]] = t["id"]
        cfg = _json(self._read, "tokenizer_config.json", [])
        if isinstance(cfg, dict) and isinstance(cfg.get("added_tokens_decoder"), dict):
            for i, t in cfg["added_tokens_decoder"].items():
                text = _token_text(t)
                if text is not None and str(i).isdigit():
                    out[text] = int(i)
        return out

    def id_of(self, text: str):
        if self._map is None:
            self._map = self._build()
        return self._map.get(text)


def _is_id(value) -> bool:
    """An id as config files give it: an int, a non-empty list of ints (several EOS tokens), or null."""
    if value is None:
        return True
    if isinstance(value, list):
        return bool(value) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    return isinstance(value, int) and not isinstance(value, bool)


def token_ids(read: Callable, fallback: dict | None = None, fallback_sources: dict | None = None) -> TokenIds:
    """The special token ids of a folder (see the module docstring); ``read(name)`` gives the bytes of a file laid
    over the folder (overlay or tokenizer files) or None when there is none; ``fallback`` holds the mapping's ids
    and ``fallback_sources`` where each came from."""
    result = TokenIds()
    for name in NUMERIC_SOURCES:
        doc = _json(read, name, result.problems)
        if not isinstance(doc, dict):
            continue
        for key in TOKEN_ID_KEYS:  # a file the overlay brings is served as given: it decides every id
            value = doc.get(key)
            if not _is_id(value):
                result.problems.append(f"{name}: {key} {value!r} is not a token id; left unset")
                value = None
            result.ids[key], result.sources[key], result.files[key] = value, name, name
        return result
    vocab = Vocabulary(read, result.problems)
    for name in TEXT_SOURCES:
        doc = _json(read, name, result.problems)
        if not isinstance(doc, dict):
            continue
        for key in TOKEN_ID_KEYS:
            if key in result.ids:
                continue
            text = _token_text(doc.get(key[:-3]))  # bos_token_id -> bos_token
            if text is None:
                continue
            tid = vocab.id_of(text)
            if tid is None:
                result.problems.append(f"{name}: {key[:-3]} {text!r} is not in the tokenizer's vocabulary; "
                                       f"{key} not taken from it")
                continue
            result.ids[key], result.sources[key], result.files[key] = tid, f"{name} {key[:-3]} {text!r}", name
    for key, value in (fallback or {}).items():
        if key in TOKEN_ID_KEYS and key not in result.ids:
            result.ids[key], result.sources[key] = value, (fallback_sources or {}).get(key, "generated")
    return result
