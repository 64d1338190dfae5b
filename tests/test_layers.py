"""The layers of docs/architecture.md are the code's: every import in ckptfs/ (at module level or inside a function)
points to the same layer or one below, and no modules import each other in a circle.

The layer table is read from docs/architecture.md itself ("Layers"), so the document and this check cannot drift
apart: a new module lands in the layer whose row names its folder or file, or this test says it has none.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ckptfs"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def layer_table(text: str) -> list:
    """``[(layer name, [path, …])]`` from the first table under "## Layers", bottom layer first."""
    section = text.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or set(cells[0]) <= set("-: ") or cells[0] == "layer":
            continue
        paths = re.findall(r"`(ckptfs/[^`]*)`", cells[1])
        rows.append((cells[0].strip("*"), [p.rstrip("/") for p in paths]))
    return rows


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict:
    """``{module name: path}`` of every module of the package."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: dict) -> list:
    """``[(line, imported ckptfs module)]`` of every import statement in the module, nested ones included. ``from X
    import y`` counts as importing ``X.y`` when that is a module, else ``X``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "ckptfs"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "ckptfs":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((node.lineno, sub if sub in known else target))
    return [(line, m) for line, m in out if m in known]


def layer_of(name: str, table: list) -> int | None:
    """The index of the layer whose row names the longest prefix of ``name``'s file or folder."""
    rel = name.replace(".", "/")
    best, where = None, -1
    for i, (_, paths) in enumerate(table):
        for p in paths:
            p = p[:-3] if p.endswith(".py") else p
            if p.endswith("/__init__"):
                p = p[:-len("/__init__")]
            if (rel == p or rel.startswith(p + "/")) and len(p) > where:
                best, where = i, len(p)
    return best


def upward_imports(table: list, known: dict) -> list:
    problems = []
    for name, path in known.items():
        mine = layer_of(name, table)
        for line, target in imports_of(name, path, known):
            theirs = layer_of(target, table)
            if mine is not None and theirs is not None and theirs > mine:
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                problems.append(f"{where}:{line}: {name} ({table[mine][0]}) imports {target} "
                                f"({table[theirs][0]}), a higher layer")
    return problems


def circles(known: dict) -> list:
    """Every set of modules that import each other, directly or not (strongly connected components of two or more
    modules), each as a sorted list."""
    graph = {name: sorted({t for _, t in imports_of(name, path, known) if t != name}) for name, path in known.items()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return sorted(found)


@pytest.fixture(scope="module")
def table():
    rows = layer_table(ARCHITECTURE.read_text())
    assert len(rows) >= 5, rows
    return rows


def test_every_module_belongs_to_a_layer_of_the_table(table):
    assert [n for n in modules() if layer_of(n, table) is None] == []


def test_no_module_imports_a_higher_layer(table):
    assert upward_imports(table, modules()) == []


def test_no_modules_import_each_other_in_a_circle():
    assert circles(modules()) == []


def test_the_check_sees_an_upward_import_inside_a_function_and_a_circle(table, tmp_path):
    """The walk finds what the rules forbid: a function-level import of a higher layer, and a circle."""
    known = modules()
    low = tmp_path / "ckptfs" / "storage" / "probe.py"
    low.parent.mkdir(parents=True)
    low.write_text("def f():\n    from ..tree.base import Tree\n    from . import probe2\n")
    other = low.with_name("probe2.py")
    other.write_text("from .probe import f\n")
    fake = {**known, "ckptfs.storage.probe": low, "ckptfs.storage.probe2": other}
    problems = upward_imports(table, fake)
    assert any("ckptfs.storage.probe (storage) imports ckptfs.tree.base (tree)" in p for p in problems), problems
    assert ["ckptfs.storage.probe", "ckptfs.storage.probe2"] in circles(fake)


def test_the_files_the_code_names_exist():
    """A docstring or comment that sends the reader to a document or test of the repository names one that exists."""
    named = set()
    for path in PACKAGE.rglob("*.py"):
        named |= {m.rstrip(".") for m in re.findall(r"\b(?:docs|tests|scripts|mappings|examples)/[\w./-]+",
                                                     path.read_text())}
    missing = sorted(n for n in named if not list(ROOT.glob(n)))
    assert named and missing == []
