"""Release rules for the Cerebras params YAML, one table entry per hop (from Model Zoo's CS→CS converters).

Each rule is a function ``(params: dict, ctx: ParamsEdit) -> dict`` that returns the new params
and records every key it drops in ``ctx.notes``. Model Zoo's ``BaseConfigConverter_CS_CS`` runs:

* every hop: the ``cerebras:`` section is removed (``save_iter_state_path`` with it);
* 1.8/1.9→2.0 (model): ``use_rms_norm`` (bool) → ``norm_type`` rmsnorm/layernorm (GPT-2 family),
  ``use_biasless_norm`` → ``norm_type`` biasless-layernorm/layernorm (GPT-J family);
* sources 1.9 and 2.0: runconfig ``experimental_api``, ``multireplica``, ``num_replicas``,
  ``save_losses``, ``service_dir``, ``use_appliance_data``, ``num_act_servers``,
  ``num_wgt_servers`` dropped; ``is_pretrained_checkpoint: true`` → ``load_checkpoint_states:
  [model, dataloader]``; ``keep_checkpoint_max`` → ``max_checkpoints``; ``csconfig`` dropped;
* 2.0→2.1: optimizer aliases (``weight_decay_rate`` → ``weight_decay``, ``beta1/beta2`` → ``betas``,
  ``eps1/eps2`` → ``eps``, ``eta1/eta2`` → ``etas``, ``step_size_min/max`` → ``step_sizes``) where the
  optimizer takes that argument; scheduler aliases (``steps``/``decay_steps`` → ``total_iters``,
  ``learning_rate``/``base_lr`` ↔ ``initial_learning_rate``, ``values`` → ``learning_rates``,
  ``boundaries`` → ``milestones``, ``t_max``/``t_0``/``t_mult`` → ``T_*``) where the scheduler takes
  it; ``model.precision_opt_level`` → ``runconfig``; ``model.use_bfloat16`` → ``fp16_type``. Model Zoo
  reads the argument lists from a pickled artifact; here they are the tables below (cstorch 2.0);
* 2.1→2.2: ``runconfig.use_cs_grad_accum`` → ``micro_batch_size`` of train/eval input,
  ``autogen_policy`` dropped, sparsity restructuring;
* 2.2→2.3: model ``use_position_embedding``, ``alibi_implementation``, ``weight_initialization_seed``
  dropped (GPT-2 family rule), then the trainer layout (``trainer_params.to_trainer_params``);
  muP 2.2 configs are not re-parametrised (noted);
* 2.3→2.4: ``trainer.init.model.name`` added (the model name; noted when unknown).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from . import trainer_params


@dataclass
class ParamsEdit:
    model_name: str | None = None  # Model Zoo model name (for ``name``), e.g. "gpt2"
    notes: list = field(default_factory=list)


def model_sections(params: dict) -> list:
    """The model config dicts: ``model``, or ``trainer[.i].init.model`` in the trainer layout."""
    out = []
    tr = params.get("trainer")
    for t in (tr if isinstance(tr, (list, tuple)) else [tr] if tr is not None else []):
        if isinstance(t, dict):
            if "trainer" in t and isinstance(t["trainer"], dict):  # list items may be {trainer: {...}}
                t = t["trainer"]
            m = (t.get("init") or {}).get("model") if isinstance(t.get("init"), dict) else None
            if isinstance(m, dict):
                out.append(m)
    if not out and isinstance(params.get("model"), dict):
        out.append(params["model"])
    return out


def _drop(section: dict, key, where: str, ctx: ParamsEdit, why: str) -> None:
    if key in section:
        section.pop(key)
        ctx.notes.append(f"params: dropped {where}{key} ({why})")


# -- every hop ---------------------------------------------------------------------------------------
def drop_cerebras_section(params: dict, ctx: ParamsEdit) -> dict:
    if "cerebras" in params:
        params.pop("cerebras")
        ctx.notes.append("params: dropped section cerebras (removed by every release upgrade)")
    return params


# -- 1.9 -> 2.0 ---------------------------------------------------------------------------------------
def norm_type_flags(params: dict, ctx: ParamsEdit) -> dict:
    for m in model_sections(params):
        if "use_rms_norm" in m:
            v = m.pop("use_rms_norm")
            m.setdefault("norm_type", "rmsnorm" if v else "layernorm")
        if "use_biasless_norm" in m:
            v = m.pop("use_biasless_norm")
            m.setdefault("norm_type", "biasless-layernorm" if v else "layernorm")
    return params


RUNCONFIG_REMOVED_2_1 = ("experimental_api", "multireplica", "num_replicas", "save_losses", "service_dir",
                         "use_appliance_data", "num_act_servers", "num_wgt_servers")


def runconfig_cleanup_2_1(params: dict, ctx: ParamsEdit) -> dict:
    rc = params.get("runconfig")
    if isinstance(rc, dict):
        for k in RUNCONFIG_REMOVED_2_1:
            _drop(rc, k, "runconfig.", ctx, "deprecated in 2.1; the release chooses it")
        if rc.pop("is_pretrained_checkpoint", False):
            rc["load_checkpoint_states"] = ["model", "dataloader"]
        if "keep_checkpoint_max" in rc:
            v = rc.pop("keep_checkpoint_max")
            if v is not None and "max_checkpoints" not in rc:
                rc["max_checkpoints"] = v
    if "csconfig" in params:
        params.pop("csconfig")
        ctx.notes.append("params: dropped section csconfig (unused since 1.9)")
    return params


# -- 2.0 -> 2.1 ---------------------------------------------------------------------------------------
#: which alias targets each cstorch 2.0 optimizer accepts (from its constructor signature)
OPTIMIZER_ARGS = {
    "adam": {"betas", "eps", "weight_decay"}, "adamw": {"betas", "eps", "weight_decay"},
    "adamax": {"betas", "eps", "weight_decay"}, "nadam": {"betas", "eps", "weight_decay"},
    "radam": {"betas", "eps", "weight_decay"}, "lamb": {"betas", "eps", "weight_decay"},
    "lion": {"betas", "weight_decay"}, "sgd": {"weight_decay"}, "asgd": {"weight_decay"},
    "adagrad": {"eps", "weight_decay"}, "adadelta": {"eps", "weight_decay"}, "rmsprop": {"eps", "weight_decay"},
    "adafactor": {"eps", "weight_decay"}, "rprop": {"etas", "step_sizes"},
}
OPTIMIZER_ALIASES = {
    "weight_decay": ["weight_decay_rate"], "betas": [["beta1", "beta2"]], "eps": [["eps1", "eps2"]],
    "etas": [["eta1", "eta2"]], "step_sizes": [["step_size_min", "step_size_max"]],
}
#: constructor arguments of the cstorch 2.0 LR schedulers that have aliases
SCHEDULER_ARGS = {
    "constantlr": {"learning_rate", "total_iters"},
    "polynomiallr": {"initial_learning_rate", "end_learning_rate", "total_iters"},
    "linearlr": {"initial_learning_rate", "end_learning_rate", "total_iters"},
    "exponentiallr": {"initial_learning_rate", "total_iters"},
    "inverseexponentialtimedecaylr": {"initial_learning_rate", "total_iters"},
    "inversesquarerootdecaylr": {"initial_learning_rate"},
    "cosinedecaylr": {"initial_learning_rate", "end_learning_rate", "total_iters"},
    "piecewiseconstantlr": {"learning_rates", "milestones"},
    "multisteplr": {"initial_learning_rate", "milestones"},
    "steplr": {"initial_learning_rate"},
    "cosineannealinglr": {"initial_learning_rate", "T_max"},
    "cosineannealingwarmrestarts": {"initial_learning_rate", "T_0", "T_mult"},
    "lambdalr": {"initial_learning_rate"}, "multiplicativelr": {"initial_learning_rate"},
    "cycliclr": {"base_lr"}, "onecyclelr": {"initial_learning_rate"},
    "sequentiallr": {"milestones"},
}
SCHEDULER_ALIASES = {
    "total_iters": ["steps", "decay_steps"], "initial_learning_rate": ["learning_rate", "base_lr"],
    "base_lr": ["learning_rate", "initial_learning_rate"], "learning_rates": ["values"],
    "milestones": ["boundaries"], "T_max": ["t_max"], "T_0": ["t_0"], "T_mult": ["t_mult"],
}


def optimizer_aliases_2_1(params: dict, ctx: ParamsEdit) -> dict:
    opt = params.get("optimizer")
    if not isinstance(opt, dict) or not isinstance(opt.get("optimizer_type"), str):
        return params
    accepted = OPTIMIZER_ARGS.get(opt["optimizer_type"].lower())
    if accepted is None:
        return params
    for name, aliases in OPTIMIZER_ALIASES.items():
        if name not in accepted or name in opt:
            continue
        for alias in aliases:
            if isinstance(alias, str) and alias in opt:
                opt[name] = opt.pop(alias)
                break
            if isinstance(alias, list) and all(a in opt for a in alias):
                opt[name] = [opt.pop(a) for a in alias]
                break
    return params


def scheduler_aliases_2_1(params: dict, ctx: ParamsEdit) -> dict:
    opt = params.get("optimizer")
    lr = opt.get("learning_rate") if isinstance(opt, dict) else None
    dicts = [lr] if isinstance(lr, dict) else list(lr) if isinstance(lr, (list, tuple)) else []
    for d in dicts:
        if not isinstance(d, dict) or not isinstance(d.get("scheduler"), str):
            continue
        s = d["scheduler"].lower()
        accepted = SCHEDULER_ARGS.get(s, SCHEDULER_ARGS.get(s + "lr"))
        if accepted is None:
            continue
        for name in sorted(accepted):
            if name in d:
                continue
            for alias in SCHEDULER_ALIASES.get(name, []):
                if alias in d:
                    d[name] = d.pop(alias)
                    break
    return params


def precision_and_fp16_2_1(params: dict, ctx: ParamsEdit) -> dict:
    model = params.get("model")
    if not isinstance(model, dict):
        return params
    if "precision_opt_level" in model and isinstance(params.get("runconfig"), dict):
        params["runconfig"].setdefault("precision_opt_level", model["precision_opt_level"])
        model.pop("precision_opt_level")
    if "use_bfloat16" in model:
        model["fp16_type"] = "bfloat16" if model.pop("use_bfloat16") else "float16"
    return params


# -- 2.1 -> 2.2 ---------------------------------------------------------------------------------------
def runconfig_cleanup_2_2(params: dict, ctx: ParamsEdit) -> dict:
    rc = params.get("runconfig")
    if not isinstance(rc, dict):
        return params
    if "use_cs_grad_accum" in rc:
        enable = rc.pop("use_cs_grad_accum")
        if type(enable) is bool:
            for section in ("train_input", "eval_input"):
                inp = params.setdefault(section, {})
                if enable is False:
                    inp["micro_batch_size"] = None
                elif "micro_batch_size" not in inp:
                    inp["micro_batch_size"] = "auto"
        else:
            ctx.notes.append(f"params: dropped runconfig.use_cs_grad_accum (not a bool: {enable!r})")
    _drop(rc, "autogen_policy", "runconfig.", ctx, "removed in 2.2")
    return params


def sparsity_2_2(params: dict, ctx: ParamsEdit) -> dict:
    sp = params.get("sparsity")
    if not isinstance(sp, dict):
        return params
    if "type" in sp:
        sp["algorithm"] = sp.pop("type")
    if sp.get("algorithm") == "static":
        sp.pop("algorithm")
        if len(sp) == 1 and "sparsity" in sp:
            params["sparsity"] = sp["sparsity"]
            return params
    if "schedule" in sp:
        sp["update"] = sp.pop("schedule")
    if "sparsity_schedule" in sp:
        steps, schedule = zip(*sp.pop("sparsity_schedule"))
        sp["schedule"] = list(schedule)
        sp["update"] = {"steps": list(steps)}
    if "sparsity" in sp and not isinstance(sp["sparsity"], (int, float)):
        sp["schedule"] = sp.pop("sparsity")
    if isinstance(sp.get("update"), int) and not isinstance(sp.get("update"), bool):
        if sp["update"] == 1:
            sp.pop("update")
        else:
            sp["update"] = {"freq": sp["update"]}
    if "param_name_patterns" in sp:
        glob = lambda p: p.replace(".*", "*")  # noqa: E731 (Model Zoo's regex_to_glob)
        pats = sp.pop("param_name_patterns")
        if isinstance(pats, str):
            sp["param_filter"] = glob(pats)
        elif isinstance(pats, (list, tuple)):
            sp["param_filter"] = type(pats)(map(glob, pats))
        elif isinstance(pats, dict):
            params["sparsity"] = [{"param_filter": glob(p), **copy.deepcopy(sp), **(cfg or {})}
                                  for p, cfg in pats.items()]
    return params


# -- 2.2 -> 2.3 ---------------------------------------------------------------------------------------
MODEL_KEYS_REMOVED_2_3 = ("use_position_embedding", "alibi_implementation", "weight_initialization_seed")


def model_keys_2_3(params: dict, ctx: ParamsEdit) -> dict:
    for m in model_sections(params):
        for k in MODEL_KEYS_REMOVED_2_3:
            _drop(m, k, "model.", ctx, "deprecated in 2.3")
    for m in model_sections(params):
        if any(m.get(k) is not None for k in ("mup_base_hidden_size", "mup_base_filter_size")) or \
                all(m.get(k) is not None for k in ("scale_qk_dot_by_d", "embeddings_scale", "output_logits_scale")):
            ctx.notes.append("params: muP settings were not re-parametrised for 2.3 (ConfigConverter_muP_CS22_CS23 "
                             "is not implemented); check the model section")
    return params


def to_trainer_layout(params: dict, ctx: ParamsEdit) -> dict:
    if "trainer" in params:
        return params
    new, dropped, notes = trainer_params.to_trainer_params(params)
    for k in dropped:
        ctx.notes.append(f"params: dropped {k} (no place in the 2.3 trainer layout)")
    ctx.notes.extend(notes)
    return new


# -- 2.3 -> 2.4 ---------------------------------------------------------------------------------------
def model_name_2_4(params: dict, ctx: ParamsEdit) -> dict:
    for m in model_sections(params):
        if "name" not in m:
            if ctx.model_name:
                m["name"] = ctx.model_name
            else:
                ctx.notes.append("params: model name unknown, trainer.init.model.name not added (use --model)")
    return params


PARAMS_HOPS = {
    ("1.9", "2.0"): (norm_type_flags, runconfig_cleanup_2_1),
    ("2.0", "2.1"): (runconfig_cleanup_2_1, optimizer_aliases_2_1, scheduler_aliases_2_1, precision_and_fp16_2_1),
    ("2.1", "2.2"): (runconfig_cleanup_2_2, sparsity_2_2),
    ("2.2", "2.3"): (model_keys_2_3, to_trainer_layout),
    ("2.3", "2.4"): (model_name_2_4,),
}
EVERY_HOP = (drop_cerebras_section,)


def upgrade_params(params: dict, hop_list, ctx: ParamsEdit) -> dict:
    """A deep copy of ``params`` with the rules of each hop applied in order."""
    params = copy.deepcopy(params)
    for hop in hop_list:
        for rule in EVERY_HOP + PARAMS_HOPS.get(tuple(hop), ()):
            params = rule(params, ctx)
    return params
