"""Multi-component checkpoints: one CS checkpoint -> several Hugging Face model directories.

A model entry with ``components:`` (DPO's policy and reference model, DPR's question and context encoders,
LLaVA's image and text models) is converted component by component: each reads the CS model keys under its
``cs_prefix`` (plus ``cs_rename``d ones) with that prefix removed, takes its config from its params section,
and is mapped by the rules of the model it names (or of its own family). The result is one ``HFModel`` per
folder, gathered under the root ``HFModel``: the component whose folder is ``''`` is the root itself, otherwise
the root holds no tensors. Params keys that no component read and CS tensors that no component claimed are
reported once, on the root.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..errors import ConfigError, MappingError
from .params.to_hf_config import config_functions, convert_config, evaluate_config_expr
from .detect import cs_model_tensors
from .hfmodel import HFModel, Scoped, map_model
from .lang.families import Registry
from .lang.spec import ComponentSpec, FamilySpec, ModelVariant, merge_config


def dotted(path: tuple) -> str:
    return ".".join(map(str, path))


def params_at(section, path: tuple):
    """The params value at ``path`` (dict keys, list indices); KeyError naming the first missing part."""
    value = section
    for i, part in enumerate(path):
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, (list, tuple)) and isinstance(part, int) and -len(value) <= part < len(value):
            value = value[part]
        else:
            raise KeyError(dotted(path[:i + 1]))
    return value


def local_key(key: str, comp: ComponentSpec) -> str | None:
    """``key`` (a CS model key without ``model.``) as ``comp`` sees it, or None when it is not the component's."""
    if key.startswith(comp.cs_prefix):
        return key[len(comp.cs_prefix):]
    for source, local in comp.cs_rename:
        if key.startswith(source):
            return local + key[len(source):]
    return None


def local_names(cs: dict, comp: ComponentSpec, spec_path=None) -> dict:
    """{local name: CS model key} of the keys ``comp`` reads, in checkpoint order."""
    out: dict = {}
    for key in cs:
        name = local_key(key, comp)
        if name is None:
            continue
        if name in out:
            raise MappingError(spec_path, f"{comp.where}: CS tensors model.{out[name]} and model.{key} both become "
                                          f"{name!r}; cs_prefix and cs_rename must not overlap")
        out[name] = key
    return out


def unused_settings(section, used: set, path: tuple = ()) -> list:
    """(path, value) of every params leaf (dicts and lists walked) that no read path covers."""
    if path in used:
        return []
    if isinstance(section, Mapping) and section:
        items = section.items()
    elif isinstance(section, list) and section and any(p[:len(path)] == path and len(p) > len(path) for p in used):
        items = enumerate(section)  # a list only partly read: report its unread items
    else:
        return [(path, section)] if path else []
    out = []
    for k, v in items:
        out += unused_settings(v, used, path + (k,))
    return out


@dataclasses.dataclass
class Built:
    """One converted component, and what it read of the params and the checkpoint."""

    comp: ComponentSpec
    spec: FamilySpec  # the family whose rules mapped it (with the component's own rules merged in)
    model: HFModel
    used: set  # params paths (from the model: section) it read
    claimed: set  # CS model keys it read


def resolve_model(comp: ComponentSpec, top: FamilySpec, variant: ModelVariant, section, registry: Registry,
                  params) -> tuple:
    """(family, variant) whose rules map ``comp``: the model it names, or the top family with ``variant``."""
    name = comp.model
    if comp.model_from is not None:
        name = section.get(comp.model_from) if isinstance(section, Mapping) else None
        if not isinstance(name, str) or not name:
            raise ConfigError(params.path, f"params lack model.{dotted(comp.params + (comp.model_from,))} naming "
                                           f"the model of {comp.folder or 'the root'} folder [{comp.where}]")
    if name is None:
        return top, variant
    spec = registry.for_model(name) or registry.for_cs_name(name)
    if spec is None:
        raise ConfigError(params.path, f"model {name!r} of {comp.folder or 'the root'} folder is not a supported "
                                       f"model name (`ckptfs models` lists them) [{comp.where}]")
    sub = spec.variant(name) if name in spec.names() else spec.models[0]
    if sub.components:
        raise MappingError(top.path, f"{comp.where}: model {name!r} has components itself; components do not nest")
    return spec, sub


def component_params(comp: ComponentSpec, whole: dict, params, spec_path) -> dict:
    """The params section ``comp`` converts, with its ``params_bind`` values added under their names."""
    try:
        section = params_at(whole, comp.params)
    except KeyError as e:
        raise ConfigError(params.path, f"params lack model.{e.args[0]}, the section of the "
                                       f"{comp.folder or 'root'} folder [{comp.where}]") from None
    if not isinstance(section, Mapping):
        raise ConfigError(params.path, f"params model.{dotted(comp.params)} is not a section "
                                       f"({type(section).__name__}) [{comp.where}]")
    section = dict(section)
    for name, path in comp.params_bind:
        if name in section:
            raise MappingError(spec_path, f"{comp.where}.params_bind: {name!r} is also a key of params "
                                          f"model.{dotted(comp.params)}")
        try:
            section[name] = params_at(whole, path)
        except KeyError:
            pass  # absent: expressions see no such name (get() gives its default)
    return section


