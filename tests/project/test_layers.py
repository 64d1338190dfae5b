"""The layers of docs/architecture.md are the code's: every import in ckptfs/ (at module level or inside a function)
points to the same layer or one below, and no modules import each other in a circle.

The layer table is read from docs/architecture.md itself ("Layers"), so the document and this check cannot drift
apart: a new module lands in the layer whose row names its folder or file, or this test says it has none.

Storage is the only door to a checkpoint's bytes: outside ``ckptfs/storage/`` no module opens or reads a file itself
(``open``, ``os.open``, ``os.read``/``pread``, ``Path.read_bytes``/``read_text``, ``np.fromfile``, ``mmap`` of a
descriptor, ``h5py.File``, …) but in the ways ``RAW_READS_ALLOWED`` declares, one line of why each (ckptfs's own
state, the export's output, /proc, pipes; ``h5py.File`` where HDF5's own driver must open the file).
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


#: Storage is the only door to a checkpoint's bytes. Outside ``ckptfs/storage/`` no module opens or reads a file by
#: itself: none of the calls ``file_accesses`` finds (a builtin ``open``, ``os.open``/``fdopen``, ``os.read``/
#: ``pread``/``preadv``/``readv``, ``Path.read_bytes``/``read_text``, ``np.fromfile``/``memmap``/``load``,
#: ``mmap.mmap`` of a descriptor, ``h5py.File``, …) but those declared here, each reading something that is not a
#: checkpoint or source folder (ckptfs's own state, the export's output, /proc, pipes), or (``h5py.File``) the one
#: accepted exception: the HDF5 C library reads a file's metadata through its own driver, so h5py opens the file
#: itself (after the storage layer has read its signature). ``{module: {call: why}}``.
RAW_READS_ALLOWED = {
    "ckptfs/commands/export.py": {"open": "the export's own part file, on the descriptor its output folder created"},
    "ckptfs/commands/export_record.py": {"os.pread": "the export's own output files, sampled to tell they are "
                                                     "unchanged"},
    "ckptfs/commands/export_tree.py": {"os.open": "the export's own output files, read back to compare"},
    "ckptfs/fuse/mount.py": {"open": "/proc/self/mounts", "os.open": "/dev/null for the server's stdin",
                             "os.fdopen": "the options and status pipes of the mount's own server process",
                             "os.read": "the status pipe of the mount's own server process",
                             ".read_text()": "the mount's own log file (its last line)"},
    "ckptfs/fuse/operations.py": {"open": "/proc/self/mountinfo and the FUSE device's read_ahead_kb in /sys"},
    "ckptfs/fuse/proctitle.py": {"open": "/proc/self/stat, /proc/self/mem, /proc/<pid>/cmdline"},
    "ckptfs/guard/confine.py": {"os.open": "a non-blocking, no-link descriptor it hands to storage's LocalFile"},
    "ckptfs/layouts/hdf5/buffers.py": {"os.pread": "ckptfs's own unlinked temporary file"},
    "ckptfs/layouts/hdf5/fork.py": {"os.read": "the pipe from ckptfs's own forked skeleton builder"},
    "ckptfs/layouts/h5saver.py": {"h5py.File": "an in-memory HDF5 file ckptfs writes"},
    "ckptfs/layouts/hdf5/skeleton.py": {"h5py.File": "an in-memory HDF5 file ckptfs writes"},
    "ckptfs/mapping/lang/spec.py": {".read_text()": "mapping YAML files (ckptfs's mappings/ or the user's), not "
                                                    "checkpoint data"},
    "ckptfs/readers/cerebras/catalog_cache.py": {".read_bytes()": "ckptfs's own source files, hashed into the "
                                                                  "cache key"},
    "ckptfs/readers/cerebras/h5store.py": {"h5py.File": "HDF5's own driver reads a checkpoint's metadata (the "
                                                        "accepted exception)"},
    "ckptfs/readers/run/scan.py": {"h5py.File": "HDF5's own driver reads a run checkpoint's root attributes (the "
                                                "accepted exception)"},
    "ckptfs/readers/s3/open.py": {"h5py.File": "over a RangedFile: HDF5 reads the object through a storage Blob"},
    "ckptfs/readers/s3/params.py": {"os.open": "ckptfs's own private copy of a params file",
                                    "os.fdopen": "ckptfs's own private copy of a params file"},
    "ckptfs/state/files.py": {"os.open": "ckptfs's own cache files", "os.fdopen": "ckptfs's own cache files",
                              "os.read": "ckptfs's own cache key file"},
    "ckptfs/state/outfiles.py": {"os.open": "the output folders and files ckptfs writes for the user"},
    "ckptfs/views/hf/overlay.py": {"os.open": "the user's --overlay files (tokenizer, cards), not checkpoint data",
                                   "os.preadv": "the user's --overlay files (tokenizer, cards), not checkpoint data"},
}

#: calls that open or read a file by their dotted name (``file_accesses``)
_FILE_CALLS = {"open", "builtins.open", "io.open", "io.FileIO", "codecs.open", "os.open", "os.fdopen", "os.read",
               "os.pread", "os.preadv", "os.readv", "np.fromfile", "numpy.fromfile", "np.memmap", "numpy.memmap",
               "np.load", "numpy.load", "h5py.File", "zipfile.ZipFile", "tarfile.open", "gzip.open"}
#: a ``.open(mode)`` call (``Path.open("rb")``; ``Folder.open(name)`` names an entry, never a mode)
_MODES = {"r", "rb", "r+", "r+b", "rt", "w", "wb", "a", "ab"}


def _dotted(f) -> str:
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        return f"{_dotted(f.value)}.{f.attr}"
    return ""


def file_accesses(path: Path) -> list:
    """``[(line, call)]`` of every call in the module that opens or reads a file by itself (``RAW_READS_ALLOWED``'s
    comment lists them): ``.read_bytes()``/``.read_text()`` only without a positional argument (``Path``'s take
    none: ``Folder.read_text(name)`` is the storage interface, ``VirtualTensor.read_bytes(start, stop)`` a tensor's), ``mmap.mmap`` only of a descriptor (not anonymous memory), the builtin ``open`` only where
    the module binds no ``open`` of its own."""
    tree = ast.parse(path.read_text(), str(path))
    own_open = any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == "open" for n in tree.body) or any(
        isinstance(n, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == "open" for a in n.names)
        for n in tree.body)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        attr = node.func.attr if isinstance(node.func, ast.Attribute) else None
        first = node.args[0] if node.args else None
        if name in _FILE_CALLS and not (name == "open" and own_open):
            out.append((node.lineno, name))
        elif attr in ("read_bytes", "read_text") and not node.args:
            out.append((node.lineno, f".{attr}()"))
        elif attr == "open" and isinstance(first, ast.Constant) and first.value in _MODES:
            out.append((node.lineno, ".open(mode)"))
        elif name == "mmap.mmap" and first is not None and not (
                isinstance(first, ast.UnaryOp) or (isinstance(first, ast.Constant) and first.value == -1)):
            out.append((node.lineno, "mmap.mmap(fd)"))
    return out


def unexpected_file_accesses(root: Path = ROOT) -> dict:
    """``{module: [(line, call)]}`` of the file accesses outside ``ckptfs/storage/`` that ``RAW_READS_ALLOWED``
    does not declare."""
    found = {}
    for path in sorted((root / "ckptfs").rglob("*.py")):
        rel = str(path.relative_to(root))
        if rel.startswith("ckptfs/storage/"):
            continue
        allowed = RAW_READS_ALLOWED.get(rel, {})
        bad = [(line, call) for line, call in file_accesses(path) if call not in allowed]
        if bad:
            found[rel] = sorted(bad)
    return found


def test_checkpoint_bytes_are_read_only_through_storage():
    """Storage is the only door to a checkpoint's bytes: outside ``ckptfs/storage/``, no module opens or reads a
    file but in the ways ``RAW_READS_ALLOWED`` declares, each with why it reads no checkpoint (or is HDF5's own
    driver); every declared entry is still used (a stale one would hide a new access)."""
    assert unexpected_file_accesses() == {}
    used = {str(p.relative_to(ROOT)): {c for _, c in file_accesses(p)} for p in PACKAGE.rglob("*.py")}
    stale = {m: sorted(set(calls) - used.get(m, set())) for m, calls in RAW_READS_ALLOWED.items()}
    assert {m: c for m, c in stale.items() if c} == {}


@pytest.mark.parametrize("line", [
    'open(path, "rb").read(8)', "Path(path).read_bytes()", 'Path(path).read_text(encoding="utf-8")',
    'Path(path).open("rb")', "os.open(path, os.O_RDONLY)", 'np.fromfile(path, dtype="<f4")',
    'h5py.File(path, "r")', "mmap.mmap(fd, 0, prot=mmap.PROT_READ)", "os.pread(fd, 8, 0)",
])
def test_the_check_sees_a_reader_opening_a_checkpoint_itself(tmp_path, line):
    """A reader that opens its checkpoint with any of these calls instead of the storage layer fails the check;
    the storage interface's own calls (``Folder.read_text(name)``, ``Folder.open(name)``, ``mmap.mmap(-1, n)``)
    do not."""
    reader = tmp_path / "ckptfs" / "readers" / "probe.py"
    reader.parent.mkdir(parents=True)
    reader.write_text(f"def f(path, fd, folder):\n    folder.read_text('latest', 64)\n    folder.open(path)\n"
                      f"    mmap.mmap(-1, 8)\n    return {line}\n")
    assert list(unexpected_file_accesses(tmp_path)) == ["ckptfs/readers/probe.py"]
    assert len(unexpected_file_accesses(tmp_path)["ckptfs/readers/probe.py"]) == 1


#: modules one package folder may hold directly: past that, a folder no longer shows what its parts are
MAX_MODULES_PER_FOLDER = 20


def _crowded_folders(package: Path) -> dict:
    """``{folder: module count}`` of the folders under ``package`` holding more than ``MAX_MODULES_PER_FOLDER``
    modules directly."""
    counts = {d: len(list(d.glob("*.py"))) for d in [package, *package.rglob("*")]
              if d.is_dir() and d.name != "__pycache__"}
    return {str(d.relative_to(package.parent)): n for d, n in counts.items() if n > MAX_MODULES_PER_FOLDER}


def test_no_package_folder_holds_more_than_twenty_modules():
    assert _crowded_folders(ROOT / "ckptfs") == {}


def test_the_check_sees_a_crowded_folder(tmp_path):
    crowded = tmp_path / "pkg" / "flat"
    crowded.mkdir(parents=True)
    for k in range(MAX_MODULES_PER_FOLDER + 1):
        (crowded / f"m{k}.py").write_text("")
    (tmp_path / "pkg" / "few.py").write_text("")
    assert _crowded_folders(tmp_path / "pkg") == {"pkg/flat": MAX_MODULES_PER_FOLDER + 1}
