"""Which model family (and CLI model name) a Cerebras checkpoint is, and why.

Precedence: an explicit ``model`` name; else the params' ``name:``; else the family whose ``detect``
rules match the checkpoint's CS tensor names (highest priority first). Then a model whose ``replaces:`` names the
chosen one may take its place when its condition holds on the params (BERT without NSP is BertForMaskedLM; a
RoBERTa whose params say ``name: bert`` is RoBERTa): one of another family only when no ``--model`` fixed the
family. Never raises for an unknown model: the result then has ``family=None`` and a ``reason`` saying why.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import CkptfsError, ConfigError
from typing import TYPE_CHECKING
from .params.to_hf_config import ConfigScope, config_functions, format_message
from .lang.expr import ExprError, MissingName, evaluate
from .params.find import CSParams, find_params
from .lang.families import Registry, default_registry

if TYPE_CHECKING:  # the source layer (h5py, numpy) is imported when a checkpoint is read, not with the CLI parser
    from ..catalog.model import Checkpoint


@dataclass
class FamilyDetection:
    family: str | None
    model_name: str | None
    reason: str
    params_path: Path | None
    chosen: str | None = None  # why a model replaced the one named (``replaces:``), for README.txt


def cs_model_tensors(checkpoint: Checkpoint) -> dict:
    """CS model tensors: the checkpoint's tensor leaves under top-level ``model``, keys without ``model.``."""
    from ..catalog.model import TensorLeaf

    out = {}
    for key, leaf in checkpoint.leaves.items():
        if key.startswith("model.") and isinstance(leaf, TensorLeaf):
            out[key[len("model."):]] = leaf.tensor
    return out


def unreadable_model_tensors(checkpoint: Checkpoint) -> dict:
    """``{key: reason}`` of the leaves under top-level ``model`` that ckptfs cannot read (a refused reference, bad
    metadata, a TorchScript graph…): HF weights made without them would silently lack a trained tensor."""
    from ..catalog.model import UnreadableLeaf

    return {k: leaf.reason for k, leaf in checkpoint.leaves.items()
            if k.startswith("model.") and isinstance(leaf, UnreadableLeaf)}


def _matches_keys(spec, keys) -> bool:
    d = spec.detect
    if not d.keys and d.config is None:
        return False
    if not all(any(p.match(k) is not None for k in keys) for p in d.keys):
        return False
    return not any(p.match(k) is not None for p in d.no_keys for k in keys)


def _matches_config(spec, params: CSParams | None) -> bool:
    if spec.detect.config is None:
        return True
    return params is not None and _holds(spec.detect.config, spec, params)


def _holds(expression: str, spec, params: CSParams) -> bool:
    """Whether a detection expression holds on the params (False when it cannot be evaluated)."""
    scope = ConfigScope(params.model)
    try:
        return bool(evaluate(expression, scope, config_functions(scope, spec.path.name, params.path)))
    except (ExprError, MissingName, CkptfsError, TypeError, ValueError):
        return False


def replacement(registry: Registry, spec, model_name: str, params: CSParams | None, *,
                other_families: bool) -> tuple | None:
    """``(spec, model name, reason)`` of the model chosen instead of ``model_name`` of ``spec`` (``replaces:``),
    following replacements of replacements; None when none applies. A model of another family (what the params'
    traits show the checkpoint is) goes before one of the same family (the HF class for its configuration), and is
    only considered with ``other_families`` (no ``--model`` fixed the family)."""
    found, seen = None, {model_name}
    while params is not None:
        current = spec.variant(model_name)
        names = (current.name, *current.aliases)  # a replacement may name the model by any of its names
        families = list({id(s): s for n in names for s in registry.families_replacing(n)}.values())
        order = [s for s in families if s is not spec and other_families] + [s for s in families if s is spec]
        hit = next(((s, m.name, r.reason) for s in order for m in s.models for r in m.replaces
                    if r.model in names and m.name not in seen and _holds(r.when, s, params)), None)
        if hit is None:
            return found
        spec, model_name, why = hit
        why = format_message(why, ConfigScope({**spec.config.defaults, **params.model}))
        seen.add(model_name)
        found = (spec, model_name, why if found is None else f"{found[2]}; {why}")
    return None


