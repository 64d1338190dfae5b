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
* ``hub/``: exactly the model's Hugging Face repository — the root model folder's files (or, without a root model,
  every model folder) with what the overlay laid over them, the same file objects, without the ``bin/`` copies, the
  other views or the folders ckptfs adds beside the model (DPO's ``ref_model/``, LoRA's ``base/``): the folder to
  publish (``hf upload ORG/NAME MOUNT/hub``) or copy; README.txt says so (``publishing_lines``).
* token ids: one value per id and folder, carried by every generated config.json and generation_config.json of the
  folder and of its ``bin/`` (``special_tokens.py``: all from the overlay's config.json, else from its
  generation_config.json, else each from the tokenizer's special tokens, else the mapping's from the params, the
  family or the class defaults); README.txt says where each came from, and when two files the overlay brings
  disagree. A tokenizer file above ``special_tokens.MAX_FILE_BYTES`` is served but not read for ids.
"""
from __future__ import annotations

import json
import posixpath

from . import formats as hf_formats
from ..base import README_NAME, BytesFile
from .overlay import collect_overlays, discover_tokenizer
from ..registry import folder_of
from .token_ids import MAX_FILE_BYTES, NUMERIC_SOURCES, token_ids

#: the folder that is exactly the model's Hugging Face repository (what to publish or copy)
HUB_FOLDER = "hub"


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


def _with_ids(content: dict, ids: dict) -> dict:
    """``content`` (a config or generation config) with the folder's token ids: set, or left out when unset."""
    out = {k: v for k, v in content.items() if k not in ids}
    out.update({k: v for k, v in ids.items() if v is not None})
    return out


def _folder_ids(model, extra: dict):
    """The folder's token ids (``special_tokens.TokenIds``) from the files ``extra`` laid over it and the model."""
    from ...mapping.params.to_hf_config import TOKEN_ID_SOURCES

    fallback = {k: model.config[k] for k in model.token_id_sources if k in model.config}
    sources = {k: TOKEN_ID_SOURCES.get(v, v) for k, v in model.token_id_sources.items()}
    too_large: list = []
    tok = token_ids(_reader(extra, too_large), fallback, sources)
    tok.problems[:0] = [p for p in dict.fromkeys(too_large) if p not in tok.problems]
    return tok


def _ids_note(base: str, also: str, tok, extra: dict) -> list:
    """README.txt lines: the token ids of the folder ``base`` (``also``: the other folders that carry them) and where
    each came from; overlay files that disagree."""
    def origin(key: str) -> str:
        where = getattr(extra.get(tok.files.get(key)), "origin", None)  # the overlay or tokenizer file's path
        return f"{tok.sources[key]} in {posixpath.dirname(str(where))}" if where else tok.sources[key]

    notes = []
    if tok.ids:
        said = ", ".join(f"{k} {'unset' if v is None else v} ({origin(k)})" for k, v in sorted(tok.ids.items()))
        notes.append(f"token ids of {base}config.json and {base}generation_config.json{also}: {said}")
    served = {n: _json_of(extra[n]) for n in NUMERIC_SOURCES if n in extra}
    if len(served) == 2 and all(isinstance(d, dict) for d in served.values()):
        a, b = served.values()
        for key in sorted(k for k in set(a) & set(b) if k.endswith("_token_id") and a[k] != b[k]):
            notes.append(f"the overlay's {base}config.json and {base}generation_config.json disagree on {key} "
                         f"({a[key]!r} / {b[key]!r}); both are served as given")
    return notes


def _json_of(f):
    if f.size > MAX_FILE_BYTES:  # not read for ids (``_reader`` says so)
        return None
    try:
        return json.loads(f.read(0, f.size))
    except Exception:  # an unreadable or invalid overlay file: special_tokens reports it
        return None


def _set_ids(own: dict, model, ids: dict) -> None:
    """Put the generated config.json (and generation_config.json) with the folder's token ids ``ids`` into ``own``."""
    own["config.json"] = json_file(_with_ids(model.config, ids))
    own.pop("generation_config.json", None)
    if model.generation_config is not None:  # a model that generates: the file even when no id is set
        own["generation_config.json"] = json_file(_with_ids(model.generation_config, ids))


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
        found, where, hints = discover_tokenizer(ctx.ckpt_path, hf.params_path, opts.allow_external,
                                                 getattr(ctx.checkpoint, "params_location", None), ctx.parts)
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
        extra = per_folder_extra[folder]
        tok = _folder_ids(model, extra)
        _set_ids(own, model, tok.ids)
        keep, sub = arrange_weights(own, opts.hf_format)
        out.update({base + n: f for n, f in keep.items()})
        same_ids = []  # sub-folders whose files carry the folder's ids (the overlay brings none of their own)
        sub_notes = []
        for fmt in hf_formats.FORMATS:
            if fmt.folder not in sub:
                continue
            files_here = sub[fmt.folder]
            sub_base = base + fmt.folder + "/"
            sub_extra = {**extra, **{rel[len(sub_base):]: f for rel, f in overlay_files.items()
                                     if rel.startswith(sub_base) and "/" not in rel[len(sub_base):]}}
            if sub_extra == extra:
                same_ids.append(fmt.folder)
            else:  # the overlay has files of its own for the sub-folder: its ids may differ
                sub_tok = _folder_ids(model, sub_extra)
                _set_ids(files_here, model, sub_tok.ids)
                sub_notes += _ids_note(sub_base, "", sub_tok, sub_extra)
                sub_notes += [f"{sub_base}{p}" for p in sub_tok.problems]
            out.update({sub_base + n: f for n, f in files_here.items()})
            out.update({sub_base + n: f for n, f in extra.items() if sub_base + n not in overlay_files})
            weights = ", ".join(n for n in sorted(files_here) if fmt.is_shard(n))
            primary = hf_formats.primary()
            safe = ", use_safetensors=False" if primary.name == "safetensors" else ""
            sub_notes.append(f"{sub_base}: the {fmt.about} ({weights}) are here, in a complete HF folder of their own "
                             f"(from_pretrained(MOUNT/{sub_base.rstrip('/')}{safe})); the {primary.about} are in "
                             f"{base or 'the root'} (--hf-format {'|'.join(hf_formats.choices())})")
        also = "".join(f" and {d}/'s" for d in same_ids)
        notes += _ids_note(base, also, tok, extra)
        notes += [f"{base}{p}" for p in tok.problems]
        notes += sub_notes
    notes += _lay_over(out, overlay_files, ctx)
    out.update(hub_files(out, folders))
    return out, notes


