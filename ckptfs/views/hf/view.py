"""The Hugging Face view: config.json, generation_config.json, the weights in every format of ``hf_formats``
(safetensors, pytorch_model.bin) with their index files, all computed from the mapping core's virtual tensors (nothing
read until a byte is asked for); ``hf_dir.arrange`` then lays them out for loaders (--hf-format, --overlay /
tokenizer files, token ids)."""
from __future__ import annotations

import json

from ...errors import CkptfsError
from ...tensor.ops import Alias
from ..base import BytesFile, ViewResult
from . import formats as hf_formats


def _json_file(obj) -> BytesFile:
    return BytesFile(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _untie(named: list) -> list:
    """Give every name its own tensor object (for safetensors, where each name owns its bytes)."""
    seen: set[int] = set()
    out = []
    for name, t in named:
        if id(t) in seen:
            t = Alias(t)
        seen.add(id(t))
        out.append((name, t))
    return out


def weight_files(named: list, *, max_shard_size: int, zip_crc: str, crc_store=None, identity: str | None = None,
                 cache=None) -> dict:
    """Every HF weight format's files (``hf_formats.FORMATS``) for ``named`` [(hf name, tensor)]: {relative path:
    file}, reading through ``cache`` (the mount's block cache; all formats share its blocks)."""
    from .shards import index_json, plan_shards, shard_filenames

    files: dict = {}
    for fmt in hf_formats.FORMATS:
        shards = plan_shards(_untie(named) if fmt.untie else named, max_shard_size)
        names = shard_filenames(fmt.stem, fmt.suffix, len(shards))
        for fname, shard in zip(names, shards):
            files[fname] = fmt.layout(shard, fname, cache=cache, zip_crc=zip_crc, crc_store=crc_store,
                                      identity=identity)
        files[fmt.index] = BytesFile(index_json(shards, names))
    return files


def extra_folder_files(hf, **layout) -> dict:
    """Files of the folders that are no HF model directory (--lora keep's PEFT ``adapter/``): JSON files and
    safetensors files (``layout``: more SafetensorsLayout arguments)."""
    from ...layouts.safetensors import SafetensorsLayout

    files = {}
    for folder, contents in hf.extra_folders.items():
        for name, content in contents.items():
            files[f"{folder}/{name}"] = (_json_file(content) if isinstance(content, dict) else
                                         SafetensorsLayout(_untie(content), metadata={"format": "pt"}, **layout))
    return files


def build(ctx) -> ViewResult:
    from ...mapping.to_hf import to_hf

    opts = ctx.options
    try:
        hf = to_hf(ctx.checkpoint, config=opts.config, model=opts.model, trainer_index=opts.trainer_index,
                   lora=opts.lora, memory=opts.cache_size)
    except CkptfsError as e:
        return ViewResult(missing=f"Hugging Face files not generated: {e.problem}")
    files = {}
    identity = getattr(ctx, "identity", None)
    for folder, model in hf.folders().items():  # one complete HF model directory each ('' = the root)
        base = f"{folder}/" if folder else ""
        files[base + "config.json"] = _json_file(model.config)
        if model.generation_config:
            files[base + "generation_config.json"] = _json_file(model.generation_config)
        for name, content in model.files.items():
            files[base + name] = _json_file(content)
        weights = weight_files(model.tensors, max_shard_size=opts.max_shard_size, zip_crc=opts.zip_crc,
                               crc_store=getattr(ctx, "crc_store", None),
                               identity=f"{identity}:{folder}" if identity and folder else identity,
                               cache=ctx.cache)
        files.update({base + name: f for name, f in weights.items()})
    notes = [f"hf: family {hf.family} (model name {hf.model_name}), class {hf.hf_class}"
             + (f", params {hf.params_path}" if hf.params_path else "")]
    notes += [f"hf: {hf.chosen}"] if hf.chosen else []
    notes += [f"hf: {folder or '(root)'}/ holds {model.description}" for folder, model in hf.folders().items()
              if hf.components]
    notes += [f"hf: {w}" for w in hf.warnings]
    from .arrange import arrange  # weight formats (--hf-format), overlay / tokenizer files, token ids

    files, more = arrange(files, hf, ctx)
    files.update(extra_folder_files(hf))  # not model folders: arrange leaves them out
    notes += [f"hf: {n}" for n in more]
    return ViewResult(files=files, notes=notes)
