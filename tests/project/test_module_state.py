"""Nothing process-wide that belongs to a mount: no module of ckptfs keeps mutable state at module level unless this
file declares it, with why it is the process's and not a mount's (``DECLARED``).

The rule (static, from each module's source): a module-level name is *state* when

* a ``global`` statement in the module names it (it is rebound at run time), or
* a module-level statement binds it to a call (an object made at import) other than a builder of immutable values
  (``IMMUTABLE_BUILDERS``, or a class of ckptfs that is a frozen dataclass, a ``NamedTuple`` or an ``Enum``), or
* a module-level statement binds it to a dict, list or set (display or comprehension) under a name that is not a
  constant's (UPPER_CASE tables are constants by the project's convention: never written after import).

Budgets of memory belong to a tree (``tree/memory.py``: the block cache, the part pool of object storage); a module
that made one process-wide again (``_pool = _Pool()`` in ``storage/s3object.py``: the last tree opened set the
budget of every tree) fails here.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
PACKAGE = ROOT / "ckptfs"

#: calls whose result is immutable (or a logger, per process by nature)
IMMUTABLE_BUILDERS = {"frozenset", "tuple", "int", "float", "str", "bytes", "bool", "complex", "range", "object",
                      "re.compile", "logging.getLogger", "struct.Struct", "namedtuple", "collections.namedtuple",
                      "TypeVar", "NewType", "MappingProxyType", "types.MappingProxyType", "np.dtype", "np.uint64",
                      "h5py.string_dtype", "getattr"}

_HDF5 = "the HDF5 library is one per process"
_TABLE = "a table computed once at import and only read after (a constant)"
_MARKER = "a sentinel object, never changed"
#: ``{"path inside ckptfs:name": why it is the process's}``; every entry must still be found (none stale)
DECLARED = {
    # storage: what is the process's or an endpoint's, never a mount's budget
    "storage/s3object.py:_live": "a weak registry of the live part pools, for fork's reset (fork is a process's "
                                 "event); each pool is its tree's, and this holds none alive",
    "storage/s3client.py:_clients": "one client per endpoint settings and AWS environment: connections and the "
                                    "endpoint's down state are the endpoint's, shared by every mount of it",
    "storage/s3client.py:_clients_lock": "guards _clients",
    "storage/base.py:_this_thread": "per-thread counters of reads that waited (a thread's, by nature)",
    "storage/base.py:_scratch": "each thread's scratch buffers (a thread's, by nature; keyed by the native thread, "
                                "whose Python state a FUSE callback does not keep)",
    "storage/local.py:page_cache": "whether the kernel answers the page-cache probe (cachestat): the kernel's",
    # threads doing CPU work: per process by nature; what they make lands in each tree's own cache
    "readers/cerebras/lz4chunks/pool.py:_pool": "CPU threads decoding chunks, per process by nature (cores are); "
                                                "what they decode goes to the reading tree's cache",
    "readers/cerebras/lz4chunks/pool.py:_threads": "the decode threads' count (set_decode_threads), per process",
    "readers/cerebras/lz4chunks/pool.py:_pool_lock": "guards _pool (made again in a forked child)",
    "tensor/readahead.py:WORKERS": "the read-ahead threads' count, from the environment once",
    "tensor/readahead.py:READ_AHEAD": "CPU threads computing blocks ahead, per process by nature (at most "
                                      "MAX_QUEUED queued); the blocks land in each tree's own cache",
    # bounded process-wide caches of small things (not byte budgets of a mount)
    "readers/cerebras/lz4chunks/index.py:indexes": "chunk indexes kept, a bound on entries across readers (a count, "
                                                   "not a byte budget; per tree would be better, not done yet)",
    "readers/cerebras/lz4chunks/files.py:local_chunk_files": "handles on local chunk files, held weakly, one per "
                                                             "file whichever mount reads it",
    "readers/s3/object_tensor.py:_streams": "the last KEEP_STREAMS zstd streams (a count across trees; per tree "
                                            "would be better, not done yet)",
    "layouts/pieces.py:_own_planned": "weak references to the KEEP_OWN_PLANS files keeping their plans (a count; "
                                      "a closed tree's files are not kept)",
    "tensor/base.py:_shapes": "shape tuples interned (immutable values shared, at most MAX_SHARED_SHAPES)",
    "tensor/base.py:_ids": "unique tensor ids of the process",
    "tensor/base.py:_uid_lock": "guards _ids",
    "tensor/cache.py:NO_CACHE": "a block cache of budget 0: holds nothing to share",
    "state/files.py:_said": "warnings already logged by this process (said once)",
    "state/files.py:_said_lock": "guards _said",
    # libraries and code loaded once per process
    "readers/cerebras/dataset_tensor.py:_open_lock": _HDF5 + ": its file opens are serialized",
    "readers/cerebras/h5store.py:_VLEN_STR_MEMORY": _HDF5 + ": a type id made once, never changed",
    "readers/cerebras/lz4chunks/reader.py:_memory_types": _HDF5 + ": memory types made once per dtype",
    "readers/cerebras/lz4chunks/frame.py:_lib_lock": "guards _lib_state",
    "readers/cerebras/lz4chunks/frame.py:_lib_state": "liblz4, loaded once per process",
    "readers/cerebras/lz4filter.py:_lock": "guards _library",
    "readers/cerebras/lz4filter.py:_library": _HDF5 + ": its LZ4 filter plugin is registered once",
    "readers/cerebras/catalog_cache.py:_code_digest": "a digest of ckptfs's own code, computed once",
    "mapping/lang/families.py:_default": "the installed mapping files' registry, read once (install data)",
    "mapping/lang/families.py:_lock": "guards _default",
    # constants computed at import
    "commands/compare.py:_tables": "float8 value tables, computed once per dtype (a pure function's memo)",
    "mapping/forward.py:TENSOR_FUNCTIONS": _TABLE,
    "mapping/inverse.py:INVERSES": _TABLE,
    "tfbundle/crc32c.py:_TABLE": _TABLE,
    "tfbundle/crc32c.py:_NP_TABLE": _TABLE,
    "tfbundle/crc32c.py:_WIDE": "CRC tables computed on first use (a pure function's memo)",
    "readers/tf/locate.py:TABLE_MAGIC": "bytes",
    "mapping/lang/expr.py:OMIT": _MARKER,
    "views/cs.py:OMIT": _MARKER,
    "views/torch.py:OMIT": _MARKER,
    "upgrade/trainer_params.py:MISSING": _MARKER,
}


def _dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return base and f"{base}.{node.attr}"
    return None


def immutable_classes(tree: ast.Module) -> set:
    """Names of the module's classes whose instances cannot change: frozen dataclasses, NamedTuples, Enums."""
    out = set()
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        for d in node.decorator_list:
            if isinstance(d, ast.Call) and _dotted(d.func) in ("dataclass", "dataclasses.dataclass") and any(
                    k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in d.keywords):
                out.add(node.name)
        if any(_dotted(b) in ("NamedTuple", "typing.NamedTuple", "Enum", "enum.Enum", "IntEnum", "enum.IntEnum")
               for b in node.bases):
            out.add(node.name)
    return out