def infer_from_keys(registry: Registry, keys, params: CSParams | None):
    """The family whose detect rules fit ``keys`` best, or None."""
    for spec in sorted(registry.families.values(), key=lambda s: (-s.detect.priority, s.family)):
        if _matches_keys(spec, keys) and _matches_config(spec, params):
            return spec
    return None


def detect_family(checkpoint: Checkpoint, config=None, model: str | None = None, *,
                  trainer_index: int | None = None, registry: Registry | None = None) -> FamilyDetection:
    registry = registry or default_registry()
    params, params_problem = None, None
    try:
        params = find_params(checkpoint, config, trainer_index)
    except ConfigError as e:
        params_problem = e.problem
    params_path = params.path if params else None
    where = f"{params.origin}" if params else "no params"

    if model is not None:
        spec = registry.for_model(model)
        if spec is None:
            return FamilyDetection(None, model, f"unknown model name {model!r} (`ckptfs models` lists the "
                                                f"supported names)", params_path)
        return _replaced(registry, FamilyDetection(spec.family, model, f"model {model!r} given explicitly",
                                                   params_path), spec, params, other_families=False)

    name = params.model.get("name") if params else None
    if isinstance(name, str) and name:
        claims = registry.families_for_cs_name(name)
        spec = claims[0] if len(claims) == 1 else None
        if len(claims) > 1:
            fitting = [s for s in claims if _matches_config(s, params)]
            if len(fitting) != 1:
                names = ", ".join(s.family for s in claims)
                return FamilyDetection(None, None, f"params name {name!r} ({where}) is shared by the families {names} "
                                                   f"and the params fit {len(fitting)} of them; pass --model",
                                       params_path)
            spec = fitting[0]
        if spec is None:
            known = ", ".join(sorted(registry.families))
            return FamilyDetection(None, None, f"params name {name!r} ({where}) is not a supported model family "
                                               f"(supported: {known}); pass --model to override", params_path)
        model_name = name if name in spec.names() else spec.models[0].name
        return _replaced(registry, FamilyDetection(spec.family, model_name, f"params name {name!r} ({where})",
                                                   params_path), spec, params, other_families=True)

    keys = list(cs_model_tensors(checkpoint))
    if not keys:
        why = f"; {params_problem}" if params_problem else ""
        return FamilyDetection(None, None, f"the checkpoint has no model tensors (no 'model.*' keys){why}",
                               params_path)
    spec = infer_from_keys(registry, keys, params)
    if spec is None:
        why = f"; {params_problem}" if params_problem else ""
        return FamilyDetection(None, None, f"model family not recognised from the CS tensor names and no "
                                           f"'name' in the params ({where}){why}; pass --model", params_path)
    how = f"no 'name' in {where}" if params else f"params unavailable: {params_problem}"
    return _replaced(registry, FamilyDetection(spec.family, spec.models[0].name,
                                               f"inferred from the CS tensor names ({how})", params_path),
                     spec, params, other_families=True)


def _replaced(registry: Registry, det: FamilyDetection, spec, params: CSParams | None, *,
              other_families: bool) -> FamilyDetection:
    """``det``, or the model that replaces its model on these params (``replacement``), the reason saying both."""
    got = replacement(registry, spec, det.model_name, params, other_families=other_families)
    if got is None:
        return det
    new_spec, name, why = got
    chosen = f"model {name} chosen instead of {det.model_name}: {why}"
    return FamilyDetection(new_spec.family, name, f"{det.reason}; {chosen}", det.params_path, chosen)
