"""LoRA-trained checkpoints: find the adapter matrices, give each its ``lora_params`` group, fold them lazily.

A model trained with LoRA (Model Zoo's ``make_model_lora``, what the trainer's ``Lora`` callback does) keeps every
base weight ``<m>.weight`` and adds ``<m>.lora_A`` / ``<m>.lora_B`` for each wrapped ``nn.Linear`` / ``nn.Embedding``.
Its scaling ``alpha / r`` comes from the params: ``lora_params`` in the ``model:`` section (legacy layout, what
``fold_lora_checkpoint.py`` reads) or under the trainer's ``Lora`` callback (``trainer.init.callbacks``), one group
or a list of groups. A module takes the first group whose ``target_modules`` all occur among the Model Zoo class
names of the module and its ancestors (``target_modules: null`` takes every module). The checkpoint holds no class
names, so the family's ``lora:`` mapping section gives each CS module's class path (``lora_spec.py``).

``find_lora`` reads all that (nothing of the tensor data) and returns a ``LoraCheckpoint``: the folded CS tensors
(``lora_fold.LoraFold``, the LoRA keys gone) and the params the folded model has (no ``lora_params``; tied
embeddings untied when LoRA changed one of them), which the family's normal mapping then converts.
"""
from __future__ import annotations

import copy
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ...errors import ConfigError, MappingError
from ..params.to_hf_config import ConfigScope, config_functions
from ..lang.expr import ExprError, MissingName, evaluate
from .fold import LoraFold
from ..params.find import CSParams
from ..lang.pattern import PatternError, fill
from ..lang.spec import FamilySpec

SUFFIX_A, SUFFIX_B = ".lora_A", ".lora_B"
#: the fields of Model Zoo's LoraConfig (a group with any other key fails there too)
GROUP_KEYS = ("r", "alpha", "dropout", "fan_in_fan_out", "merge_weights", "target_modules")


@dataclass(frozen=True)
class LoraGroup:
    """One ``lora_params`` group (Model Zoo's LoraConfig, same defaults)."""

    index: int
    r: int = 0
    alpha: float = 1
    target_modules: tuple | None = None
    fan_in_fan_out: bool = False

    @property
    def scaling(self) -> float:
        """``alpha / r`` as Model Zoo computes it (a Python float; torch rounds it to float32 when it multiplies)."""
        return self.alpha / self.r

    def selects(self, class_path) -> bool:
        return self.target_modules is None or all(t in class_path for t in self.target_modules)

    def describe(self) -> str:
        targets = "null (every Linear and Embedding)" if self.target_modules is None else list(self.target_modules)
        if self.r == 0:  # Model Zoo leaves such modules as they are
            return f"group {self.index}: r 0 (no LoRA matrices), target_modules {targets}"
        scaling = self.scaling
        as32 = float(np.float32(scaling))
        exact = "" if as32 == scaling else f", multiplied as float32 {as32!r}"
        return (f"group {self.index}: r {self.r}, alpha {self.alpha} (scaling {self.alpha}/{self.r} = {scaling!r}"
                f"{exact}), target_modules {targets}")


@dataclass(frozen=True)
class LoraSettings:
    groups: tuple
    where: str  # "model.lora_params" / "the trainer's Lora callback"


