"""Command-line entry point: ``ckptfs <command> …``. Each command lives in ``ckptfs/commands/<name>.py``
with ``add_parser(subparsers)`` and ``run(args) -> int``. Errors become one line and exit code 2.

``main(argv, build_tree=…)`` runs the commands over trees built by another function than
``ckptfs.tree.assemble.build_tree`` (its arguments): what a test does to mount or export synthetic files."""
from __future__ import annotations

import argparse
import importlib
import sys

from .errors import exit_code

#: each command's module, by the name its parser is stored under (full names: the layer test reads them as imports)
COMMANDS = {
    "info": "ckptfs.commands.info", "ls": "ckptfs.commands.ls", "models": "ckptfs.commands.models",
    "mount": "ckptfs.commands.mount", "umount": "ckptfs.commands.umount", "export": "ckptfs.commands.export",
    "convert_config": "ckptfs.commands.convert_config", "explain": "ckptfs.commands.explain",
    "diff": "ckptfs.commands.diff"}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of ``only`` (the command being run: the others' modules are not imported,
    which is most of a cold ``ckptfs mount``'s start)."""
    p = argparse.ArgumentParser(prog="ckptfs", description="Mount Cerebras checkpoints as Hugging Face / torch / upgraded Cerebras files, converted lazily on read.")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    p.add_argument("--version", action=_Version, help="print the installed version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in [only] if only else COMMANDS:
        mod = importlib.import_module(COMMANDS[name])
        sp = mod.add_parser(sub)
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        sp.set_defaults(_run=mod.run)
    return p


def version() -> str:
    """The installed package's version (its metadata); for a source tree that was never installed, saying so."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("ckptfs")
    except PackageNotFoundError:
        return "(not installed: run from a source tree)"


class _Version(argparse.Action):
    """``--version``: the version is looked up only when asked for (reading the package metadata costs every command's
    start tens of milliseconds)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"ckptfs {version()}")  # on stdout, as argparse's own version action
        parser.exit()


def _command_named(argv: list) -> str | None:
    """The command ``argv`` runs when it is plain to see (its first argument, or the one after ``--debug``)."""
    rest = argv[1:] if argv[:1] == ["--debug"] else argv
    modules = {m.replace("_", "-"): m for m in COMMANDS}  # a command's name is its module's, with - for _
    return modules.get(rest[0]) if rest else None


def main(argv=None, *, build_tree=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command_named(argv))
    args = parser.parse_args(argv)
    args.build_tree = build_tree  # None: the commands build trees with ckptfs.tree.assemble.build_tree
    return exit_code(lambda: args._run(args), getattr(args, "debug", False))


if __name__ == "__main__":
    sys.exit(main())
