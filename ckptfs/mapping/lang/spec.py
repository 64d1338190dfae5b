"""Load and validate the declarative mapping YAML files (one per model family, plus shared fragments).

A family file names the CLI model names it serves, how to recognise its checkpoints, how the CS params
``model:`` section becomes HF ``config.json``, and how CS tensors become HF tensors. Every problem is a
``MappingError`` naming the YAML file and the place in it. The schema is documented in
``mappings/README.md``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ...errors import MappingError
from ..lora import spec as lora_spec
from .expr import ExprError, parse
from .pattern import KeyPattern, PatternError, alternatives, fields, template_names


@dataclass(frozen=True)
class Replacement:
    """A model chosen instead of ``model`` when ``when`` holds on the CS params: HF's class for the configuration
    the params describe (BERT without NSP -> BertForMaskedLM) or the family their traits show (a RoBERTa whose params
    say ``name: bert``). ``reason`` is README.txt's line on why."""

    model: str
    when: str
    reason: str


@dataclass(frozen=True)
class ModelVariant:
    """One CLI model name (and its aliases) of a family: which HF class it produces ("" in a family without an HF
    side)."""

    name: str
    hf_class: str
    headless: bool = False
    aliases: tuple = ()
    vars: dict = field(default_factory=dict)
    notes: str = ""
    # where the HF class's modeling code lives when transformers does not ship it (trust_remote_code)
    remote_code: str | None = None
    # multi-component checkpoints: ComponentSpec per HF model directory (empty: one model at the root)
    components: tuple = ()
    # HF -> CS of a multi-component model: params model: entries beside the components' sections
    # ({dotted params path: expression over the components' HF configs, by folder})
    cs: dict = field(default_factory=dict)
    replaces: tuple = ()  # Replacement: models this one is chosen instead of, and when

@dataclass(frozen=True)
class ComponentSpec:
    """One HF model directory of a multi-component checkpoint (DPO's reference model, DPR's two encoders,
    LLaVA's image and text models): which CS keys and params section it reads and which rules map them.

    Without ``model`` / ``model_from`` the component is mapped by its own family's ``config:`` and
    ``tensors:``; with one of them, by that model's family. Its own ``config`` / ``tensors`` come on top.
    """

    folder: str  # sub-folder of the HF view; "" = the view's root
    where: str  # "<file>: models[0].components[1]" for messages
    cs_prefix: str = ""  # CS model keys (without "model.") it reads; the prefix is removed before matching
    cs_rename: tuple = ()  # ((CS key prefix, local prefix), ...): more CS keys it reads, under a local name
    params: tuple = ()  # path of its params section inside the params model: section (() = all of it)
    params_bind: tuple = ()  # ((name, path), ...): other params values its expressions read under a name
    model: str | None = None  # a model name (of any family) whose config and tensor rules map it
    model_from: str | None = None  # key of its params section naming that model (DPO's model_name)
    hf_class: str | None = None  # overrides the model's HF class
    model_type: str | None = None  # overrides the family's model_type
    vars: dict = field(default_factory=dict)  # added to (and overriding) the model's vars
    config: "ConfigSpec | None" = None  # merged over the mapping family's config (these entries win)
    tensors: tuple = ()  # tried before the mapping family's tensor rules
    files: tuple = ()  # ((file name, expression giving its JSON content), ...) written beside config.json
    # HF -> CS: when the HF model has no such folder, its CS tensors are a copy of this folder's (the converter
    # makes DPO's reference model from the policy model)
    copy_of: str | None = None

    @property
    def self_contained(self) -> bool:
        """Mapped by its own family's rules (no other model named)."""
        return self.model is None and self.model_from is None


@dataclass(frozen=True)
class Emit:
    """One HF output of a tensor rule: its name template and the operation producing it."""

    hf: str
    op: str = "x"
    when: str | None = None
    each: tuple = ()  # ((var, expression giving a list), ...): one output per combination


