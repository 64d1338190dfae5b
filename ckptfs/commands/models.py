"""``ckptfs models``: every model name ``--model`` accepts, its family, the HF class (none for a family without an HF
side, whose checkpoints mount with the other views) and notes."""
from __future__ import annotations

import json
import shutil
import textwrap

from ..errors import UsageError


def add_parser(subparsers):
    p = subparsers.add_parser("models", help="list the supported model names (for --model)",
                              description="List every model name ckptfs can convert to Hugging Face, with its "
                                          "family, the HF class it produces and notes.")
    p.add_argument("name", nargs="?", help="show only this model name (or family)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--hide-notes", action="store_true", help="leave out the notes column")
    return p


def run(args) -> int:
    from ..mapping.lang.families import list_models

    models = list_models()
    if args.name:
        chosen = [m for m in models if args.name in (m.name, m.family)]
        if not chosen:
            known = ", ".join(m.name for m in models)
            raise UsageError(None, f"unknown model {args.name!r}; supported: {known}")
        models = chosen
    if args.json:
        rows = [{"name": m.name, "family": m.family, "hf_class": m.hf_class or None, "notes": m.notes} for m in models]
        print(json.dumps(rows, indent=2))
        return 0
    print(format_table(models, notes=not args.hide_notes))
    return 0


#: the HF CLASS cell of a model without an HF side
NO_HF_CLASS = "(none)"


def format_table(models, *, notes: bool = True) -> str:
    head = ["MODEL", "FAMILY", "HF CLASS"] + (["NOTES"] if notes else [])
    rows = [[m.name, m.family, m.hf_class or NO_HF_CLASS] + ([m.notes] if notes else []) for m in models]
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(3)]
    total = shutil.get_terminal_size((120, 20)).columns
    note_width = max(30, total - sum(widths) - 6)
    lines = []
    for r in [head] + rows:
        cells = "  ".join(c.ljust(w) for c, w in zip(r[:3], widths))
        if notes:
            wrapped = textwrap.wrap(r[3], note_width) or [""]
            lines.append(cells + "  " + wrapped[0])
            lines += [" " * (len(cells) + 2) + w for w in wrapped[1:]]
        else:
            lines.append(cells.rstrip())
    return "\n".join(line.rstrip() for line in lines)
