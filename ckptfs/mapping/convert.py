"""The mapping core's entry point: a Cerebras checkpoint -> a lazily computed Hugging Face model.

``to_hf`` detects the family, finds the params, translates the config and maps the tensors; the
returned ``HFModel`` holds HF names with virtual tensors (no data read yet), ``config.json`` and
``generation_config.json`` contents, and every warning (unconverted config keys, dropped or unmatched
tensors).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MappingError
from ..source.catalog import Checkpoint
from . import floats
from .config import config_functions, convert_config, unused_key_warnings
from .detect import cs_model_tensors, detect_family, unreadable_model_tensors
from .lora import find_lora
from .params import find_params
from .registry import Registry, default_registry
from .tensors import RuleEngine


@dataclass
class HFModel:
    family: str
    model_name: str
    hf_class: str
    tensors: list  # [(HF name, VirtualTensor)] in converter order; tied outputs may share one object
    config: dict
    generation_config: dict | None
    warnings: list = field(default_factory=list)
    params_path: Path | None = None
    # multi-component checkpoints (DPO reference model, DPR towers, LLaVA parts): [(sub-folder, HFModel)],
    # each a complete HF model directory of its own beside (or instead of) the root model
    components: list = field(default_factory=list)
    files: dict = field(default_factory=dict)  # more JSON files of this folder: {file name: content}
    description: str = ""  # one line on where this folder's model comes from (README.txt)
    # folders that are no HF model directory (--lora keep's PEFT adapter/): {folder: {file name: content}}, a
    # content being JSON (a dict) or a safetensors file's [(name, tensor)]
    extra_folders: dict = field(default_factory=dict)

    def folders(self) -> dict:
        """{sub-folder ('' = the mount root): HFModel} for every HF model directory this checkpoint gives."""
        out = {"": self} if self.tensors else {}
        for folder, sub in self.components:
            out.update({f"{folder}/{k}".rstrip("/"): v for k, v in sub.folders().items()})
        return out


def weights_dtype(tensors) -> str | None:
    """The dtype of most floating-point elements (HF ``torch_dtype``), or None when there are none."""
    counts: Counter = Counter()
    for _, t in tensors:
        if floats.is_float(t.dtype):
            counts[t.dtype.name] += t.numel
    return counts.most_common(1)[0][0] if counts else None


def set_weights_dtype(config: dict, tensors) -> None:
    """config.json's ``torch_dtype`` and ``dtype`` (both spellings, for old and new transformers) from the tensors."""
    dtype = weights_dtype(tensors)
    if dtype is not None:
        config["torch_dtype"] = dtype
        config["dtype"] = dtype


#: what ``to_hf`` does with a LoRA checkpoint: fold the adapters into the weights (always), and with ``keep`` also
#: serve the base model (``base/``) and the adapter as a PEFT adapter directory (``adapter/``) where PEFT can
#: express it (``lora_peft.py``)
LORA_MODES = ("fold", "keep")


def to_hf(checkpoint: Checkpoint, *, config=None, model: str | None = None, trainer_index: int | None = None,
          registry: Registry | None = None, lora: str = "fold") -> HFModel:
    """Convert ``checkpoint`` to HF; ConfigError / MappingError saying why when it cannot."""
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
    params = find_params(checkpoint, config, trainer_index)
    spec = registry.family(det.family)
    variant = spec.variant(det.model_name)
    warnings = []
    cs_name = params.model.get("name")
    if model is not None and isinstance(cs_name, str) and registry.for_cs_name(cs_name) not in (None, spec):
        warnings.append(f"params name {cs_name!r} overridden by --model {model}")
    if variant.components:  # one HF model directory per component (DPO, DPR, LLaVA)
        from .components import components_to_hf

        return components_to_hf(checkpoint, spec, variant, params, registry, warnings,
                                model_name=det.model_name or variant.name)

    cs = cs_model_tensors(checkpoint)
    name = det.model_name or variant.name
    adapters = find_lora(spec, params, cs, checkpoint.path)  # LoRA folded lazily (None: no LoRA)
    if adapters is None:
        return _map_model(checkpoint, spec, variant, name, params.model, params.path, cs, warnings)
    hf = _map_model(checkpoint, spec, variant, name, adapters.params_model, params.path, adapters.tensors,
                    warnings + adapters.notes)
    if lora == "keep":
        from .lora_peft import keep_adapter

        base_params = {k: v for k, v in params.model.items() if k != "lora_params"}
        base = _map_model(checkpoint, spec, variant, name, base_params, params.path, adapters.base_tensors(cs), [])
        keep_adapter(hf, base, adapters, spec, variant, base_params, params.path, cs)
    return hf


def _map_model(checkpoint: Checkpoint, spec, variant, model_name: str, params_model: dict, params_path,
               cs: dict, warnings: list) -> HFModel:
    """One HF model from CS model tensors ``cs`` and the params ``model:`` section ``params_model``."""
    warnings = list(warnings)
    cfg = convert_config(spec, variant, params_model, params_path)
    cfg.cs_scope.used.add(("name",))  # consumed by family detection
    funcs = config_functions(cfg.cs_scope, spec.path.name, params_path)
    engine = RuleEngine(spec, variant, cfg.scope, funcs, params_path)
    mapping = engine.run(cs)
    if not mapping.tensors:
        raise MappingError(checkpoint.path, f"no CS model tensor matched the {spec.family} mapping "
                                            f"({spec.path.name}); is this really a {variant.name} checkpoint?")

    set_weights_dtype(cfg.hf, mapping.tensors)
    if variant.remote_code:
        warnings.append(f"HF class {variant.hf_class} is not part of transformers: load it with "
                        f"trust_remote_code=True; its modeling code comes from {variant.remote_code}")
    warnings += cfg.warnings
    warnings += unused_key_warnings(cfg.cs_scope, spec, variant)
    warnings += [f"CS tensor model.{key} not converted: {reason}" for key, reason in mapping.dropped]
    for key in mapping.unmatched:
        t = cs[key]
        warnings.append(f"CS tensor model.{key} {list(t.shape)} {t.dtype.name} matches no rule of "
                        f"{spec.path.name}; not converted")
    return HFModel(family=spec.family, model_name=model_name, hf_class=variant.hf_class,
                   tensors=mapping.tensors, config=cfg.hf, generation_config=cfg.generation, warnings=warnings,
                   params_path=params_path)
