"""The ``lora:`` section of a mapping YAML (family or fragment): what LoRA folding needs to know about a family.

Model Zoo picks the LoRA group of a module by the *type names* of the module and its ancestors
(``make_model_lora``), and a checkpoint holds only parameter names. The section says, per CS module that LoRA can
wrap (an ``nn.Linear`` or ``nn.Embedding``), which Model Zoo classes lie on its path::

    lora:
      wrapper: LlamaModel            # the registry class whose `.model` holds the CS model (keys model.<...>)
      derive: {attention: "expression over the CS params"}   # values the class templates below may use
      modules:                       # first match wins; the last class is Linear or Embedding
        - cs: "transformer_decoder.layers.{i}.self_attn.{p:proj_(?:q|k|v|output)_dense_layer}"
          classes: [GPT2LMHeadModel, TransformerDecoder, ModuleList, TransformerDecoderLayer, "{attention}", Linear]
      tied: {modules: [embedding_layer.word_embeddings, lm_head], key: share_embedding_weights}
      peft:                          # --lora keep: the adapter as PEFT's LoRA writes it for the HF model
        fan_in_fan_out: false        # PEFT's flag: true when the HF layers are Conv1D (weight [in, out])
        tensors:                     # PEFT adapter tensors from the CS lora_A / lora_B (rule syntax of `tensors:`)
          - {cs: "lm_head.lora_{m:A|B}", hf: "lm_head.lora_{m}.weight"}

A fragment's section and a family's merge: the family's ``wrapper`` / ``tied`` win, its ``derive`` entries are
added, its ``modules`` and ``peft.tensors`` rules are tried first (its ``peft.fan_in_fan_out`` wins).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..lang.pattern import KeyPattern, PatternError, template_names

MODULE_KINDS = ("Linear", "Embedding")


@dataclass(frozen=True)
class LoraModuleSpec:
    """CS modules matching ``cs`` (a module path, without the wrapper's ``model.``) and their class path."""

    cs: KeyPattern
    classes: tuple  # class-name templates ({name} filled from lora.derive), outermost first
    where: str

    @property
    def kind(self) -> str:
        return self.classes[-1]


@dataclass(frozen=True)
class TiedSpec:
    """Two modules sharing one weight while the params ``key`` is true (input embedding and LM head)."""

    modules: tuple
    key: str


@dataclass(frozen=True)
class PeftSpec:
    """How the CS LoRA matrices become a PEFT LoRA adapter of the HF model."""

    tensors: tuple = ()  # TensorRule: CS lora_A / lora_B -> adapter tensor names (without base_model.model.)
    fan_in_fan_out: bool | None = None  # None: not said (false)


@dataclass(frozen=True)
class LoraSpec:
    wrapper: str | None = None
    derive: dict = field(default_factory=dict)  # name -> expression over the CS params
    modules: tuple = ()  # LoraModuleSpec, first match wins
    tied: TiedSpec | None = None
    peft: PeftSpec = PeftSpec()


def merge(base: "LoraSpec | None", own: "LoraSpec | None") -> "LoraSpec | None":
    """A fragment's section (``base``) under a family's (``own``)."""
    if base is None or own is None:
        return own if base is None else base
    return LoraSpec(wrapper=own.wrapper or base.wrapper, derive={**base.derive, **own.derive},
                    modules=own.modules + base.modules, tied=own.tied or base.tied,
                    peft=PeftSpec(own.peft.tensors + base.peft.tensors,
                                  base.peft.fan_in_fan_out if own.peft.fan_in_fan_out is None
                                  else own.peft.fan_in_fan_out))


def parse(data, v, var_names: set) -> LoraSpec | None:
    """The ``lora:`` mapping of a YAML file; ``v`` is the spec loader's validator (its ``fail`` names the file)."""
    if data is None:
        return None
    v.keys(data, {"wrapper", "derive", "modules", "tied", "peft"}, "lora")
    wrapper = None if data.get("wrapper") is None else v.string(data["wrapper"], "lora.wrapper")
    derive = data.get("derive") or {}
    if not isinstance(derive, dict):
        v.fail("lora.derive: must map names to expressions")
    derive = {str(k): v.expr(e, f"lora.derive.{k}") for k, e in derive.items()}
    items = data.get("modules") or []
    if not isinstance(items, list):
        v.fail("lora.modules: must be a list")
    modules = tuple(_module(item, f"lora.modules[{n}]", v, set(derive)) for n, item in enumerate(items))
    tied = None
    if data.get("tied") is not None:
        t = data["tied"]
        v.keys(t, {"modules", "key"}, "lora.tied")
        mods = t.get("modules")
        if not isinstance(mods, list) or len(mods) != 2 or not all(isinstance(m, str) and m for m in mods):
            v.fail("lora.tied.modules: give the two CS module paths that share a weight")
        tied = TiedSpec(tuple(mods), v.string(t.get("key"), "lora.tied.key"))
    peft = data.get("peft") or {}
    v.keys(peft, {"fan_in_fan_out", "tensors"}, "lora.peft")
    fan = peft.get("fan_in_fan_out")
    if fan is not None and not isinstance(fan, bool):
        v.fail(f"lora.peft.fan_in_fan_out: expected true or false, got {fan!r}")
    rules = tuple(v.rules(peft.get("tensors") or [], "lora.peft.tensors", var_names))
    return LoraSpec(wrapper, derive, modules, tied, PeftSpec(rules, fan))


def _module(item, where, v, derived: set) -> LoraModuleSpec:
    v.keys(item, {"cs", "classes"}, where)
    cs = v.pattern(item.get("cs"), f"{where}.cs")
    classes = item.get("classes")
    if not isinstance(classes, list) or not classes or not all(isinstance(c, str) and c for c in classes):
        v.fail(f"{where}.classes: give the Model Zoo class names from the CS model down to the module")
    if classes[-1] not in MODULE_KINDS:
        v.fail(f"{where}.classes: the last class must be one of {list(MODULE_KINDS)} (the module LoRA wraps), "
               f"got {classes[-1]!r}")
    for c in classes:
        try:
            unknown = [n for n in template_names(c) if n not in derived]
        except PatternError as e:
            v.fail(f"{where}.classes: {e}")
        if unknown:
            v.fail(f"{where}.classes: {c!r} uses {{{unknown[0]}}}, which lora.derive does not define")
    return LoraModuleSpec(cs, tuple(classes), f"{v.path.name}: {where}")
