"""The HF config.json a checkpoint trained with a params YAML would get, from the params alone (no tensors).

``params_to_hf_configs`` runs the mapping core's config conversion (``convert_config``, per component for
multi-component models) exactly as ``to_hf`` does, and reports every obstacle at once (one message per setting HF
cannot express) and every params key that would be dropped. The weights' dtype (``torch_dtype``/``dtype`` in
config.json) comes from the tensors in a real conversion; here it is given (``dtype``, default float32: Cerebras
keeps float32 weights unless the model was built in another dtype).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from ...errors import ConfigError
from ..components import Built, component_config, params_used, unused_warnings
from .to_hf_config import convert_config, unused_key_warnings
from ..detect import detect_family
from .find import load_params_file
from ..lang.families import Registry, default_registry

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ParamsConversion:
    family: str | None = None
    model_name: str | None = None
    configs: dict = field(default_factory=dict)  # HF folder ('' = the root) -> config.json content
    problems: list = field(default_factory=list)  # settings HF cannot express, one message each
    dropped: list = field(default_factory=list)  # params keys with no HF counterpart (README.txt warnings)
    notes: list = field(default_factory=list)  # other warnings of the conversion

    @property
    def ok(self) -> bool:
        return not self.problems


def _with_dtype(config: dict, dtype: str) -> dict:
    return {**config, "torch_dtype": dtype, "dtype": dtype}


def params_to_hf_configs(params_path, *, model: str | None = None, trainer_index: int | None = None,
                         dtype: str = "float32", registry: Registry | None = None) -> ParamsConversion:
    """Convert the params YAML at ``params_path``; ``ConfigError`` only when there is no model to convert at all
    (unreadable params, unknown model name), otherwise the obstacles are in the result's ``problems``."""
    registry = registry or default_registry()
    path = Path(params_path)
    params = load_params_file(path, trainer_index)
    stub = SimpleNamespace(path=path, leaves={})  # detection from the params alone: no tensor names to look at
    det = detect_family(stub, path, model, trainer_index=trainer_index, registry=registry)
    if det.family is None:
        if model is None and not params.model.get("name"):
            raise ConfigError(path, "params have no model.name to tell the model family; pass --model")
        raise ConfigError(path, det.reason)
    spec = registry.family(det.family)
    if spec.no_hf is not None:
        raise ConfigError(path, f"model {det.model_name} (family {spec.family}) has no Hugging Face counterpart: "
                                f"{spec.no_hf}")
    variant = spec.variant(det.model_name)
    out = ParamsConversion(family=spec.family, model_name=det.model_name or variant.name)
    out.notes += [det.chosen] if det.chosen else []
    cs_name = params.model.get("name")
    if model is not None and isinstance(cs_name, str) and registry.for_cs_name(cs_name) not in (None, spec):
        out.notes.append(f"params name {cs_name!r} overridden by --model {model}")

    if variant.components:
        built = []
        for comp in variant.components:
            try:
                sub_spec, sub, _, cfg = component_config(comp, spec, variant, params, registry, out.problems)
            except ConfigError as e:
                out.problems.append(e.problem)
                continue
            out.configs[comp.folder] = _with_dtype(cfg.hf, dtype)
            out.notes += [f"{comp.folder}/: {w}" if comp.folder else w for w in cfg.warnings]
            built.append(Built(comp, sub_spec, None, params_used(comp, cfg), set()))
        out.dropped = unused_warnings(params, built, spec, variant, {("name",)})
        return out

    cfg = convert_config(spec, variant, params.model, params.path, out.problems)
    cfg.cs_scope.used.add(("name",))  # consumed by family detection
    out.configs[""] = _with_dtype(cfg.hf, dtype)
    out.notes += cfg.warnings
    out.dropped = unused_key_warnings(cfg.cs_scope, spec, variant)
    return out


__all__ = ["DTYPES", "ParamsConversion", "params_to_hf_configs"]
