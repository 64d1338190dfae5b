"""Find the mapping YAML files and answer "which family serves this model name?".

Files come from the installed package ``ckptfs.mappings`` (the repo folder ``mappings/``), falling back
to ``<repo>/mappings`` when running from a checkout without an install. ``*.yaml`` files with a
top-level ``fragment:`` are shared pieces; the others are families.
"""
from __future__ import annotations

import importlib.resources
import threading
from dataclasses import dataclass
from pathlib import Path

from ..errors import MappingError
from .spec import FamilySpec, load_family, load_fragment, read_yaml


@dataclass(frozen=True)
class ModelInfo:
    """One model name accepted by ``--model`` (the converter's names, aliases included)."""

    name: str
    family: str
    hf_class: str
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


class Registry:
    """Every family spec of the given folders, by family name and by model name."""

    def __init__(self, dirs=None):
        dirs = mapping_dirs() if dirs is None else [Path(d) for d in dirs]
        files: dict[str, Path] = {}
        for d in dirs:  # a file name seen first (installed package) wins
            for f in sorted(Path(d).glob("*.yaml")):
                files.setdefault(f.name, f)
        raw = {name: (path, read_yaml(path)) for name, path in sorted(files.items())}
        fragments = {}
        for path, data in raw.values():
            if "fragment" in data:
                frag = load_fragment(path, data)
                if frag.name in fragments:
                    raise MappingError(path, f"fragment {frag.name!r} also defined in {fragments[frag.name].path}")
                fragments[frag.name] = frag
        self.families: dict[str, FamilySpec] = {}
        self.by_model: dict[str, FamilySpec] = {}
        self.by_cs_name: dict[str, FamilySpec] = {}
        # CS names several families share (the Model Zoo's one `vision_transformer` class serves both HF ViT
        # and CLIP): each sharing family tells its checkpoints apart with detect.config
        self.shared_cs_names: dict[str, list] = {}
        for path, data in raw.values():
            if "fragment" in data:
                continue
            spec = load_family(path, fragments, data)
            if spec.family in self.families:
                raise MappingError(path, f"family {spec.family!r} also defined in {self.families[spec.family].path}")
            self.families[spec.family] = spec
            for name in spec.names():
                if name in self.by_model:
                    raise MappingError(path, f"model name {name!r} also belongs to family "
                                             f"{self.by_model[name].family!r} ({self.by_model[name].path.name})")
                self.by_model[name] = spec
            for name in spec.cs_names:
                claims = self.shared_cs_names.get(name) or ([self.by_cs_name[name]] if name in self.by_cs_name else [])
                if claims and not (spec.detect.config and all(c.detect.config for c in claims)):
                    raise MappingError(path, f"CS model name {name!r} also claimed by {claims[0].path.name} (families "
                                             f"sharing a CS name each need detect.config to tell them apart)")
                if claims:
                    self.shared_cs_names[name] = claims + [spec]
                    self.by_cs_name.pop(name, None)
                else:
                    self.by_cs_name[name] = spec

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
            return sorted(self.shared_cs_names[name], key=lambda s: (-s.detect.priority, s.family))
        spec = self.for_cs_name(name)
        return [spec] if spec is not None else []

    def models(self) -> list:
        out = []
        for spec in self.families.values():
            for m in spec.models:
                out.append(ModelInfo(m.name, spec.family, m.hf_class, m.notes))
                for a in m.aliases:
                    out.append(ModelInfo(a, spec.family, m.hf_class, f"alias of {m.name}. {m.notes}".strip()))
        return out


_lock = threading.Lock()
_default: Registry | None = None


def default_registry() -> Registry:
    """The registry of the installed mapping files, loaded once per process."""
    global _default
    with _lock:
        if _default is None:
            _default = Registry()
        return _default


def list_models() -> list:
    """Every supported model name: ``[ModelInfo(name, family, hf_class, notes)]``."""
    return default_registry().models()


def family_for_model(name: str) -> FamilySpec | None:
    return default_registry().for_model(name)
