"""``ckptfs explain CKPT VIRTUAL_PATH OFFSET``: which piece of a generated file serves one byte, and where it comes
from — for a tensor's bytes: the tensor, the element and its byte, the cache block, and each step back to the
source element (through transposes, slices, permutations…) with the source's chunk.

Takes the same options as ``ckptfs export`` (they decide what the tree contains). Reads no tensor data, except
that explaining a byte of the cs view's ``.mdl`` lays out its HDF5 skeleton first.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from ..views import options as mount_options
from ckptfs.commands import CKPT_HELP
from ..tree.base import Tree
from .export import resolve_file


def _offset(text: str) -> int:
    try:
        n = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid offset {text!r} (a byte number, e.g. 1024 or 0x400)") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"invalid offset {text!r}: negative")
    return n


def add_parser(subparsers):
    p = subparsers.add_parser(
        "explain", help="say which piece and which source tensor region serve one byte of a file",
        description="Explain byte OFFSET of VIRTUAL_PATH (a path inside the mount): the piece of the file it lies "
                    "in (header, tensor bytes, zip directory…) and, for tensor bytes, the element, the cache block "
                    "and the source tensor element it is computed from.")
    p.add_argument("ckpt", metavar="CKPT", help=CKPT_HELP)
    p.add_argument("virtual_path", metavar="VIRTUAL_PATH", help="path inside the mount (see README.txt)")
    p.add_argument("offset", metavar="OFFSET", type=_offset, help="byte offset in the file (decimal or 0x hex)")
    mount_options.add_arguments(p)
    return p


def explain_file(tree: Tree, vpath: str, offset: int) -> str:
    """The explanation of byte ``offset`` of the virtual file ``vpath``, as text."""
    e = resolve_file(tree, vpath)
    f = e.file
    if f.deferred:
        f = f.resolve()
    explain = getattr(f, "explain", None)
    if explain is None:  # not made of pieces: say what kind of file it is
        if offset >= e.size:
            return f"/{e.path}: offset {offset} is past the end ({e.size} bytes)"
        kind = (type(f).__doc__ or type(f).__name__).strip().splitlines()[0]
        return f"/{e.path}: byte {offset} of {e.size}: {type(f).__name__}: {kind}"
    return replace(explain(offset), file="/" + e.path).text()


def run(args) -> int:
    from ..tree.assemble import build_tree

    tree = (getattr(args, "build_tree", None) or build_tree)(args.ckpt, mount_options.from_args(args))
    try:
        print(explain_file(tree, args.virtual_path, args.offset))
    finally:
        tree.close()
    return 0
