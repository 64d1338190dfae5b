"""The mapping core the other way: a Hugging Face model -> the Cerebras checkpoint the Model Zoo converter makes.

``to_cs`` takes, per HF model folder (``''`` for a single-folder model), its parsed ``config.json`` and its tensors
(``{HF name: VirtualTensor}``, read lazily by the caller), and gives a ``CSModel``: the CS model tensors under the
keys ``cstorch.save`` writes (``model.<key>``), the params the converter writes (``{'model': {...}}``), the model
name chosen, and notes for README.txt (tensors ckptfs adds and why, HF settings the params cannot carry, HF tensors
no rule takes). It uses the same family files as ``to_hf``, read the other way: ``config.cs`` for the params
(``hf_params.py``), the tensor rules pushed back through their ops (``inverse.py``). The result is checked by
mapping it forward again: every HF tensor must come back under its name and shape, and one that does not come back
is an error naming it (a weight lost), unless its family declares it unused (``config.hf_unused``, with the
reason: rotary ``inv_freq`` buffers, a head the CS model lacks) or the caller allows unused weights
(``allow_unused``, the CLI's ``--allow-unused-weights``). The config must agree with the weights
(``hf_agreement``): structural sizes are positive integers, layers, hidden size and experts match the tensors.

Multi-component models (``components:``) take one folder per component; a component with ``copy_of`` that the HF
model lacks is made from that folder's tensors, as the converter makes DPO's reference model.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import SimpleNamespace

from ..errors import ConfigError, MappingError
from ..tensor import ops
from .components import component_config, component_spec, params_at
from .params.to_hf_config import ConfigScope, config_functions, convert_config
from .lang.expr import ExprError, MissingName, evaluate
from .hf_agreement import agreement_problem, structural_problem
from .params.to_cs_params import cs_differences, dotted_path, hf_functions, hf_to_section, set_path
from .inverse import InverseEngine, hf_coverage
from .lang.pattern import KeyPattern
from .lang.families import Registry, default_registry
from .forward import RuleEngine
from .lang.spec import ComponentSpec, FamilySpec, ModelVariant


@dataclass
class CSModel:
    """A Cerebras checkpoint planned from an HF model (nothing read)."""

    family: str
    model_name: str  # the converter name (``--model``) it was made as
    tensors: list  # [(CS key without 'model.', VirtualTensor)]: the checkpoint's ``model`` entries, in order
    params: dict  # params.yaml: {'model': {...}}
    notes: list = field(default_factory=list)  # README.txt lines
    added: list = field(default_factory=list)  # CS keys of tensors the HF model does not hold (``added=False``: none)

    def state(self) -> dict:
        """``{'model.<key>': tensor}``: the flat keys ``cstorch.save`` writes for ``{'model': state_dict}``."""
        return {"model." + k: t for k, t in self.tensors}


@dataclass
class CSParams:
    """``hf_to_params``: the params an HF config gives, and what it cannot carry."""

    family: str | None = None
    model_name: str | None = None
    params: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)  # settings the Cerebras model cannot take, one message each
    notes: list = field(default_factory=list)  # HF settings not carried by the params, one line each

    @property
    def ok(self) -> bool:
        return not self.problems


# -- which model ------------------------------------------------------------------------------------------------

def _architecture(config: dict) -> str | None:
    arch = config.get("architectures")
    return arch[0] if isinstance(arch, list) and arch and isinstance(arch[0], str) else None


def detect_hf(configs: dict, model: str | None, registry: Registry, names: dict | None = None, *, path=None) -> tuple:
    """(family spec, variant, model name, notes) for HF configs by folder; ConfigError when no converter name fits.

    A model's ``architectures`` (else its ``model_type``) gives the candidates; with the HF tensor names by folder
    (``names``), the candidate whose rules take most of them wins (a headless model from one with an LM head: the
    configs of remote-code models do not tell them apart)."""
    if model is not None:
        spec = registry.for_model(model)
        if spec is None:
            raise ConfigError(path, f"--model {model!r} is not a supported model name (`ckptfs models` lists them)")
        return spec, spec.variant(model), model, []
    folders = set(configs)
    found = []  # (rank, family, variant)
    for spec in registry.families.values():
        for v in spec.models:
            if v.components:
                need = {c.folder for c in v.components if c.copy_of is None}
                every = {c.folder for c in v.components}
                if not (need <= folders <= every):
                    continue
                score = sum(c.hf_class is not None and _architecture(configs[c.folder]) == c.hf_class
                            for c in v.components if c.folder in folders)
                if score:  # the folders say which model; a component's class may be spelled otherwise (LLaVA)
                    found.append(((-score,), spec, v))
            elif folders == {""}:
                config = configs[""]
                by_class = _architecture(config) == v.hf_class
                if not by_class and not (spec.model_type and config.get("model_type") == spec.model_type):
                    continue
                cover = hf_coverage(spec, v, names[""]) if names else 0
                found.append(((-cover, not by_class), spec, v))
    found.sort(key=lambda f: f[0])
    ties = [(spec, v) for rank, spec, v in found if rank == found[0][0]] if found else []
    if not found:
        arch = {f or ".": _architecture(c) for f, c in configs.items()}
        raise ConfigError(path, f"no converter name takes this Hugging Face model (architectures {arch}); pass "
                                f"--model NAME (`ckptfs models` lists them)")
    spec, v = ties[0]
    notes = []
    if len(ties) > 1:
        others = ", ".join(o.name for _, o in ties[1:])
        notes.append(f"model {v.name} chosen from the HF model; --model chooses another ({others})")
    return spec, v, v.name, notes


def _component_model(comp: ComponentSpec, top: FamilySpec, variant: ModelVariant, config: dict,
                     registry: Registry, path=None) -> tuple:
    """(family, variant) whose rules map ``comp`` of an HF model: the model it names, the model its folder's HF
    class says (``model_from``), or the top family."""
    if comp.model is not None:
        spec = registry.for_model(comp.model) or registry.for_cs_name(comp.model)
        return spec, spec.variant(comp.model) if comp.model in spec.names() else spec.models[0]
    if comp.model_from is not None:
        spec, sub, _, _ = detect_hf({"": config}, None, registry, path=path)
        return spec, sub
    return top, variant


# -- params -------------------------------------------------------------------------------------------------------

def _sorted(value):
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def _place(whole: dict, path: tuple, section: dict) -> None:
    if not path:
        whole.update(section)
        return
    try:
        node = params_at(whole, path)
    except KeyError:
        set_path(whole, path, section)
        return
    node.update(section)


def _variant_entries(variant: ModelVariant, configs: dict, whole: dict, model_name: str, problems: list) -> None:
    """A multi-component model's own params entries (``models[].cs``), over the HF configs by folder (``root`` for
    the folder '')."""
    hf = ConfigScope({(f or "root"): c for f, c in configs.items()})
    scope = hf.child({"model_name": model_name})
    funcs = hf_functions(hf, f"{variant.name} (models.cs)", None)
    for key, text in variant.cs.items():
        try:
            value = evaluate(text, scope, funcs)
        except MissingName as e:
            problems.append(f"the HF configs lack {e.name}, needed for params model.{key}")
            continue
        except ConfigError as e:
            problems.append(e.problem)
            continue
        except ExprError as e:
            raise MappingError(None, f"{variant.name}: models.cs.{key}: {e}") from None
        set_path(whole, dotted_path(key), value)


def _params(spec, variant, model_name, configs, registry, problems, path=None) -> tuple:
    """(params model: section, {folder: (spec, variant, section result)}) for the HF configs by folder."""
    whole: dict = {}
    parts = {}
    if not variant.components:
        sec = hf_to_section(spec, variant, configs[""], model_name=model_name, problems=problems, config_path=path)
        return sec.section, {"": (spec, variant, sec)}
    for comp in variant.components:
        config = configs.get(comp.folder)
        if config is None:
            continue  # a copy_of component the HF model lacks: its section is its source's
        base, base_variant = _component_model(comp, spec, variant, config, registry, path)
        cspec, sub = component_spec(comp, base, base_variant)
        sec = hf_to_section(cspec, sub, config, model_name=base_variant.name, problems=problems,
                            config_path=path)
        if comp.model_from is not None:
            sec.section[comp.model_from] = base_variant.name
        _place(whole, comp.params, sec.section)
        parts[comp.folder] = (cspec, sub, sec)
    _variant_entries(variant, configs, whole, model_name, problems)
    return whole, parts


def hf_to_params(configs: dict, *, model: str | None = None, registry: Registry | None = None,
                 path=None) -> CSParams:
    """The params YAML the converter writes for HF configs by folder (``{'': config}`` for one model): every
    obstacle in ``problems``, every HF setting the params do not carry in ``notes``; ConfigError (naming ``path``)
    only when no converter name takes the model."""
    registry = registry or default_registry()
    spec, variant, name, notes = detect_hf(configs, model, registry, path=path)
    out = CSParams(spec.family, name, notes=list(notes))
    section, parts = _params(spec, variant, name, configs, registry, out.problems, path)
    out.params = {"model": _sorted(section)}
    if out.problems:
        return out
    for folder, (cspec, sub, sec) in parts.items():
        try:
            back = _forward_config(cspec, sub, variant, section, folder, spec, registry)
        except ConfigError as e:
            out.problems.append(e.problem)
            continue
        lost = cs_differences(configs[folder], back.hf, sec.used, cspec.config.hf_notes, sub.hf_class)
        out.notes += [f"{folder}/: {n}" if folder else n for n in lost]
    return out


def _forward_config(cspec, sub, variant, section, folder, top, registry):
    """The CS -> HF config of the params ``section`` (for component ``folder`` of a multi-component model)."""
    if not variant.components:
        return convert_config(cspec, sub, section, None)
    comp = next(c for c in variant.components if c.folder == folder)
    return component_config(comp, top, variant, SimpleNamespace(model=section, path=None), registry)[3]


# -- tensors -------------------------------------------------------------------------------------------------------

def _global_key(comp: ComponentSpec, local: str) -> str:
    for source, prefix in comp.cs_rename:
        if local.startswith(prefix):
            return source + local[len(prefix):]
    return comp.cs_prefix + local


#: HF tensors left out listed one by one in the notes; more are counted
MAX_UNMATCHED_NOTES = 20


@functools.lru_cache(maxsize=None)
def _pattern(text: str) -> KeyPattern:
    return KeyPattern.compile(text)


def _unused_reason(spec, name: str) -> str | None:
    """Why the family leaves the HF tensor ``name`` out on purpose (``config.hf_unused``), or None."""
    for text, why in spec.config.hf_unused.items():
        if _pattern(text).match(name) is not None:
            return why
    return None


def _map_folder(spec, sub, cfg, hf: dict, where: str, notes: list, path, allow_unused: bool = False):
    """The ``CSMapping`` of one HF folder (CS keys as its rules name them); checks that the CS tensors map back to
    every HF tensor. An HF tensor the checkpoint would not carry is an error (ConfigError naming it), unless the
    family declares it unused (``config.hf_unused``: a note with the reason) or ``allow_unused`` (a note)."""
    funcs = config_functions(cfg.cs_scope, spec.path.name, None)
    mapping = InverseEngine(spec, sub, cfg.scope, funcs).run(hf)
    if not mapping.tensors:
        raise MappingError(path, f"{where}no HF tensor matched the {spec.family} rules ({spec.path.name}); is this "
                                 f"really a {sub.hf_class}?")
    local = dict(mapping.tensors + mapping.made + [(a.key, a.tensor) for a in mapping.added])
    back = dict(RuleEngine(spec, sub, cfg.scope, funcs).run(local).tensors)
    unmatched = set(mapping.unmatched)
    lost = [(n, "matches no rule of " + spec.path.name) for n in mapping.unmatched]
    for name, t in hf.items():
        if name in unmatched:
            continue
        if name not in back:
            lost.append((name, "is not carried by the Cerebras checkpoint (its CS tensors map to other HF names)"))
        elif back[name].shape != t.shape:
            raise MappingError(spec.path, f"{where}HF tensor {name} {list(t.shape)} would come back as "
                                          f"{list(back[name].shape)}: the inverse of its rule is wrong")
    declared = {}
    undeclared = []
    for name, how in lost:
        why = _unused_reason(spec, name)
        if why is None:
            undeclared.append((name, how))
        else:
            declared.setdefault(why, []).append(name)
    if undeclared and not allow_unused:
        name, how = undeclared[0]
        t = hf[name]
        more = f" (and {len(undeclared) - 1} more unused)" if len(undeclared) > 1 else ""
        raise ConfigError(path, f"{where}HF weight {name} {list(t.shape)} {t.dtype.name} {how}: the Cerebras "
                                f"checkpoint would lose it{more}; is config.json the weights' own? "
                                f"(--allow-unused-weights converts without it)")
    for why, names in declared.items():
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        notes.append(f"{where}HF tensor(s) {shown} not converted: {why}")
    for name, how in undeclared[:MAX_UNMATCHED_NOTES]:
        t = hf[name]
        notes.append(f"{where}HF tensor {name} {list(t.shape)} {t.dtype.name} {how}; not converted "
                     f"(--allow-unused-weights)")
    if len(undeclared) > MAX_UNMATCHED_NOTES:
        notes.append(f"{where}{len(undeclared) - MAX_UNMATCHED_NOTES} more HF tensors unused; not converted "
                     f"(--allow-unused-weights)")
    return mapping


def to_cs(folders: dict, *, model: str | None = None, added: bool = True, registry: Registry | None = None,
          path=None, allow_unused: bool = False) -> CSModel:
    """Plan the Cerebras checkpoint of an HF model: ``folders`` maps a folder ('' for a single model) to
    ``(config dict, {HF name: VirtualTensor})``; ``added=False`` leaves out tensors the HF model does not hold
    (README.txt says which); ``allow_unused``: an HF tensor the checkpoint would not carry is a note, not an error.
    ConfigError / MappingError (naming ``path``, the HF model's folder) saying why when it cannot."""
    registry = registry or default_registry()
    configs = {f: c for f, (c, _) in folders.items()}
    for folder, config in configs.items():
        why = structural_problem(config)
        if why is not None:
            raise ConfigError(path, (f"{folder}/: " if folder else "") + why)
    spec, variant, name, notes = detect_hf(configs, model, registry, {f: list(t) for f, (_, t) in folders.items()},
                                           path=path)
    problems: list = []
    section, parts = _params(spec, variant, name, configs, registry, problems, path)
    if problems:
        raise ConfigError(path, problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    params = {"model": _sorted(section)}
    out = CSModel(spec.family, name, [], params, list(notes))
    pending_added = []
    by_folder: dict = {}
    comps = variant.components or (None,)
    for comp in comps:
        folder = "" if comp is None else comp.folder
        where = f"{folder}/: " if folder else ""
        if folder not in folders:
            continue
        cspec, sub, sec = parts[folder]
        cfg = _forward_config(cspec, sub, variant, section, folder, spec, registry)
        config, hf = folders[folder]
        mapping = _map_folder(cspec, sub, cfg, hf, where, out.notes, path, allow_unused)
        glob = (lambda k: k) if comp is None else (lambda k, c=comp: _global_key(c, k))
        by_folder[folder] = mapping
        out.tensors += [(glob(k), t) for k, t in mapping.tensors + mapping.made]
        pending_added += [(glob(a.key), a.tensor, f"{where}{a.why}") for a in mapping.added]
        lost = cs_differences(config, cfg.hf, sec.used, cspec.config.hf_notes, sub.hf_class)
        out.notes += [where + n for n in lost]
    for comp in variant.components:
        if comp.folder in folders or comp.copy_of is None:
            continue
        src = by_folder[comp.copy_of]
        for k, t in src.tensors + src.made + [(a.key, a.tensor) for a in src.added]:
            pending_added.append((_global_key(comp, k), ops.Alias(t),
                                  f"{comp.folder}/ is not in the Hugging Face model: a copy of "
                                  f"{comp.copy_of or 'the root'}'s tensors, as the converter makes it"))
    for key, t, why in pending_added:
        if added:
            out.tensors.append((key, t))
            out.added.append(key)
    why = agreement_problem(section, out.tensors)
    if why is not None:
        raise ConfigError(path, why)
    _explain_added(out, pending_added, added)
    seen = set()
    for i, (key, t) in enumerate(out.tensors):  # one object per key: a checkpoint writer would link repeats
        if id(t) in seen:
            out.tensors[i] = (key, ops.Alias(t))
        seen.add(id(t))
    return out


def _explain_added(out: CSModel, pending: list, added: bool) -> None:
    """One note per reason (a component copy is one line, not one per tensor)."""
    by_why: dict = {}
    for key, _, why in pending:
        by_why.setdefault(why, []).append(key)
    for why, keys in by_why.items():
        shown = ", ".join(f"model.{k}" for k in keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        if added:
            out.notes.append(f"added {shown}: {why}")
        else:
            out.notes.append(f"left out {shown} (tensors the Hugging Face model does not hold): {why}")


__all__ = ["CSModel", "CSParams", "detect_hf", "hf_to_params", "to_cs"]
