"""``ckptfs diff A B [--json] [--tolerance X] [--view NAME]``: what changed between two checkpoints, reading only
what must be read (Cerebras' ``cszoo checkpoint diff`` loads both).

A and B are checkpoint files, model_dirs (their latest checkpoint), or a run's checkpoint named as a run mount
names it: ``MODEL_DIR/checkpoint_2000``, ``MODEL_DIR/latest``; each may be local or in a bucket (``s3://``: an
object, a prefix in Cerebras' S3 layout, a run), as ``source.kind`` takes every checkpoint argument. Every key is added, removed, equal, or changed in
kind, shape, dtype or value (``ckptfs.commands.compare``: chunks stored alike are compared as stored, the others
decoded block by block). ``--view hf`` (or cs, torch, tensors) compares instead the files two mounts would serve
(``diff_trees``), e.g. to check that an upgrade changed nothing. Memory stays within ``--cache-size``.

Exit code: 0 when everything compared is equal, 1 when something differs, 2 on bad input (a file that cannot be
opened, a tensor that cannot be read: one line naming the file).

Time is bounded: chunks neither checkpoint wrote are never read (two datasets that declare terabytes and wrote
nothing are equal at once), and ``--max-bytes`` (default 256 GiB, ``0``: no bound) caps the bytes of A that are
read to be compared; reaching it stops the diff with one line naming the key, exit 2. On a terminal a progress bar
counts the bytes compared.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from ..views import options as mount_options
from ..errors import CheckpointError, UsageError
from ..units import parse_size

#: what a diff reads at most unless --max-bytes says otherwise (the comparison's own default: ``compare.Budget``;
#: not imported from there, which would import h5py and numpy into every command's parser)
DEFAULT_MAX_BYTES = 256 << 30

#: mount options that decide what a view's files are (``--view``); the others apply to both kinds of diff
VIEW_OPTIONS = ("config", "model", "trainer_index", "lora", "max_shard_size", "hf_format", "overlay", "zip_crc",
                "data_iter_dir", "shuffle_seed")
COMMON_OPTIONS = ("cache_size", "allow_partial", "allow_external", "endpoint_url", "profile")

_MARK = {"equal": "=", "changed": "~", "added": "+", "removed": "-", "shape": "!", "dtype": "!", "kind": "!",
         "size": "!", "unreadable": "?"}


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0 or math.isinf(value):
        raise ValueError(f"invalid tolerance {text!r} (a number >= 0)")
    return value


def add_parser(subparsers):
    from argparse import ArgumentTypeError

    from ..views.registry import names as view_names

    def tolerance(text):
        try:
            return _tolerance(text)
        except ValueError as e:
            raise ArgumentTypeError(str(e)) from None

    def max_bytes(text):
        try:
            return parse_size(text)
        except ValueError as e:
            raise ArgumentTypeError(str(e)) from None

    p = subparsers.add_parser(
        "diff", help="what changed between two checkpoints (or what two mounts would serve)",
        description="Compare two checkpoints key by key: keys added or removed, and for keys both hold, changes of "
                    "kind, shape, dtype or value (how many elements differ, the largest difference, the first "
                    "differing element). Chunks stored alike are compared without decoding. With --view, compare "
                    "the files two mounts would serve instead. Exit code 0: equal, 1: different, 2: bad input.")
    p.add_argument("a", metavar="A", help="checkpoint .mdl file, model_dir (its latest checkpoint), or "
                                          "MODEL_DIR/checkpoint_<step> or MODEL_DIR/latest; local or s3://")
    p.add_argument("b", metavar="B", help="the checkpoint to compare A with (same forms)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--tolerance", type=tolerance, default=0.0, metavar="X",
                   help="elements differing by at most X count as equal (default 0: bit for bit)")
    p.add_argument("--view", metavar="NAME", choices=view_names(),
                   help=f"compare the files of this view ({', '.join(view_names())}) two mounts would serve")
    p.add_argument("--equal", action="store_true", help="also list the keys (files) that are equal")
    p.add_argument("--max-bytes", type=max_bytes, default=DEFAULT_MAX_BYTES, metavar="SIZE",
                   help="stop (exit 2, one line) rather than read more than SIZE of A's data to compare, e.g. 1TiB; "
                        "chunks neither side wrote are not read (default: 256GiB; 0: no bound)")
    mount_options.add_arguments(p, only=VIEW_OPTIONS + COMMON_OPTIONS)
    return p


def resolve_argument(text: str, options=None):
    """The checkpoint an argument names (see the module docstring): a local file (a ``Path``) or a checkpoint in a
    bucket (an ``S3Location``); ``CheckpointError`` naming it (one line: what was found, what would work) if none.
    A model_dir, local or in a bucket, means its latest complete checkpoint."""
    from ..views.options import MountOptions, s3_settings
    from ..readers.kind import classify
    from ..readers.run.scan import RunScanner

    options = options or MountOptions()
    src = classify(text, settings=s3_settings(options), allow_external=options.allow_external).require()
    if src.is_hf:
        raise CheckpointError(text, "a Hugging Face model, not a Cerebras checkpoint: diff its files against a "
                                    "mount's with --view hf, or mount it and diff its checkpoint.mdl")
    if src.kind == "tf checkpoint":  # its prefix or folder: the .index file of the checkpoint it names
        from ..readers.run.resolve import resolve_checkpoint

        return resolve_checkpoint(src.path)
    if not src.is_run:
        return src.path
    listing = RunScanner(src.path, allow_external=options.allow_external).scan()
    if listing.latest is None:
        raise CheckpointError(text, f"a run with no complete checkpoint ({listing.latest_reason})")
    return listing.latest.path


def _number(x):
    """A value for JSON: non-finite floats as strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, complex):
        return str(x)
    return x


