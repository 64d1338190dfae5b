"""Chunk-parallel reads of HDF5 datasets compressed with the LZ4 filter (id 32004), bypassing HDF5's filter pipeline.

HDF5 decodes chunks one at a time, with per-chunk overhead, under h5py's global lock. For a chunked dataset whose
*only* filter is LZ4 (every Cerebras tensor), ``plan(dset).read(box)`` does the work itself:

* ``index``: where the chunks under the box are stored (HDF5's chunk index, read once per dataset, bounded);
* ``files``: the blob they are fetched from — the one seam to storage (``OpenChunkFile`` gives a
  ``ckptfs.storage`` ``Blob``: a checked local file, or none: then each chunk comes through HDF5's
  ``read_direct_chunk``);
* ``fetch``: the stored bytes of many chunks into one scratch buffer, over coalesced file ranges;
* ``frame``: the HDF5-LZ4 framing, checked and decoded (pure, no I/O);
* ``grid``: the chunk geometry, and placing decoded chunks into the output;
* ``reader`` / ``batch``: which way a read goes (a peek at a few rows, a few chunks in plain Python, a numpy batch),
  and ``pool``: the decoding threads and scratch buffers.

``plan(dset)`` returns a reader, or None when the plain h5py hyperslab read must be used (not an h5py Dataset,
contiguous, 0-d, other or extra filters, compound/string/complex types, a file type that h5py would convert, or
the LZ4 library cannot be loaded). ``read`` returns None (the caller then uses h5py, so errors stay the same) for
a box out of range, a closed dataset, or a box touching an unallocated chunk of a dataset whose fill value HDF5
would not apply (fill time "never" / undefined fill value). A chunk that does not decode to exactly its bytes
raises ``CorruptChunkError`` — never wrong bytes.

Block alignment: ``aligned_block_elems`` (``ckptfs.tensor.base``) rounds a tensor's cache-block size to whole chunk rows
(``chunks[0]`` rows of all trailing dimensions), so consecutive blocks never decode the same chunk.

Limitation: a file written with ``H5Pset_chunk_opts(H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS)`` (never done by h5py or
cstorch) stores partial edge chunks unfiltered without saying so in the filter mask; h5py cannot query that flag,
so such edge chunks fail to decode and raise ``CorruptChunkError`` (an error, not wrong data).
"""
from __future__ import annotations

from .files import OpenChunkFile, local_chunk_files
from .frame import CorruptChunkError
from .pool import decode_threads, set_decode_threads
from .reader import LZ4ChunkReader, plan, why_not

__all__ = ["CorruptChunkError", "LZ4ChunkReader", "OpenChunkFile", "decode_threads",
           "local_chunk_files", "plan", "set_decode_threads", "why_not"]
