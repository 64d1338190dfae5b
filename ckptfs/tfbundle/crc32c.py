"""CRC-32C (Castagnoli) as TensorFlow's tensor bundles use it, and TensorFlow's ``crc32c::Mask``.

``crc32c(data, crc=0)`` extends ``crc`` (a finished CRC-32C value) over ``data``, so that
``crc32c(b, crc32c(a)) == crc32c(a + b)``. It uses the ``google_crc32c`` C extension when it is installed
(over 1 GB/s), else a numpy version that runs many lanes of the table algorithm side by side, four bytes a step,
and joins them with ``combine`` (200-300 MB/s), and for small inputs the byte-wise loop.

``mask(crc)`` / ``unmask(masked)`` are TF's (and LevelDB's): rotate right by 15 bits and add ``0xa282ead8``;
a tensor bundle stores masked values both in its index entries and in its table blocks' trailers.
"""
from __future__ import annotations

import numpy as np

__all__ = ["crc32c", "mask", "unmask", "combine", "MASK_DELTA"]

MASK_DELTA = 0xA282EAD8
_POLY = 0x82F63B78  # reflected Castagnoli polynomial


def _table() -> list[int]:
    out = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ (_POLY if c & 1 else 0)
        out.append(c)
    return out


_TABLE = _table()
_NP_TABLE = np.array(_TABLE, dtype=np.uint32)

try:  # pragma: no cover - depends on what is installed
    import google_crc32c as _g

    _fast = _g.extend if getattr(_g, "implementation", "c") == "c" else None
except ImportError:  # pragma: no cover
    _fast = None


def mask(crc: int) -> int:
    """TF's ``crc32c::Mask``: rotate right by 15, add ``MASK_DELTA`` (mod 2**32)."""
    crc &= 0xFFFFFFFF
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + MASK_DELTA) & 0xFFFFFFFF


def unmask(masked: int) -> int:
    """The inverse of ``mask``."""
    rot = (masked - MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


def _bytewise(data, crc: int) -> int:
    c = crc ^ 0xFFFFFFFF
    t = _TABLE
    for b in bytes(data):
        c = t[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


# -- combining: the operator "append n zero bytes" on the CRC register, as 32 columns over GF(2) ------------------


def _times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: list[int]) -> list[int]:
    return [_times(mat, mat[i]) for i in range(32)]


def _zeros_operator(nbytes: int) -> list[int]:
    """The 32 columns of the linear map that appends ``nbytes`` zero bytes to a (raw) CRC register."""
    one_bit = [_POLY] + [1 << i for i in range(31)]  # one zero bit
    op = _square(_square(_square(one_bit)))  # one zero byte
    result = [1 << i for i in range(32)]  # identity
    while nbytes:
        if nbytes & 1:
            result = [_times(op, c) for c in result]
        nbytes >>= 1
        if nbytes:
            op = _square(op)
    return result


def combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32C of ``a + b`` from ``crc32c(a)``, ``crc32c(b)`` and ``len(b)``."""
    if len2 <= 0:
        return crc1
    return _times(_zeros_operator(len2), crc1) ^ crc2


def _apply_vec(cols: list[int], x: np.ndarray) -> np.ndarray:
    out = np.zeros_like(x)
    for i, c in enumerate(cols):
        if c:
            out ^= ((x >> np.uint32(i)) & np.uint32(1)) * np.uint32(c)
    return out


_LANES = 1 << 14
_WIDE: tuple | None = None  # two 65536-entry tables: slicing by 4 bytes, two bytes per lookup


def _wide_tables() -> tuple:
    global _WIDE
    if _WIDE is None:
        t = [_NP_TABLE]
        for _ in range(3):  # t[k][b]: the CRC register after byte b followed by k zero bytes
            prev = t[-1]
            t.append(_NP_TABLE[prev & np.uint32(0xFF)] ^ (prev >> np.uint32(8)))
        lo = np.arange(1 << 16, dtype=np.uint32)
        low = t[3][lo & np.uint32(0xFF)] ^ t[2][lo >> np.uint32(8)]
        high = t[1][lo & np.uint32(0xFF)] ^ t[0][lo >> np.uint32(8)]
        _WIDE = (low, high)
    return _WIDE


def _lanes(data: memoryview, crc: int) -> int:
    """Many lanes of the table algorithm at once, four bytes a step, joined pairwise (``len(data)`` a multiple of
    ``4 * _LANES``)."""
    n = len(data)
    words = n // 4 // _LANES
    arr = np.frombuffer(data, dtype="<u4").reshape(_LANES, words)
    low, high = _wide_tables()
    state = np.full(_LANES, 0xFFFFFFFF, dtype=np.uint32)
    x = np.empty(_LANES, dtype=np.uint32)
    halves = x.view("<u2").reshape(_LANES, 2)  # the low and high 16 bits of each lane's register
    lo_half, hi_half = halves[:, 0], halves[:, 1]
    step = 1024
    for j0 in range(0, words, step):
        cols = np.ascontiguousarray(arr[:, j0:j0 + step].T)
        for row in cols:
            np.bitwise_xor(state, row, out=x)
            np.take(low, lo_half, out=state)
            state ^= np.take(high, hi_half)
    state ^= np.uint32(0xFFFFFFFF)
    length = words * 4
    while len(state) > 1:  # join lanes 2i and 2i+1: crc(a+b) = Z^len(b) crc(a) ^ crc(b)
        state = _apply_vec(_zeros_operator(length), state[0::2]) ^ state[1::2]
        length *= 2
    return combine(crc, int(state[0]), n)


def crc32c(data, crc: int = 0) -> int:
    """CRC-32C of ``data`` (bytes-like), continuing from the CRC-32C ``crc`` of the bytes before it."""
    if _fast is not None:  # it takes bytes only (not a memoryview): a copy, at memory speed
        return _fast(crc, data if type(data) is bytes else bytes(data))
    view = memoryview(data).cast("B")
    n = len(view)
    big = n - n % (4 * _LANES)
    if big >= _LANES * 256:
        crc = _lanes(view[:big], crc)
        return _bytewise(view[big:], crc)
    return _bytewise(view, crc)
