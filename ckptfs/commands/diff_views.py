"""What two mounts would serve, compared file by file without FUSE (``ckptfs diff --view NAME``).

The files of one view of each tree (any ``ckptfs.tree.base.Tree``: a checkpoint's, as a mount serves it) are paired
by path; a file
named after its checkpoint (``cs/<stem>.mdl``, ``torch/<stem>.pt``) is paired with the other checkpoint's. README.txt
is no view's file (it names the mounted checkpoint) and is left out. Two files of one size are read side by side
in blocks through each tree's own block cache; a difference is described by how many bytes differ and where the
first one is: the piece of the file it lies in and, for tensor bytes, the tensor and element (``ckptfs explain``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..errors import CkptfsError
from .compare import ADDED, CHANGED, EQUAL, REMOVED, UNREADABLE
from ..tree.base import Tree
from ..views.base import README_NAME
from ..views.registry import VIEWS, folder_of

#: a file of two different sizes
SIZE = "size"

#: bytes read from each tree at a time
BLOCK = 4 << 20


@dataclass
class FileDiff:
    """One file of either tree's view and what the comparison found."""

    path: str  # its path in A's tree (in B's when only B has it)
    status: str  # ADDED, REMOVED, EQUAL, CHANGED, SIZE or UNREADABLE
    size_a: int | None = None
    size_b: int | None = None
    other: str | None = None  # its path in B's tree when that is another (named after B's checkpoint)
    differing: int = 0  # bytes that differ (files of one size)
    first_offset: int | None = None
    where: str | None = None  # what the first differing byte is
    problem: str | None = None  # UNREADABLE: why

    @property
    def equal(self) -> bool:
        return self.status == EQUAL


def view_files(tree: Tree, view: str, stem: str) -> dict:
    """``{pairing key: path}`` of the files of ``view`` in ``tree``; the key writes the checkpoint's stem as
    ``<stem>`` (its files are named after it) so that two checkpoints' files pair."""
    folder = folder_of(view)
    others = [v.folder for v in VIEWS if v.folder and v.folder != folder]
    out = {}
    for path in tree.walk(""):
        if path == README_NAME or not path.startswith(folder) or any(path.startswith(o) for o in others):
            continue
        head, _, name = path.rpartition("/")
        if name.startswith(stem + "."):
            name = "<stem>" + name[len(stem):]
        out[f"{head}/{name}" if head else name] = path
    return out


def _where(tree: Tree, path: str, offset: int) -> str:
    """What byte ``offset`` of ``path`` is: the tensor and element, else the piece (``ckptfs explain``)."""
    from .explain import explain_file

    try:
        lines = [ln.strip() for ln in explain_file(tree, path, offset).splitlines()[1:]]
    except CkptfsError as e:
        return f"(cannot explain: {e.problem})"
    if not lines:
        return "(not made of pieces)"
    what = lines[0].split(":", 1)[0] if lines[0].startswith("tensor ") else lines[0]
    element = re.search(r"element \[[^\]]*\]", lines[1]) if len(lines) > 1 else None
    return f"{what}, {element.group(0)}" if element and lines[0].startswith("tensor ") else what


def compare_files(ta: Tree, tb: Tree, pa: str, pb: str, block: int = BLOCK, budget=None) -> FileDiff:
    """Compare file ``pa`` of tree ``ta`` with file ``pb`` of tree ``tb``; ``budget`` (``source.compare.Budget``)
    bounds the bytes read (``BudgetExceeded``)."""
    ea, eb = ta.lookup(pa), tb.lookup(pb)
    out = FileDiff(pa, EQUAL, ea.size, eb.size, pb if pb != pa else None)
    if ea.size != eb.size:
        out.status = SIZE
        return out
    buf_a, buf_b = bytearray(min(block, ea.size)), bytearray(min(block, ea.size))
    for off in range(0, ea.size, block):
        n = min(block, ea.size - off)
        if budget is not None:
            budget.key = pa
            budget.spend(n)
        try:
            ta.readinto(ea, off, memoryview(buf_a)[:n])
        except CkptfsError as e:
            out.status, out.problem = UNREADABLE, f"A: {e}"
            return out
        try:
            tb.readinto(eb, off, memoryview(buf_b)[:n])
        except CkptfsError as e:
            out.status, out.problem = UNREADABLE, f"B: {e}"
            return out
        if budget is not None:
            budget.advance(n)
        if buf_a[:n] == buf_b[:n]:
            continue
        diff = np.frombuffer(buf_a, np.uint8, n) != np.frombuffer(buf_b, np.uint8, n)
        out.differing += int(np.count_nonzero(diff))
        if out.first_offset is None:
            out.first_offset = off + int(np.argmax(diff))
    if out.differing:
        out.status = CHANGED
        out.where = _where(ta, pa, out.first_offset)
    return out


def diff_trees(ta: Tree, tb: Tree, view: str, stem_a: str, stem_b: str, on_file=None, block: int = BLOCK,
               budget=None) -> list:
    """``[FileDiff]`` of the files of ``view`` in the two trees (A's files in order, then those only B has);
    ``on_file`` sees each as soon as it is known; ``budget`` bounds the bytes read."""
    fa, fb = view_files(ta, view, stem_a), view_files(tb, view, stem_b)
    out = []

    def emit(d: FileDiff) -> None:
        out.append(d)
        if on_file is not None:
            on_file(d)

    for key, pa in fa.items():
        pb = fb.get(key)
        if pb is None:
            emit(FileDiff(pa, REMOVED, size_a=ta.lookup(pa).size))
        else:
            emit(compare_files(ta, tb, pa, pb, block, budget))
    for key, pb in fb.items():
        if key not in fa:
            emit(FileDiff(pb, ADDED, size_b=tb.lookup(pb).size))
    return out
