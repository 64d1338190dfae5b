"""``ckptfs ls CKPT [-l] [--allow-partial]``: a checkpoint's key tree, nesting shown by indentation (for a model_dir,
the run's checkpoints: ``commands/runinfo.py``; ``--single`` lists its latest checkpoint's keys).

Containers end in ``/`` (sequence items are ``[i]``); an alias (link) is marked ``-> target key``;
``-l`` adds each tensor's shape and dtype, each value, and what opaque/unreadable leaves are.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from ..views import options as mount_options

if TYPE_CHECKING:  # the source layer (h5py, numpy) is imported when a command runs, not when the CLI is built
    from ..catalog.walk import Entry


def add_parser(subparsers):
    p = subparsers.add_parser("ls", help="list a checkpoint's key tree",
                              description="List a Cerebras checkpoint's keys as a tree (indentation shows nesting; "
                                          "'-> key' marks an alias of another key).")
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint .mdl file, or a model_dir: its checkpoints (steps, sizes, "
                                                "completeness, latest); with --single, its latest checkpoint's keys; "
                                                "or a Hugging Face model folder: the keys of the Cerebras checkpoint "
                                                "a mount of it serves")
    p.add_argument("-l", "--long", action="store_true", help="also show shapes, dtypes and values")
    mount_options.add_arguments(p, only=("allow_partial", "allow_external", "single", "model", "added_tensors",
                                         "allow_unused_weights", "endpoint_url", "profile", "revision"))
    return p


def _name(e: Entry, parent_is_seq: bool) -> str:
    return f"[{e.name}]" if parent_is_seq else str(e.name)


def leaf_detail(leaf) -> str:
    from ..catalog.model import OpaqueLeaf, TensorLeaf, UnreadableLeaf, ValueLeaf

    if isinstance(leaf, TensorLeaf):
        t = leaf.tensor
        return f"{list(t.shape)} {t.dtype.name}" + (" (numpy)" if leaf.numpy else "")
    if isinstance(leaf, ValueLeaf):
        r = repr(leaf.value)
        return f"= {r if len(r) <= 80 else r[:77] + '...'}"
    if isinstance(leaf, OpaqueLeaf):
        return f"opaque pickled object, {len(leaf.data)} bytes"
    if isinstance(leaf, UnreadableLeaf):
        return f"unreadable: {leaf.reason}"
    return ""


def format_lines(ckpt, long: bool = False):
    from ..catalog.model import Container
    from ..catalog.walk import walk

    seq_depths: dict[int, bool] = {0: isinstance(ckpt.root, Container) and ckpt.root.keys is None}
    if not isinstance(ckpt.root, Container):
        leaf = ckpt.root
        yield "(a single leaf)" + (f"  {leaf_detail(leaf)}" if long else "")
        return
    for e in walk(ckpt):
        name = _name(e, seq_depths.get(e.depth, False))
        pad = "  " * e.depth
        if isinstance(e.node, Container):
            seq_depths[e.depth + 1] = e.node.keys is None
            n = len(e.node.children)
            extra = f"  ({e.node.kind}, {n} {'entry' if n == 1 else 'entries'})" if long else ""
            yield f"{pad}{name}/{extra}"
            continue
        line = f"{pad}{name}"
        if e.link_target is not None:
            line += f" -> {e.link_target}"
        if long:
            line += f"  {leaf_detail(e.node)}"
        yield line


def run(args) -> int:
    from .runinfo import classify_argument, format_run, scan_run

    src = classify_argument(args)  # before the readers are imported: an S3 location's first request leaves sooner
    from ..readers import open_checkpoint

    where = src.path
    if src.is_run and not args.single:  # a model_dir: the run's checkpoints
        print(format_run(scan_run(where, args.allow_external or ())))
        return 0
    if src.is_hf:  # a Hugging Face model: the checkpoint its mount serves
        from ..mapping.hf_checkpoint import open_hf_checkpoint

        hc = open_hf_checkpoint(where, mount_options.from_args(args))
        for line in format_lines(hc.checkpoint, args.long):
            sys.stdout.write(line + "\n")
        return 0
    with open_checkpoint(where, allow_partial=args.allow_partial,
                         allow_external=args.allow_external or ()) as ckpt:
        out = sys.stdout
        for line in format_lines(ckpt, args.long):
            out.write(line + "\n")
        for msg in ckpt.warnings:
            print(f"warning: {msg}", file=sys.stderr)
    return 0
