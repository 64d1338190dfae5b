"""CS params ``model:`` section -> HF ``config.json`` (and ``generation_config.json`` where derivable).

Driven by a family's ``config:`` spec: framework defaults fill absent CS keys, ``derive`` computes named
values (also used by the tensor rules, e.g. ``num_kv_heads``), ``guards`` reject (or warn about) CS
settings the HF class cannot express, and ``hf`` gives every HF key as an expression. Every CS key that
no rule read is reported once as a warning: nothing is dropped silently.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ...errors import ConfigError, MappingError
from ..lang.expr import BASE_FUNCTIONS, OMIT, ExprError, MissingName, Scope, evaluate
from .hf_defaults import TOKEN_ID_KEYS
from ..lang.spec import FamilySpec, Guard, ModelVariant


class ConfigScope(Scope):
    """Names backed by the CS model dict; every key path read is recorded in ``used``."""

    def __init__(self, cs: dict, defaulted=()):
        super().__init__({})
        self.cs = cs
        self.used: set = set()
        self.defaulted = set(defaulted)  # keys filled from framework defaults (never reported as unused)

    def lookup(self, name):
        return self.path_lookup((name,))

    def path_lookup(self, path):
        value = self.cs
        for i, part in enumerate(path):
            if isinstance(value, (list, tuple)) and isinstance(part, int) and -len(value) <= part < len(value):
                self.used.add(tuple(path[:i]))  # an item of a list setting (image_size[0]): the list is read
                value = value[part]
                continue
            if not isinstance(value, Mapping) or part not in value:
                raise MissingName(".".join(map(str, path[:i + 1])))
            value = value[part]
        self.used.add(tuple(path))
        return value

    def has(self, dotted: str) -> bool:
        try:
            return self.path_lookup(tuple(dotted.split("."))) is not None
        except MissingName:
            return False

    def get(self, dotted: str, default=None):
        try:
            value = self.path_lookup(tuple(dotted.split(".")))
        except MissingName:
            return default
        return default if value is None else value

    def unused(self) -> list:
        """(dotted key, value) of every CS leaf setting no rule read."""
        out = []

        def walk(prefix, value):
            if prefix and any(prefix[:n] in self.used for n in range(1, len(prefix) + 1)):
                return
            if isinstance(value, Mapping) and value:
                for k, v in value.items():
                    walk(prefix + (k,), v)
            elif prefix and prefix[0] not in self.defaulted:
                out.append((".".join(map(str, prefix)), value))

        walk((), self.cs)
        return out


@dataclass
class ConfigResult:
    hf: dict
    generation: dict | None
    warnings: list
    scope: Scope  # CS keys + derived values + model vars, for the tensor rules
    cs_scope: ConfigScope = field(repr=False, default=None)
    token_id_sources: dict = field(default_factory=dict)  # token id key in ``hf`` -> TOKEN_ID_SOURCES entry


def config_functions(cs: ConfigScope, where: str, path) -> dict:
    """Functions config expressions may call, besides the basic ones."""

    def lookup(key: str, mapping: dict):
        return translate(cs.get(key) if cs.has(key) else None, mapping, key, "HF", path, where)

    def fail(message: str):
        raise ConfigError(path, f"{message} [{where}]")

    def has(key: str) -> bool:
        return cs.has(key)

    def keys_with_prefix(prefix: str) -> list:
        return sorted(k for k in cs.cs if isinstance(k, str) and k.startswith(prefix) and cs.has(k))

    def get(key: str, default=None):
        return cs.get(key, default)

    return {**BASE_FUNCTIONS, "lookup": lookup, "error": fail, "has": has, "get": get,
            "keys_with_prefix": keys_with_prefix, "default_id2label": default_id2label,
            "default_label2id": default_label2id, "null_if": null_if}


def translate(value, mapping: dict, what: str, side: str, path, where: str):
    """``mapping[value]``: a setting's value in the other direction's terms (``side``: "HF" or "Cerebras"); a
    ConfigError naming the setting ``what``, its value and the supported ones when the mapping has none."""
    if value not in mapping:
        shown = ", ".join(repr(k) for k in mapping)
        raise ConfigError(path, f"{what}={value!r} has no {side} equivalent (supported: {shown}) [{where}]")
    return mapping[value]


def null_if(value, default):
    """None (JSON null) when ``value`` equals ``default``, else ``value``: for HF settings whose class computes
    ``default`` itself from a null (GPT-2's ``n_inner`` is 4 x ``n_embd``), so that config.json says null as
    save_pretrained of a model built with the default does."""
    return None if value == default else value


def default_id2label(count: int) -> dict:
    """The label names transformers gives ``count`` unnamed classes (``id2label`` as config.json stores it)."""
    return {str(i): f"LABEL_{i}" for i in range(int(count))}


def default_label2id(count: int) -> dict:
    """The inverse of ``default_id2label`` (``label2id``)."""
    return {f"LABEL_{i}": i for i in range(int(count))}


def evaluate_config_expr(text: str, scope: Scope, functions: dict, params_path, spec_path, where: str):
    """Evaluate a config expression; a missing CS key or bad value is a ConfigError, a bad rule a MappingError."""
    try:
        return evaluate(text, scope, functions)
    except MissingName as e:
        raise ConfigError(params_path, f"params lack model.{e.name}, needed for {where}") from None
    except ExprError as e:
        raise MappingError(spec_path, f"{where}: {e}") from None
    except (TypeError, ValueError, ZeroDivisionError, OverflowError) as e:
        raise ConfigError(params_path, f"cannot compute {where}: {e}") from None


def convert_config(spec: FamilySpec, variant: ModelVariant, cs_model: dict, params_path: Path | None,
                   problems: list | None = None) -> ConfigResult:
    """Translate ``cs_model`` (the params ``model:`` dict) for ``variant`` of ``spec``.

    The first setting HF cannot express raises ``ConfigError``; with a ``problems`` list, every such obstacle is
    appended to it instead (one message each, naming the key and its value) and the result holds what could be
    converted (``ckptfs convert-config`` reports them all at once)."""
    cfg = spec.config
    cs = copy.deepcopy(cs_model)
    defaulted = [k for k in cfg.defaults if k not in cs]
    for k in defaulted:
        cs[k] = copy.deepcopy(cfg.defaults[k])
    cs_scope = ConfigScope(cs, defaulted)
    scope = cs_scope.child({"headless": variant.headless, **variant.vars})
    funcs = config_functions(cs_scope, spec.path.name, params_path)
    warnings: list = []
    failed: list = []  # derived names that could not be computed (collecting mode)

    def ev(text, where):
        return evaluate_config_expr(text, scope, funcs, params_path, spec.path, f"{spec.path.name}: {where}")

    def obstacle(e: ConfigError) -> None:
        if problems is None:
            raise e
        if any(f"params lack model.{n}," in e.problem for n in failed):
            return  # follows from a derived value already reported
        if e.problem not in problems:
            problems.append(e.problem)

    def attempt(text, where, default=OMIT):
        try:
            return ev(text, where)
        except ConfigError as e:
            obstacle(e)
            return default

    for name, text in cfg.derive.items():
        try:
            scope.values[name] = ev(text, f"config.derive.{name}")
        except ConfigError as e:
            obstacle(e)
            failed.append(name)

    for g in cfg.guards:
        try:
            problem = _check_guard(g, cs_scope, scope, variant, ev)
        except ConfigError as e:
            obstacle(e)
            continue
        if problem:
            if g.warn:
                warnings.append(problem)
            else:
                obstacle(ConfigError(params_path, problem))

    hf: dict = {}
    for key, text in cfg.hf.items():
        value = attempt(text, f"config.hf.{key}")
        if value is not OMIT:
            hf[key] = value
    hf["model_type"] = spec.model_type
    hf["architectures"] = [variant.hf_class]

    gen = {}
    for key, text in cfg.generation.items():
        value = attempt(text, f"config.generation.{key}")
        if value is not OMIT:
            gen[key] = value
    stated = {k: ("params" if cs_scope.has(k) else "mapping") for k in TOKEN_ID_KEYS if k in hf}
    generates = fill_token_ids(hf, gen, cfg.generation, spec.model_type, variant)
    sources = {k: stated.get(k, "class") for k in TOKEN_ID_KEYS if k in hf}
    return ConfigResult(hf, gen if generates else None, warnings, scope, cs_scope, sources)


#: where a config.json token id the mapping wrote comes from (``ConfigResult.token_id_sources``)
TOKEN_ID_SOURCES = {
    "params": "the params YAML",
    "mapping": "the family's mapping, as the converter writes it",
    "class": "the transformers config class's default",
}


def fill_token_ids(hf: dict, gen: dict, gen_spec: dict, model_type: str, variant: ModelVariant) -> bool:
    """Complete the special token ids in place: a config.json id the params did not give takes the transformers
    config class's default (``hf_defaults``; never for remote-code classes, whose defaults are not known here), and
    generation_config.json carries config.json's ids. Returns whether the HF class generates text
    (``hf_defaults.generates``): only such a model gets a generation_config.json, as with ``save_pretrained``."""
    from .hf_defaults import TOKEN_ID_KEYS, class_token_ids, generates

    if not variant.remote_code:
        for key, value in class_token_ids(model_type).items():
            hf.setdefault(key, value)
    if not generates(variant.hf_class):
        return False
    for key in TOKEN_ID_KEYS:
        if hf.get(key) is not None and str(gen_spec.get(key, "")).strip() != "omit":
            gen.setdefault(key, hf[key])
    return True


def _check_guard(g: Guard, cs: ConfigScope, scope: Scope, variant: ModelVariant, ev) -> str | None:
    if g.key is not None:
        try:
            value = cs.path_lookup(tuple(g.key.split(".")))
        except MissingName:
            return None  # like the converter: a guard only judges keys that are present
        if value in g.allowed:
            return None
        allowed = ", ".join(repr(a) for a in g.allowed)
        why = f": {g.message}" if g.message else ""
        head = f"model.{g.key}={value!r}"
        if g.warn:
            return f"{head} differs from what HF {variant.hf_class} assumes ({allowed}); converted anyway{why}"
        return f"{head} cannot be converted to HF {variant.hf_class} (supported: {allowed}){why}"
    if ev(g.check, g.where.split(": ", 1)[-1]):
        return None
    message = format_message(g.message, scope)
    return f"HF {variant.hf_class}: {message}" if g.warn else f"cannot convert to HF {variant.hf_class}: {message}"


class _Lenient(dict):
    def __init__(self, scope):
        super().__init__()
        self.scope = scope

    def __missing__(self, key):
        try:
            return self.scope.lookup(key)
        except MissingName:
            return "{" + key + "}"


def format_message(message: str, scope: Scope) -> str:
    """``message`` with each ``{name}`` replaced by its value in ``scope`` (left as written when it has none)."""
    try:
        return message.format_map(_Lenient(scope))
    except (ValueError, IndexError, AttributeError):
        return message


def unused_key_warnings(cs_scope: ConfigScope, spec: FamilySpec, variant: ModelVariant) -> list:
    """One warning per CS setting that nothing converted."""
    out = []
    for key, value in cs_scope.unused():
        note = spec.config.notes.get(key) or spec.config.notes.get(key.split(".")[0])
        why = f" ({note})" if note else ""
        out.append(f"params model.{key}={value!r} has no counterpart in HF {variant.hf_class} "
                   f"config.json; not converted{why}")
    return out
