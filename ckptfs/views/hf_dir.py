"""The Hugging Face view as a directory every loader accepts: weight formats, tokenizer overlay, token ids.

``arrange(files, hf, ctx)`` takes the generated files of every HF model folder (``config.json``,
``generation_config.json``, extra JSON files, both weight formats with their indexes, as ``views/hf.py`` builds
them) and returns the view's final files and README.txt lines:

* ``--hf-format`` (the formats are rows of ``hf_formats.FORMATS``): ``safetensors`` keeps ``model*.safetensors``,
  ``bin`` keeps ``pytorch_model*.bin``; ``both`` (the default) keeps the safetensors in the folder and puts the
  ``.bin`` files in its sub-folder ``bin/``, a complete HF folder of its own (config.json, generation_config.json,
  tokenizer…). One folder then has one weight format
  and at most one ``*.index.json``, which is what loaders that choose between formats need (accelerate's
  ``load_checkpoint_and_dispatch`` takes ``pytorch_model.bin`` over ``model.safetensors`` and refuses a folder with
  two index files). An index file is written only for a sharded format, as ``save_pretrained`` does.
* ``--overlay DIR`` (``views/overlay.py``): DIR's files appear at their paths (a generated file of the same path is
  replaced, and README.txt says so); each model folder's ``bin/`` gets the folder's overlay files too. Without
  ``--overlay``, tokenizer files found next to the checkpoint or its params go to the model folder(s).
* token ids: a folder's tokenizer files (overlay or found) give ``bos/eos/pad_token_id`` (``special_tokens.py``),
  which win over the params' and the HF class defaults in config.json and generation_config.json.
"""
from __future__ import annotations

import json
import posixpath

from .base import README_NAME, BytesFile
from . import hf_formats
from .overlay import collect_overlays, discover_tokenizer
from .registry import folder_of
from .special_tokens import MAX_FILE_BYTES, token_ids

