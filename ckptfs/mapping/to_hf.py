"""The mapping core's entry point: a Cerebras checkpoint -> a lazily computed Hugging Face model.

``to_hf`` detects the family, finds the params, translates the config and maps the tensors; the
returned ``HFModel`` holds HF names with virtual tensors (no data read yet), ``config.json`` and
``generation_config.json`` contents, and every warning (unconverted config keys, dropped or unmatched
tensors).
"""
from __future__ import annotations

from ..errors import MappingError
from ..catalog.model import Checkpoint
from .components import components_to_hf
from .params.to_hf_config import convert_config, unused_key_warnings
from .detect import cs_model_tensors, detect_family, unreadable_model_tensors
from .hfmodel import HFModel, map_model
from .lora.find import find_lora
from .lora.peft import keep_adapter
from .params.find import find_params
from .lang.families import Registry, default_registry


#: what ``to_hf`` does with a LoRA checkpoint: fold the adapters into the weights (always), and with ``keep`` also
#: serve the base model (``base/``) and the adapter as a PEFT adapter directory (``adapter/``) where PEFT can
#: express it (``lora_peft.py``)
LORA_MODES = ("fold", "keep")


def to_hf(checkpoint: Checkpoint, *, config=None, model: str | None = None, trainer_index: int | None = None,
          registry: Registry | None = None, lora: str = "fold", memory: int | None = None) -> HFModel:
    """Convert ``checkpoint`` to HF; ConfigError / MappingError saying why when it cannot. ``memory``: what one
    tensor operation may hold at once (the cache size; bounds a LoRA fold, ``find_lora``)."""
    if lora not in LORA_MODES:
        raise ValueError(f"lora must be one of {LORA_MODES}, got {lora!r}")
    registry = registry or default_registry()
    det = detect_family(checkpoint, config, model, trainer_index=trainer_index, registry=registry)
    if det.family is None:
        raise MappingError(checkpoint.path, det.reason)
    unreadable = unreadable_model_tensors(checkpoint)
    if unreadable:  # never a model that silently lacks a trained tensor
        key, reason = next(iter(unreadable.items()))
        more = f" (and {len(unreadable) - 1} more model tensors)" if len(unreadable) > 1 else ""
        raise MappingError(checkpoint.path, f"CS tensor {key} is unreadable ({reason}){more}; the Hugging Face "
                                            "weights would lack it")
    spec = registry.family(det.family)
    if spec.no_hf is not None:
        raise MappingError(checkpoint.path, f"model {det.model_name} (family {spec.family}) has no Hugging Face "
                                            f"counterpart: {spec.no_hf}")
    params = find_params(checkpoint, config, trainer_index)
    variant = spec.variant(det.model_name)
    warnings = []
    cs_name = params.model.get("name")
    if model is not None and isinstance(cs_name, str) and registry.for_cs_name(cs_name) not in (None, spec):
        warnings.append(f"params name {cs_name!r} overridden by --model {model}")
    hf = _to_hf(checkpoint, spec, variant, params, registry, warnings, det.model_name or variant.name, lora, memory)
    hf.chosen = det.chosen or ""
    return hf


def _to_hf(checkpoint: Checkpoint, spec, variant, params, registry, warnings: list, name: str, lora: str,
           memory: int | None) -> HFModel:
    """``to_hf`` once the family and model are known."""
    if variant.components:  # one HF model directory per component (DPO, DPR, LLaVA)
        return components_to_hf(checkpoint, spec, variant, params, registry, warnings, model_name=name)

    cs = cs_model_tensors(checkpoint)
    adapters = find_lora(spec, params, cs, checkpoint.path, memory=memory)  # folded lazily (None: no LoRA)
    if adapters is None:
        return _map_model(checkpoint, spec, variant, name, params.model, params.path, cs, warnings)
    hf = _map_model(checkpoint, spec, variant, name, adapters.params_model, params.path, adapters.tensors,
                    warnings + adapters.notes)
    if lora == "keep":
        base_params = {k: v for k, v in params.model.items() if k != "lora_params"}
        base = _map_model(checkpoint, spec, variant, name, base_params, params.path, adapters.base_tensors(cs), [])
        keep_adapter(hf, base, adapters, spec, variant, base_params, params.path, cs)
    return hf


def _map_model(checkpoint: Checkpoint, spec, variant, model_name: str, params_model: dict, params_path,
               cs: dict, warnings: list) -> HFModel:
    """One HF model from CS model tensors ``cs`` and the params ``model:`` section ``params_model``."""
    cfg = convert_config(spec, variant, params_model, params_path)
    cfg.cs_scope.used.add(("name",))  # consumed by family detection
    return map_model(spec, variant, cfg, cs, params_path, family=spec.family, model_name=model_name,
                     warnings=warnings, config_warnings=unused_key_warnings(cfg.cs_scope, spec, variant),
                     empty=(checkpoint.path, f"no CS model tensor matched the {spec.family} mapping "
                                             f"({spec.path.name}); is this really a {variant.name} checkpoint?"))
