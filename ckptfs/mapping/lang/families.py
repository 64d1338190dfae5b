"""Find the mapping YAML files and answer "which family serves this model name?".

Files come from the installed package ``ckptfs.mappings`` (the repo folder ``mappings/``), falling back
to ``<repo>/mappings`` when running from a checkout without an install. ``*.yaml`` files with a
top-level ``fragment:`` are shared pieces; the others are families.
"""
from __future__ import annotations

import importlib.resources
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from ...errors import MappingError
from ...state.files import StateDir
from .spec import FamilySpec, load_family, load_fragment, read_yaml


@dataclass(frozen=True)
class ModelInfo:
    """One model name accepted by ``--model`` (the converter's names, aliases included)."""

    name: str
    family: str
    hf_class: str  # "" for a family without an HF side
    notes: str


def mapping_dirs() -> list:
    """Folders holding the mapping YAML files, the installed package first."""
    dirs = []
    try:
        res = importlib.resources.files("ckptfs.mappings")
        p = Path(str(res))
        if p.is_dir():
            dirs.append(p)
    except (ModuleNotFoundError, TypeError):
        pass
    checkout = Path(__file__).resolve().parents[2] / "mappings"
    if checkout.is_dir() and all(checkout.resolve() != d.resolve() for d in dirs):
        dirs.append(checkout)
    return dirs


def _mapping_files(dirs) -> dict:
    """``{file name: path}`` of every mapping file of ``dirs`` (default ``mapping_dirs()``), sorted by name; a file
    name seen first (installed package) wins."""
    dirs = mapping_dirs() if dirs is None else [Path(d) for d in dirs]
    files: dict[str, Path] = {}
    for d in dirs:
        for f in sorted(Path(d).glob("*.yaml")):
            files.setdefault(f.name, f)
    return dict(sorted(files.items()))


def _read_all(dirs) -> dict:
    """``{file name: (path, parsed YAML)}`` of every mapping file of ``dirs`` (``_mapping_files``)."""
    return {name: (path, read_yaml(path)) for name, path in _mapping_files(dirs).items()}


def _load_fragments(raw: dict) -> dict:
    fragments = {}
    for path, data in raw.values():
        if "fragment" in data:
            frag = load_fragment(path, data)
            if frag.name in fragments:
                raise MappingError(path, f"fragment {frag.name!r} also defined in {fragments[frag.name].path}")
            fragments[frag.name] = frag
    return fragments


def _by_detect_priority(specs: list) -> list:
    """Families sharing a CS name, highest detect priority first (then by name)."""
    return sorted(specs, key=lambda s: (-s.detect.priority, s.family))


class Registry:
    """Every family spec of the given folders, by family name and by model name (all parsed and checked at once)."""

    def __init__(self, dirs=None):
        raw = _read_all(dirs)
        self._load(raw, _load_fragments(raw))

    @classmethod
    def from_raw(cls, raw: dict, fragments: dict | None = None) -> "Registry":
        """The registry of already parsed files (``_read_all``)."""
        reg = cls.__new__(cls)
        reg._load(raw, _load_fragments(raw) if fragments is None else fragments)
        return reg

    def _load(self, raw: dict, fragments: dict) -> None:
        claims = _Claims()
        for path, data in raw.values():
            if "fragment" in data:
                continue
            spec = load_family(path, fragments, data)
            try:
                claims.add(spec, spec.names(), spec.cs_names, spec.detect.config is not None, path,
                           replaces=[r.model for m in spec.models for r in m.replaces])
            except _Clash as e:
                raise MappingError(path, str(e)) from None
        unknown = claims.unknown_replaced()
        if unknown:
            family, name = unknown
            raise MappingError(claims.path_of(family), f"replaces: unknown model name {name!r}")
        self.families: dict[str, FamilySpec] = claims.families
        self.by_model: dict[str, FamilySpec] = claims.by_model
        self.by_cs_name: dict[str, FamilySpec] = claims.by_cs_name
        self.shared_cs_names: dict[str, list] = claims.shared_cs_names
        self.replacing: dict[str, list] = claims.replacing

    def family(self, name: str) -> FamilySpec:
        try:
            return self.families[name]
        except KeyError:
            raise MappingError(None, f"unknown model family {name!r} (known: {', '.join(sorted(self.families))})") from None

    def for_model(self, name: str) -> FamilySpec | None:
        return self.by_model.get(name)

    def for_cs_name(self, name: str) -> FamilySpec | None:
        """The family for a CS params ``name:`` (a ModelZoo name, or any CLI model name); None when unknown or
        shared by several families (``families_for_cs_name`` lists those)."""
        if name in self.shared_cs_names:
            return None
        return self.by_cs_name.get(name) or self.by_model.get(name)

    def families_for_cs_name(self, name: str) -> list:
        """Every family a CS params ``name:`` may mean (several when it is shared), highest detect priority first."""
        if name in self.shared_cs_names:
            return _by_detect_priority(self.shared_cs_names[name])
        spec = self.for_cs_name(name)
        return [spec] if spec is not None else []

    def families_replacing(self, name: str) -> list:
        """Every family with a model that may be chosen instead of model ``name`` (``replaces:``), highest detect
        priority first."""
        return _by_detect_priority(self.replacing.get(name, []))

    def models(self) -> list:
        out = []
        for spec in self.families.values():
            for m in spec.models:
                out.append(ModelInfo(m.name, spec.family, m.hf_class, m.notes))
                for a in m.aliases:
                    out.append(ModelInfo(a, spec.family, m.hf_class, f"alias of {m.name}. {m.notes}".strip()))
        return out


