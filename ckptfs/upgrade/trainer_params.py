"""The 2.3 trainer layout of a legacy params YAML: a faithful subset of Model Zoo's
``convert_legacy_params_to_trainer_params`` (``cerebras.modelzoo.trainer.utils``, release 2.10).

Same table (``TRAINER_PARAMS_TO_LEGACY``: trainer path → legacy key, ``.*`` = a whole subtree) and
same steps: exact keys first, then globs from the deepest scope up (a key taken by an exact match is
still copied into a glob that covers it), leftover legacy keys reported as dropped, empty values
removed (outside ``"*"`` merges), ``LogSparsity`` from ``sparsity.add_summaries``, ``fit`` and
``validate`` sharing ``val_dataloader``, schedulers nested by ``convert_lr_scheduler`` (a constant
``learning_rate`` becomes a ``ConstantLR``), callbacks ``true``/``false`` → ``{}``/``None``,
``precision.{enabled,fp16_type}`` copied back into the model, the prune list, and the optimizer
nested under its type. Differences: Model Zoo validates scheduler names against the installed
cerebras.pytorch classes (raising on unknown ones); here ``SCHEDULER_CLASSES`` is a fixed table and
an unknown name is kept as written. ``val_dataloader`` is shared by value (a copy), not by object.
"""
from __future__ import annotations

import copy
import fnmatch

MISSING = type("Missing", (), {"__repr__": lambda self: "MISSING"})()

