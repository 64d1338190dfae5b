"""The sorted key/value table of a bundle's ``.index`` file: TensorFlow's copy of LevelDB's table format
(``tsl/lib/io``: table_builder.cc, block_builder.cc, format.cc), uncompressed, as ``BundleWriter`` builds it.

File = data blocks, the metaindex block (empty), the index block, then a 48-byte footer: the metaindex and index
``BlockHandle``s (varint64 offset, varint64 size) padded with zeros to 40 bytes, then the magic
``0xdb4775248b80fb57`` (fixed64). Every block is followed by a 5-byte trailer: its compression type (0 = none)
and the masked CRC-32C of the block and that type byte.

A block = entries, then its restart offsets (fixed32 each) and their count (fixed32). An entry = varint32
``shared`` (bytes of the key in common with the previous key; 0 at a restart point), varint32 ``non_shared``,
varint32 value length, the key's non-shared bytes, the value. A restart point every ``restart_interval`` entries
(16 in data blocks, 1 in the index block). The builder closes a data block once its size estimate (entries +
4 bytes per restart + 4) reaches ``block_size`` (TF's default, 256 KiB); the index block holds, per data block,
a short key at or after its last key and before the next block's first key (``shortest_separator``; after the
last block ``short_successor``), with the block's handle as value.
"""
from __future__ import annotations

from dataclasses import dataclass

from ckptfs.tfbundle.crc32c import crc32c, mask
from ckptfs.tfbundle.wire import BundleFormatError, get_fixed32, get_varint, put_fixed32, put_fixed64, put_varint

__all__ = ["TABLE_MAGIC", "FOOTER_SIZE", "BLOCK_SIZE", "RESTART_INTERVAL", "TableOptions", "write_table",
           "read_table", "shortest_separator", "short_successor", "MAX_INDEX_BYTES"]

TABLE_MAGIC = 0xDB4775248B80FB57
FOOTER_SIZE = 48
BLOCK_SIZE = 256 << 10
RESTART_INTERVAL = 16
TRAILER = 5
#: the largest ``.index`` ckptfs parses (an index of 1,000,000 tensors is ~60 MB)
MAX_INDEX_BYTES = 1 << 30


@dataclass(frozen=True)
class TableOptions:
    block_size: int = BLOCK_SIZE
    restart_interval: int = RESTART_INTERVAL


def shortest_separator(start: bytes, limit: bytes) -> bytes:
    """TF's bytewise comparator's ``FindShortestSeparator``: a short key ``k`` with ``start <= k < limit``."""
    n = min(len(start), len(limit))
    i = 0
    while i < n and start[i] == limit[i]:
        i += 1
    if i >= n:
        return start
    b = start[i]
    if b < 0xFF and b + 1 < limit[i]:
        return start[:i] + bytes([b + 1])
    return start


def short_successor(key: bytes) -> bytes:
    """``FindShortSuccessor``: a short key at or after ``key`` (its first byte below 0xff, plus one)."""
    for i, b in enumerate(key):
        if b != 0xFF:
            return key[:i] + bytes([b + 1])
    return key


class _Block:
    """BlockBuilder."""

    def __init__(self, restart_interval: int):
        self.interval = restart_interval
        self.buf = bytearray()
        self.restarts = [0]
        self.counter = 0
        self.last = b""

    def add(self, key: bytes, value: bytes) -> None:
        shared = 0
        if self.counter < self.interval:
            last = self.last
            n = min(len(last), len(key))
            while shared < n and last[shared] == key[shared]:
                shared += 1
        else:
            self.restarts.append(len(self.buf))
            self.counter = 0
        self.buf += put_varint(shared) + put_varint(len(key) - shared) + put_varint(len(value))
        self.buf += key[shared:]
        self.buf += value
        self.last = key
        self.counter += 1

    def estimate(self) -> int:
        return len(self.buf) + 4 * len(self.restarts) + 4

    def empty(self) -> bool:
        return not self.buf

    def finish(self) -> bytes:
        return bytes(self.buf) + b"".join(put_fixed32(r) for r in self.restarts) + put_fixed32(len(self.restarts))


def _trailer(raw: bytes) -> bytes:
    return b"\x00" + put_fixed32(mask(crc32c(b"\x00", crc32c(raw))))


def write_table(items, options: TableOptions = TableOptions()) -> bytes:
    """The table file of ``items`` (``(key, value)`` byte pairs, keys strictly increasing), as TF's TableBuilder
    writes it with ``options`` and no compression."""
    out = bytearray()
    data = _Block(options.restart_interval)
    index = _Block(1)
    last = None
    pending = None  # handle of the last data block written, not yet in the index

    def write_block(block: _Block) -> bytes:
        raw = block.finish()
        handle = put_varint(len(out)) + put_varint(len(raw))
        out.extend(raw)
        out.extend(_trailer(raw))
        return handle

    for key, value in items:
        key, value = bytes(key), bytes(value)
        if last is not None and key <= last:
            raise ValueError(f"table keys must increase: {key!r} after {last!r}")
        if pending is not None:
            index.add(shortest_separator(last, key), pending)
            pending = None
        last = key
        data.add(key, value)
        if data.estimate() >= options.block_size:
            pending = write_block(data)
            data = _Block(options.restart_interval)
    if not data.empty():
        pending = write_block(data)
    meta = write_block(_Block(options.restart_interval))
    if pending is not None:
        index.add(short_successor(last), pending)
    idx = write_block(index)
    footer = meta + idx
    out.extend(footer + bytes(40 - len(footer)) + put_fixed64(TABLE_MAGIC))
    return bytes(out)


