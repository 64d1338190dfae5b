"""The HDF5-LZ4 chunk frame (filter 32004) and its decoding: pure functions over memory, no I/O.

Framing (hdf5plugin ``src/LZ4/H5Zlz4.c``): 8-byte big-endian total uncompressed size, 4-byte big-endian block size
(clamped to the total), then per block a 4-byte big-endian stored size and the block; a block whose stored size
equals its uncompressed size is stored raw. A chunk whose filter mask has bit 0 set skipped the (optional) filter
and is stored raw. Anything that does not decode to exactly the chunk's size raises ``CorruptChunkError`` — never
wrong bytes. Trailing bytes after the last block are ignored, as HDF5's own filter does.

Blocks are decoded with ``LZ4_decompress_safe`` from hdf5plugin's own ``libh5lz4.so`` through ctypes (which releases
the GIL, so decoding threads run in parallel).
"""
from __future__ import annotations

import ctypes
import struct
import threading

import numpy as np

from ..lz4filter import lz4_library

#: total uncompressed size, block size
HEADER = struct.Struct(">QI")
#: a block's stored size
BLOCK = struct.Struct(">I")
#: a one-block frame stored raw: these 16 header bytes, then the data
RAW_HEAD = HEADER.size + BLOCK.size
#: total size, block size, first block's stored size
HEAD = struct.Struct(">QII")
HEAD_DTYPE = np.dtype([("total", ">u8"), ("block", ">u4"), ("stored", ">u4")])


class CorruptChunkError(Exception):
    """A stored chunk that does not decode to exactly its expected bytes; ``coords`` is its dataset offset."""

    def __init__(self, coords: tuple, detail: str):
        self.coords = tuple(int(c) for c in coords)
        self.detail = detail
        super().__init__(f"chunk at {self.coords}: {detail}")


_lib_lock = threading.Lock()
_lib_state: list = []  # [] = not tried; [fn] = loaded; [None] = unavailable


def lz4_decompress_safe():
    """``LZ4_decompress_safe(src, dst, compressed_size, capacity) -> int`` from hdf5plugin's libh5lz4, or None."""
    if _lib_state:
        return _lib_state[0]
    with _lib_lock:
        if not _lib_state:
            lib = lz4_library()
            try:
                fn = lib.LZ4_decompress_safe
                fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int)
                fn.restype = ctypes.c_int
            except AttributeError:  # no library (None has no such attribute), or one without the symbol
                fn = None
            _lib_state.append(fn)
    return _lib_state[0]


def address(buf) -> int:
    """Address of a writable buffer (bytearray / numpy array / mmap)."""
    if isinstance(buf, np.ndarray):
        return buf.__array_interface__["data"][0]
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def decode_frame(raw, raw_addr: int, nbytes: int, dst_addr: int, coords: tuple = ()) -> None:
    """Decode one HDF5-LZ4 framed chunk (``raw``, a bytes-like at ``raw_addr``) into ``nbytes`` at ``dst_addr``.

    Raises ``CorruptChunkError`` (naming ``coords``) unless the frame decodes to exactly ``nbytes``.
    """
    fn = lz4_decompress_safe()
    if fn is None:
        raise CorruptChunkError(coords, "LZ4 library unavailable")
    size = len(raw)
    if size < HEADER.size:
        raise CorruptChunkError(coords, f"{size}-byte chunk is shorter than the LZ4 header")
    total, block = HEADER.unpack_from(raw, 0)
    if total != nbytes:
        raise CorruptChunkError(coords, f"header says {total} bytes, chunk holds {nbytes}")
    if block > total:
        block = total
    if block == 0 and total:
        raise CorruptChunkError(coords, "block size 0")
    pos, done = HEADER.size, 0
    while done < total:
        n = min(block, total - done)
        if pos + 4 > size:
            raise CorruptChunkError(coords, f"truncated at block {done // block}")
        (stored,) = BLOCK.unpack_from(raw, pos)
        pos += 4
        if pos + stored > size:
            raise CorruptChunkError(coords, f"block {done // block} runs past the chunk's end")
        if stored == n:
            ctypes.memmove(dst_addr + done, raw_addr + pos, n)
        else:
            try:
                got = fn(raw_addr + pos, dst_addr + done, stored, n)
            except (ctypes.ArgumentError, OSError) as e:
                raise CorruptChunkError(coords, f"LZ4 call failed: {e}") from e
            if got != n:
                raise CorruptChunkError(coords, f"block {done // block} decodes to {got} bytes, not {n}")
        pos += stored
        done += n


def stored_raw(buf, p: int, size: int, mask: int, nbytes: int) -> bool:
    """Whether the chunk at ``buf[p:p+size]`` (filter mask ``mask``) is a one-block frame holding its ``nbytes``
    raw."""
    if mask & 1 or size != nbytes + RAW_HEAD:
        return False
    total, block, stored = HEAD.unpack_from(buf, p)
    return total == stored == nbytes and block >= total


def frame_heads(buf, pos: np.ndarray, sizes: np.ndarray, masks: np.ndarray, nbytes: int) -> tuple:
    """The frame headers of the chunks at ``buf[pos[k]:pos[k]+sizes[k]]`` at once: ``(single, raw, stored)``, which
    are one-block frames of a chunk of ``nbytes`` (every chunk under the 1 GiB default block size), which of those
    hold it raw (stored size == chunk size), and each first block's stored size."""
    head = np.zeros(len(pos), HEAD_DTYPE)
    ok = (sizes >= RAW_HEAD) & ((masks & 1) == 0)
    if ok.any():
        ab = np.frombuffer(buf, np.uint8)
        head[ok] = ab[pos[ok, None] + np.arange(RAW_HEAD)].view(HEAD_DTYPE)[:, 0]
    stored = head["stored"].astype(np.int64)
    single = ok & (head["total"] == nbytes) & (head["block"] >= nbytes) & (stored + RAW_HEAD <= sizes)
    return single, single & (stored == nbytes), stored


def decode_single_blocks(src_addr: int, pos, stored, raw, dst_addr: int, nbytes: int, coords_of) -> None:
    """Decode one-block frames whose blocks start at ``src_addr + pos[k]`` (``stored[k]`` bytes, ``raw[k]``: stored
    raw) back to back into ``nbytes`` each from ``dst_addr``; ``coords_of(k)`` names a frame that does not decode
    (``CorruptChunkError``)."""
    fn = lz4_decompress_safe()
    for k, (p, n, r) in enumerate(zip(pos.tolist(), stored.tolist(), raw.tolist())):
        if r:
            ctypes.memmove(dst_addr + k * nbytes, src_addr + p, nbytes)
        elif fn(src_addr + p, dst_addr + k * nbytes, n, nbytes) != nbytes:
            raise CorruptChunkError(coords_of(k), "block 0 does not decode to the chunk's size")
