"""Prefetch state lives only in the cursor module (ckptfs/layouts/cursor.py): one ``ReadCursor`` per open handle.

The rule, checked on the syntax of every other module of the package: none of them *defines* a stream's state — where
a reader's stream began or ended, how far it went in order, the run of blocks served from memory — as an attribute.
"Defines" means any of:

* an assignment to an attribute of that name (``self._last_end = …``, ``obj.memory_run += 1``, annotated or not);
* a ``__slots__`` entry of that name;
* a method or property of that name (``def from_memory(self)``, ``def block_computed(...)``).

Reading a cursor's attributes elsewhere is fine (``cursor.from_memory`` in a test, a log line); keeping them on a file,
a blob, a tensor or the block cache shared by every file is what confused two readers of one file (each saw the
other's reads as jumps) and what let one stream served from the page cache stop every other stream's read-ahead.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
PACKAGE = ROOT / "ckptfs"
CURSOR = PACKAGE / "layouts" / "cursor.py"

#: the names of a stream's state (the old scattered ones and the cursor's own)
STREAM_STATE = {"_last_end", "last_end", "_streak", "_stream_from", "memory_run", "from_memory", "block_computed",
                "_in_file_order"}


def definitions(path: Path) -> list:
    """``[(line, name)]`` of the stream-state names ``path`` defines (see the module docstring)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and sub.attr in STREAM_STATE:
                    found.append((node.lineno, sub.attr))
            if isinstance(t, ast.Name) and t.id == "__slots__":
                value = node.value
                for c in ast.walk(value) if value is not None else ():
                    if isinstance(c, ast.Constant) and c.value in STREAM_STATE:
                        found.append((node.lineno, c.value))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in STREAM_STATE:
            found.append((node.lineno, node.name))
    return found


def test_only_the_cursor_module_defines_a_streams_state():
    outside = {str(p.relative_to(ROOT)): d for p in sorted(PACKAGE.rglob("*.py")) if p != CURSOR
               if (d := definitions(p))}
    assert outside == {}, "stream state belongs to ckptfs/layouts/cursor.py (a ReadCursor per handle)"


def test_the_rule_sees_each_kind_of_definition(tmp_path):
    """The check is not vacuous: the cursor module defines them, and each kind of definition is found."""
    assert {name for _, name in definitions(CURSOR)} >= {"last_end", "memory_run", "from_memory", "block_computed"}
    sample = tmp_path / "sample.py"
    sample.write_text("class F:\n"
                      "    __slots__ = ('name', '_last_end')\n"
                      "    def __init__(self):\n"
                      "        self._streak: int = 0\n"
                      "        self.cache.memory_run += 1\n"
                      "    @property\n"
                      "    def from_memory(self):\n"
                      "        return self.cursor.from_memory\n")
    assert sorted(name for _, name in definitions(sample)) == ["_last_end", "_streak", "from_memory", "memory_run"]