TRAINER_PARAMS_TO_LEGACY = {
    "init": {
        "model_dir": "runconfig.model_dir",
        "seed": "runconfig.seed",
        "backend": {
            "backend_type": "runconfig.target_device",
            "compile_dir": "runconfig.compile_dir",
            "compile_only": "runconfig.compile_only",
            "validate_only": "runconfig.validate_only",
            "cluster_config": {
                "num_csx": "runconfig.num_csx",
                "max_wgt_servers": "runconfig.num_wgt_servers",
                "mgmt_address": "runconfig.mgmt_address",
                "mgmt_namespace": "runconfig.mgmt_namespace",
                "credentials_path": "runconfig.credentials_path",
                "mount_dirs": "runconfig.mount_dirs.*",
                "python_paths": "runconfig.python_paths.*",
                "num_workers_per_csx": "runconfig.num_workers_per_csx",
                "max_act_per_csx": "runconfig.num_act_servers",
                "job_labels": "runconfig.job_labels.*",
                "job_priority": "runconfig.job_priority",
                "job_time_sec": "runconfig.job_time_sec",
                "disable_version_check": "runconfig.disable_version_check",
            },
            "enable_distributed": "runconfig.enable_distributed",
            "main_process_id": "runconfig.main_process_id",
            "dist_backend": "runconfig.dist_backend",
            "init_method": "runconfig.init_method",
            "sync_batchnorm": "runconfig.sync_batchnorm",
        },
        "model": {"*": "model.*"},
        "optimizer": "optimizer.*",
        "schedulers": "optimizer.learning_rate.*",
        "precision": {
            "enabled": "model.mixed_precision",
            "fp16_type": "model.fp16_type",
            "precision_opt_level": "runconfig.precision_opt_level",
            "loss_scaling_factor": "optimizer.loss_scaling_factor",
            "initial_loss_scale": "optimizer.initial_loss_scale",
            "steps_per_increase": "optimizer.steps_per_increase",
            "min_loss_scale": "optimizer.min_loss_scale",
            "max_loss_scale": "optimizer.max_loss_scale",
            "max_gradient_norm": "optimizer.max_gradient_norm",
            "max_gradient_value": "optimizer.max_gradient_value",
            "log_loss_scale": "optimizer.log_summaries",
        },
        "sparsity": {"*": "sparsity.*", "sparsity": "sparsity"},
        "loop": {
            "num_steps": "runconfig.num_steps",
            "max_steps": "runconfig.max_steps",
            "num_epochs": "runconfig.num_epochs",
            "steps_per_epoch": "runconfig.steps_per_epoch",
            "eval_frequency": "runconfig.eval_frequency",
            "eval_steps": "runconfig.eval_steps",
            "grad_accum_steps": "optimizer.grad_accum_steps",
        },
        "checkpoint": {
            "steps": "runconfig.checkpoint_steps",
            "disable_strict_checkpoint_loading": "runconfig.disable_strict_checkpoint_loading",
            "autoload_last_checkpoint": "runconfig.autoload_last_checkpoint",
            "save_initial_checkpoint": "runconfig.save_initial_checkpoint",
        },
        "logging": {
            "log_steps": "runconfig.log_steps",
            "log_level": "runconfig.logging",
            "wsc_log_level": "runconfig.wsc_log_level.*",
            "enable_act_frequency": "runconfig.enable_act_frequency",
        },
        "callbacks": [
            {"GlobalFlags": {
                "csx.performance.transfer_processes": "runconfig.transfer_processes",
                "csx.debug.ini": "runconfig.ini.*",
                "csx.debug.debug_args": "runconfig.debug_args.*",
                "csx.debug.retrace_every_iteration": "runconfig.retrace_every_iteration",
                "csx.debug.lazy_initialization": "runconfig.lazy_initialization",
                "csx.debug.log_initialization": "runconfig.log_initialization",
                "csx.debug.drop_data": "runconfig.drop_data",
                "csx.debug.fabric_type_blacklist": "runconfig.fabric_type_blacklist.*",
                "csx.debug.compile_crd_memory_gi": "runconfig.compile_crd_memory_gi",
                "csx.debug.execute_crd_memory_gi": "runconfig.execute_crd_memory_gi",
                "csx.debug.wrk_memory_gi": "runconfig.wrk_memory_gi",
                "csx.debug.act_memory_gi": "runconfig.act_memory_gi",
                "csx.debug.cmd_memory_gi": "runconfig.cmd_memory_gi",
                "csx.debug.wgt_memory_gi": "runconfig.wgt_memory_gi",
            }},
            {"ScopedTrainFlags": {"csx.performance.micro_batch_size": "train_input.micro_batch_size"}},
            {"ScopedValidateFlags": {"csx.performance.micro_batch_size": "eval_input.micro_batch_size"}},
            {"DebugArgsPath": {"debug_args_path": "runconfig.debug_args_path"}},
            {"LogInputSummaries": "runconfig.log_input_summaries"},
            {"CheckLoss": "runconfig.check_loss_values"},
            {"ComputeNorm": "optimizer.log_summaries"},
            {"LoadCheckpointStates": {"load_checkpoint_states": "runconfig.load_checkpoint_states"}},
            {"KeepNCheckpoints": {"n": "runconfig.max_checkpoints"}},
            {"LogSparsity": "sparsity.add_summaries"},
            {"WeightCompression": {"compressions": "model.compression.*"}},
            {"SelectiveGrad": {"selective_grads": "model.selective_grad.*"}},
            {"Listener": {"listeners": "runconfig.experimental.listeners.*"}},
            {"OpProfiler": "runconfig.op_profiler_config.*"},
            {"DumpActivations": "runconfig.dump_activations"},
            {"HFCacheDir": {"cache_dir": "runconfig.hf_cache_dir"}},
        ],
        "loggers": [
            {"TensorBoardLogger": {"summary_dir": "runconfig.summary_dir",
                                   "legacy_event_dirs": "runconfig.legacy_event_dirs"}},
            {"WandbLogger": {"project": "wandb.project", "group": "wandb.group", "run_id": "wandb.run_id",
                             "run_name": "wandb.run_name", "job_type": "wandb.job_type", "tags": "wandb.tags",
                             "resume": "wandb.resume"}},
        ],
    },
    "fit": {
        "train_dataloader": {"*": "train_input.*"},
        "val_dataloader": {"*": "eval_input.*"},
        "ckpt_path": "runconfig.checkpoint_path",
    },
    "validate": {"val_dataloader": {"*": "eval_input.*"}, "ckpt_path": "runconfig.checkpoint_path"},
    "validate_all": {"val_dataloaders": {"*": "eval_input.*"}, "ckpt_paths": "runconfig.checkpoint_path"},
}

