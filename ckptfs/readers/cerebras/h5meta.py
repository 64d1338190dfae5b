"""Where an HDF5 file keeps its objects' headers and its datasets' chunk indexes, read from the file's bytes, so
that a file in object storage can fetch them ahead, many at once, instead of one request per HDF5 read.

HDF5 reads an object header, then each node of a dataset's chunk B-tree, one after another; over HTTP each is a round
trip (docs/measurements.md, "S3: an .mdl object's metadata"). The functions here find those byte ranges — version-1
object headers and their continuation blocks, the layout message (version 1 to 3) of a chunked dataset, the
version-1 B-tree nodes of its chunk index — so a caller fetches each level of every tree together
(``header_spans``, ``chunk_index_spans``: rounds of span reads through ``fetch``). HDF5 remains the only reader of
what the bytes mean: a range found wrong here costs a request, never a wrong value. Anything else (version-2
headers, layout version 4 indexes, a malformed field) ends the walk of that object: HDF5 reads it on demand as
before. Every count, size and address is bounded before it is used.

The parsing functions are pure (bytes in, numbers out); the two walkers do their I/O only through ``fetch(spans)``,
which returns each span's bytes (shorter at the end of the file).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable, Iterable

#: the HDF5 format signature, at the start of the superblock
SIGNATURE = b"\x89HDF\r\n\x1a\n"
#: a chunk index node's signature (version-1 B-tree)
NODE_SIGNATURE = b"TREE"
#: bytes fetched at each object header's address in the first round: the prefix and, for the headers Cerebras'
#: writers make (a few hundred bytes of messages), the whole first chunk
HEADER_GUESS = 4096
#: ... and before it: HDF5 writes a header's continuation block next to the header of the object written after it
HEADER_BEFORE = 4096
#: an object header chunk larger than this is not fetched ahead (HDF5 reads it itself)
MAX_HEADER_CHUNK = 1 << 20
#: continuation blocks followed per object header
MAX_CONTINUATIONS = 64
#: rounds of fetches for the headers (the first chunk, its rest, continuation blocks in turn)
MAX_HEADER_ROUNDS = 8
#: B-tree levels followed (HDF5 builds a few; a deeper tree is not this file's)
MAX_LEVELS = 16
#: a chunk index node larger than this is not fetched ahead
MAX_NODE_BYTES = 1 << 20
#: default "indexed storage internal node K" (HDF5_BTREE_CHUNK_IK_DEF) for superblocks that do not say
DEFAULT_CHUNK_K = 32
#: an undefined address (all bits set)
_UNDEFINED = (1 << 64) - 1

#: object header message types
_MSG_LAYOUT, _MSG_CONTINUATION = 0x0008, 0x0010

Fetch = Callable[[list], list]


@dataclass(frozen=True)
class Sizes:
    """The superblock's field sizes: of an address (``offsets``), of a length (``lengths``), and the chunk B-tree's
    node capacity ``2 * chunk_k``."""

    offsets: int
    lengths: int
    chunk_k: int = DEFAULT_CHUNK_K


@dataclass(frozen=True)
class ChunkIndexRoot:
    """A chunked dataset's version-1 B-tree: the root node's address and the key's dimensionality (rank + 1)."""

    address: int
    dims: int


def superblock_sizes(head: bytes) -> Sizes | None:
    """The field sizes of a superblock starting at ``head[0]`` (versions 0 to 3), or None."""
    if len(head) < 28 or head[:8] != SIGNATURE:
        return None
    version = head[8]
    if version in (0, 1):
        o, length = head[13], head[14]
        k = struct.unpack_from("<H", head, 24)[0] if version == 1 else DEFAULT_CHUNK_K
    elif version in (2, 3):
        o, length, k = head[9], head[10], DEFAULT_CHUNK_K
    else:
        return None
    if o not in (2, 4, 8) or length not in (2, 4, 8) or not 0 < k <= 1 << 15:
        return None
    return Sizes(o, length, k)


def _uint(data: bytes, at: int, n: int) -> int:
    return int.from_bytes(data[at:at + n], "little")


def header_chunk0(prefix: bytes) -> int | None:
    """The size of a version-1 object header's first chunk of messages (which starts 16 bytes after the header's
    address), from the header's first 16 bytes; None for anything else."""
    if len(prefix) < 16 or prefix[0] != 1:
        return None
    size = struct.unpack_from("<I", prefix, 8)[0]
    return size if 0 < size <= MAX_HEADER_CHUNK else None


def header_messages(chunk: bytes, sizes: Sizes) -> tuple:
    """The messages of one version-1 object header chunk that matter here: ``(layout message body or None,
    [(address, length)] of continuation blocks)``. Stops at the first message that does not fit."""
    layout, more, pos = None, [], 0
    o, n = sizes.offsets, sizes.lengths
    while pos + 8 <= len(chunk):
        kind, size = struct.unpack_from("<HH", chunk, pos)
        body = chunk[pos + 8:pos + 8 + size]
        if len(body) < size:
            break
        if kind == _MSG_LAYOUT and layout is None:
            layout = body
        elif kind == _MSG_CONTINUATION and len(body) >= o + n:
            at, length = _uint(body, 0, o), _uint(body, o, n)
            if 0 < length <= MAX_HEADER_CHUNK and at != _UNDEFINED >> (64 - 8 * o):
                more.append((at, length))
        pos += 8 + size
    return layout, more