@dataclass(frozen=True)
class _Declared:
    """What one family file declares about its names, read from its YAML without building the spec."""

    key: str  # file name (the key of ``_read_all``)
    family: str
    names: tuple  # model names and aliases, in file order (``FamilySpec.names()``)
    cs_names: tuple
    has_detect_config: bool
    replaces: tuple = ()  # model names its models may be chosen instead of (``replaces:``)


def _declared(key: str, data: dict) -> _Declared | None:
    """The names a family file declares, or None when they are not plainly written (the full parse says why)."""
    family, models = data.get("family"), data.get("models")
    if not (isinstance(family, str) and family and isinstance(models, list) and models):
        return None
    names, replaces = [], []
    for m in models:
        aliases = (m.get("aliases") or []) if isinstance(m, dict) else None
        if not (isinstance(m, dict) and isinstance(m.get("name"), str) and m["name"] and isinstance(aliases, list)
                and all(isinstance(a, str) for a in aliases)):
            return None
        names += [m["name"], *aliases]
        rules = m.get("replaces") or []
        if not (isinstance(rules, list) and all(isinstance(r, dict) and isinstance(r.get("model"), str)
                                                for r in rules)):
            return None
        replaces += [r["model"] for r in rules]
    cs_names = data.get("cs_names") or [family]
    detect = data.get("detect") or {}
    if not (isinstance(cs_names, list) and all(isinstance(n, str) for n in cs_names) and isinstance(detect, dict)):
        return None
    return _Declared(key, family, tuple(names), tuple(cs_names), detect.get("config") is not None, tuple(replaces))


class _Clash(Exception):
    """A family file claims a family, model name or CS name another one already has (the message says which)."""


class _Claims:
    """Which family claims each family name, model name and CS name: the lookups ``Registry`` answers. The claimant
    is whatever the caller indexes (``Registry``: built specs; ``LazyRegistry``: each file's ``_Declared`` names),
    so the rules about clashes are written once. A claimant has a ``family`` attribute."""

    def __init__(self):
        self.families: dict = {}
        self.by_model: dict = {}
        self.by_cs_name: dict = {}
        # CS names several families share (the Model Zoo's one `vision_transformer` class serves both HF ViT
        # and CLIP): each sharing family tells its checkpoints apart with detect.config
        self.shared_cs_names: dict = {}
        self.replacing: dict = {}  # model name -> the claimants with a model chosen instead of it (``replaces:``)
        self._where: dict = {}  # family -> (path of its file, has detect.config)

    def add(self, item, names, cs_names, detect_config: bool, path: Path, replaces=()) -> None:
        """Record ``item``'s claims (its ``family``, model ``names``, ``cs_names``, the model names it ``replaces``);
        ``_Clash`` if one of them is another family's (or repeated)."""
        family = item.family
        if family in self.families:
            raise _Clash(f"family {family!r} also defined in {self._where[family][0]}")
        self.families[family] = item
        self._where[family] = (Path(path), detect_config)
        for name in names:
            if name in self.by_model:
                other = self.by_model[name].family
                raise _Clash(f"model name {name!r} also belongs to family {other!r} ({self._where[other][0].name})")
            self.by_model[name] = item
        for name in cs_names:
            claims = self.shared_cs_names.get(name) or ([self.by_cs_name[name]] if name in self.by_cs_name else [])
            others = [c.family for c in claims]
            if claims and not (detect_config and all(self._where[o][1] for o in others)):
                raise _Clash(f"CS model name {name!r} also claimed by {self._where[others[0]][0].name} (families "
                             f"sharing a CS name each need detect.config to tell them apart)")
            if claims:
                self.shared_cs_names[name] = claims + [item]
                self.by_cs_name.pop(name, None)
            else:
                self.by_cs_name[name] = item
        for name in dict.fromkeys(replaces):
            self.replacing.setdefault(name, []).append(item)

    def unknown_replaced(self) -> tuple | None:
        """``(family, model name)`` of a ``replaces:`` entry naming no model of any family, or None."""
        for name, claimants in self.replacing.items():
            if name not in self.by_model:
                return claimants[0].family, name
        return None

    def path_of(self, family: str) -> Path:
        return self._where[family][0]


