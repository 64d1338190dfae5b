"""Two checkpoints compared key by key, reading only what must be read (``ckptfs diff``).

Every flat key is added, removed, or held by both; a leaf held by both is equal, or changed in kind (a tensor
against a value), shape, dtype or value. Values and opaque objects are compared as they are; tensors element by
element, bit for bit (``tolerance`` 0), or as equal when they differ by at most ``tolerance``.

Two HDF5 datasets stored alike (``StoredLayout``: the same chunk shape, filters, stored type and fill value) are
compared chunk by chunk as stored: a chunk at the same address of the same file version, or whose stored bytes are
the same, is equal without being decoded (a checkpoint copied, or saved again with a tensor unchanged, is told
equal from its stored chunks alone); only chunks whose bytes differ are decoded and compared. Only the chunks
either side has written are visited: a chunk neither wrote holds the fill value on both sides (the layouts, fill
value included, are equal), so two datasets that declare terabytes and wrote nothing are equal without a read. Two
datasets of any layouts that wrote nothing are compared by their fill values alone. Every other pair is read in
C-order boxes of at most ``max_elements`` elements. Either way memory stays bounded: one box, or one chunk, per side
at a time.

Time is bounded by a ``Budget``: the bytes of A's tensors that are read to be compared (decoded boxes, stored chunk
bytes) count against ``max_bytes``; past it ``BudgetExceeded`` stops the comparison (``ckptfs diff --max-bytes``).

A change is described by how many elements differ, the largest absolute difference, and the first differing
element (in C order) with its two values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from ..dtypes import DType
from ..errors import CkptfsError
from ..catalog.model import Checkpoint, OpaqueLeaf, TensorLeaf, UnreadableLeaf, ValueLeaf
from ..readers.cerebras.dataset_tensor import H5DatasetTensor

# what a key's comparison found
ADDED, REMOVED, EQUAL, CHANGED, SHAPE, DTYPE, KIND, UNREADABLE = (
    "added", "removed", "equal", "changed", "shape", "dtype", "kind", "unreadable")


@dataclass
class ValueDiff:
    """Two same-shaped tensors compared element by element."""

    elements: int
    changed: int = 0  # elements that differ (beyond the tolerance)
    max_abs_diff: float = 0.0  # largest |a - b|, within the tolerance too (inf where one side only is NaN)
    first_index: tuple | None = None  # the first differing element, in C order
    first_values: tuple | None = None  # (a, b) there
    by_storage: int = 0  # elements found equal from the stored chunks, without decoding
    _first_flat: int = field(default=-1, repr=False)

    @property
    def equal(self) -> bool:
        return self.changed == 0

    @property
    def decoded(self) -> int:
        """Elements that had to be decoded to compare."""
        return self.elements - self.by_storage


@dataclass
class KeyDiff:
    """One flat key of either checkpoint and what the comparison found (``status``)."""

    key: str
    status: str
    a: str | None = None  # what A holds there, in a few words ("[32, 32] float32", "= 10")
    b: str | None = None
    values: ValueDiff | None = None
    problem: str | None = None  # UNREADABLE: why

    @property
    def equal(self) -> bool:
        return self.status == EQUAL


@dataclass
class CheckpointDiff:
    keys: list  # KeyDiff, A's keys in A's order, then the keys only B holds in B's order
    tolerance: float = 0.0

    @property
    def equal(self) -> bool:
        return all(k.equal for k in self.keys)

    @property
    def unreadable(self) -> list:
        return [k for k in self.keys if k.status == UNREADABLE]

    def counts(self) -> dict:
        out: dict = {}
        for k in self.keys:
            out[k.status] = out.get(k.status, 0) + 1
        return out


# -- element values --------------------------------------------------------------------------------------------


def _float8_table(exp_bits: int, man_bits: int, fn: bool) -> np.ndarray:
    """The 256 values of a float8 type (``fn``: no infinities, NaN only at all ones, as e4m3fn)."""
    bias = (1 << (exp_bits - 1)) - 1
    out = np.empty(256, dtype=np.float64)
    for bits in range(256):
        sign = -1.0 if bits & 0x80 else 1.0
        e = (bits >> man_bits) & ((1 << exp_bits) - 1)
        m = bits & ((1 << man_bits) - 1)
        top = (1 << exp_bits) - 1
        if fn and e == top and m == (1 << man_bits) - 1:
            out[bits] = math.nan
        elif not fn and e == top:
            out[bits] = math.nan if m else sign * math.inf
        elif e == 0:
            out[bits] = sign * m * 2.0 ** (1 - bias - man_bits)
        else:
            out[bits] = sign * (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
    return out


_FLOAT8 = {"float8_e4m3fn": (4, 3, True), "float8_e5m2": (5, 2, False)}
_tables: dict = {}


def numbers(storage: np.ndarray, dtype: DType) -> np.ndarray:
    """The elements of a storage array as numbers to subtract: float64 (complex128 for complex types)."""
    if dtype.name == "bfloat16":
        return (np.asarray(storage).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype.name in _FLOAT8:
        table = _tables.get(dtype.name)
        if table is None:
            table = _tables[dtype.name] = _float8_table(*_FLOAT8[dtype.name])
        return table[np.asarray(storage).view(np.uint8)]
    if dtype.name.startswith("complex"):
        return np.asarray(storage).astype(np.complex128)
    return np.asarray(storage).astype(np.float64)


def _bits(storage: np.ndarray) -> np.ndarray:
    """The elements' bit patterns, one comparable row per element."""
    a = np.ascontiguousarray(storage).reshape(-1)
    size = a.dtype.itemsize
    if size in (1, 2, 4, 8):
        return a.view(f"<u{size}")
    return a.view("<u8").reshape(len(a), -1)


