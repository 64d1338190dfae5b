"""One Hugging Face model folder as the mapping core gives it (``HFModel``), and the one function that makes it.

``map_model`` turns CS model tensors and a converted config into an ``HFModel``: the family's rules run
(``rules.RuleEngine``), config.json gets the weights' dtype, and every warning (remote code, config notes, dropped
and unmatched tensors) is written here once. Whole models (``convert.to_hf``) and the components of a
multi-component checkpoint (``components.py``) both go through it.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MappingError
from ..tensor import floats
from .params.to_hf_config import ConfigResult, config_functions
from .forward import RuleEngine
from .lang.spec import FamilySpec, ModelVariant


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
    chosen: str = ""  # why this model replaced the one the params or --model named (README.txt), "" if none did
    # config.json's token ids: where each came from ({key: ckptfs.mapping.params.to_hf_config.TOKEN_ID_SOURCES key})
    token_id_sources: dict = field(default_factory=dict)

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


@dataclass
class Scoped:
    """Which CS keys a model (or component) reads, for its messages: ``names`` maps the name its rules see to the
    checkpoint's key (a component's prefix removed), ``where`` says what was searched, ``folder`` which HF folder
    it becomes (None: a whole model)."""

    names: dict | None = None
    where: str = ""
    folder: str | None = None

    def key(self, local: str) -> str:
        return local if self.names is None else self.names[local]


def map_model(spec: FamilySpec, variant: ModelVariant, cfg: ConfigResult, cs: dict, params_path, *,
              family: str, model_name: str, empty: tuple, scoped: Scoped | None = None, warnings=(),
              config_warnings=()) -> HFModel:
    """The HF model of CS tensors ``cs`` (named as the rules see them) under the converted config ``cfg``.

    ``empty`` is the (path, problem) of the MappingError raised when no tensor matched; ``warnings`` come first in
    the model's warnings, ``config_warnings`` (params keys not converted) after the config's own."""
    scoped = scoped or Scoped()
    funcs = config_functions(cfg.cs_scope, spec.path.name, params_path)
    mapping = RuleEngine(spec, variant, cfg.scope, funcs, params_path).run(cs)
    if not mapping.tensors:
        raise MappingError(*empty)

    config = dict(cfg.hf)
    set_weights_dtype(config, mapping.tensors)
    warnings = list(warnings)
    if variant.remote_code:
        warnings.append(f"HF class {variant.hf_class} is not part of transformers: load it with "
                        f"trust_remote_code=True; its modeling code comes from {variant.remote_code}")
    warnings += cfg.warnings
    warnings += config_warnings
    warnings += [f"CS tensor model.{scoped.key(key)} not converted: {reason}" for key, reason in mapping.dropped]
    folder = "" if scoped.folder is None else f" for the {scoped.folder or 'root'} folder"
    for key in mapping.unmatched:
        t = cs[key]
        warnings.append(f"CS tensor model.{scoped.key(key)} {list(t.shape)} {t.dtype.name} matches no rule of "
                        f"{spec.path.name}{folder}; not converted")
    return HFModel(family=family, model_name=model_name, hf_class=variant.hf_class, tensors=mapping.tensors,
                   config=config, generation_config=cfg.generation, warnings=warnings, params_path=params_path,
                   token_id_sources=dict(cfg.token_id_sources))
