"""Cerebras release numbers: parsing ``"2.10.0"`` / ``"cs-2.1"`` / ``"1.7"`` and the chain of release hops.

Releases are compared as (major, minor) integer pairs, so 2.10 comes after 2.9 (Model Zoo's own
single-digit regex reads ``cs-2.10`` as 2.1; we do not). An upgrade walks every hop from the
source release to ``CURRENT`` in order.
"""
from __future__ import annotations

import re

#: every release that has (or had) a checkpoint/config format, oldest first
RELEASES = ("1.7", "1.8", "1.9", "2.0", "2.1", "2.2", "2.3", "2.4", "2.5", "2.6", "2.7", "2.8", "2.9", "2.10")
CURRENT = "2.10"
CURRENT_VERSION = "2.10.0"  # what cstorch 2.10 writes as __cstorch_version__ and metadata "version"

_RE = re.compile(r"^(?:cs-)?v?(\d+)\.(\d+)")


def parse(release: str | None) -> tuple | None:
    """``(major, minor)`` of a release string, or None if it is not one."""
    if release is None:
        return None
    m = _RE.match(str(release).strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def name(mm: tuple) -> str:
    return f"{mm[0]}.{mm[1]}"


def hops(source: str | None, target: str = CURRENT) -> list:
    """``[("2.0", "2.1"), ("2.1", "2.2"), …]`` from ``source`` up to ``target``.

    Sources older than the first known release start at it (1.7); a source at or after the target,
    or an unparsable one, needs no hop.
    """
    src, dst = parse(source), parse(target)
    if src is None or dst is None or src >= dst:
        return []
    chain = [parse(r) for r in RELEASES]
    out = []
    for a, b in zip(chain, chain[1:]):
        if b <= src or a >= dst:
            continue
        out.append((name(a), name(b)))
    return out
