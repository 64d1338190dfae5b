"""Which bytes of each fetched part of an object reads have used: a part whose bytes were all read is *spent*.

A file generated from one object (a safetensors file from an ``.mdl``) reads the object's tensors in the file's
order, not the object's: a part holding the end of one tensor and the start of another is read twice, far apart in
time. The part pool (``s3object.PartPool``) keeps a part some of whose bytes no read used yet before one that reads
used up, and remembers the spent parts it let go of, so that neither a read of their last bytes nor an announcement
ahead fetches them whole again.
"""
from __future__ import annotations

from collections import OrderedDict

#: a part let go of is remembered only while the bytes reads used of it are at most this many ranges: a crafted
#: object read in many tiny scattered pieces must not make the memory of 65,536 parts grow past ``--cache-size``
MAX_RANGES = 64


def add_range(ranges: list, lo: int, hi: int) -> list:
    """``ranges`` (sorted, disjoint ``(lo, hi)``) with ``[lo, hi)`` added, merged where they touch."""
    out, placed = [], False
    for a, b in ranges:
        if b < lo:
            out.append((a, b))
        elif hi < a:
            if not placed:
                out.append((lo, hi))
                placed = True
            out.append((a, b))
        else:
            lo, hi = min(lo, a), max(hi, b)
    if not placed:
        out.append((lo, hi))
    return sorted(out)


def inside(ranges: list, lo: int, hi: int) -> bool:
    """Whether every byte of ``[lo, hi)`` lies in ``ranges`` (sorted, disjoint, merged)."""
    return any(a <= lo and hi <= b for a, b in ranges)


def covered(ranges: list) -> int:
    return sum(b - a for a, b in ranges)


class PartReads:
    """The bytes reads used of each part (keyed as the pool keys them, offsets within the part), of the parts held and
    of those let go of (at most ``keep`` of them remembered, oldest forgotten first). Not thread-safe: the pool's lock guards
    it."""

    def __init__(self, slack: int, keep: int = 1 << 16):
        self.slack = slack  # a part is spent once fewer bytes than this are unread (HDF5 metadata between datasets)
        self.keep = keep
        self.used: dict = {}  # part key -> ranges read, for parts held by the pool
        self.gone: OrderedDict = OrderedDict()  # part key -> (ranges read, bytes read again), for parts let go of

    def read(self, key, lo: int, hi: int, size: int) -> bool:
        """Note that a read used ``[lo, hi)`` of held part ``key`` (``size`` bytes): whether it is spent now."""
        ranges = self.used[key] = add_range(self.used.get(key, []), lo, hi)
        return size - covered(ranges) < self.slack

    def spent(self, key, size: int) -> bool:
        return size - covered(self.used.get(key, [])) < self.slack

    def dropped(self, key, size: int) -> None:
        """Part ``key`` left the pool: the bytes reads used of it remembered when they are half of it or more (a later
        read of the others fetches just those). A part of which reads used less (a loader's look at a tensor's first
        and last pages, before it reads every tensor) is fetched whole again, ahead of the reads that follow."""
        ranges = self.used.pop(key, None)
        if ranges and 2 * covered(ranges) >= size and len(ranges) <= MAX_RANGES:
            self.gone[key] = (ranges, 0)  # the bytes used, and how many of them reads came back to
            self.gone.move_to_end(key)
            while len(self.gone) > self.keep:
                self.gone.popitem(last=False)

    def was_read(self, key) -> bool:
        """Whether ``key`` was let go of after reads used some of it (and no read has come back to those bytes
        since): what is left of it is fetched by the reads that need it, not ahead, whole, again."""
        return key in self.gone

    def read_gone(self, key, lo: int, hi: int, size: int) -> bool:
        """A read needs ``[lo, hi)`` of part ``key`` (``size`` bytes), which the pool let go of after reads used some of
        it: True (fetch just that range) unless reads have come back to bytes they used, half a part of them (a
        second pass over the object: the part is forgotten, False, and fetched whole as any other). A block converted
        twice (two threads at once, or evicted from the block cache) reads a few of its bytes again."""
        got = self.gone.get(key)
        if got is None:
            return False
        ranges, again = got
        if inside(ranges, lo, hi):
            again += hi - lo
            if 2 * again >= size:
                del self.gone[key]
                return False
        ranges = add_range(ranges, lo, hi)
        if len(ranges) > MAX_RANGES:  # too scattered to remember (``MAX_RANGES``): this range is fetched alone
            del self.gone[key]
            return True
        self.gone[key] = (ranges, again)
        return True

    def forget(self, key) -> None:
        """Remember nothing of part ``key``: it is fetched whole again, or its fetch failed."""
        self.used.pop(key, None)
        self.gone.pop(key, None)

    def clear(self) -> None:
        self.used.clear()
        self.gone.clear()
