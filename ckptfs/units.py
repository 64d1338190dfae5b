"""Byte sizes for people: parse them ("5GB", "512MiB", "300B", "123") the way Hugging Face tools spell them, and
write them (``format_size`` exactly, ``human_size`` rounded).

Decimal units KB/MB/GB/TB are powers of 10 (as in ``save_pretrained(max_shard_size="5GB")``), binary
units KiB/MiB/GiB/TiB powers of 2. Unit letters are case-insensitive and always mean bytes (unlike
transformers' old ``"5Gb"`` = bits quirk). A fraction is allowed when the result is a whole number of
bytes (``"1.5GB"``); anything else raises ``ValueError`` naming the input.
"""
from __future__ import annotations

import re
from decimal import Decimal

UNITS: dict[str, int] = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def format_size(n: int) -> str:
    """The shortest exact text ``parse_size`` reads back: 5_000_000_000 → ``"5GB"``, 2**28 → ``"256MiB"``."""
    n = int(n)
    texts = [f"{n // f}{u if u != 'B' else ''}".replace("IB", "iB") for u, f in UNITS.items()
             if u and n and n % f == 0]
    return min(texts, key=len) if texts else str(n)


def parse_size(size: int | str) -> int:
    """``"5GB"`` → 5_000_000_000, ``"2GiB"`` → 2**31, ``"300B"``/``"300"``/``300`` → 300."""
    if isinstance(size, bool):
        raise ValueError(f"invalid size {size!r}")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"invalid size {size!r}: negative")
        return size
    if not isinstance(size, str):
        raise ValueError(f"invalid size {size!r}: expected a string such as '5GB'")
    m = _SIZE.fullmatch(size)
    unit = m.group(2).upper() if m else None
    if m is None or unit not in UNITS:
        raise ValueError(f"invalid size {size!r}: expected a number with an optional unit "
                         f"B, KB, MB, GB, TB, KiB, MiB, GiB or TiB (e.g. '5GB')")
    value = Decimal(m.group(1)) * UNITS[unit]
    if value != value.to_integral_value():
        raise ValueError(f"invalid size {size!r}: not a whole number of bytes")
    return int(value)


def human_size(n: int, *, binary: bool = False) -> str:
    """``n`` bytes to one decimal in the largest unit below it (up to TB): ``1234567`` → ``"1.2 MB"`` (``binary``:
    ``"1.2 MiB"``); below one unit ``"999 B"``."""
    base, units = (1024, ("B", "KiB", "MiB", "GiB", "TiB")) if binary else (1000, ("B", "KB", "MB", "GB", "TB"))
    v = n
    for unit in units:
        if v < base or unit == units[-1]:
            return f"{int(v)} B" if unit == "B" else f"{v:.1f} {unit}"
        v /= base
    return f"{n} B"
