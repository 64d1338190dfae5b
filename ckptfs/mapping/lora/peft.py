"""``--lora keep``: beside the folded model, the base model (``base/``) and its LoRA adapter as a PEFT adapter
directory (``adapter/``: ``adapter_config.json`` + ``adapter_model.safetensors``, PEFT's tensor names).

PEFT's LoRA computes what Model Zoo's does: ``W + (B @ A) * lora_alpha / r`` per wrapped module (embeddings:
the product transposed; Conv1D layers with ``fan_in_fan_out``), ranks and alphas per module through
``rank_pattern`` / ``alpha_pattern``. The family's ``lora.peft`` rules turn the CS ``lora_A`` / ``lora_B`` into the
HF modules' factors: renamed, rows permuted like the weight's rows (Llama q/k), or several CS modules as one
fused HF layer (GPT-2 ``c_attn``: A stacked, B block-diagonal, rank and alpha times three, the same scaling).
Where that cannot be exact — no rules for the family, muP scales folded into the HF weights, HF modules mixing
scalings — there is no adapter and README.txt says why.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction

from ...errors import CkptfsError
from ..params.to_hf_config import config_functions, convert_config
from ..lang.expr import MissingName
from ..forward import RuleEngine

PEFT_PREFIX = "base_model.model."
#: (suffix of a PEFT tensor name, factor, module kind)
PEFT_SUFFIXES = ((".lora_A.weight", "A", "Linear"), (".lora_B.weight", "B", "Linear"),
                 (".lora_embedding_A", "A", "Embedding"), (".lora_embedding_B", "B", "Embedding"))
ADAPTER_DIR = "adapter"
BASE_DIR = "base"


@dataclass
class PeftAdapter:
    config: dict  # adapter_config.json
    tensors: list  # [(PEFT tensor name, VirtualTensor)] for adapter_model.safetensors
    modules: int


class NotExpressible(Exception):
    """Why PEFT cannot hold this checkpoint's LoRA exactly (one line for README.txt)."""


def keep_adapter(hf, base, adapters, spec, variant, base_params: dict, params_path, cs: dict) -> None:
    """Add ``base/`` (the model before LoRA) and, where PEFT can express it, ``adapter/`` to ``hf``."""
    hf.description = "the model with LoRA folded in"
    base.description = "the base model (weights as before LoRA training, the LoRA matrices left out)"
    hf.components.append((BASE_DIR, base))
    try:
        adapter = peft_adapter(spec, variant, base_params, params_path, adapters, cs)
    except NotExpressible as e:
        hf.warnings.append(f"--lora keep: no PEFT adapter: {e}; {BASE_DIR}/ holds the base model, the root the "
                           f"folded one")
        return
    base.description += f"; {ADAPTER_DIR}/ holds its LoRA adapter"
    hf.extra_folders[ADAPTER_DIR] = {"adapter_config.json": adapter.config,
                                     "adapter_model.safetensors": adapter.tensors}
    hf.warnings.append(f"--lora keep: {ADAPTER_DIR}/ is a PEFT LoRA adapter of {BASE_DIR}/ ({adapter.modules} "
                       f"modules; load with PeftModel.from_pretrained(<{BASE_DIR}/ model>, '<mount>/{ADAPTER_DIR}')); "
                       f"merged, it is the root's folded model up to PEFT's own rounding")


