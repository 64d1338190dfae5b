"""``ckptfs convert-config PARAMS.yaml``: the Hugging Face config.json a checkpoint trained with these params would
get — before training, to learn whether the model can be converted at all.

On success the config is printed (or written with ``-o``) exactly as the hf view's config.json, and the params keys
that have no HF counterpart are listed on stderr. When HF cannot express the params, every obstacle is printed as
one ``error:`` line naming the key and its value, then the dropped keys, and the exit code is 2.

config.json's ``torch_dtype``/``dtype`` come from the weights in a real conversion; here ``--dtype`` gives them
(default float32, what Cerebras checkpoints hold unless the model was built in another dtype).

A multi-component model (DPO, DPR, LLaVA…) has one config per HF folder: stdout then shows ``{folder: config}``
(``""`` = the root); ``--folder NAME`` prints one of them alone, ``-o DIR`` writes ``DIR/<folder>/config.json``.

The other way, ``ckptfs convert-config config.json`` (a Hugging Face config, or an HF model folder: each
component's config.json) prints the params YAML a mount of that model serves (``params.yaml``, the model section
Model Zoo's converter writes), and lists on stderr every HF setting the Cerebras model cannot carry, one line each;
settings it cannot take at all are one ``error:`` line each and exit code 2.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..views import options as mount_options
from ..errors import UsageError
from ..state.outfiles import OutputDir, OutputError, write_file


#: what ``--dtype`` accepts: ``ckptfs.mapping.params.convert_config.DTYPES``, spelled out here because building the CLI's
#: parser (every ``ckptfs`` command, ``mount`` included) must not import the mapping core; a test checks they agree
DTYPES = ("float32", "bfloat16", "float16")


def add_parser(subparsers):
    p = subparsers.add_parser(
        "convert-config", help="the HF config.json a checkpoint trained with PARAMS.yaml would get (or why none)",
        description="Print the Hugging Face config.json that a checkpoint trained with these Cerebras params would "
                    "be converted with, and the params keys HF has no counterpart for; or, when HF cannot express "
                    "the params, one error per obstacle (exit code 2).")
    p.add_argument("params", metavar="PARAMS.yaml", help="Cerebras params YAML (legacy model: or trainer layout); or a "
                                                          "Hugging Face config.json (or model folder): the params "
                                                          "YAML a mount of that model serves")
    mount_options.add_arguments(p, only=("model", "trainer_index", "revision"))  # --model, --trainer-index, --revision
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="the weights' dtype for torch_dtype/dtype (comes from the tensors in a real conversion; "
                        "default: float32)")
    p.add_argument("-o", "--output", metavar="PATH",
                   help="write config.json here (a file, or an existing directory; for a multi-component model a "
                        "directory that receives <folder>/config.json) instead of printing it")
    p.add_argument("--folder", metavar="NAME", help="for a multi-component model: only this HF folder's config")
    return p


def config_text(config: dict) -> str:
    """A config as the hf view writes config.json."""
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def _report(lines: list, head: str) -> None:
    if lines:
        print(head, file=sys.stderr)
        for line in lines:
            print(f"  {line}", file=sys.stderr)


def is_hf_config(path: Path) -> bool:
    """A Hugging Face config (``*.json``) or model folder, or a Hub repository id in the local cache (a path that
    does not exist, spelled ``ORG/NAME``), rather than Cerebras params."""
    from ..readers.hf.hub_cache import looks_like_repo_id

    return path.is_dir() or path.suffix.lower() == ".json" or (not os.path.lexists(path) and
                                                              looks_like_repo_id(str(path)))


def hf_source(args) -> Path:
    """The config file or model folder ``args.params`` names: a Hub repository id means its snapshot in the local
    cache (``source.hub_cache``, with ``--revision``)."""
    src = Path(args.params)
    if src.is_dir() or os.path.lexists(src):
        return src
    from ..readers.hf.hub_cache import resolve_repo_id

    return resolve_repo_id(args.params, getattr(args, "revision", None))  # a config alone will do: no weights needed


def run_hf(args) -> int:
    """HF config(s) -> the params YAML a mount serves, and what it cannot carry."""
    from ..mapping.to_cs import hf_to_params
    from ..readers.hf.folder import read_hf_configs
    from ..views.cs import params_yaml

    src = hf_source(args)
    configs = read_hf_configs(src)
    result = hf_to_params(configs, model=args.model)
    if result.problems:
        for problem in result.problems:
            print(f"ckptfs: error: {src}: {problem}", file=sys.stderr)
        _report(result.notes, "Hugging Face settings the Cerebras params cannot carry:")
        return 2
    text = params_yaml(result.params)
    if args.output is None:
        sys.stdout.write(text)
    else:
        out = Path(args.output)
        target = out / "params.yaml" if out.is_dir() else out
        try:
            target.write_text(text)
        except OSError as e:
            raise UsageError(e.filename or target, f"cannot write: {e.strerror or e}") from e
    _report(result.notes, "Hugging Face settings the Cerebras params cannot carry:")
    return 0


def run(args) -> int:
    from ..mapping.params.convert_config import params_to_hf_configs

    params = Path(args.params)
    if is_hf_config(params):
        return run_hf(args)
    result = params_to_hf_configs(params, model=args.model, trainer_index=args.trainer_index, dtype=args.dtype)
    if not result.ok:
        for problem in result.problems:
            print(f"ckptfs: error: {params}: {problem}", file=sys.stderr)
        _report(result.dropped, "params keys that would be dropped (no HF counterpart):")
        return 2
    configs = result.configs
    if args.folder is not None:
        if args.folder not in configs:
            raise UsageError("--folder", f"no HF folder {args.folder!r} in {result.model_name} "
                                         f"(folders: {', '.join(repr(f) for f in configs)})")
        configs = {args.folder: configs[args.folder]}
    _write(configs, args.output)
    _report(result.dropped, "params keys that would be dropped (no HF counterpart):")
    _report(result.notes, "notes:")
    return 0


def _write(configs: dict, output) -> None:
    single = len(configs) == 1
    if output is None:
        text = config_text(next(iter(configs.values()))) if single else config_text(configs)
        sys.stdout.write(text)
        return
    out = Path(output)
    try:
        if single:  # written as ckptfs.state.outfiles writes: no link followed, nothing but a regular file replaced
            folder, name = (out, "config.json") if out.is_dir() else (out.parent, out.name)
            with OutputDir(folder, create=False) as d:
                write_file(d, name, config_text(next(iter(configs.values()))).encode())
            return
        with OutputDir(out) as d:
            for folder, config in configs.items():
                write_file(d, f"{folder}/config.json" if folder else "config.json", config_text(config).encode())
    except OutputError as e:
        raise UsageError(e.path, e.problem) from None
    except OSError as e:
        raise UsageError(e.filename or out, f"cannot write: {e.strerror or e}") from e