def component_config(comp: ComponentSpec, top: FamilySpec, variant: ModelVariant, params, registry: Registry,
                     problems: list | None = None) -> tuple:
    """(family spec, variant, base variant, ConfigResult) of one component without its tensors: the family whose
    rules map it (with the component's own config and rules merged in) and its converted config (``problems``:
    see ``convert_config``)."""
    section = component_params(comp, params.model, params, top.path)
    base, base_variant = resolve_model(comp, top, variant, section, registry, params)
    spec, sub = component_spec(comp, base, base_variant)
    return spec, sub, base_variant, convert_config(spec, sub, section, params.path, problems)


def component_spec(comp: ComponentSpec, base: FamilySpec, base_variant: ModelVariant) -> tuple:
    """(family spec, variant) of a component mapped by the family ``base``: the component's own model type, HF
    class, config and tensor rules merged over the family's (its rules first), no components of its own."""
    spec = dataclasses.replace(
        base, model_type=comp.model_type or base.model_type,
        config=merge_config(base.config, comp.config) if comp.config else base.config,
        tensors=list(comp.tensors) + list(base.tensors))
    sub = dataclasses.replace(base_variant, hf_class=comp.hf_class or base_variant.hf_class,
                              vars={**base_variant.vars, **comp.vars}, components=())
    return spec, sub


def params_used(comp: ComponentSpec, cfg) -> set:
    """The params paths (from the model: section) a component's config conversion read."""
    binds = dict(comp.params_bind)
    used = {binds[p[0]] + p[1:] if p[0] in binds else comp.params + p for p in cfg.cs_scope.used}
    if comp.model_from is not None:
        used.add(comp.params + (comp.model_from,))
    return used


def build_component(comp: ComponentSpec, top: FamilySpec, variant: ModelVariant, cs: dict, params,
                    registry: Registry) -> Built:
    """Convert one component: its config, its tensors, its extra files."""
    spec, sub, base_variant, cfg = component_config(comp, top, variant, params, registry)
    funcs = config_functions(cfg.cs_scope, spec.path.name, params.path)
    files = {}
    for fname, text in comp.files:
        files[fname] = evaluate_config_expr(text, cfg.scope, funcs, params.path, top.path,
                                            f"{comp.where}.files.{fname}")
    names = local_names(cs, comp, top.path)
    local = {name: cs[key] for name, key in names.items()}
    where = " or ".join(f"model.{p}*" for p in (comp.cs_prefix, *(s for s, _ in comp.cs_rename)))
    section_text = f"params model.{dotted(comp.params)}" if comp.params else "the params model: section"
    model = map_model(spec, sub, cfg, local, params.path, family=top.family, model_name=base_variant.name,
                      scoped=Scoped(names, where, comp.folder),
                      empty=(top.path, f"{comp.where}: no CS tensor under {where} matched the {spec.family} "
                                       f"rules; is this really a {variant.name} checkpoint?"))
    model.files = files
    model.description = f"{sub.hf_class} ({spec.family} rules) from CS {where} and {section_text}"
    return Built(comp, spec, model, params_used(comp, cfg), set(names.values()))


def unused_warnings(params, built: list, top: FamilySpec, variant: ModelVariant, extra_used: set) -> list:
    """One warning per params setting that no component read, with the reason the YAML notes give."""
    used = set(extra_used).union(*(b.used for b in built))
    out = []
    for path, value in unused_settings(params.model, used):
        key = dotted(path)
        note = top.config.notes.get(key) or top.config.notes.get(str(path[0]))
        for b in sorted(built, key=lambda b: -len(b.comp.params)):
            rel = path[len(b.comp.params):] if path[:len(b.comp.params)] == b.comp.params else None
            if not note and rel:
                note = b.spec.config.notes.get(dotted(rel)) or b.spec.config.notes.get(str(rel[0]))
        why = f" ({note})" if note else ""
        out.append(f"params model.{key}={value!r} has no counterpart in the HF config.json of any folder of "
                   f"{variant.name}; not converted{why}")
    return out


def components_to_hf(checkpoint, top: FamilySpec, variant: ModelVariant, params, registry: Registry,
                     warnings: list, *, model_name: str) -> HFModel:
    """Convert every component of ``variant``; the root HFModel holds the others in ``components``."""
    cs = cs_model_tensors(checkpoint)
    built = [build_component(c, top, variant, cs, params, registry) for c in variant.components]

    warnings = list(warnings)
    for b in built:
        prefix = f"{b.comp.folder}/: " if b.comp.folder else ""
        warnings += [prefix + w for w in b.model.warnings]
    warnings += unused_warnings(params, built, top, variant, {("name",)})
    claimed = set().union(*(b.claimed for b in built))
    for key, t in cs.items():
        if key not in claimed:
            warnings.append(f"CS tensor model.{key} {list(t.shape)} {t.dtype.name} belongs to no component of "
                            f"{variant.name} ({top.path.name}); not converted")

    subs = [(b.comp.folder, b.model) for b in built if b.comp.folder]
    root = next((b.model for b in built if not b.comp.folder), None)
    if root is None:
        return HFModel(family=top.family, model_name=model_name, hf_class=variant.hf_class, tensors=[], config={},
                       generation_config=None, warnings=warnings, params_path=params.path, components=subs,
                       description=f"{variant.name}: " + ", ".join(f"{f}/ {m.hf_class}" for f, m in subs))
    return dataclasses.replace(root, family=top.family, model_name=model_name, warnings=warnings, components=subs)