TRAINER_POST_CONVERSION_PRUNE_LIST = (
    "init.model.compression", "init.model.selective_grad", "init.optimizer.loss_scaling_factor",
    "init.optimizer.initial_loss_scale", "init.optimizer.steps_per_increase", "init.optimizer.min_loss_scale",
    "init.optimizer.max_loss_scale", "init.optimizer.max_gradient_norm", "init.optimizer.max_gradient_value",
    "init.optimizer.log_summaries", "init.optimizer.grad_accum_steps", "fit.train_dataloader.micro_batch_size",
    "fit.val_dataloader.micro_batch_size", "validate.val_dataloader.micro_batch_size",
    "validate_all.val_dataloader.micro_batch_size",
)
IGNORE_LEGACY_KEYS = ("runconfig.mode",)

#: cerebras.pytorch LR scheduler class names, looked up case-insensitively (with or without "LR")
SCHEDULER_CLASSES = (
    "ConstantLR", "PolynomialLR", "LinearLR", "ExponentialLR", "InverseExponentialTimeDecayLR",
    "InverseSquareRootDecayLR", "CosineDecayLR", "SequentialLR", "PiecewiseConstantLR", "MultiStepLR", "StepLR",
    "CosineAnnealingLR", "LambdaLR", "CosineAnnealingWarmRestarts", "MultiplicativeLR", "ChainedScheduler",
    "CyclicLR", "OneCycleLR", "ScalePerParamLR",
)


# -- flatten / unflatten (torch pytree semantics: dicts and lists/tuples are nodes, the rest leaves) --
def _flatten(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flatten(v, path + (k,))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _flatten(v, path + (i,))
    else:
        yield path, obj


def _unflatten(structure, values):
    it = iter(values)

    def build(s):
        if isinstance(s, dict):
            return {k: build(v) for k, v in s.items()}
        if isinstance(s, (list, tuple)):
            return type(s)(build(v) for v in s)
        return next(it)

    return build(structure)


def _dotted(path) -> str:
    return ".".join(str(p) for p in path)


def _subtree(obj, scope: list):
    for k in scope:
        if isinstance(obj, dict) and k in obj:
            obj = obj[k]
        else:
            raise KeyError(k)
    return obj


def _is_not_empty(obj) -> bool:
    return obj is not MISSING and (bool(obj) or isinstance(obj, (int, float, bool, str)))


def _strip_missing(obj):
    if isinstance(obj, dict):
        return {k: _strip_missing(v) for k, v in obj.items() if v is not MISSING}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_strip_missing(v) for v in obj if v is not MISSING)
    return obj


def _cleanup(obj):
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if v is MISSING:
                continue
            if k == "*":
                if isinstance(v, dict):
                    out.update(_strip_missing(v))  # globs are copied as they are (empty lists kept)
                else:
                    return _cleanup(v)
            else:
                v = _cleanup(v)
                if _is_not_empty(v):
                    out[k] = v
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(c for c in (_cleanup(p) for p in obj) if _is_not_empty(c))
    return obj


def convert_lr_scheduler(params, adjust_learning_rate=None, notes: list | None = None):
    """Model Zoo's ``convert_lr_scheduler``: legacy ``learning_rate`` dict(s) → ``{ClassName: {...}}``."""
    if adjust_learning_rate:
        return {"ScalePerParamLR": {"scheduler": convert_lr_scheduler(params, None, notes)}}
    if isinstance(params, (list, tuple)):
        subs, mains = [], set()
        for p in params:
            p = dict(p)
            m = p.pop("main_scheduler", None)
            if m:
                mains.add(m)
            subs.append(convert_lr_scheduler(p, None, notes))
        if len(mains) > 1:
            raise ValueError(f"conflicting main_scheduler values: {sorted(mains)}")
        main = next(iter(mains)) if mains else None
        key = "ChainedScheduler" if main is not None and str(main).lower() in ("chained", "chainedlr") else "SequentialLR"
        if len(subs) == 1 and key == "SequentialLR":
            return subs[0]
        return {key: {"schedulers": subs}}
    params = dict(params)
    name = str(params.pop("scheduler", "ConstantLR"))
    lookup = {c.lower(): c for c in SCHEDULER_CLASSES}
    for cand in (name.lower(), name.lower() + "lr"):
        if cand in lookup:
            return {lookup[cand]: params}
    if notes is not None:
        notes.append(f"params: LR scheduler {name!r} is not a known cerebras.pytorch class; kept as written")
    return {name: params}