@dataclass(frozen=True)
class TensorRule:
    """Matches one CS tensor key (``cs``) and emits HF tensors from it (plus ``inputs``), or drops it."""

    cs: KeyPattern
    where: str  # "<file>: tensors[3]" for messages
    when: str | None = None
    inputs: tuple = ()  # ((name, key template), ...) other CS tensors the rule consumes
    drop: str | None = None
    emits: tuple = ()
    # HF -> CS (``inverse.py``): ((CS input name, expression over the HF output ``y``), ...) where the rule's op
    # does not invert by itself; for a drop rule, ``make`` gives the CS tensor the HF model does not hold (a tied
    # copy, a generated buffer) and ``added`` says why it is added (absent: part of the model, e.g. a tied copy)
    inverse: tuple = ()
    make: str | None = None
    added: str | None = None


@dataclass(frozen=True)
class Guard:
    """A CS setting the HF class cannot express: ``key`` must be in ``allowed``, or ``check`` must hold."""

    where: str
    key: str | None = None
    allowed: tuple | None = None
    check: str | None = None
    message: str | None = None
    warn: bool = False  # a failed guard is a warning instead of an error


@dataclass
class ConfigSpec:
    defaults: dict = field(default_factory=dict)  # CS framework defaults for absent keys
    derive: dict = field(default_factory=dict)  # name -> expression, in order
    guards: list = field(default_factory=list)
    hf: dict = field(default_factory=dict)  # HF config key -> expression, in order
    generation: dict = field(default_factory=dict)  # generation_config key -> expression
    notes: dict = field(default_factory=dict)  # CS key -> why it has no HF counterpart
    # HF -> CS: params model: entries from config.json, as the converter writes them ({key: expression over the HF
    # config}); hf_notes: HF config key -> why the CS model has no counterpart
    cs: dict = field(default_factory=dict)
    hf_notes: dict = field(default_factory=dict)
    cs_derive: dict = field(default_factory=dict)  # name -> expression over the HF config, usable in ``cs``
    # HF -> CS: HF tensors the CS model has no place for, on purpose ({HF name pattern: reason}): left out with a
    # note; any other HF tensor no rule takes is an error (``--allow-unused-weights`` makes it a note)
    hf_unused: dict = field(default_factory=dict)


@dataclass(frozen=True)
class DetectSpec:
    """How to recognise the family from CS key names (when the params give no ``name``)."""

    priority: int = 0
    keys: tuple = ()  # KeyPatterns that must all match some CS model key
    no_keys: tuple = ()  # KeyPatterns none of which may match
    config: str | None = None  # expression over the CS params (only checked when params were found)


@dataclass
class FamilySpec:
    family: str
    path: Path
    description: str
    model_type: str
    cs_names: tuple
    models: list
    detect: DetectSpec
    config: ConfigSpec
    prepare: list
    tensors: list
    lora: "lora_spec.LoraSpec | None" = None  # LoRA folding facts (lora_spec.py); None: LoRA checkpoints not supported
    no_hf: str | None = None  # why the family has no Hugging Face side (its checkpoints get the other views only)

    def variant(self, name: str | None) -> ModelVariant:
        """The model entry for CLI name ``name`` (an alias counts); the first entry when None."""
        if name is None:
            return self.models[0]
        for m in self.models:
            if name == m.name or name in m.aliases:
                return m
        raise KeyError(name)

    def names(self) -> list:
        return [n for m in self.models for n in (m.name, *m.aliases)]


@dataclass
class FragmentSpec:
    """Shared config / prepare rules that families pull in with ``include:``."""

    name: str
    path: Path
    config: ConfigSpec
    prepare: list
    lora: "lora_spec.LoraSpec | None" = None


# -- loading ---------------------------------------------------------------------------------------

_FAMILY_KEYS = {"family", "description", "model_type", "cs_names", "include", "models", "detect", "config",
                "prepare", "tensors", "lora", "no_hf"}
_FRAGMENT_KEYS = {"fragment", "description", "config", "prepare", "lora"}


#: the safe loader, libyaml's when PyYAML was built with it (several times faster: every mount reads every family)
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_yaml(path: Path) -> dict:
    try:
        data = yaml.load(Path(path).read_text(), Loader=_YAML_LOADER)  # noqa: S506 - a safe loader (libyaml's if built)
    except (OSError, yaml.YAMLError) as e:
        raise MappingError(path, f"cannot read mapping YAML: {e}") from None
    if not isinstance(data, dict):
        raise MappingError(path, "mapping YAML must be a mapping at the top level")
    return data


