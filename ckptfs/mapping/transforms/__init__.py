"""Named tensor transforms that families need beyond the generic operations (one small module per family).

Each module here defines ``FUNCTIONS: dict[str, callable]``: names usable in mapping YAML ``op`` expressions,
built on ``ckptfs.tensor.ops``; and ``INVERSES`` for the HF -> CS direction (``mapping/inverse.py``): for a
function ``f(t1, t2, …, *values, **kwargs)`` of CS tensors, ``INVERSES['f'](y, *values, **kwargs)`` gives back
``[t1, t2, …]`` from f's output ``y``. Modules are collected at import; a name defined twice is an error, so two
families can never silently change each other's transform.
"""
from __future__ import annotations

import importlib
import pkgutil


def collect(table: str = "FUNCTIONS") -> dict:
    """Every module's ``FUNCTIONS`` (or other ``table``) merged; ValueError when two modules define the same name."""
    out: dict = {}
    owner: dict = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        mod = importlib.import_module(f"{__name__}.{info.name}")
        for name, fn in getattr(mod, table, {}).items():
            if name in out:
                raise ValueError(f"tensor transform {name!r} defined in both {owner[name]} and {info.name}")
            out[name] = fn
            owner[name] = info.name
    return out


def collect_inverses() -> dict:
    """Every module's ``INVERSES`` merged (ValueError as for ``collect``)."""
    return collect("INVERSES")