def _index(raw: dict) -> _Claims | None:
    """The lookups of every family file of ``raw``; None if any file is irregular or two files clash (the full
    parse then raises the error that says which)."""
    declared = [_declared(key, data) for key, (_, data) in raw.items() if "fragment" not in data]
    return None if None in declared else _index_of(declared)


def _index_of(declared: list) -> _Claims | None:
    """The lookups of these family files' declarations; None if two of them clash."""
    claims = _Claims()
    try:
        for d in declared:
            claims.add(d, d.names, d.cs_names, d.has_detect_config, Path(d.key), d.replaces)
    except _Clash:
        return None
    return None if claims.unknown_replaced() else claims


#: version of the index cache file's format (``LazyRegistry(index_cache=…)``)
INDEX_CACHE_VERSION = 2
INDEX_CACHE_KIND = "mappings-index"
#: an index cache file is at most this large (~60 families take ~20 KB)
MAX_INDEX_CACHE_BYTES = 16 << 20


def _stamp(files: dict) -> list:
    """What the index of ``files`` depends on: each file's name, path and full identity (device, inode, size, mtime,
    ctime)."""
    out = []
    for name, path in files.items():
        st = os.stat(path)
        out.append([name, str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
    return out


def _load_index_cache(path: Path, stamp: list) -> tuple | None:
    """``(declarations, fragment file names)`` from the index cache at ``path`` if it was made from exactly the files
    of ``stamp``; None otherwise (missing, stale, not the user's own — ``ckptfs.state.files`` —, malformed: the files
    are read instead)."""
    folder = StateDir.open(path.parent, create=False)
    if folder is None:
        return None
    with folder:
        loaded = folder.load(path.name, INDEX_CACHE_KIND, MAX_INDEX_CACHE_BYTES)
    if loaded is None:
        return None
    try:
        (doc, ) = loaded[1]
        if doc.get("version") != INDEX_CACHE_VERSION or doc.get("stamp") != stamp:
            return None
        names = {name for name, *_ in stamp}
        declared = [_Declared(str(d["key"]), str(d["family"]), tuple(map(str, d["names"])),
                              tuple(map(str, d["cs_names"])), bool(d["has_detect_config"]),
                              tuple(map(str, d["replaces"]))) for d in doc["families"]]
        fragments = [str(k) for k in doc["fragments"]]
        if not {d.key for d in declared} | set(fragments) <= names:
            return None
        return declared, fragments
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _save_index_cache(path: Path, stamp: list, declared: list, fragments: list) -> None:
    """Write the index cache (best effort: a read-only or untrusted cache directory only costs the next start)."""
    doc = {"version": INDEX_CACHE_VERSION, "stamp": stamp, "fragments": fragments,
           "families": [{**asdict(d), "names": list(d.names), "cs_names": list(d.cs_names),
                         "replaces": list(d.replaces)} for d in declared]}
    folder = StateDir.open(path.parent)
    if folder is not None:
        with folder:
            folder.write(path.name, {"ckptfs": INDEX_CACHE_KIND}, [doc], max_bytes=MAX_INDEX_CACHE_BYTES)


class LazyRegistry:
    """The same lookups as ``Registry``, parsing a family's rules only when it is asked for.

    A mount needs one family, yet ``Registry`` builds all of them (their key patterns compiled, expressions
    checked: most of the registry's cost). This one reads every file's YAML (the names each declares, checked for
    clashes as ``Registry`` does) and builds a ``FamilySpec`` on first use. What needs every family (``families``,
    ``by_model``…, ``models()``, detection from key names) loads them all, as ``Registry`` would; so does a file
    whose names are not plainly written, so that its error is raised exactly as ``Registry`` raises it.

    ``index_cache``: a JSON file keeping those declarations between processes, valid for exactly the files (names,
    paths, sizes, modification times) it was made from; with a valid one, only the asked family's file and the
    fragments are parsed. Paths always come from the folders' listing, never from the cache.
    """

    def __init__(self, dirs=None, *, index_cache: Path | None = None):
        self._files = _mapping_files(dirs)
        self._raw: dict = {}  # file name -> (path, parsed YAML), parsed when needed
        self._lock = threading.RLock()
        self._fragments: dict | None = None
        self._specs: dict = {}  # family -> FamilySpec built so far
        self._full: Registry | None = None
        stamp = _stamp(self._files) if index_cache is not None else None
        cached = _load_index_cache(Path(index_cache), stamp) if index_cache is not None else None
        if cached is not None:
            declared, self._fragment_keys = cached
            self._index = _index_of(declared)
        else:
            self._raw = {name: (path, read_yaml(path)) for name, path in self._files.items()}
            self._fragment_keys = [k for k, (_, data) in self._raw.items() if "fragment" in data]
            self._index = _index(self._raw)
            if self._index is not None and index_cache is not None:
                _save_index_cache(Path(index_cache), stamp, list(self._index.families.values()),
                                  self._fragment_keys)
        if self._index is None:
            self._load_all()

    def _parsed(self, key: str) -> tuple:
        """``(path, parsed YAML)`` of the mapping file ``key``."""
        got = self._raw.get(key)
        if got is None:
            path = self._files[key]
            got = self._raw[key] = (path, read_yaml(path))
        return got

    def _load_all(self) -> Registry:
        with self._lock:
            if self._full is None:
                raw = {key: self._parsed(key) for key in self._files}
                self._full = Registry.from_raw(raw, self._fragments)
            return self._full

    def _spec(self, d: _Declared) -> FamilySpec:
        with self._lock:
            spec = self._specs.get(d.family)
            if spec is None:
                if self._fragments is None:
                    self._fragments = _load_fragments({k: self._parsed(k) for k in self._fragment_keys})
                path, data = self._parsed(d.key)
                spec = load_family(path, self._fragments, data)
                replaces = tuple(r.model for m in spec.models for r in m.replaces)
                if (spec.family, tuple(spec.names()), tuple(spec.cs_names), spec.detect.config is not None,
                        tuple(dict.fromkeys(replaces))) != (d.family, d.names, d.cs_names, d.has_detect_config,
                                                            tuple(dict.fromkeys(d.replaces))):
                    return self._load_all().families[d.family]  # never expected: trust the full parse
                self._specs[d.family] = spec
            return spec

    # what needs every family: the full registry
    @property
    def families(self) -> dict:
        return self._load_all().families

    @property
    def by_model(self) -> dict:
        return self._load_all().by_model

    @property
    def by_cs_name(self) -> dict:
        return self._load_all().by_cs_name

    @property
    def shared_cs_names(self) -> dict:
        return self._load_all().shared_cs_names

    @property
    def replacing(self) -> dict:
        return self._load_all().replacing

    def models(self) -> list:
        return self._load_all().models()

    # lookups of one family
    def family(self, name: str) -> FamilySpec:
        if self._full is not None:
            return self._full.family(name)
        d = self._index.families.get(name)
        if d is None:
            known = ", ".join(sorted(self._index.families))
            raise MappingError(None, f"unknown model family {name!r} (known: {known})")
        return self._spec(d)

    def for_model(self, name: str) -> FamilySpec | None:
        if self._full is not None:
            return self._full.for_model(name)
        d = self._index.by_model.get(name)
        return self._spec(d) if d is not None else None

    def for_cs_name(self, name: str) -> FamilySpec | None:
        """As ``Registry.for_cs_name``."""
        if self._full is not None:
            return self._full.for_cs_name(name)
        d = Registry.for_cs_name(self._index, name)  # the same lookup over the declarations (same attribute names)
        return self._spec(d) if d is not None else None

    def families_replacing(self, name: str) -> list:
        """As ``Registry.families_replacing``: only the families declaring such a model are parsed."""
        if self._full is not None:
            return self._full.families_replacing(name)
        return _by_detect_priority([self._spec(d) for d in self._index.replacing.get(name, [])])

    def families_for_cs_name(self, name: str) -> list:
        """As ``Registry.families_for_cs_name``."""
        if self._full is not None:
            return self._full.families_for_cs_name(name)
        if name in self._index.shared_cs_names:
            return _by_detect_priority([self._spec(d) for d in self._index.shared_cs_names[name]])
        spec = self.for_cs_name(name)
        return [spec] if spec is not None else []


_lock = threading.Lock()
_default: LazyRegistry | None = None


#: the index cache of the installed mapping files, under ckptfs's cache directory
INDEX_CACHE_NAME = "mappings-index.json"


def default_registry() -> LazyRegistry:
    """The registry of the installed mapping files, read once per process; a family's rules are parsed when first
    used, and the names each file declares are kept between processes (``LazyRegistry``, ``index_cache``)."""
    global _default
    with _lock:
        if _default is None:
            from ...state.dirs import cache_dir

            _default = LazyRegistry(index_cache=cache_dir() / INDEX_CACHE_NAME)
        return _default


def list_models() -> list:
    """Every supported model name: ``[ModelInfo(name, family, hf_class, notes)]``."""
    return default_registry().models()