def to_trainer_params(params: dict) -> tuple[dict, list, list]:
    """``({"trainer": {...}}, dropped legacy keys, notes)`` for legacy (pre-2.3) params.

    Params already in the trainer layout come back unchanged.
    """
    if "trainer" in params:
        return params, [], []
    params = copy.deepcopy(params)
    notes: list = []
    spec_paths = list(_flatten(TRAINER_PARAMS_TO_LEGACY))
    legacy_keys = [k for _, k in spec_paths]

    flat_pairs = list(_flatten(params))
    params_keys = [_dotted(p) for p, _ in flat_pairs]
    flattened = dict(zip(params_keys, (v for _, v in flat_pairs)))
    for key in IGNORE_LEGACY_KEYS:
        flattened.pop(key, None)

    legacy_values = {k: flattened.pop(k) for k in legacy_keys if k in flattened}
    globs = [k for k in set(legacy_keys) - set(legacy_values) if k.endswith(".*")]
    for g in sorted(globs, key=lambda k: (-len(k.split(".")), k)):
        scope = g.split(".")[:-1]
        try:
            sub = _subtree(params, scope)
        except KeyError:
            continue
        matched = fnmatch.filter(params_keys, g)
        if not matched:
            continue
        values = [flattened.pop(k, legacy_values.get(k, MISSING)) for k in matched]
        if len(values) != sum(1 for _ in _flatten(sub)):
            continue  # the glob also matched keys outside its subtree; leave them
        legacy_values[g] = _unflatten(sub, values)

    dropped = sorted(flattened)

    trainer = _unflatten(TRAINER_PARAMS_TO_LEGACY, [legacy_values.get(k, MISSING) for k in legacy_keys])
    init = trainer["init"]

    def extract(cfg, key):
        if isinstance(cfg, dict):
            yield cfg.pop(key, False)
            for v in cfg.values():
                yield from extract(v, key)
        elif isinstance(cfg, (list, tuple)):
            for c in cfg:
                yield from extract(c, key)
        else:
            yield False

    if any([x for x in extract(init["sparsity"], "add_summaries") if _is_not_empty(x)]):
        for cb in init["callbacks"]:
            if "LogSparsity" in cb:
                cb["LogSparsity"] = True
                break

    trainer = _cleanup(trainer)
    init = trainer.setdefault("init", {})

    fit = trainer.get("fit", {})
    if "val_dataloader" in fit:
        if "val_dataloader" in trainer.get("validate", {}):
            trainer["validate"]["val_dataloader"] = copy.deepcopy(fit["val_dataloader"])
        if "val_dataloaders" in trainer.get("validate_all", {}):
            trainer["validate_all"]["val_dataloaders"] = copy.deepcopy(fit["val_dataloader"])

    alr = init["optimizer"].get("adjust_learning_rate") if isinstance(init.get("optimizer"), dict) else None
    if "schedulers" in init:
        init["schedulers"] = [convert_lr_scheduler(init["schedulers"], alr, notes)]
    elif isinstance(init.get("optimizer"), dict) and "learning_rate" in init["optimizer"]:
        init["schedulers"] = [convert_lr_scheduler(
            {"scheduler": "ConstantLR", "learning_rate": float(init["optimizer"]["learning_rate"])}, alr, notes)]

    for cb in init.get("callbacks", []):
        name = next(iter(cb))
        if cb[name] is True:
            cb[name] = {}
        elif cb[name] is False:
            cb[name] = None

    prec = init.get("precision", {})
    if isinstance(prec, dict):
        if prec.get("enabled") is not None:
            init.setdefault("model", {})["mixed_precision"] = prec["enabled"]
        if prec.get("fp16_type") is not None:
            init.setdefault("model", {})["fp16_type"] = prec["fp16_type"]

    for full in TRAINER_POST_CONVERSION_PRUNE_LIST:
        section = trainer
        keys = full.split(".")
        for i, k in enumerate(keys):
            if not isinstance(section, dict) or k not in section:
                break
            if i < len(keys) - 1:
                section = section[k]
            else:
                section.pop(k)

    opt = init.get("optimizer")
    if isinstance(opt, dict) and "optimizer_type" in opt:
        otype = opt.pop("optimizer_type")
        init["optimizer"] = {otype: opt}
    elif isinstance(opt, dict):
        notes.append("params: optimizer has no optimizer_type; left unnested")
    return {"trainer": trainer}, dropped, notes