def json_file(obj) -> BytesFile:
    return BytesFile(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def folder_files(files: dict, folder: str) -> dict:
    """{name: VFile} of the generated files directly in ``folder``."""
    return {name: f for path, f in files.items() for d, name in [posixpath.split(path)] if d == folder}


def arrange_weights(own: dict, fmt: str) -> tuple:
    """(files kept in the folder, {sub-folder: its files}) of one model folder's generated files ``own`` under
    ``--hf-format fmt``: a format's files (and its index, when sharded) where its row says."""
    names = sorted(own)
    shards = {f.name: [n for n in names if f.is_shard(n)] for f in hf_formats.FORMATS}
    weights = {n for found in shards.values() for n in found} | {f.index for f in hf_formats.FORMATS}
    small = {n: f for n, f in own.items() if n not in weights}
    keep, sub = dict(small), {}
    for f in hf_formats.FORMATS:
        chosen = {n: own[n] for n in shards[f.name]}
        if len(shards[f.name]) > 1 and f.index in own:
            chosen[f.index] = own[f.index]
        if fmt == f.name or (fmt == hf_formats.ALL and not f.folder):
            keep.update(chosen)
        elif fmt == hf_formats.ALL:
            sub.setdefault(f.folder, dict(small)).update(chosen)
    return keep, sub


def _with_ids(model, ids: dict) -> tuple:
    """(config, generation config or None) of ``model`` with the tokenizer's ids laid over."""
    config = {**model.config, **ids}
    gen = None
    if model.generation_config is not None:
        gen = {**model.generation_config, **ids}
    return config, gen


def _reader(files: dict, problems: list):
    """``read(name)`` for ``token_ids``: a file's bytes, None when absent — or too large to be read for ids
    (``MAX_FILE_BYTES``: parsing reads it whole; it is still served as it is), which ``problems`` then says."""
    def read(name: str):
        f = files.get(name)
        if f is None:
            return None
        if f.size > MAX_FILE_BYTES:
            problems.append(f"{name} is larger than {MAX_FILE_BYTES >> 20} MiB ({f.size:,} bytes): not read for "
                            "token ids (served as it is)")
            return None
        return f.read(0, f.size)

    return read


def arrange(files: dict, hf, ctx) -> tuple:
    """(final files, README.txt lines) of the HF view; see the module docstring."""
    opts = ctx.options
    folders = hf.folders()
    notes: list = []
    overlay_files: dict = {}
    per_folder_extra: dict = {f: {} for f in folders}  # folder -> {name: OverlayFile} its bin/ mirrors
    if opts.overlay:
        overlay = collect_overlays(opts.overlay)
        overlay_files = dict(overlay.files)
        notes += overlay.notes
        for folder in folders:
            per_folder_extra[folder] = overlay.folder(folder)
    else:
        found, where, hints = discover_tokenizer(ctx.ckpt_path, hf.params_path, opts.allow_external)
        notes += hints
        targets = [""] if "" in folders else list(folders)
        if where is not None:
            for folder in targets:
                per_folder_extra[folder] = dict(found)
                base = f"{folder}/" if folder else ""
                overlay_files.update({base + n: f for n, f in found.items()})
            shown = ", ".join(f"{t or '(root)'}/" for t in targets)
            notes.append(f"tokenizer files {', '.join(sorted(found))} from {where}, served in {shown}")
        else:
            notes.append("no tokenizer files (a Cerebras checkpoint carries none, and none were found next to it or "
                         "its params): mount with --overlay DIR holding the model's tokenizer for AutoTokenizer, "
                         "pipeline(), chat templates and GGUF conversion")

    out: dict = {}
    for folder, model in folders.items():
        base = f"{folder}/" if folder else ""
        own = folder_files(files, folder)
        too_large: list = []
        tok = token_ids(_reader(per_folder_extra[folder], too_large))
        config, gen = _with_ids(model, tok.ids)
        own["config.json"] = json_file(config)
        own.pop("generation_config.json", None)
        if gen:
            own["generation_config.json"] = json_file(gen)
        if tok.ids:
            said = ", ".join(f"{k} {v!r} ({tok.sources[k]})" for k, v in sorted(tok.ids.items()))
            notes.append(f"{base or '(root)/'}config.json token ids from the tokenizer files: {said}")
        notes += [f"{base}{p}" for p in dict.fromkeys(too_large + tok.problems)]
        keep, sub = arrange_weights(own, opts.hf_format)
        out.update({base + n: f for n, f in keep.items()})
        for fmt in hf_formats.FORMATS:
            if fmt.folder not in sub:
                continue
            sub_base = base + fmt.folder + "/"
            out.update({sub_base + n: f for n, f in sub[fmt.folder].items()})
            out.update({sub_base + n: f for n, f in per_folder_extra[folder].items()
                        if sub_base + n not in overlay_files})
            alone = hf_formats.primary().name
            notes.append(f"{sub_base}: the same model as {fmt.about}, a complete HF folder "
                         f"(from_pretrained(MOUNT/{sub_base.rstrip('/')})) beside the {alone}-only "
                         f"{base or '(root)/'} (--hf-format {'|'.join(hf_formats.choices())})")
    notes += _lay_over(out, overlay_files, ctx)
    return out, notes


def _lay_over(out: dict, overlay_files: dict, ctx) -> list:
    """Put the overlay files into ``out`` (replacing generated ones); skip what cannot coexist with the mount."""
    notes = []
    other_dirs = {folder_of(v).rstrip("/") for v in ctx.options.views if folder_of(v)}
    generated_dirs = {"/".join(p.split("/")[:i]) for p in out for i in range(1, p.count("/") + 1)}
    for rel, f in sorted(overlay_files.items()):
        parts = rel.split("/")
        parents = {"/".join(parts[:i]) for i in range(1, len(parts))}
        if rel == README_NAME or parts[0] in other_dirs:
            notes.append(f"overlay file {rel} left out: the mount's own {parts[0]} is there")
            continue
        if rel in generated_dirs or parents & set(out):
            notes.append(f"overlay file {rel} left out: it clashes with a generated folder or file")
            continue
        if rel in out and getattr(out[rel], "origin", None) is None:
            notes.append(f"{rel} is the overlay's ({f.origin}), replacing the generated one")
        out[rel] = f
    return notes