def parse_groups(value, where: str, params_path) -> tuple:
    """``lora_params`` (one group or a list of groups) as LoraGroups; ConfigError naming what is wrong."""
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ConfigError(params_path, f"{where} is an empty list")
    groups = []
    for n, item in enumerate(items):
        gw = f"{where}[{n}]" if isinstance(value, list) else where
        if not isinstance(item, dict):
            raise ConfigError(params_path, f"{gw} must be a mapping of LoRA settings, got {item!r}")
        unknown = sorted(set(item) - set(GROUP_KEYS))
        if unknown:
            raise ConfigError(params_path, f"{gw} has unknown LoRA setting(s) {unknown} (known: {list(GROUP_KEYS)})")
        r, alpha = item.get("r", 0), item.get("alpha", 1)
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ConfigError(params_path, f"{gw}.r must be a non-negative integer, got {r!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise ConfigError(params_path, f"{gw}.alpha must be a number, got {alpha!r}")
        targets = item.get("target_modules")
        if targets is not None and (not isinstance(targets, list) or not all(isinstance(t, str) for t in targets)):
            raise ConfigError(params_path, f"{gw}.target_modules must be a list of class names or null, "
                                           f"got {targets!r}")
        groups.append(LoraGroup(n, r, alpha, None if targets is None else tuple(targets),
                                bool(item.get("fan_in_fan_out", False))))
    return tuple(groups)


def lora_settings(params: CSParams) -> LoraSettings | None:
    """The checkpoint's LoRA groups from its params, or None when the params set no LoRA."""
    if params.model.get("lora_params") is not None:
        return LoraSettings(parse_groups(params.model["lora_params"], "model.lora_params", params.path),
                            "model.lora_params")
    for n, cb in enumerate(params.callbacks):
        if isinstance(cb, dict) and isinstance(cb.get("Lora"), dict) and cb["Lora"].get("lora_params") is not None:
            where = f"trainer.init.callbacks[{n}].Lora.lora_params"
            return LoraSettings(parse_groups(cb["Lora"]["lora_params"], where, params.path), where)
    return None


@dataclass(frozen=True)
class LoraModule:
    """One CS module with LoRA matrices and what folding it takes."""

    name: str  # CS module key (model tensors' keys without the leading "model.")
    kind: str  # Linear / Embedding
    class_path: tuple
    group: LoraGroup

    @property
    def weight(self) -> str:
        return self.name + ".weight"

    @property
    def lora_a(self) -> str:
        return self.name + SUFFIX_A

    @property
    def lora_b(self) -> str:
        return self.name + SUFFIX_B


@dataclass
class LoraCheckpoint:
    """What a LoRA checkpoint's folded model is: the tensors, the params, and the lines README.txt shows."""

    settings: LoraSettings
    modules: list  # LoraModule, checkpoint order
    params_model: dict  # the folded model's params: no lora_params, tied embeddings untied where needed
    tensors: dict  # CS model tensors with every LoRA weight folded and the lora_A / lora_B keys gone
    notes: list = field(default_factory=list)

    def base_tensors(self, cs: dict) -> dict:
        """The CS model tensors without the LoRA matrices (the base weights as trained from)."""
        return {k: t for k, t in cs.items() if not k.endswith((SUFFIX_A, SUFFIX_B))}


def lora_module_names(cs: dict) -> list:
    """CS modules with LoRA matrices (a lora_A or lora_B key), in checkpoint order."""
    out: dict = {}
    for key in cs:
        if key.endswith((SUFFIX_A, SUFFIX_B)):
            out.setdefault(key[:-len(SUFFIX_A)], None)
    return list(out)


def find_lora(spec: FamilySpec, params: CSParams, cs: dict, ckpt_path=None, *, memory: int | None = None
              ) -> LoraCheckpoint | None:
    """The folded view of a LoRA checkpoint, or None when neither its keys nor its params have LoRA.

    The work a fold costs is bounded by what the checkpoint holds: a group's rank must be within its base weight's
    dimensions, and what one fold holds at once (``fold_bytes``) within ``memory`` (the cache size) when given."""
    names = lora_module_names(cs)
    settings = lora_settings(params)
    if not names and settings is None:
        return None
    if not names:  # params say LoRA, the checkpoint has none: already folded (or the base model)
        params_model = {k: v for k, v in params.model.items() if k != "lora_params"}
        note = (f"params set LoRA ({settings.where}) but the checkpoint has no lora_A / lora_B tensors: mapped as "
                f"it is (a folded checkpoint, or the model before LoRA training)")
        return LoraCheckpoint(settings, [], params_model, dict(cs), [note])
    if settings is None:
        raise ConfigError(params.path or ckpt_path,
                          f"the checkpoint holds LoRA matrices ({len(names)} modules, e.g. {names[0]}.lora_A) but "
                          f"the params set no lora_params (model.lora_params or a trainer Lora callback), so their "
                          f"scaling alpha / r is unknown")
    if spec.lora is None or not spec.lora.modules:
        raise MappingError(spec.path, f"no lora: section with module class paths, so the LoRA matrices of this "
                                      f"{spec.family} checkpoint ({len(names)} modules) cannot be folded")
    classes = _ClassPaths(spec, params)
    modules = []
    for name in names:
        for key in (name + ".weight", name + SUFFIX_A, name + SUFFIX_B):
            if key not in cs:
                raise MappingError(ckpt_path, f"LoRA module model.{name} lacks model.{key}")
        kind, path = classes.of(name)
        if path is None:
            raise MappingError(spec.path, f"lora.modules: no entry matches the LoRA module {name}, so its Model Zoo "
                                          f"class path (which lora_params group applies) is unknown")
        group = next((g for g in settings.groups if g.selects(path)), None)
        if group is None:
            raise ConfigError(params.path, f"no group of {settings.where} selects the LoRA module {name} (class "
                                           f"path {list(path)}), yet the checkpoint holds LoRA matrices for it")
        if group.r == 0:
            raise ConfigError(params.path, f"{settings.where} group {group.index} has r 0, yet the checkpoint holds "
                                           f"LoRA matrices for {name}")
        if group.r != cs[name + SUFFIX_A].shape[0]:
            raise ConfigError(params.path, f"{settings.where} group {group.index} has r {group.r}, but "
                                           f"{name}.lora_A has {cs[name + SUFFIX_A].shape[0]} rows")
        _check_work(name, group.r, cs[name + ".weight"], memory, ckpt_path)
        if group.fan_in_fan_out and kind == "Linear":
            raise MappingError(ckpt_path, f"LoRA module {name}: fan_in_fan_out stores the weight transposed "
                                          f"([in, out]), which no CS -> HF rule expects")
        modules.append(LoraModule(name, kind, path, group))

    tensors = {}
    by_weight = {m.weight: m for m in modules}
    lora_keys = {k for m in modules for k in (m.lora_a, m.lora_b)}
    for key, t in cs.items():
        if key in lora_keys:
            continue
        m = by_weight.get(key)
        tensors[key] = t if m is None else LoraFold(t, cs[m.lora_a], cs[m.lora_b], m.group.scaling,
                                                    embedding=m.kind == "Embedding", name=f"model.{key}")
    params_model = {k: copy.deepcopy(v) for k, v in params.model.items() if k != "lora_params"}
    notes = _notes(settings, modules)
    notes += _unselected(classes, settings, modules, cs)
    notes += _untie(spec, params_model, modules, tensors, cs, classes)
    return LoraCheckpoint(settings, modules, params_model, tensors, notes)


def fold_bytes(rank: int, weight_shape) -> int:
    """What folding one cache block holds at once beyond the block: all of lora_A (Linear) or of lora_B (Embedding)
    for whole rows — rank x the weight's columns — as float32 and as float64."""
    return rank * int(weight_shape[-1]) * 12


def _check_work(name: str, rank: int, weight, memory: int | None, ckpt_path) -> None:
    """``MappingError`` when a fold of ``rank`` would cost more than its base weight can justify: a rank above the
    weight's smaller dimension (a fold of rank r costs r multiply-adds per element), or a fold that holds more
    than ``memory`` bytes at once."""
    if weight.ndim != 2:
        return  # LoraFold says what is wrong with its shape
    if rank > min(weight.shape):
        raise MappingError(ckpt_path, f"LoRA module {name}: rank {rank} exceeds the base weight's dimensions "
                                      f"{list(weight.shape)} (a rank above the smaller one adds nothing a fold can "
                                      f"express)")
    need = fold_bytes(rank, weight.shape)
    if memory is not None and need > memory:
        raise MappingError(ckpt_path, f"LoRA module {name}: folding rank {rank} into {list(weight.shape)} holds "
                                      f"{need:,} bytes at once, more than the cache ({memory:,} bytes; raise "
                                      f"--cache-size)")


class _ClassPaths:
    """Model Zoo class paths of CS modules from the family's ``lora.modules`` table."""

    def __init__(self, spec: FamilySpec, params: CSParams):
        self.spec, self.lora = spec, spec.lora
        cs = copy.deepcopy(params.model)
        for k, v in spec.config.defaults.items():
            cs.setdefault(k, copy.deepcopy(v))
        self.scope = ConfigScope(cs)
        funcs = config_functions(self.scope, spec.path.name, params.path)
        self.values = {}
        for name, text in self.lora.derive.items():
            try:
                self.values[name] = evaluate(text, self.scope.child(self.values), funcs)
            except MissingName as e:
                raise ConfigError(params.path, f"params lack model.{e.name}, needed by lora.derive.{name} of "
                                               f"{spec.path.name}") from None
            except ExprError as e:
                raise MappingError(spec.path, f"lora.derive.{name}: {e}") from None

    def of(self, name: str) -> tuple:
        """(kind, class path) of CS module ``name`` (with or without the wrapper's ``model.``); (None, None)."""
        local = name[len("model."):] if name.startswith("model.") else name
        for candidate in dict.fromkeys((name, local)):
            for entry in self.lora.modules:
                if entry.cs.match(candidate) is not None:
                    try:
                        inner = tuple(fill(c, self.values) for c in entry.classes)
                    except PatternError as e:
                        raise MappingError(self.spec.path, f"{entry.where}: {e}") from None
                    return entry.kind, ((self.lora.wrapper,) if self.lora.wrapper else ()) + inner
        return None, None

    def setting(self, key: str):
        return self.scope.get(key)


def _pattern(name: str) -> str:
    """A module name with its list indices shown as ``*`` (one line per kind of module)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def _notes(settings: LoraSettings, modules: list) -> list:
    kinds = Counter(m.kind for m in modules)
    out = [f"LoRA folded into the weights ({len(modules)} modules: "
           + ", ".join(f"{n} {k}" for k, n in kinds.items())
           + f"), as Model Zoo's fold_lora_checkpoint.py does: W + (lora_B @ lora_A) * alpha / r (Embedding: "
             f"the product transposed), float32; LoRA settings from {settings.where}; the lora_A / lora_B "
             f"matrices are not in the HF files (cs/ keeps the unfolded checkpoint; --lora keep also serves base/ "
             f"and a PEFT adapter/)"]
    for g in settings.groups:
        mine = [m for m in modules if m.group is g]
        where = sorted(dict.fromkeys(_pattern(m.name) for m in mine))
        out.append(f"LoRA {g.describe()}: folded into {len(mine)} modules"
                   + (f" ({', '.join(where)})" if where else ""))
    return out


def _unselected(classes: _ClassPaths, settings: LoraSettings, modules: list, cs: dict) -> list:
    """Modules the params select for LoRA that hold no LoRA matrices (a warning each kind)."""
    have = {m.name for m in modules}
    missing = []
    for key in cs:
        if not key.endswith(".weight") or key[:-len(".weight")] in have:
            continue
        name = key[:-len(".weight")]
        _, path = classes.of(name)
        group = None if path is None else next((g for g in settings.groups if g.selects(path)), None)
        if group is not None and group.r > 0:
            missing.append(name)
    if not missing:
        return []
    kinds = ", ".join(sorted(dict.fromkeys(_pattern(n) for n in missing)))
    return [f"{settings.where} selects {len(missing)} more modules for LoRA ({kinds}) but the checkpoint has no "
            f"lora_A / lora_B for them: their weights are taken as they are"]


def _untie(spec: FamilySpec, params_model: dict, modules: list, tensors: dict, cs: dict,
           classes: _ClassPaths) -> list:
    """Untie the input embedding and the LM head when LoRA changed either (they no longer hold the same values)."""
    tied = spec.lora.tied
    if tied is None or not classes.setting(tied.key):
        return []
    folded = {m.name: m for m in modules}
    changed = []
    for m in tied.modules:
        for name in (m, "model." + m):
            if name in folded:
                changed.append(name)
    if not changed:
        return []
    prefix = "model." if changed[0].startswith("model.") else ""
    emb, head = (prefix + m + ".weight" for m in tied.modules)
    for key, other in ((head, emb), (emb, head)):
        if key not in tensors and other in cs:  # a tied weight stored once (None): the other holds its values
            tensors[key] = cs[other]
    params_model[tied.key] = False
    which = " and ".join(n[len(prefix):] for n in changed)
    note = (f"{tied.key} set to false: LoRA changed {which}, so the input embedding and the LM head no longer hold "
            f"the same values")
    if all(not n.endswith(tied.modules[0]) for n in changed):
        note += (" (fold_lora_checkpoint.py unties only for the input embedding; with the tie kept, the converter "
                 "would drop the folded LM head)")
    return [note]