def _short(x) -> str:
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def key_text(k) -> str:
    """One line of the text report for a ``KeyDiff``."""
    v = k.values
    if k.status in ("added", "removed"):
        detail = k.b if k.status == "added" else k.a
    elif k.status == "unreadable":
        detail = f"unreadable: {k.problem}"
    elif k.status == "equal":
        how = "" if v is None else (" (stored chunks alike: not decoded)" if v.decoded == 0 else
                                    f" ({v.by_storage:,} of {v.elements:,} elements from stored chunks alike)"
                                    if v.by_storage else " (decoded)")
        detail = f"{k.a}{how}"
    elif k.status in ("shape", "dtype", "kind") and (v is None or k.status != "dtype"):
        detail = f"{k.status}: {k.a} -> {k.b}"
    elif v is None:
        detail = f"{k.a} -> {k.b}"
    else:
        head = f"dtype: {k.a} -> {k.b}: " if k.status == "dtype" else f"{k.a}: "
        if v.changed:
            a, b = v.first_values
            detail = (f"{head}{v.changed:,} of {v.elements:,} elements differ ({v.changed / v.elements:.3%}), "
                      f"max |a-b| {_short(v.max_abs_diff)}, first {list(v.first_index)}: {_short(a)} -> {_short(b)}")
        else:
            detail = f"{head}values equal"
    return f"{_MARK[k.status]} {k.key}  {detail}"


def key_json(k) -> dict:
    out = {"key": k.key, "status": k.status, "a": k.a, "b": k.b}
    v = k.values
    if v is not None:
        out.update(elements=v.elements, changed=v.changed,
                   fraction_changed=v.changed / v.elements if v.elements else 0.0,
                   max_abs_diff=_number(v.max_abs_diff),
                   first_index=list(v.first_index) if v.first_index is not None else None,
                   first_values=[_number(x) for x in v.first_values] if v.first_values else None,
                   equal_by_storage=v.by_storage, decoded=v.decoded)
    if k.problem:
        out["problem"] = k.problem
    return out


def file_text(f) -> str:
    if f.status in ("added", "removed"):
        detail = f"{f.size_b if f.status == 'added' else f.size_a:,} bytes"
    elif f.status == "size":
        detail = f"size: {f.size_a:,} -> {f.size_b:,} bytes"
    elif f.status == "unreadable":
        detail = f"unreadable: {f.problem}"
    elif f.status == "equal":
        detail = f"{f.size_a:,} bytes"
    else:
        detail = (f"{f.differing:,} of {f.size_a:,} bytes differ, first at byte {f.first_offset:,}: {f.where}")
    other = f" (B: {f.other})" if f.other else ""
    return f"{_MARK[f.status]} {f.path}{other}  {detail}"


def file_json(f) -> dict:
    return {k: v for k, v in {"path": f.path, "path_b": f.other, "status": f.status, "size_a": f.size_a,
                              "size_b": f.size_b, "differing_bytes": f.differing if f.status == "changed" else None,
                              "first_offset": f.first_offset, "where": f.where, "problem": f.problem}.items()
            if v is not None}


def _summary(items, noun: str) -> str:
    counts: dict = {}
    for i in items:
        counts[i.status] = counts.get(i.status, 0) + 1
    parts = [f"{n} {status}" for status, n in sorted(counts.items(), key=lambda kv: (kv[0] != "equal", kv[0]))]
    text = f"{len(items)} {noun}: " + (", ".join(parts) or "none")
    stored = [i for i in items if i.status == "equal" and getattr(i, "values", None) is not None
              and i.values.decoded == 0]
    if stored:
        text += f" ({len(stored)} equal from their stored chunks alone, not decoded)"
    return text


