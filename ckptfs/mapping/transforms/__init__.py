"""Named tensor transforms that families need beyond the generic operations (one small module per family).

Each module here defines ``FUNCTIONS: dict[str, callable]``: names usable in mapping YAML ``op`` expressions,
built on ``ckptfs.mapping.ops``. Modules are collected at import; a name defined twice is an error, so two
families can never silently change each other's transform.
"""
from __future__ import annotations

import importlib
import pkgutil


def collect() -> dict:
    """Every module's ``FUNCTIONS`` merged; ValueError when two modules define the same name."""
    out: dict = {}
    owner: dict = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        mod = importlib.import_module(f"{__name__}.{info.name}")
        for name, fn in getattr(mod, "FUNCTIONS", {}).items():
            if name in out:
                raise ValueError(f"tensor transform {name!r} defined in both {owner[name]} and {info.name}")
            out[name] = fn
            owner[name] = info.name
    return out
