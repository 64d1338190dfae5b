"""Decompressing an untrusted zstd frame within a bound known before decoding.

``zstandard``'s one-shot ``decompress(data, max_output_size=…)`` ignores its cap when the frame header states a
content size: it allocates that size at once (2 GiB for a 64 KiB frame, ``MemoryError`` for 2^40). Here the frame
header's declared size is checked against the cap first, then the frame is decoded as a stream (window bounded by
``MAX_WINDOW``) and refused as soon as its output passes the cap. Pure: bytes in, bytes out, no I/O.
"""
from __future__ import annotations

import io

#: largest zstd window a frame may ask for (zstd's default levels use at most 8 MiB)
MAX_WINDOW = 128 << 20
#: decompressed bytes produced at a time
_STEP = 1 << 20


class ZstdRefused(ValueError):
    """A frame that is not decoded: over the cap, or not valid zstd (the message is one line)."""


def declared_size(data: bytes) -> int | None:
    """The content size a zstd frame header declares (None when it declares none); ``ZstdRefused`` when ``data``
    does not start with a zstd frame header."""
    import zstandard

    try:
        size = zstandard.get_frame_parameters(data).content_size
    except zstandard.ZstdError as e:
        raise ZstdRefused(f"not a zstd frame ({' '.join(str(e).split())})") from None
    return None if size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR) else int(size)


def decompress_bounded(data: bytes, cap: int) -> bytes:
    """The decoded bytes of the zstd frame ``data``, at most ``cap`` of them; ``ZstdRefused`` for a frame that
    declares or produces more, asks for a window over ``MAX_WINDOW``, or does not decode."""
    import zstandard

    declared = declared_size(data)
    if declared is not None and declared > cap:
        raise ZstdRefused(f"the zstd frame declares {declared} decompressed bytes, more than the {cap} accepted")
    out = bytearray()
    try:
        reader = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW).stream_reader(
            io.BytesIO(data), read_size=_STEP, read_across_frames=False)
        while True:
            piece = reader.read(min(_STEP, cap + 1 - len(out)))
            if not piece:
                break
            out += piece
            if len(out) > cap:
                raise ZstdRefused(f"the zstd frame decompresses to more than the {cap} bytes accepted")
    except zstandard.ZstdError as e:
        raise ZstdRefused(f"the zstd frame does not decode ({' '.join(str(e).split())})") from None
    if declared is not None and len(out) != declared:
        raise ZstdRefused(f"the zstd frame declares {declared} bytes but decodes to {len(out)}")
    return bytes(out)