def run(args) -> int:
    options = mount_options.from_args(args)
    a, b = resolve_argument(args.a, options), resolve_argument(args.b, options)
    show = (lambda line: print(line, flush=True)) if not args.json else (lambda line: None)
    show(f"A: {a}")
    show(f"B: {b}")
    bar = _Progress(not args.json and sys.stderr.isatty())
    try:
        if args.view:
            items, noun, bad = _diff_views(a, b, args, options, show, bar)
        else:
            items, noun, bad = _diff_checkpoints(a, b, args, options, show, bar)
    finally:
        bar.close()
    equal = all(i.equal for i in items)
    if args.json:
        doc = {"a": str(a), "b": str(b), "view": args.view, "tolerance": args.tolerance, "equal": equal,
               "counts": {s: sum(1 for i in items if i.status == s) for s in sorted({i.status for i in items})}}
        doc["files" if args.view else "keys"] = [(file_json if args.view else key_json)(i) for i in items]
        print(json.dumps(doc, indent=1))
    else:
        print(_summary(items, noun))
    if bad:
        first = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        print(f"ckptfs: error: {first.problem}{more}", file=sys.stderr)
        return 2
    return 0 if equal else 1


class _Progress:
    """A progress bar of the bytes compared, on a terminal only, made once the total is known."""

    def __init__(self, wanted: bool):
        self.wanted, self.bar = wanted, None

    def start(self, total: int, desc: str) -> None:
        if self.wanted and total > 0:
            from ..progress import progress_bar

            self.bar = progress_bar(total, desc)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _diff_checkpoints(a: Path, b: Path, args, options, show, bar: _Progress) -> tuple:
    from ..readers import open_checkpoint
    from .compare import Budget, compared_bytes, diff_checkpoints

    if any(getattr(args, n, None) is not None for n in VIEW_OPTIONS):
        raise UsageError(None, "options that shape a view's files (--config, --model, --max-shard-size…) need --view")
    max_elements = max(1024, options.cache_size // 64)  # two boxes and their float64 values fit the cache
    with open_checkpoint(a, allow_partial=options.allow_partial, allow_external=options.allow_external) as ca, \
            open_checkpoint(b, allow_partial=options.allow_partial, allow_external=options.allow_external) as cb:
        bar.start(compared_bytes(ca, cb), "diff")
        result = diff_checkpoints(ca, cb, tolerance=args.tolerance, max_elements=max_elements,
                                  on_key=lambda k: show(key_text(k)) if args.equal or not k.equal else None,
                                  budget=Budget(args.max_bytes, bar.update))
    return result.keys, "keys", result.unreadable


def _diff_views(a: Path, b: Path, args, options, show, bar: _Progress) -> tuple:
    from dataclasses import replace

    from .compare import Budget

    from ..tree.assemble import build_tree
    from .diff_views import diff_trees, view_files

    if args.tolerance:
        raise UsageError(None, "--tolerance compares tensor values: it does not apply to the bytes of --view")
    opts = replace(options, views=(args.view,), cache_size=max(1 << 20, options.cache_size // 2))  # each tree half
    ta = build_tree(a, opts)
    try:
        tb = build_tree(b, opts)
        try:
            for path, tree in ((a, ta), (b, tb)):
                if not view_files(tree, args.view, path.stem):
                    raise CheckpointError(path, f"view {args.view} is missing: {_why_missing(tree, args.view)}")
            fa = view_files(ta, args.view, a.stem)
            bar.start(sum(ta.lookup(p).size for p in fa.values()), f"diff --view {args.view}")
            files = diff_trees(ta, tb, args.view, a.stem, b.stem,
                               on_file=lambda f: show(file_text(f)) if args.equal or not f.equal else None,
                               block=max(64 << 10, min(4 << 20, opts.cache_size // 8)),
                               budget=Budget(args.max_bytes, bar.update))
        finally:
            tb.close()
    finally:
        ta.close()
    return files, "files", [f for f in files if f.status == "unreadable"]


def _why_missing(tree, view: str) -> str:
    """Why a view has no files, as the tree's README.txt says it."""
    from ..views.base import README_NAME

    text = tree.read(README_NAME, 0, 1 << 20).decode("utf-8", "replace")
    for line in text.splitlines():
        if f" {view}:" in line and "missing:" in line:
            return line.split("missing:", 1)[1].strip()
    return "it has no files (see README.txt of a mount)"