def _python(value):
    """A numpy scalar as a plain int, float or complex (for messages and JSON)."""
    return value.item() if hasattr(value, "item") else value


def accumulate(diff: ValueDiff, a: np.ndarray, b: np.ndarray, dtype_a: DType, dtype_b: DType, flat_index,
               tolerance: float, shape: tuple) -> None:
    """Add the comparison of ``a`` and ``b`` (the same elements of two tensors, as storage arrays) to ``diff``.
    ``flat_index(positions)`` gives the C-order index in the whole tensor of positions (flat, in ``a``)."""
    if dtype_a == dtype_b and tolerance == 0:
        bits_a, bits_b = _bits(a), _bits(b)
        changed = bits_a != bits_b if bits_a.ndim == 1 else (bits_a != bits_b).any(axis=1)
        if not changed.any():
            return
    x, y = numbers(a, dtype_a).reshape(-1), numbers(b, dtype_b).reshape(-1)
    same = (x == y) | (np.isnan(x) & np.isnan(y))
    if same.all() and not (dtype_a == dtype_b and tolerance == 0):
        return
    with np.errstate(invalid="ignore"):
        gap = np.abs(x - y)
    gap[same] = 0
    gap[np.isnan(gap)] = math.inf  # one side NaN, the other not
    diff.max_abs_diff = max(diff.max_abs_diff, float(gap.max()))
    if not (dtype_a == dtype_b and tolerance == 0):
        changed = gap > tolerance
    n = int(np.count_nonzero(changed))
    if not n:
        return
    diff.changed += n
    where = np.flatnonzero(changed)
    flat = flat_index(where)
    k = int(np.argmin(flat))
    if diff._first_flat < 0 or int(flat[k]) < diff._first_flat:
        diff._first_flat = int(flat[k])
        diff.first_index = tuple(int(i) for i in np.unravel_index(diff._first_flat, shape))
        diff.first_values = (_python(x[where[k]]), _python(y[where[k]]))


# -- how much is read -------------------------------------------------------------------------------------------

#: what ``ckptfs diff`` reads at most by default, counted on A's side (``--max-bytes``)
DEFAULT_MAX_BYTES = 256 << 30


class BudgetExceeded(CkptfsError):
    """The comparison would read more than its budget allows (``problem``: one line, with the key)."""


