"""``python tests/helpers/fakecli.py --fake NAME ARGS``: the ckptfs command line over a synthetic tree — every tree it builds
(a mount's, an export's) holds the files of ``fusehelp.NAME`` instead of a checkpoint's views
(``ckptfs.cli.main(build_tree=…)``). conftest.run_ckptfs(..., fake=NAME) runs it."""
from __future__ import annotations

import functools
import sys

from helpers import fuse as fusehelp
from ckptfs.cli import main
from ckptfs.tree.assemble import build_tree

if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] != ["--fake"] or len(args) < 2:
        sys.exit("usage: fakecli.py --fake NAME ARGS")
    views = getattr(fusehelp, args[1])
    sys.exit(main(args[2:], build_tree=functools.partial(build_tree, views=views)))