def peft_adapter(spec, variant, base_params: dict, params_path, adapters, cs: dict) -> PeftAdapter:
    """The PEFT adapter of a LoRA checkpoint; NotExpressible saying why there is none."""
    rules = spec.lora.peft.tensors if spec.lora is not None else ()
    if not rules:
        raise NotExpressible(f"the {spec.family} mapping ({spec.path.name}) has no lora.peft rules naming the HF "
                             f"modules of its LoRA matrices")
    cfg = convert_config(spec, variant, base_params, params_path)
    if _truthy(cfg.scope, "mup_active"):
        raise NotExpressible("muP scales are folded into the HF weights; the adapter's factors would need them "
                             "too, which changes their rounding")
    lora_keys = {k: cs[k] for m in adapters.modules for k in (m.lora_a, m.lora_b)}
    engine = RuleEngine(replace(spec, prepare=[], tensors=list(rules)), variant, cfg.scope,
                        config_functions(cfg.cs_scope, spec.path.name, params_path), params_path)
    try:
        mapping = engine.run(lora_keys)
    except CkptfsError as e:
        raise NotExpressible(e.problem) from None
    if mapping.unmatched:
        raise NotExpressible(f"no lora.peft rule of {spec.path.name} maps {mapping.unmatched[0]}")
    by_key = {id(t): k for k, t in lora_keys.items()}
    groups = {m.name: m.group for m in adapters.modules}
    modules: dict = {}
    for name, t in mapping.tensors:
        module, factor, kind = _split(name)
        entry = modules.setdefault(module, {"kind": kind})
        if entry["kind"] != kind or factor in entry:
            raise NotExpressible(f"lora.peft gives {name} twice or with another kind of module")
        entry[factor] = t
        entry.setdefault("from", set()).update(_cs_modules(t, by_key))
    patterns = {}
    for module, entry in modules.items():
        if "A" not in entry or "B" not in entry:
            raise NotExpressible(f"lora.peft gives only one factor of {module}")
        a, b = entry["A"], entry["B"]
        r = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != r:
            raise NotExpressible(f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not multiply")
        scalings = {(groups[m].alpha, groups[m].r) for m in entry["from"]}
        if len({Fraction(al) / rr for al, rr in scalings}) != 1:
            raise NotExpressible(f"{module} combines CS modules with different LoRA scalings {sorted(scalings)}")
        alpha, r_cs = next(iter(scalings))
        alpha_h = Fraction(alpha) * r / r_cs
        alpha_h = int(alpha_h) if alpha_h.denominator == 1 else float(alpha_h)
        if alpha_h / r != alpha / r_cs:
            raise NotExpressible(f"{module}: alpha {alpha_h} / r {r} is not the scaling {alpha} / {r_cs} in floats")
        patterns[module] = (r, alpha_h)
    if not patterns:
        raise NotExpressible("the lora.peft rules drop every LoRA matrix (e.g. an LM head the headless model lacks)")
    r0, alpha0 = max(set(patterns.values()), key=lambda p: sum(v == p for v in patterns.values()))
    config = {
        "peft_type": "LORA",
        "task_type": "FEATURE_EXTRACTION" if variant.headless else "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": r0,
        "lora_alpha": alpha0,
        "target_modules": sorted(patterns),
        "rank_pattern": {m: r for m, (r, _) in sorted(patterns.items()) if r != r0},
        "alpha_pattern": {m: al for m, (_, al) in sorted(patterns.items()) if al != alpha0},
        "fan_in_fan_out": bool(spec.lora.peft.fan_in_fan_out),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    tensors = [(PEFT_PREFIX + name, t) for name, t in mapping.tensors]
    return PeftAdapter(config, tensors, len(patterns))


def _truthy(scope, name: str) -> bool:
    try:
        return bool(scope.lookup(name))
    except MissingName:  # the family has no such derived value
        return False


def _split(name: str) -> tuple:
    for suffix, factor, kind in PEFT_SUFFIXES:
        if name.endswith(suffix):
            return name[:-len(suffix)], factor, kind
    raise NotExpressible(f"lora.peft output {name} does not end in one of PEFT's LoRA names "
                         f"{[s for s, _, _ in PEFT_SUFFIXES]}")


def _cs_modules(t, by_key: dict) -> set:
    """The CS LoRA modules a tensor is computed from (following ``sources()``)."""
    out, todo, seen = set(), [t], set()
    while todo:
        cur = todo.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        key = by_key.get(id(cur))
        if key is not None:
            out.add(key.rsplit(".", 1)[0])
        else:
            todo.extend(cur.sources())
    return out
