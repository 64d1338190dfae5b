"""Mount options, declared once.

Every option that shapes a mount is one field of ``MountOptions``, declared with ``option(...)``: its default, its
command-line flag, the kind of value (how a text is parsed and written back), its help, and whether it changes
the content of generated files. Everything else derives from these declarations:

* ``add_arguments(parser)`` — the flags of ``ckptfs mount`` and ``ckptfs export`` (argparse, help with defaults);
* ``from_args(args)`` — ``MountOptions`` from parsed arguments;
* ``to_argv(options)`` — the flags that reproduce ``options`` (the background server's argv,
  ``mountproc.server_argv``);
* ``from_kwargs(**kw)`` — the Python API (``ckptfs.open(ckpt, max_shard_size="5GB", …)``): texts are parsed as on
  the command line, other values are taken as they are;
* ``content_options(options)`` — the options that change file content and differ from their default, for
  ``tree/assemble.py`` ``content_identity`` (which keys persisted zip CRCs).

Adding an option is a one-place change. Add a field here, for example a repeatable path::

    allow_external: tuple = option((), "--allow-external", PATH, repeat=True, content=True,
                                   help="a directory external tensor files may be read from (repeatable)")

and read ``ctx.options.allow_external`` where it takes effect; the flag, the server's argv, the API keyword and
the content identity follow. A new kind of value is a ``Kind`` (``parse`` a text, ``text`` back for argv,
``show`` for help); ``parse`` raises ``ValueError`` with a message that names the bad input.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from typing import Any, Callable

from ..tensor.cache import DEFAULT_CACHE_BYTES
from ..units import format_size, parse_size
from .hf import formats as hf_formats


# ---- kinds of values ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """How one kind of option value is read from text, written back as text, and shown in help."""

    parse: Callable[[str], Any]
    text: Callable[[Any], str] = str
    show: Callable[[Any], str] = str
    metavar: str | None = None
    flag: bool = False  # a switch (``--allow-partial``): no argument, True when given
    path: bool = False  # a file-system path: absolute in the server's argv, its file identity in content identity


def _int(text: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise ValueError(f"invalid integer {text!r}") from None


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise ValueError(f"{text!r} is not a positive integer")
    return value


def _abspath(p) -> str:
    return os.path.abspath(str(p))


def parse_views(text: str) -> tuple:
    """``"hf,cs"`` → ``("hf", "cs")``; an unknown name or an empty list → ``ValueError``."""
    known = _all_views()
    names = []
    for n in (x.strip() for x in str(text).split(",")):
        if not n:
            continue
        if n not in known:
            raise ValueError(f"unknown view {n!r} (choose from {', '.join(known)})")
        if n not in names:
            names.append(n)
    if not names:
        raise ValueError("no view named")
    return tuple(names)


def choice(*values) -> Kind:
    """One of ``values``; or, given one function, one of what it returns when a value is parsed (a table such as
    ``views.hf_formats``, which may gain rows after this module is imported)."""
    allowed = values[0] if len(values) == 1 and callable(values[0]) else (lambda: values)

    def parse(text: str) -> str:
        if text not in allowed():
            raise ValueError(f"invalid choice {text!r} (choose from {', '.join(allowed())})")
        return text

    return Kind(parse, metavar="{" + ",".join(allowed()) + "}")


def _directory(text: str) -> Path:
    p = Path(text)
    if not p.is_dir():
        raise ValueError(f"not a directory: {text!r}")
    return p


TEXT = Kind(str)
INT = Kind(_int, metavar="N")
POSITIVE = Kind(_positive_int, metavar="N")
SIZE = Kind(parse_size, show=format_size, metavar="SIZE")
PATH = Kind(Path, text=_abspath, metavar="PATH", path=True)
DIRECTORY = Kind(_directory, text=_abspath, metavar="DIR", path=True)
FLAG = Kind(bool, flag=True)
VIEWS = Kind(parse_views, text=",".join, show=",".join, metavar="VIEWS")


# ---- the declaration ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One declared option (``name`` and ``default`` come from its ``MountOptions`` field)."""

    flag: str
    kind: Kind
    help: str
    content: bool = False  # changes the bytes of generated files (part of the content identity)
    repeat: bool = False  # the flag may be given several times; the value is a tuple
    name: str = ""
    default: Any = None

    def parse(self, value):
        """A value from a text (or, for ``repeat``, from a text or a sequence of texts); non-texts pass through."""
        if self.repeat:
            items = (value,) if isinstance(value, (str, os.PathLike)) else tuple(value)
            return tuple(self.kind.parse(v) if isinstance(v, str) else v for v in items)
        return self.kind.parse(value) if isinstance(value, str) and not self.kind.flag else value

    def argv(self, value) -> list:
        """The flags that give ``value`` (nothing for the default)."""
        if value == self.default:
            return []
        if self.kind.flag:
            return [self.flag] if value else []
        values = value if self.repeat else (value,)
        return [a for v in values for a in (self.flag, self.kind.text(v))]

    def help_text(self) -> str:
        if self.kind.flag or self.default in (None, ()):
            return self.help
        return f"{self.help} (default: {self.kind.show(self.default)})"