class Budget:
    """The bytes a comparison may read (``max_bytes``; 0: no bound) and those read so far; ``on_bytes(n)`` is told
    of every ``n`` bytes of tensor data compared, read or not (a progress bar)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, on_bytes: Callable[[int], None] | None = None):
        self.max_bytes = int(max_bytes)
        self.read = 0
        self.on_bytes = on_bytes
        self.key = "?"

    def spend(self, nbytes: int) -> None:
        """Account for reading ``nbytes`` more; ``BudgetExceeded`` (before they are read) past the bound."""
        if self.max_bytes and self.read + nbytes > self.max_bytes:
            raise BudgetExceeded(None, f"diff stopped at {self.key}: comparing it would read more than "
                                       f"--max-bytes {self.max_bytes} bytes ({self.read} read so far); raise "
                                       f"--max-bytes (0: no bound) to compare everything")
        self.read += nbytes

    def advance(self, nbytes: int) -> None:
        """``nbytes`` of tensor data compared without being read."""
        if self.on_bytes is not None and nbytes:
            self.on_bytes(nbytes)


# -- tensors ---------------------------------------------------------------------------------------------------


def c_order_boxes(shape: tuple, max_elements: int) -> Iterator[tuple]:
    """``(box, flat index of its first element)`` covering ``shape`` in C order, each box a run of consecutive
    elements of at most ``max_elements`` (at least one row of the last dimension's elements, or one element)."""
    shape = tuple(int(n) for n in shape)
    if not shape:
        yield (), 0
        return
    if math.prod(shape) == 0:
        return
    k = len(shape) - 1  # the boxes are whole in dimensions after k
    while k > 0 and math.prod(shape[k:]) <= max_elements:
        k -= 1
    inner = math.prod(shape[k + 1:])
    step = max(1, max_elements // inner)
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    for idx in np.ndindex(*shape[:k]):
        for start in range(0, shape[k], step):
            stop = min(start + step, shape[k])
            box = tuple((i, i + 1) for i in idx) + ((start, stop),) + tuple((0, n) for n in shape[k + 1:])
            yield box, sum(i * s for i, s in zip(idx, strides)) + start * strides[k]


def _same_file(a: H5DatasetTensor, b: H5DatasetTensor) -> bool:
    ia, ib = a.file_identity(), b.file_identity()
    return ia is not None and ia == ib


def _stored_alike(a, b):
    """The ``StoredLayout`` two tensors share (so that their chunks compare as stored), else None."""
    if not (isinstance(a, H5DatasetTensor) and isinstance(b, H5DatasetTensor)):
        return None
    la = a.stored_layout()
    return la if la is not None and la == b.stored_layout() else None


def _unwritten_fills(a, b):
    """``(fill of a, fill of b)`` when both are HDF5 datasets that wrote nothing (every element is its fill value);
    else None."""
    if not (isinstance(a, H5DatasetTensor) and isinstance(b, H5DatasetTensor)):
        return None
    fa = a.unwritten_fill()
    fb = b.unwritten_fill() if fa is not None else None
    return None if fb is None else (fa, fb)


def compare_tensors(a, b, *, tolerance: float = 0.0, max_elements: int = 1 << 22,
                    budget: Budget | None = None) -> ValueDiff:
    """Compare two tensors of the same shape (their dtypes may differ: then by value); ``budget`` bounds the bytes
    read (``BudgetExceeded``)."""
    budget = budget if budget is not None else Budget(0)
    shape = tuple(a.shape)
    diff = ValueDiff(math.prod(shape))
    item = a.dtype.itemsize
    fills = _unwritten_fills(a, b) if diff.elements else None
    if fills is not None:  # nothing written on either side: every element is the fill value
        one = ValueDiff(1)
        accumulate(one, fills[0], fills[1], a.dtype, b.dtype, lambda where: where, tolerance, (1,))
        if one.equal:
            diff.by_storage = diff.elements
            diff.max_abs_diff = one.max_abs_diff
        else:
            diff.changed, diff.max_abs_diff = diff.elements, one.max_abs_diff
            diff.first_index, diff.first_values = tuple(0 for _ in shape), one.first_values
        budget.advance(diff.elements * item)
        return diff
    layout = _stored_alike(a, b) if a.dtype == b.dtype else None
    if layout is not None:
        same_file = _same_file(a, b)
        written = np.concatenate([a.stored_chunk_origins(), b.stored_chunk_origins()])
        visited = 0
        for row in (np.unique(written, axis=0) if len(written) else written):  # chunks either side wrote
            origin = tuple(int(o) for o in row)
            box = layout.chunk_box(origin)
            n = math.prod(hi - lo for lo, hi in box)
            visited += n
            sa, sb = a.stored_chunk(origin), b.stored_chunk(origin)
            if sa is None and sb is None or same_file and sa is not None and sa == sb:
                diff.by_storage += n  # fill values, or the same stored chunk
                budget.advance(n * item)
                continue
            if sa is not None and sb is not None and sa[0] == sb[0] and sa[2] == sb[2]:
                budget.spend(sa[2])
                if a.read_stored_chunk(origin) == b.read_stored_chunk(origin):
                    diff.by_storage += n  # stored bytes alike
                    budget.advance(n * item)
                    continue
            budget.spend(n * item)
            starts = np.array([lo for lo, _ in box])
            local = tuple(hi - lo for lo, hi in box)
            accumulate(diff, a.read(box), b.read(box), a.dtype, b.dtype,
                       lambda where: np.ravel_multi_index(
                           tuple(np.add(np.unravel_index(where, local), starts.reshape(-1, 1))), shape),
                       tolerance, shape)
            budget.advance(n * item)
        diff.by_storage += diff.elements - visited  # chunks neither side wrote: the fill value on both
        budget.advance((diff.elements - visited) * item)
        return diff
    for box, start in c_order_boxes(shape, max_elements):
        nbytes = math.prod(hi - lo for lo, hi in box) * item
        budget.spend(nbytes)
        accumulate(diff, a.read(box), b.read(box), a.dtype, b.dtype, lambda where, s=start: where + s, tolerance,
                   shape)
        budget.advance(nbytes)
    return diff


# -- leaves and checkpoints --------------------------------------------------------------------------------------


def describe(leaf) -> str:
    """What a leaf is, in a few words."""
    if isinstance(leaf, TensorLeaf):
        return f"{list(leaf.tensor.shape)} {leaf.tensor.dtype.name}"
    if isinstance(leaf, ValueLeaf):
        text = repr(leaf.value)
        return "= " + (text if len(text) <= 60 else text[:57] + "...")
    if isinstance(leaf, OpaqueLeaf):
        return f"opaque object, {len(leaf.data)} bytes"
    return f"unreadable: {leaf.reason}"


def _same_value(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def _numeric(dtype: DType) -> bool:
    return dtype.name != "bool"


def compare_leaves(key: str, la, lb, *, tolerance: float, max_elements: int, paths=("A", "B"),
                   budget: Budget | None = None) -> KeyDiff:
    """What changed between two leaves held under ``key`` (``paths``: their checkpoints, for messages);
    ``BudgetExceeded`` past ``budget``."""
    da, db = describe(la), describe(lb)
    out = KeyDiff(key, EQUAL, da, db)
    for leaf, path in zip((la, lb), paths):
        if isinstance(leaf, UnreadableLeaf):
            out.status, out.problem = UNREADABLE, f"{path}: {key}: {leaf.reason}"
            return out
    if type(la) is not type(lb):
        out.status = KIND
    elif isinstance(la, ValueLeaf):
        out.status = EQUAL if _same_value(la.value, lb.value) else CHANGED
    elif isinstance(la, OpaqueLeaf):
        out.status = EQUAL if la.data == lb.data else CHANGED
    else:
        ta, tb = la.tensor, lb.tensor
        if tuple(ta.shape) != tuple(tb.shape):
            out.status = SHAPE
            return out
        if ta.dtype != tb.dtype and not (_numeric(ta.dtype) and _numeric(tb.dtype)):
            out.status = DTYPE
            return out
        if budget is not None:
            budget.key = key
        try:
            out.values = compare_tensors(ta, tb, tolerance=tolerance, max_elements=max_elements, budget=budget)
        except BudgetExceeded:
            raise
        except CkptfsError as e:
            out.status, out.problem = UNREADABLE, str(e)
            return out
        out.status = DTYPE if ta.dtype != tb.dtype else (EQUAL if out.values.equal else CHANGED)
    return out


def diff_checkpoints(a: Checkpoint, b: Checkpoint, *, tolerance: float = 0.0, max_elements: int = 1 << 22,
                     on_key: Callable[[KeyDiff], None] | None = None, budget: Budget | None = None) -> CheckpointDiff:
    """Compare every flat key of ``a`` and ``b``; ``on_key`` sees each result as soon as it is known. A leaf held
    under several keys (a tied alias) is compared once. ``budget`` bounds the bytes read (``BudgetExceeded``)."""
    result = CheckpointDiff([], tolerance)
    done: dict = {}  # (id of A's leaf, id of B's leaf) -> KeyDiff already computed

    def emit(d: KeyDiff) -> None:
        result.keys.append(d)
        if on_key is not None:
            on_key(d)

    for key, la in a.leaves.items():
        lb = b.leaves.get(key)
        if lb is None:
            emit(KeyDiff(key, REMOVED, describe(la), None))
            continue
        seen = done.get((id(la), id(lb)))
        if seen is None:
            seen = done[(id(la), id(lb))] = compare_leaves(key, la, lb, tolerance=tolerance,
                                                           max_elements=max_elements, paths=(a.path, b.path),
                                                           budget=budget)
            emit(seen)
        else:
            emit(KeyDiff(key, seen.status, seen.a, seen.b, seen.values, seen.problem))
    for key, lb in b.leaves.items():
        if key not in a.leaves:
            emit(KeyDiff(key, ADDED, None, describe(lb)))
    return result


def compared_bytes(a: Checkpoint, b: Checkpoint) -> int:
    """The bytes of A's tensors that B also holds under the same key (what a progress bar counts)."""
    total, seen = 0, set()
    for key, la in a.leaves.items():
        if isinstance(la, TensorLeaf) and isinstance(b.leaves.get(key), TensorLeaf) and id(la) not in seen:
            seen.add(id(la))
            total += la.tensor.nbytes
    return total