def chunk_index_root(layout: bytes, sizes: Sizes) -> ChunkIndexRoot | None:
    """The chunk B-tree of a layout message body (versions 1 to 3, chunked class), or None (another class, a
    version-4 index, nothing allocated yet, a malformed body)."""
    if len(layout) < 2:
        return None
    o = sizes.offsets
    if layout[0] == 3:
        if len(layout) < 3 + o or layout[1] != 2:
            return None
        dims, at = layout[2], _uint(layout, 3, o)
    elif layout[0] in (1, 2):
        if len(layout) < 8 + o or layout[2] != 2:
            return None
        dims, at = layout[1], _uint(layout, 8, o)
    else:
        return None
    if not 1 <= dims <= 33 or at == _UNDEFINED >> (64 - 8 * o):
        return None
    return ChunkIndexRoot(at, dims)


def node_bytes(sizes: Sizes, dims: int) -> int:
    """Bytes of a chunk B-tree node (allocated for ``2K`` children whatever it holds): signature, type, level,
    entries, two siblings, then ``2K`` children between ``2K + 1`` keys (chunk size, filter mask, ``dims`` offsets)."""
    o, k2 = sizes.offsets, 2 * sizes.chunk_k
    return 8 + 2 * o + k2 * o + (k2 + 1) * (8 + 8 * dims)


def node_children(node: bytes, sizes: Sizes, dims: int) -> tuple | None:
    """``(level, [child addresses])`` of a chunk B-tree node (at level 0 the children are chunks), or None when the
    bytes are not such a node."""
    o, key = sizes.offsets, 8 + 8 * dims
    if len(node) < 8 + 2 * o or node[:4] != NODE_SIGNATURE or node[4] != 1:
        return None
    level, used = node[5], struct.unpack_from("<H", node, 6)[0]
    if level >= MAX_LEVELS or used > 2 * sizes.chunk_k:
        return None
    first = 8 + 2 * o + key
    if first + used * (o + key) - key > len(node):
        return None
    return level, [_uint(node, first + i * (o + key), o) for i in range(used)]


def header_spans(addresses: Iterable[int], fetch: Fetch, sizes: Sizes, file_size: int) -> dict:
    """Fetch the version-1 object headers at ``addresses`` — first chunk, then continuation blocks — every header's
    pieces of a round together: ``{address: its layout message body, or None}`` for the headers parsed."""
    layouts: dict = {}
    followed: dict = {}
    todo = [(a, a, min(HEADER_GUESS, file_size - a), True) for a in dict.fromkeys(addresses) if 0 <= a < file_size]
    for _ in range(MAX_HEADER_ROUNDS):
        if not todo:
            break
        # a first chunk is fetched with the bytes just before it (``HEADER_BEFORE``), kept for what lies there
        ahead = [min(at, HEADER_BEFORE) if first and n == HEADER_GUESS else 0 for _, at, n, first in todo]
        got = fetch([(at - b, at + n) for (_, at, n, _), b in zip(todo, ahead)])
        later = []
        for (a, at, n, first), data, b in zip(todo, got, ahead):
            data = data[b:]
            if first:
                size = header_chunk0(data)
                if size is None:
                    continue
                if 16 + size > len(data):  # a long first chunk: fetched whole next round
                    if n < 16 + size and a + 16 + size <= file_size:
                        later.append((a, a, 16 + size, True))
                    continue
                layouts.setdefault(a, None)
                body = data[16:16 + size]
            else:
                body = data
            layout, more = header_messages(body, sizes)
            if layout is not None and layouts.get(a) is None:
                layouts[a] = layout
            done = followed.get(a, 0)
            later += [(a, at2, n2, False) for at2, n2 in more[:max(0, MAX_CONTINUATIONS - done)]
                      if at2 + n2 <= file_size]
            followed[a] = done + len(more)
        todo = later
    return layouts


def chunk_index_spans(roots: Iterable[ChunkIndexRoot], fetch: Fetch, sizes: Sizes, file_size: int,
                      most_bytes: int) -> int:
    """Fetch the nodes of the chunk B-trees under ``roots`` level by level, every node of a level of every tree
    together, at most ``most_bytes`` of nodes in all (the roots first, then each level down): the number of nodes
    fetched. Chunks themselves (the children of level-0 nodes) are not fetched."""
    level = [(r.address, r.dims, None) for r in roots]
    seen: set = set()
    budget, fetched = most_bytes, 0
    for _ in range(MAX_LEVELS + 1):
        batch = []
        for at, dims, want in level:
            n = node_bytes(sizes, dims)
            if at in seen or n > MAX_NODE_BYTES or not 0 <= at <= file_size - n:
                continue
            if n > budget:
                break
            budget -= n
            seen.add(at)
            batch.append((at, dims, want, n))
        if not batch:
            break
        got = fetch([(at, at + n) for at, _, _, n in batch])
        fetched += len(batch)
        level = []
        for (at, dims, want, _), data in zip(batch, got):
            parsed = node_children(data, sizes, dims)
            if parsed is None or (want is not None and parsed[0] != want):
                continue
            lvl, children = parsed
            if lvl > 0:
                level += [(c, dims, lvl - 1) for c in children]
    return fetched