def _top_level(body: list):
    """The module-level assignments, those under a module-level ``if`` or ``try`` included."""
    for s in body:
        if isinstance(s, (ast.Assign, ast.AnnAssign)):
            yield s
        elif isinstance(s, (ast.If, ast.Try)):
            for part in (s.body, s.orelse, getattr(s, "finalbody", [])):
                yield from _top_level(part)
            for h in getattr(s, "handlers", []):
                yield from _top_level(h.body)


def _constant_name(name: str) -> bool:
    return name == "__all__" or name.strip("_").isupper()


def module_state(source: str, immutable: set) -> list:
    """``[(line, name, why)]``: the module state of a module's source (the rule in the module docstring)."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found += [(node.lineno, n, "named by a `global` statement") for n in node.names]
    for s in _top_level(tree.body):
        if s.value is None:
            continue
        names = [t.id for t in (s.targets if isinstance(s, ast.Assign) else [s.target]) if isinstance(t, ast.Name)]
        v = s.value
        if isinstance(v, ast.Call):
            f = _dotted(v.func)
            if f in IMMUTABLE_BUILDERS or (f or "").rsplit(".", 1)[-1] in immutable:
                continue
            why = f"made at import by a call of {f or 'an expression'}"
        elif isinstance(v, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
            names = [n for n in names if not _constant_name(n)]
            why = "a mutable container under a name that is not a constant's"
        else:
            continue
        found += [(s.lineno, n, why) for n in names]
    return found


def package_state() -> dict:
    """``{"path inside ckptfs:name": (line, why)}`` of every module of the package."""
    paths = sorted(PACKAGE.rglob("*.py"))
    immutable = set()
    for p in paths:
        immutable |= immutable_classes(ast.parse(p.read_text(), str(p)))
    out = {}
    for p in paths:
        for line, name, why in module_state(p.read_text(), immutable):
            out.setdefault(f"{p.relative_to(PACKAGE)}:{name}", (line, why))
    return out


def test_no_module_keeps_state_it_does_not_declare():
    found = package_state()
    undeclared = [f"ckptfs/{k.split(':')[0]}:{line}: {k.split(':')[1]} ({why})"
                  for k, (line, why) in sorted(found.items()) if k not in DECLARED]
    assert not undeclared, ("module-level state that may belong to a mount (make it its tree's, or declare why it is "
                            "the process's in DECLARED):\n" + "\n".join(undeclared))
    stale = sorted(set(DECLARED) - set(found))
    assert not stale, f"declared but not found any more (drop them): {stale}"


def test_storage_keeps_no_part_pool_or_budget_of_its_own():
    """The storage layer's declared state is the process's or an endpoint's: no pool, no budget."""
    storage = {k for k in package_state() if k.startswith("storage/")}
    assert storage == {"storage/s3object.py:_live", "storage/s3client.py:_clients", "storage/s3client.py:_clients_lock",
                       "storage/base.py:_this_thread", "storage/base.py:_scratch", "storage/local.py:page_cache"}, \
        storage


def test_the_rule_sees_a_process_wide_pool_and_a_global_rebinding():
    source = '''
import threading
from dataclasses import dataclass

LIMIT = 8 << 20
NAMES = {"a": 1}
_pool = _Pool()
_seen: dict = {}
_lock = threading.Lock()
PATTERN = re.compile("x")

@dataclass(frozen=True)
class Point:
    x: int

ORIGIN = Point(0)

def set_memory(n):
    global LIMIT
    LIMIT = n
'''
    got = {(name, why.split(" ")[0]) for _, name, why in module_state(source, immutable_classes(ast.parse(source)))}
    assert got == {("_pool", "made"), ("_seen", "a"), ("_lock", "made"), ("LIMIT", "named")}, got
