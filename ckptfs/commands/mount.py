"""``ckptfs mount CKPT MOUNTPOINT``: serve a checkpoint's converted files as a read-only FUSE directory.

The options that decide what the tree contains are declared in ``ckptfs.views.options`` (shared with ``ckptfs export``
and the Python API); ``--foreground`` and ``--allow-other`` concern only the server.
"""
from __future__ import annotations

import argparse

from ..views import options as mount_options
from ckptfs.commands import CKPT_FORMS, CKPT_HELP


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "mount", help="mount a checkpoint as a read-only directory of converted files",
        description="Mount a checkpoint read-only at MOUNTPOINT. Files are generated on read. Without --foreground "
                    "the server runs in the background (its log file is printed); stop it with `ckptfs umount "
                    "MOUNTPOINT`. " + CKPT_FORMS)
    p.add_argument("ckpt", metavar="CKPT", help=CKPT_HELP)
    p.add_argument("mountpoint", metavar="MOUNTPOINT", help="an existing empty directory")
    mount_options.add_arguments(p)
    p.add_argument("--foreground", "-f", action="store_true",
                   help="serve in this process until unmounted or interrupted (logs on stderr)")
    p.add_argument("--allow-other", action="store_true",
                   help="let other users read the mount (needs user_allow_other in /etc/fuse.conf)")
    # internal: the write end of the status pipe of a background start (ckptfs.fuse.mount.start_background)
    p.add_argument("--status-fd", type=int, default=None, help=argparse.SUPPRESS)
    # internal: the read end of the pipe a background start sends the options through (not on the command line,
    # which every user can read: ckptfs.fuse.mount.public_argv)
    p.add_argument("--options-fd", type=int, default=None, help=argparse.SUPPRESS)
    return p


def run(args) -> int:
    from ..fuse.mount import build_tree, mount

    if args.options_fd is not None:
        args = _with_private_options(args)
    options = mount_options.from_args(args)
    started = mount(args.ckpt, args.mountpoint, options, foreground=args.foreground,
                    allow_other=args.allow_other, debug=getattr(args, "debug", False),
                    status_fd=args.status_fd if args.foreground else None,
                    build=getattr(args, "build_tree", None) or build_tree)
    if started is not None:
        print(f"ckptfs: mounted {args.ckpt} at {started.mountpoint} (server pid {started.pid}; "
              f"log: {started.log_path}; stop with `ckptfs umount {started.mountpoint}`)")
    return 0


def _with_private_options(args):
    """``args`` with the options read from the options pipe (``--options-fd``) parsed as if given on the command
    line."""
    from ckptfs.fuse.mount import receive_options

    extra = receive_options(args.options_fd)
    argv = ["mount", args.ckpt, args.mountpoint, "--foreground", *extra]
    if args.status_fd is not None:
        argv += ["--status-fd", str(args.status_fd)]
    parser = argparse.ArgumentParser(prog="ckptfs")  # this command's parser alone (the CLI imports this module)
    sp = add_parser(parser.add_subparsers(dest="command"))
    sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    full = parser.parse_args(argv)
    full.build_tree = getattr(args, "build_tree", None)
    full.debug = getattr(full, "debug", False) or getattr(args, "debug", False)
    return full
