"""``ckptfs export CKPT VIRTUAL_PATH DEST``: write one file of the mount without FUSE.

The bytes come from the same ``VirtualTree`` the mount serves (same view options), streamed in 8 MiB blocks.
DEST ``-`` is stdout; an existing directory receives the file under its own name. A file is written to
``DEST.tmp`` and renamed at the end, so a failed export leaves no partial DEST behind.
"""
from __future__ import annotations

import difflib
import os
import sys
import time
from pathlib import Path

from ..errors import CkptfsError, UsageError
from ..vfs import VirtualPathError, VirtualTree, split_path
from .. import options as mount_options

BLOCK = 8 << 20


def add_parser(subparsers):
    p = subparsers.add_parser(
        "export", help="write one file of the mount (same bytes) without mounting",
        description="Write VIRTUAL_PATH (a path inside the mount, e.g. model.safetensors or torch/checkpoint.pt) to DEST ('-' for "
                    "stdout) without FUSE, with exactly the bytes the mount serves.")
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint .mdl file or model_dir")
    p.add_argument("virtual_path", metavar="VIRTUAL_PATH", help="path inside the mount (see README.txt)")
    p.add_argument("dest", metavar="DEST", help="output file, existing directory, or - for stdout")
    mount_options.add_arguments(p)
    return p


def resolve_file(tree: VirtualTree, vpath: str):
    """The file entry at ``vpath``, or a ``UsageError`` listing close matches / the directory's files."""
    key = "/".join(split_path(vpath))
    try:
        e = tree.lookup(key)
    except VirtualPathError:
        close = difflib.get_close_matches(key, tree.all_paths(), n=5, cutoff=0.5)
        hint = f"; close matches: {', '.join(close)}" if close else "; see README.txt in the mount for what exists"
        raise UsageError("/" + key, f"no such file in the mount{hint}") from None
    if e.is_dir:
        inside = [p for p in tree.file_paths() if p.startswith(e.path + "/")] if e.path else tree.file_paths()
        more = f", … ({len(inside)} files)" if len(inside) > 5 else ""
        raise UsageError("/" + key, f"is a directory; export one of its files: {', '.join(inside[:5])}{more}")
    return e


class _Progress:
    """A one-line progress bar on stderr (only used when stderr is a terminal)."""

    def __init__(self, name: str, total: int):
        self.name, self.total, self.t0, self.last = name, total, time.monotonic(), 0.0

    def update(self, done: int, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < 0.2:
            return
        self.last = now
        pct = 100 * done / self.total if self.total else 100.0
        rate = done / max(now - self.t0, 1e-6) / 1e6
        bar = "#" * int(pct / 5)
        sys.stderr.write(f"\r{self.name}: [{bar:<20}] {pct:5.1f}% {done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB "
                         f"{rate:,.0f} MB/s")
        if final:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _read_failed(path: str, off: int, err: Exception) -> CkptfsError:
    if isinstance(err, CkptfsError):
        return err
    return CkptfsError("/" + path, f"read failed at offset {off}: {type(err).__name__}: {err}")


def _copy(tree: VirtualTree, e, out, bar, block: int) -> None:
    """Stream file entry ``e`` into the binary stream ``out``, ``block`` bytes at a time."""
    for off in range(0, e.size, block):
        try:
            data = tree.read(e, off, block)
        except Exception as err:
            raise _read_failed(e.path, off, err) from err
        out.write(data)
        if bar:
            bar.update(off + len(data))


def export_file(tree: VirtualTree, vpath: str, dest, *, progress: bool = False, block: int = BLOCK) -> int:
    """Write the virtual file ``vpath`` to ``dest`` (a path, an existing directory, or ``"-"``); returns its size.
    A file destination is written as ``DEST.tmp`` and renamed, so a failed export leaves nothing behind."""
    e = resolve_file(tree, vpath)
    bar = _Progress(e.name, e.size) if progress else None
    if str(dest) == "-":
        _copy(tree, e, sys.stdout.buffer, bar, block)
        sys.stdout.buffer.flush()
    else:
        target = Path(dest)
        if target.is_dir():
            target = target / e.name
        tmp = target.with_name(target.name + ".tmp")
        ok = False
        try:
            with open(tmp, "wb") as f:
                _copy(tree, e, f, bar, block)
            os.replace(tmp, target)
            ok = True
        except OSError as err:
            raise CkptfsError(target, f"cannot write: {err.strerror or err}") from err
        finally:
            if not ok:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
    if bar:
        bar.update(e.size, final=True)
    return e.size


def run(args) -> int:
    from ..cache import set_default_cache_size
    from ..vfs import build_tree

    options = mount_options.from_args(args)
    set_default_cache_size(options.cache_size)
    tree = build_tree(args.ckpt, options)
    try:
        export_file(tree, args.virtual_path, args.dest, progress=sys.stderr.isatty())
    finally:
        tree.close()
    return 0