def option(default, flag: str, kind: Kind, *, help: str, content: bool = False, repeat: bool = False,  # noqa: A002
           factory: Callable[[], Any] | None = None):
    """A ``MountOptions`` field declared as a mount option (see the module docstring); ``factory`` computes a
    default that is not known at import time (``default`` is then ``None``)."""
    meta = {"option": Option(flag, kind, help, content, repeat)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _all_views() -> tuple:
    """The registered views' names (``ckptfs.views.registry``: imported when first needed, not at import time)."""
    from .registry import names

    return names()


def _default_views() -> tuple:
    """The views generated when ``--views`` is not given (every registered view but those off by default: tf)."""
    from .registry import default_names

    return default_names()


@dataclass
class MountOptions:
    """What a mount (or an export, or ``ckptfs.open``) is built with. One field per option, each declared once."""

    config: Path | None = option(None, "--config", PATH, content=True,
                                 help="Cerebras params YAML (default: found next to the checkpoint)")
    model: str | None = option(None, "--model", TEXT, content=True,
                               help="model name (any of `ckptfs models`), overriding detection from the params YAML "
                                    "(a Cerebras checkpoint) or from the config's architectures (a Hugging Face model)")
    trainer_index: int | None = option(None, "--trainer-index", INT, content=True,
                                       help="which trainer of a params YAML that lists several")
    lora: str = option("fold", "--lora", choice("fold", "keep"), content=True,
                       help="LoRA-trained checkpoints: fold the adapters into the HF weights (fold), or also serve "
                            "base/ (the model before LoRA) and adapter/ (a PEFT LoRA adapter of it) beside the "
                            "folded model (keep)")
    views: tuple = option(None, "--views", VIEWS, factory=_default_views,
                          help="comma-separated views to generate (tf, a TensorFlow saver checkpoint, only when named)")
    max_shard_size: int = option(5 * 10**9, "--max-shard-size", SIZE, content=True,
                                 help="largest HF weight shard, e.g. 5GB, 500MB, 2GiB")
    hf_format: str = option(hf_formats.ALL, "--hf-format", choice(hf_formats.choices), content=True,
                            help=hf_formats.option_help())
    overlay: tuple = option((), "--overlay", DIRECTORY, repeat=True, content=True,
                            help="a directory whose files appear in the HF view (tokenizer, chat template, "
                                 "generation_config.json, model card…), replacing generated files of the same name "
                                 "(repeatable; a later one wins); without it, tokenizer files next to the checkpoint "
                                 "or its params are used")
    tf_max_shard_size: int | None = option(None, "--tf-max-shard-size", SIZE, content=True,
                                           help="tf view: split the data into shards of at most this size with "
                                                "TensorFlow's MaxShardSizePolicy (tensors cut into slices as TF cuts "
                                                "them), e.g. 2GB (default: one data file)")
    tf_shard_by: int | None = option(None, "--tf-shard-by", POSITIVE, content=True,
                                     help="tf view: give each group of tensors whose names share their first N "
                                          "components (separated by / or .) data shards of its own")
    zip_crc: str = option("exact", "--zip-crc", choice("exact", "zero"), content=True,
                          help="CRC-32 of torch zip records: exact (computed) or zero (faster; torch does not check)")
    cache_size: int = option(DEFAULT_CACHE_BYTES, "--cache-size", SIZE,
                             help="memory for tensor blocks (and parts fetched from S3), e.g. 256MiB")
    allow_external: tuple = option((), "--allow-external", DIRECTORY, repeat=True, content=True,
                                   help="a folder outside the checkpoint's own whose files the checkpoint may refer "
                                        "to (external tensors; repeatable). Default: only files inside the "
                                        "checkpoint's folder are ever read")
    allow_partial: bool = option(False, "--allow-partial", FLAG,
                                 help="open a partially written checkpoint (no __SUCCESS__ marker), salvaging what its "
                                      "datasets describe")
    single: bool = option(False, "--single", FLAG,
                          help="mount a model_dir as its latest checkpoint alone, fixed at mount time (default: the "
                               "whole run, live: every checkpoint as a folder, and latest; export always reads one)")
    added_tensors: str = option("keep", "--added-tensors", choice("keep", "omit"), content=True,
                                help="a Hugging Face model mounted as a Cerebras checkpoint: tensors the Cerebras model "
                                     "needs but the HF model lacks (Model Zoo's converter draws them at random: a "
                                     "headless model's lm_head, a missing projector…): keep (made deterministically; "
                                     "README.txt says how) or omit")
    allow_unused_weights: bool = option(False, "--allow-unused-weights", FLAG, content=True,
                                        help="a Hugging Face model mounted as a Cerebras checkpoint: convert it even "
                                             "when some of its weights match no rule (they are left out, README.txt "
                                             "lists them). Default: such a weight is an error naming it")
    endpoint_url: str | None = option(None, "--endpoint-url", TEXT,
                                      help="S3-compatible endpoint for s3:// checkpoints (MinIO, Ceph, R2…; default: "
                                           "AWS_ENDPOINT_URL, the AWS profile's endpoint_url, else AWS S3)")
    profile: str | None = option(None, "--profile", TEXT,
                                 help="AWS profile (~/.aws/config, ~/.aws/credentials) for s3:// checkpoints "
                                      "(default: AWS_PROFILE, else the environment's credentials or the default "
                                      "profile)")
    revision: str | None = option(None, "--revision", TEXT,
                                  help="a Hub repository id (ORG/NAME) or cache folder: the branch, tag or commit to "
                                       "read from the local Hugging Face cache (default: main)")
    data_iter_dir: Path | None = option(None, "--data-iter-dir", PATH, content=True,
                                        help="dataloader state directory for the cs view")
    shuffle_seed: int | None = option(None, "--shuffle-seed", INT, content=True,
                                      help="dataloader shuffle seed for the cs view")


def s3_settings(options: MountOptions):
    """How ``s3://`` checkpoints are reached with these options (``--endpoint-url``, ``--profile``)."""
    from ..storage.s3url import S3Settings

    return S3Settings(options.endpoint_url, options.profile)


def check_options(options: MountOptions) -> None:
    """One-line errors for options that cannot work, raised before anything is built or mounted: a ``--config``
    that does not exist, is not a regular file, does not parse (or is an alias bomb: ``mapping.safe_yaml``) or is
    not a mapping. (Directories are checked when parsed: the ``DIRECTORY`` kind.)"""
    if options.config is not None:
        from ..errors import ConfigError
        from ..guard.safe_yaml import load_params_yaml

        if not isinstance(load_params_yaml(options.config), dict):
            raise ConfigError(options.config, "params YAML (--config) is not a mapping of sections")


@cache
def declared() -> tuple:
    """Every option, in declaration order, with its field's name and default (built on first use, so that a
    default computed by a factory — the registered views — is read once everything is imported)."""
    out = []
    for f in fields(MountOptions):
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        out.append(replace(f.metadata["option"], name=f.name, default=default))
    return tuple(out)


def by_name(name: str) -> Option:
    for o in declared():
        if o.name == name:
            return o
    raise KeyError(name)


# ---- what derives from it -------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser, only: tuple | None = None) -> None:
    """Every option (or those named in ``only``) as a command-line flag (argparse ``dest`` = the field name)."""
    for o in declared():
        if only is not None and o.name not in only:
            continue
        if o.kind.flag:
            p.add_argument(o.flag, dest=o.name, action="store_true", help=o.help_text())
            continue
        p.add_argument(o.flag, dest=o.name, type=_argparse_type(o), metavar=o.kind.metavar,
                       action="append" if o.repeat else "store", default=None, help=o.help_text())


def _argparse_type(o: Option):
    def convert(text: str):
        try:
            return o.kind.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = o.flag.lstrip("-")  # what argparse names in "invalid <name> value"
    return convert


def from_args(args) -> MountOptions:
    """``MountOptions`` from parsed arguments (a flag not given keeps the field's default)."""
    kw = {}
    for o in declared():
        v = getattr(args, o.name, None)
        if v is None or (o.kind.flag and not v):
            continue
        kw[o.name] = tuple(v) if o.repeat else v
    return MountOptions(**kw)


def to_argv(options: MountOptions) -> list:
    """Command-line flags that make ``from_args`` give back ``options`` (defaults are left out)."""
    return [a for o in declared() for a in o.argv(getattr(options, o.name))]


def absolute(options: MountOptions) -> MountOptions:
    """``options`` with every path made absolute (as the server's argv gives them): a server that changes its working
    folder reads the same files."""
    changes = {}
    for o in declared():
        value = getattr(options, o.name)
        if not o.kind.path or value is None or value == o.default:
            continue
        values = value if o.repeat else (value,)
        made = tuple(type(v)(os.path.abspath(v)) for v in values)
        changes[o.name] = made if o.repeat else made[0]
    return replace(options, **changes) if changes else options


def from_kwargs(**kw) -> MountOptions:
    """The Python API's options: field names as keywords; texts parsed as on the command line."""
    known = {o.name: o for o in declared()}
    bad = sorted(set(kw) - known.keys())
    if bad:
        raise TypeError(f"unknown option(s) {bad}; known: {sorted(known)}")
    return MountOptions(**{k: known[k].parse(v) for k, v in kw.items()})


def content_options(options: MountOptions) -> list:
    """``[(Option, value)]`` of the options that change file content and differ from their default."""
    return [(o, getattr(options, o.name)) for o in declared()
            if o.content and getattr(options, o.name) != o.default]