# -- reading ----------------------------------------------------------------------------------------------------


def _handle(buf, pos: int, end: int, what: str) -> tuple[int, int, int]:
    offset, pos = get_varint(buf, pos, end, f"{what} offset")
    size, pos = get_varint(buf, pos, end, f"{what} size")
    return offset, size, pos


def _block(buf, offset: int, size: int, limit: int, what: str) -> memoryview:
    """The contents of the block at ``offset`` (``size`` bytes + trailer inside ``[0, limit)``), trailer checked."""
    if offset + size + TRAILER > limit:
        raise BundleFormatError(f"{what} [{offset}, {offset + size}) + trailer runs past byte {limit}")
    raw = buf[offset:offset + size]
    kind = buf[offset + size]
    if kind != 0:
        raise BundleFormatError(f"{what} is compressed (type {kind}); only uncompressed tables are read")
    stored = get_fixed32(buf, offset + size + 1)
    actual = mask(crc32c(b"\x00", crc32c(raw)))
    if stored != actual:
        raise BundleFormatError(f"{what} checksum {stored:#010x} does not match its bytes ({actual:#010x})")
    return raw


def _entries(raw: memoryview, what: str) -> list:
    n = len(raw)
    if n < 4:
        raise BundleFormatError(f"{what} is {n} bytes, too short for its restart count")
    count = get_fixed32(raw, n - 4)
    if count == 0 or count > (n - 4) // 4:
        raise BundleFormatError(f"{what} claims {count} restart points in {n} bytes")
    end = n - 4 - 4 * count
    for i in range(count):
        r = get_fixed32(raw, end + 4 * i)
        if r > end:
            raise BundleFormatError(f"{what} restart point {r} is past its entries ({end} bytes)")
    out, pos, last = [], 0, b""
    while pos < end:
        shared, pos = get_varint(raw, pos, end, f"{what} entry")
        unshared, pos = get_varint(raw, pos, end, f"{what} entry")
        vlen, pos = get_varint(raw, pos, end, f"{what} entry")
        if shared > len(last) or unshared > end - pos or vlen > end - pos - unshared:
            raise BundleFormatError(f"{what}: entry at byte {pos} claims {shared}+{unshared} key and {vlen} value "
                                    f"bytes, beyond its block")
        key = last[:shared] + bytes(raw[pos:pos + unshared])
        pos += unshared
        out.append((key, raw[pos:pos + vlen]))
        pos += vlen
        last = key
    return out


def read_table(buf) -> list:
    """Every ``(key bytes, value memoryview)`` of the table file ``buf``, in key order; checks the magic, every
    handle, block checksum and entry against the bounds of the file, and that keys increase."""
    view = memoryview(buf)
    size = len(view)
    if size < FOOTER_SIZE:
        raise BundleFormatError(f"index is {size} bytes, shorter than a table footer ({FOOTER_SIZE})")
    if size > MAX_INDEX_BYTES:
        raise BundleFormatError(f"index is {size} bytes, more than the {MAX_INDEX_BYTES} ckptfs reads")
    foot = size - FOOTER_SIZE
    magic = int.from_bytes(view[size - 8:], "little")
    if magic != TABLE_MAGIC:
        raise BundleFormatError(f"index ends in {magic:#018x}, not the table magic {TABLE_MAGIC:#018x}")
    _, _, pos = _handle(view, foot, size - 8, "metaindex handle")
    ioff, isize, _ = _handle(view, pos, size - 8, "index block handle")
    index = _entries(_block(view, ioff, isize, foot, "index block"), "index block")
    out: list = []
    prev_end = 0
    for sep, value in index:
        off, bsize, used = _handle(value, 0, len(value), "data block handle")
        if used != len(value):
            raise BundleFormatError(f"index block entry {sep!r} holds {len(value) - used} bytes after its handle")
        if off < prev_end:
            raise BundleFormatError(f"data block at {off} overlaps the previous one (ending at {prev_end})")
        rows = _entries(_block(view, off, bsize, ioff, f"data block at {off}"), f"data block at {off}")
        for key, _ in rows:
            if key > sep:
                raise BundleFormatError(f"key {key!r} is after its index key {sep!r}")
        out.extend(rows)
        prev_end = off + bsize + TRAILER
    for (a, _), (b, _) in zip(out, out[1:]):
        if b <= a:
            raise BundleFormatError(f"keys out of order: {b!r} after {a!r}")
    return out
