"""``ckptfs mount CKPT MOUNTPOINT``: serve a checkpoint's converted files as a read-only FUSE directory.

Also defines the options shared by every command that builds the virtual tree (``add_tree_arguments`` and
``options_from_args``; ``ckptfs export`` uses them so that it produces exactly what the mount shows).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import UsageError
from ..layouts.units import parse_size
from ..views.base import ALL_VIEWS, MountOptions


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_views(text: str) -> tuple:
    """``"hf,cs"`` → ``("hf", "cs")``; unknown or empty → ``UsageError``."""
    names = []
    for n in (x.strip() for x in text.split(",")):
        if not n:
            continue
        if n not in ALL_VIEWS:
            raise UsageError(None, f"unknown view {n!r} in --views (choose from {', '.join(ALL_VIEWS)})")
        if n not in names:
            names.append(n)
    if not names:
        raise UsageError(None, "--views is empty")
    return tuple(names)


def add_tree_arguments(p: argparse.ArgumentParser) -> None:
    """Options that decide what the virtual tree contains (same for mount and export)."""
    d = MountOptions()
    p.add_argument("--config", type=Path, help="Cerebras params YAML (default: found next to the checkpoint)")
    p.add_argument("--model", help="model name, overriding detection from the params YAML")
    p.add_argument("--trainer-index", type=int, help="which trainer of a params YAML that lists several")
    p.add_argument("--views", default=",".join(d.views),
                   help=f"comma-separated views to generate (default: {','.join(d.views)})")
    p.add_argument("--max-shard-size", type=_size, default=d.max_shard_size,
                   help="largest HF weight shard, e.g. 5GB, 500MB, 2GiB (default: 5GB)")
    p.add_argument("--zip-crc", choices=("exact", "zero"), default=d.zip_crc,
                   help="CRC-32 of torch zip records: exact (computed) or zero (faster; torch does not check)")
    p.add_argument("--cache-size", type=_size, default=d.cache_size,
                   help="memory for converted tensor blocks, e.g. 256MiB (default: 256MiB)")
    p.add_argument("--allow-partial", action="store_true",
                   help="open a checkpoint whose save did not finish (no __SUCCESS__ marker)")
    p.add_argument("--data-iter-dir", type=Path, help="dataloader state directory for the cs view")
    p.add_argument("--shuffle-seed", type=int, help="dataloader shuffle seed for the cs view")


def options_from_args(args) -> MountOptions:
    return MountOptions(config=args.config, model=args.model, trainer_index=args.trainer_index,
                        views=parse_views(args.views), max_shard_size=args.max_shard_size, zip_crc=args.zip_crc,
                        cache_size=args.cache_size, allow_partial=args.allow_partial,
                        data_iter_dir=args.data_iter_dir, shuffle_seed=args.shuffle_seed)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "mount", help="mount a checkpoint as a read-only directory of converted files",
        description="Mount a Cerebras checkpoint (a .mdl file or a model_dir) read-only at MOUNTPOINT. Files are "
                    "generated on read. Without --foreground the server runs in the background (its log file is "
                    "printed); stop it with `ckptfs umount MOUNTPOINT`.")
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint .mdl file or model_dir")
    p.add_argument("mountpoint", metavar="MOUNTPOINT", help="an existing empty directory")
    add_tree_arguments(p)
    p.add_argument("--foreground", "-f", action="store_true",
                   help="serve in this process until unmounted or interrupted (logs on stderr)")
    p.add_argument("--allow-other", action="store_true",
                   help="let other users read the mount (needs user_allow_other in /etc/fuse.conf)")
    return p


def run(args) -> int:
    from ..mountproc import mount

    options = options_from_args(args)
    started = mount(args.ckpt, args.mountpoint, options, foreground=args.foreground,
                    allow_other=args.allow_other, debug=getattr(args, "debug", False))
    if started is not None:
        print(f"ckptfs: mounted {args.ckpt} at {started.mountpoint} (server pid {started.pid}; "
              f"log: {started.log_path}; stop with `ckptfs umount {started.mountpoint}`)")
    return 0
