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

ROOT = Path(__file__).resolve().parent.parent.parent
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
    out += declared_targets(path, name, known)
    for names_them, importer in DECLARED_FOR.items():
        if importer == name and names_them in known:
            out += declared_targets(known[names_them], names_them, known, own=False)
    return [(line, m) for line, m in out if m in known and m != name]


#: registries whose declared targets another module imports: ``{registry: the module that imports what it names}``
DECLARED_FOR = {"ckptfs.views.registry": "ckptfs.tree.assemble"}


def declared_targets(path: Path, name: str, known: dict, own: bool = True) -> list:
    """``[(line, module)]`` of the imports a module makes through ``importlib``: every string constant that is the full
    name of a ckptfs module (the registries name their targets so: cli.py, and views/registry.py for the module
    ``DECLARED_FOR`` says), and every module of its own package when it walks ``pkgutil.iter_modules(__path__)`` (a
    plugin folder: mapping/transforms/). A registry of ``DECLARED_FOR`` imports none of what it names."""
    text = path.read_text()
    out = []
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known \
                and node.value != name and node.value.startswith("ckptfs.") and (name not in DECLARED_FOR or not own):
            out.append((node.lineno, node.value))
    if "iter_modules(__path__)" in text:
        prefix = name + "."
        out += [(0, m) for m in known if m.startswith(prefix) and "." not in m[len(prefix):]]
    return out


def dynamic_imports(path: Path) -> list:
    """``[line]`` of every ``importlib.import_module`` / ``__import__`` call whose target is not a string constant or
    a name this module binds to constants only — the kind of import the layer check could not see."""
    tree = ast.parse(path.read_text(), str(path))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if called in ("import_module", "__import__") and node.args:
                lines.append(node.lineno)
    return lines


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


#: modules that call ``importlib`` and where their targets are declared (checked by ``declared_targets``)
DYNAMIC_IMPORTERS = {
    "ckptfs.cli": "COMMANDS: each command's full module name",
    "ckptfs.tree.assemble": "the modules views/registry.py names (VIEWS: each view's full module name)",
    "ckptfs.mapping.transforms": "every module of its own folder (pkgutil.iter_modules)",
    "ckptfs.readers": "_NAMES: open_checkpoint's and resolve_checkpoint's modules, imported on first use",
}


def test_every_importlib_import_has_declared_targets():
    """A module importing through ``importlib`` is one whose targets the layer check reads (a new one must declare
    them the same way, or this test names it); and the targets it declares are seen as imports."""
    found = {name for name, path in modules().items() if dynamic_imports(path)}
    assert found == set(DYNAMIC_IMPORTERS), found
    known = modules()
    assert "ckptfs.views.tensors" in {m for _, m in imports_of("ckptfs.tree.assemble", known["ckptfs.tree.assemble"],
                                                                known)}
    assert imports_of("ckptfs.views.registry", known["ckptfs.views.registry"], known) == []
    assert "ckptfs.commands.mount" in {m for _, m in imports_of("ckptfs.cli", known["ckptfs.cli"], known)}
    assert "ckptfs.mapping.transforms.falcon" in {
        m for _, m in imports_of("ckptfs.mapping.transforms", known["ckptfs.mapping.transforms"], known)}


#: raw reads (``os.pread``/``preadv``/``readv``/``read``) outside storage/, each with why it reads no checkpoint bytes
RAW_READS_ALLOWED = {
    "ckptfs/layouts/hdf5/fork.py": "the pipe from ckptfs's own forked skeleton builder",
    "ckptfs/layouts/hdf5/buffers.py": "ckptfs's own unlinked temporary file",
    "ckptfs/fuse/mount.py": "the status pipe of the mount's own server process",
    "ckptfs/readers/run/resolve.py": "a run's `latest` pointer, a bounded text file (not checkpoint data)",
    "ckptfs/state/files.py": "ckptfs's own cache files",
    "ckptfs/commands/export_record.py": "the export's own output files, sampled to tell they are unchanged",
    "ckptfs/views/hf/overlay.py": "the user's --overlay files (tokenizer, cards), not checkpoint data",
}


def test_checkpoint_bytes_are_read_only_through_storage():
    """Storage is the only door to a checkpoint's bytes: no ``os.pread``/``preadv``/``readv``/``read`` outside
    ``ckptfs/storage/`` but in the modules listed above, each reading something that is not a checkpoint."""
    raw = {"pread", "preadv", "readv", "read"}
    found = {}
    for path in PACKAGE.rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        if rel.startswith("ckptfs/storage/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in raw \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "os":
                found.setdefault(rel, []).append(node.lineno)
    assert {k: v for k, v in found.items() if k not in RAW_READS_ALLOWED} == {}