def load_fragment(path: Path, data: dict | None = None) -> FragmentSpec:
    data = read_yaml(path) if data is None else data
    v = _Validator(path)
    v.keys(data, _FRAGMENT_KEYS, "top level")
    name = v.string(data.get("fragment"), "fragment")
    return FragmentSpec(name, Path(path), v.config(data.get("config") or {}, set()),
                        v.rules(data.get("prepare") or [], "prepare", set(), prepare=True),
                        lora_spec.parse(data.get("lora"), v, set()))


def load_family(path: Path, fragments: dict, data: dict | None = None) -> FamilySpec:
    """Parse one family file; ``fragments`` maps fragment name -> FragmentSpec for ``include:``."""
    data = read_yaml(path) if data is None else data
    v = _Validator(path)
    v.keys(data, _FAMILY_KEYS, "top level")
    family = v.string(data.get("family"), "family")
    no_hf = None if data.get("no_hf") is None else v.string(data.get("no_hf"), "no_hf")
    models = v.models(data.get("models"), hf=no_hf is None)
    var_names = set(models[0].vars)
    for m in models:
        if set(m.vars) != var_names:
            v.fail(f"models: {m.name} defines vars {sorted(m.vars)} but {models[0].name} defines {sorted(var_names)}")
    var_names = v.component_vars(models, var_names)
    config = v.config(data.get("config") or {}, var_names)
    prepare = v.rules(data.get("prepare") or [], "prepare", var_names, prepare=True)
    tensors = v.rules(data.get("tensors") or [], "tensors", var_names)
    lora = lora_spec.parse(data.get("lora"), v, var_names)
    own_rules_used = no_hf is None and any(not m.components or any(c.self_contained for c in m.components)
                                           for m in models)
    if no_hf is not None and (tensors or prepare or "config" in data or "lora" in data):
        v.fail("no_hf: a family without an HF side has no config, prepare, tensors or lora rules")
    if not tensors and own_rules_used:
        v.fail("tensors: a family needs at least one tensor rule (unless every model's components name "
               "another model to map them)")
    include = data.get("include") or []
    if not isinstance(include, list):
        v.fail("include: must be a list of fragment names")
    for name in include:
        frag = fragments.get(name)
        if frag is None:
            v.fail(f"include: unknown fragment {name!r} (known: {sorted(fragments)})")
        config = merge_config(frag.config, config)
        prepare = frag.prepare + prepare
        lora = lora_spec.merge(frag.lora, lora)
    cs_names = data.get("cs_names") or [family]
    if not isinstance(cs_names, list) or not all(isinstance(n, str) for n in cs_names):
        v.fail("cs_names: must be a list of strings")
    return FamilySpec(
        family=family, path=Path(path), description=str(data.get("description") or ""),
        model_type=(v.string(data.get("model_type"), "model_type") if own_rules_used or "model_type" in data
                    else ""), cs_names=tuple(cs_names), models=models,
        detect=v.detect(data.get("detect") or {}), config=config, prepare=prepare, tensors=tensors, lora=lora,
        no_hf=no_hf)


def merge_config(base: ConfigSpec, own: ConfigSpec) -> ConfigSpec:
    """A fragment's config under a family's: the family's entries win, derived values keep order."""
    return ConfigSpec(
        defaults={**base.defaults, **own.defaults},
        derive={**base.derive, **own.derive},
        guards=base.guards + own.guards,
        hf={**base.hf, **own.hf},
        generation={**base.generation, **own.generation},
        notes={**base.notes, **own.notes},
        cs={**base.cs, **own.cs},
        hf_notes={**base.hf_notes, **own.hf_notes},
        cs_derive={**base.cs_derive, **own.cs_derive},
        hf_unused={**base.hf_unused, **own.hf_unused})