def _outside_repo(paths) -> list:
    """The entries of a mount (``paths``: every file's) that are not the repository ``hub/`` mirrors: for each such
    file, its first folder the repository has no file in (``bin/``, ``text_model/bin/``, ``cs/``…), or the file."""
    mirrored = {p[len(HUB_FOLDER) + 1:] for p in paths if p.startswith(HUB_FOLDER + "/")}
    repo_dirs = {"/".join(p.split("/")[:i]) for p in mirrored for i in range(1, p.count("/") + 1)}
    out = set()
    for p in paths:
        head, sep, _ = p.partition("/")
        if head == HUB_FOLDER or p in mirrored or p == README_NAME:
            continue
        if sep and head not in repo_dirs:  # a folder of its own (another view's: 100,000 tensors/ files)
            out.add(head + "/")
            continue
        parts = p.split("/")
        dirs = ["/".join(parts[:i]) for i in range(1, len(parts))]
        out.add(next((d + "/" for d in dirs if d not in repo_dirs), p))
    return sorted(out)


def publishing_lines(paths, view_folders=()) -> list:
    """README.txt's ``publish:`` lines for a mount of the files ``paths`` (README.txt aside), whose other views
    (cs, torch, tensors: the whole checkpoint) are in ``view_folders``: ``hub/`` is the repository to publish or copy;
    what else the mount holds says why its root is not."""
    import textwrap

    extras = _outside_repo(paths)
    whole = [e for e in extras if e.rstrip("/") in {f.rstrip("/") for f in view_folders}]
    said = ["README.txt (this file)", f"{HUB_FOLDER}/ (the repository again)"]
    about = {f.folder: f.about for f in hf_formats.FORMATS if f.folder}
    said += [e + (f" (the model again, as {about[last]})" if (last := e.rstrip("/").rsplit("/", 1)[-1]) in about
                  else "") for e in extras if e not in whole]
    if whole:
        said.append(", ".join(whole) + " (the whole checkpoint, its optimizer state too if it has one)")
    text = (f"{HUB_FOLDER}/ is exactly the model's Hugging Face repository (config, weights, tokenizer and overlay "
            f"files): publish or copy that folder (hf upload ORG/NAME MOUNT/{HUB_FOLDER}; cp -r MOUNT/{HUB_FOLDER} "
            f"DEST), not the mount root, which also has " + ", ".join(said) + ".")
    return textwrap.wrap(text, 118, initial_indent="publish:        ", subsequent_indent=" " * 16)


def hub_folders(folders) -> list:
    """The model folders of the Hugging Face repository: the root model's (without the reference model, base model
    or other folders ckptfs adds beside it), or, for a checkpoint without one (LLaVA, DPR), every model folder."""
    return [""] if "" in folders else sorted(folders)


def hub_files(out: dict, folders) -> dict:
    """``hub/``: the files of the Hugging Face repository of the model, as served in ``out`` (the same file objects)
    — the model folders' own files and what the overlay laid over the root (a model card…), without the ``bin/``
    copies or the folders ckptfs adds beside the root model."""
    repo = [f for f in hub_folders(folders) if f]
    others = tuple(f"{f}/" for f in folders if f and f not in repo)

    formats = tuple(f"{f.folder}/" for f in hf_formats.FORMATS if f.folder)  # bin/: the model again

    def in_repo(rel: str) -> bool:
        if rel.startswith(formats + others):
            return False
        inside = next((f for f in repo if rel.startswith(f + "/")), None)
        return inside is None or not rel[len(inside) + 1:].startswith(formats)

    return {f"{HUB_FOLDER}/{rel}": f for rel, f in out.items() if in_repo(rel)}


def _lay_over(out: dict, overlay_files: dict, ctx) -> list:
    """Put the overlay files into ``out`` (replacing generated ones); skip what cannot coexist with the mount."""
    notes = []
    other_dirs = {folder_of(v).rstrip("/") for v in ctx.options.views if folder_of(v)} | {HUB_FOLDER}
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