class _Validator:
    def __init__(self, path):
        self.path = Path(path)

    def fail(self, problem: str):
        raise MappingError(self.path, problem)

    def keys(self, data, allowed, where):
        if not isinstance(data, dict):
            self.fail(f"{where}: expected a mapping, got {type(data).__name__}")
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            self.fail(f"{where}: unknown key(s) {unknown} (allowed: {sorted(allowed)})")

    def string(self, value, where) -> str:
        if not isinstance(value, str) or not value:
            self.fail(f"{where}: expected a non-empty string, got {value!r}")
        return value

    def expr(self, text, where) -> str:
        if isinstance(text, bool) or text is None or isinstance(text, (int, float)):
            return repr(text)  # literal YAML values are valid expressions of themselves
        if not isinstance(text, str):
            self.fail(f"{where}: expected an expression string, got {text!r}")
        try:
            parse(text)
        except ExprError as e:
            self.fail(f"{where}: {e}")
        return text

    def pattern(self, text, where) -> KeyPattern:
        try:
            return KeyPattern.compile(text)
        except PatternError as e:
            self.fail(f"{where}: {e}")

    def template(self, text, where, known: set):
        self.string(text, where)
        try:
            missing = [n for n in template_names(text) if n not in known]
        except PatternError as e:
            self.fail(f"{where}: {e}")
        if missing:
            self.fail(f"{where}: template {text!r} uses {{{missing[0]}}}, which is not a capture or var "
                      f"(known: {sorted(known)})")
        return text

    def models(self, items, hf: bool = True) -> list:
        """The ``models:`` list; ``hf`` False for a family without an HF side (no ``hf_class``)."""
        if not isinstance(items, list) or not items:
            self.fail("models: expected a non-empty list of model names")
        out, seen = [], set()
        for n, item in enumerate(items):
            where = f"models[{n}]"
            self.keys(item, {"name", "hf_class", "headless", "aliases", "vars", "notes", "remote_code", "components",
                             "cs", "replaces"}, where)
            if not hf and "hf_class" in item:
                self.fail(f"{where}.hf_class: the family has no HF side (no_hf)")
            aliases = item.get("aliases") or []
            if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
                self.fail(f"{where}.aliases: must be a list of names")
            vars_ = item.get("vars") or {}
            if not isinstance(vars_, dict):
                self.fail(f"{where}.vars: must be a mapping")
            m = ModelVariant(self.string(item.get("name"), f"{where}.name"),
                             self.string(item.get("hf_class"), f"{where}.hf_class") if hf else "",
                             bool(item.get("headless", False)), tuple(aliases), dict(vars_),
                             str(item.get("notes") or ""),
                             None if item.get("remote_code") is None
                             else self.string(item.get("remote_code"), f"{where}.remote_code"),
                             self.components(item["components"], f"{where}.components", set(vars_))
                             if "components" in item else (),
                             self.expressions(item.get("cs") or {}, f"{where}.cs"),
                             self.replacements(item.get("replaces"), f"{where}.replaces"))
            if m.cs and not m.components:
                self.fail(f"{where}.cs: only a model with components has model-level params entries (a family's "
                          f"own go to config.cs)")
            for name in (m.name, *m.aliases):
                if name in seen:
                    self.fail(f"{where}: model name {name!r} listed twice")
                seen.add(name)
            out.append(m)
        return out

    def replacements(self, items, where) -> tuple:
        """A model's ``replaces:`` list (see Replacement)."""
        if items is None:
            return ()
        if not isinstance(items, list) or not items:
            self.fail(f"{where}: expected a non-empty list of {{model, when, reason}}")
        out = []
        for n, item in enumerate(items):
            rw = f"{where}[{n}]"
            self.keys(item, {"model", "when", "reason"}, rw)
            out.append(Replacement(self.string(item.get("model"), f"{rw}.model"),
                                   self.expr(item.get("when"), f"{rw}.when"),
                                   self.string(item.get("reason"), f"{rw}.reason")))
        return tuple(out)

    _COMPONENT_KEYS = {"folder", "cs_prefix", "cs_rename", "params", "params_bind", "model", "model_from",
                       "hf_class", "model_type", "vars", "config", "tensors", "files", "copy_of"}

    def components(self, items, where, model_vars: set) -> tuple:
        """A model's ``components:`` list (see ComponentSpec); its own rules may use captures and vars."""
        if not isinstance(items, list) or not items:
            self.fail(f"{where}: expected a non-empty list of components")
        out, folders = [], set()
        for n, item in enumerate(items):
            cw = f"{where}[{n}]"
            self.keys(item, self._COMPONENT_KEYS, cw)
            folder = item.get("folder")
            if not isinstance(folder, str) or folder.startswith("/") or folder.endswith("/") or ".." in folder:
                self.fail(f"{cw}.folder: expected a relative folder name ('' = the HF view's root), got {folder!r}")
            if folder in folders:
                self.fail(f"{cw}.folder: {folder!r} listed twice")
            folders.add(folder)
            for k in ("vars", "cs_rename", "params_bind", "files"):
                if not isinstance(item.get(k) or {}, dict):
                    self.fail(f"{cw}.{k}: must be a mapping")
            vars_ = dict(item.get("vars") or {})
            if "model" in item and "model_from" in item:
                self.fail(f"{cw}: give 'model' or 'model_from', not both")
            opt = lambda k: None if item.get(k) is None else self.string(item[k], f"{cw}.{k}")
            comp = ComponentSpec(
                folder=folder, where=f"{self.path.name}: {cw}",
                cs_prefix=self._prefix(item.get("cs_prefix", ""), f"{cw}.cs_prefix"),
                cs_rename=tuple((self._prefix(a, f"{cw}.cs_rename"), self._prefix(b, f"{cw}.cs_rename"))
                                for a, b in (item.get("cs_rename") or {}).items()),
                params=self.params_path(item.get("params", ""), f"{cw}.params"),
                params_bind=tuple((self.string(k, f"{cw}.params_bind"), self.params_path(p, f"{cw}.params_bind.{k}"))
                                  for k, p in (item.get("params_bind") or {}).items()),
                model=opt("model"), model_from=opt("model_from"), hf_class=opt("hf_class"),
                model_type=opt("model_type"), vars=vars_,
                config=self.config(item["config"], set(vars_)) if "config" in item else None,
                tensors=tuple(self.rules(item.get("tensors") or [], f"{cw}.tensors", model_vars | set(vars_))),
                files=tuple((self.string(k, f"{cw}.files"), self.expr(e, f"{cw}.files.{k}"))
                            for k, e in (item.get("files") or {}).items()),
                copy_of=None if item.get("copy_of") is None else self._prefix(item["copy_of"], f"{cw}.copy_of"))
            if comp.self_contained and comp.hf_class is None:
                self.fail(f"{cw}: a component without 'model' / 'model_from' needs 'hf_class'")
            out.append(comp)
        for comp in out:
            if comp.copy_of is not None and (comp.copy_of not in folders or comp.copy_of == comp.folder):
                self.fail(f"{comp.where.split(': ', 1)[1]}.copy_of: {comp.copy_of!r} is not another component's folder")
        return tuple(out)

    def expressions(self, data, where) -> dict:
        """A mapping of names (dotted params paths) to expressions."""
        if not isinstance(data, dict):
            self.fail(f"{where}: must be a mapping")
        return {self.string(k, where): self.expr(e, f"{where}.{k}") for k, e in data.items()}

    def _prefix(self, value, where) -> str:
        if not isinstance(value, str):
            self.fail(f"{where}: expected a CS key prefix string, got {value!r}")
        return value

    def params_path(self, value, where) -> tuple:
        """A dotted params path ('' = the whole section); decimal parts index lists."""
        if not isinstance(value, str):
            self.fail(f"{where}: expected a dotted params path, got {value!r}")
        if not value:
            return ()
        parts = value.split(".")
        if any(not p for p in parts):
            self.fail(f"{where}: empty part in params path {value!r}")
        return tuple(int(p) if p.isdigit() else p for p in parts)

    def component_vars(self, models, var_names: set) -> set:
        """The var names the family's own rules may use: the models' plus those of components mapped by them
        (each such component, with its model's vars, must define all of them)."""
        own = [(m, c) for m in models for c in m.components if c.self_contained]
        names = set(var_names).union(*(set(c.vars) for _, c in own))
        for m, c in own:
            have = set(m.vars) | set(c.vars)
            if have != names:
                self.fail(f"{c.where.split(': ', 1)[1]}: vars {sorted(have)} (with model {m.name}'s) differ from "
                          f"the vars the family's rules may use {sorted(names)}")
        if names != var_names and any(not m.components for m in models):
            self.fail(f"models: component vars {sorted(names - var_names)} are not defined by the models "
                      f"without components")
        return names

    def detect(self, data) -> DetectSpec:
        self.keys(data, {"priority", "keys", "no_keys", "config"}, "detect")
        pri = data.get("priority", 0)
        if not isinstance(pri, int):
            self.fail("detect.priority: must be an integer")
        pats = lambda k: tuple(self.pattern(p, f"detect.{k}[{i}]") for i, p in enumerate(data.get(k) or []))
        cfg = data.get("config")
        return DetectSpec(pri, pats("keys"), pats("no_keys"),
                          None if cfg is None else self.expr(cfg, "detect.config"))

    def config(self, data, var_names) -> ConfigSpec:
        self.keys(data, {"defaults", "derive", "guards", "hf", "generation", "notes", "cs", "hf_notes", "cs_derive",
                         "hf_unused"}, "config")
        for k in ("defaults", "derive", "hf", "generation", "notes", "cs", "hf_notes", "cs_derive", "hf_unused"):
            if not isinstance(data.get(k) or {}, dict):
                self.fail(f"config.{k}: must be a mapping")
        derive = {k: self.expr(e, f"config.derive.{k}") for k, e in (data.get("derive") or {}).items()}
        hf = {k: self.expr(e, f"config.hf.{k}") for k, e in (data.get("hf") or {}).items()}
        gen = {k: self.expr(e, f"config.generation.{k}") for k, e in (data.get("generation") or {}).items()}
        guards = []
        items = data.get("guards") or []
        if not isinstance(items, list):
            self.fail("config.guards: must be a list")
        for n, g in enumerate(items):
            where = f"config.guards[{n}]"
            self.keys(g, {"key", "allowed", "check", "message", "warn"}, where)
            if ("key" in g) == ("check" in g):
                self.fail(f"{where}: give exactly one of 'key' (with 'allowed') or 'check'")
            if "key" in g:
                allowed = g.get("allowed")
                if not isinstance(allowed, list):
                    self.fail(f"{where}.allowed: must be a list of accepted values")
                guards.append(Guard(f"{self.path.name}: {where}", key=self.string(g["key"], f"{where}.key"),
                                    allowed=tuple(allowed), message=g.get("message"), warn=bool(g.get("warn"))))
            else:
                guards.append(Guard(f"{self.path.name}: {where}", check=self.expr(g["check"], f"{where}.check"),
                                    message=self.string(g.get("message"), f"{where}.message"),
                                    warn=bool(g.get("warn"))))
        return ConfigSpec(dict(data.get("defaults") or {}), derive, guards, hf, gen,
                          {str(k): str(v) for k, v in (data.get("notes") or {}).items()},
                          self.expressions(data.get("cs") or {}, "config.cs"),
                          {str(k): str(v) for k, v in (data.get("hf_notes") or {}).items()},
                          self.expressions(data.get("cs_derive") or {}, "config.cs_derive"),
                          self.unused(data.get("hf_unused") or {}))

    def unused(self, data: dict) -> dict:
        """``config.hf_unused``: {HF tensor name pattern: the reason the CS model has no place for it}."""
        out = {}
        for text, why in data.items():
            try:
                KeyPattern.compile(text)
            except PatternError as e:
                self.fail(f"config.hf_unused: {e}")
            out[str(text)] = self.string(why, f"config.hf_unused.{text}")
        return out

    def rules(self, items, section, var_names, prepare=False) -> list:
        if not isinstance(items, list):
            self.fail(f"{section}: must be a list of rules")
        make = self.prepare_rule if prepare else self.rule
        return [make(item, f"{section}[{n}]", var_names) for n, item in enumerate(items)]

    def prepare_rule(self, item, where, var_names) -> TensorRule:
        """A rewrite of a CS tensor in place (same key), applied before the key rules (muP folding)."""
        self.keys(item, {"cs", "when", "op"}, where)
        cs = self.pattern(item.get("cs"), f"{where}.cs")
        when = None if item.get("when") is None else self.expr(item["when"], f"{where}.when")
        if "op" not in item:
            self.fail(f"{where}: a prepare rule needs 'op'")
        return TensorRule(cs, f"{self.path.name}: {where}", when, (), None,
                          (Emit("", self.expr(item["op"], f"{where}.op")),))

    def rule(self, item, where, var_names) -> TensorRule:
        self.keys(item, {"cs", "when", "with", "drop", "hf", "op", "emit", "inverse", "make", "added"}, where)
        cs = self.pattern(item.get("cs"), f"{where}.cs")
        known = set(cs.names) | set(var_names)
        when = None if item.get("when") is None else self.expr(item["when"], f"{where}.when")
        inputs = item.get("with") or {}
        if not isinstance(inputs, dict):
            self.fail(f"{where}.with: must map input names to CS key templates")
        inputs = tuple((name, self.template(t, f"{where}.with.{name}", known)) for name, t in inputs.items())
        forms = [k for k in ("drop", "hf", "emit") if k in item]
        if len(forms) != 1:
            self.fail(f"{where}: give exactly one of 'drop', 'hf' (+ 'op') or 'emit'")
        if "op" in item and "hf" not in item:
            self.fail(f"{where}: 'op' goes with 'hf' (or inside an 'emit' entry)")
        emits: list = []
        if "hf" in item:
            emits.append(Emit(self.template(item["hf"], f"{where}.hf", known),
                              self.expr(item.get("op", "x"), f"{where}.op")))
        elif "emit" in item:
            if not isinstance(item["emit"], list) or not item["emit"]:
                self.fail(f"{where}.emit: must be a non-empty list")
            for n, e in enumerate(item["emit"]):
                ew = f"{where}.emit[{n}]"
                self.keys(e, {"hf", "op", "when", "each"}, ew)
                each = e.get("each") or {}
                if not isinstance(each, dict):
                    self.fail(f"{ew}.each: must map a name to an expression giving a list")
                each = tuple((k, self.expr(x, f"{ew}.each.{k}")) for k, x in each.items())
                emits.append(Emit(self.template(e.get("hf"), f"{ew}.hf", known | {k for k, _ in each}),
                                  self.expr(e.get("op", "x"), f"{ew}.op"),
                                  None if e.get("when") is None else self.expr(e["when"], f"{ew}.when"), each))
        drop = item.get("drop")
        if "drop" in item and (not isinstance(drop, str) or not drop):
            self.fail(f"{where}.drop: give the reason the tensor is not converted")
        inverse = self.expressions(item.get("inverse") or {}, f"{where}.inverse")
        unknown = sorted(set(inverse) - {"x", *(n for n, _ in inputs)})
        if unknown:
            self.fail(f"{where}.inverse: {unknown[0]!r} is not the rule's CS tensor x or one of its 'with' inputs")
        if inverse and (len(emits) != 1 or emits[0].each):
            self.fail(f"{where}.inverse: only a rule with one HF output (no 'each') names its inverse")
        if ("make" in item or "added" in item) and "drop" not in item:
            self.fail(f"{where}: 'make' and 'added' go with 'drop' (a CS tensor the HF model does not hold)")
        if "added" in item and "make" not in item:
            self.fail(f"{where}.added: says why 'make' adds a tensor; give 'make'")
        if "make" in item and any(rx is None or alternatives(rx) is None for _, rx in fields(cs.text)):
            self.fail(f"{where}.make: the keys a rule makes must be listed by 'cs' (captures of literal "
                      f"alternatives such as {{p:weight|bias}}, no indices)")
        make = None if item.get("make") is None else self.expr(item["make"], f"{where}.make")
        added = None if item.get("added") is None else self.string(item["added"], f"{where}.added")
        return TensorRule(cs, f"{self.path.name}: {where}", when, inputs, drop, tuple(emits),
                          tuple(inverse.items()), make, added)
