"""The tf view of a TensorFlow saver checkpoint: its own files, byte for byte (``tf/<prefix>.index``,
``tf/<prefix>.data-0000i-of-0000N``, ``tf/checkpoint`` naming the prefix), whatever variables, sharding and slices
they hold (re-encoding them could not guess the sharding policy that wrote them).

The index's bytes are read from the file (checked to be the version parsed); each data shard is its tensors' byte
ranges, read through the tensors (so CRC-checked: a corrupt tensor is EIO, never its bytes), and the bytes no
numeric tensor covers (string tensors such as ``_CHECKPOINTABLE_OBJECT_GRAPH``) read as the file holds them.
"""
from __future__ import annotations

from ckptfs.layouts.pieces import Computed, PiecedFile, TensorBytes
from ckptfs.tfbundle import checkpoint_state, data_file_name
from ckptfs.views.base import BytesFile, ViewResult


def _raw(shard, lo: int, hi: int):
    """A piece of bytes ``[lo, hi)`` of ``shard`` (a ``TfShard``) served as the file holds them."""

    def compute(a: int, b: int) -> bytes:
        buf, starts = shard.read_spans(f"bytes [{lo + a}, {lo + b}) of {shard.path.name}", [(lo + a, lo + b)])
        return bytes(memoryview(buf)[starts[0]:starts[0] + b - a])

    return Computed(hi - lo, compute, f"bytes [{lo}, {hi}) of {shard.path.name} as stored")


def _data_file(shard, regions: list, name: str, cache) -> PiecedFile:
    pieces, pos = [], 0
    for off, size, tensor in regions:
        if off > pos:
            pieces.append(_raw(shard, pos, off))
        pieces.append(_raw(shard, off, off + size) if tensor is None else TensorBytes(tensor, tensor.key))
        pos = off + size
    if pos < shard.identity.size:
        pieces.append(_raw(shard, pos, shard.identity.size))
    return PiecedFile(pieces, name=name, cache=cache)


def source_files(ctx) -> ViewResult:
    """The tf view's files for a checkpoint whose ``source_files`` are a ``tf_saver.TfFiles``."""
    tf = ctx.checkpoint.source_files
    n = len(tf.shards)
    files = {f"tf/{tf.prefix}.index": PiecedFile([_raw(tf.index, 0, tf.index.identity.size)],
                                                 name=f"{tf.prefix}.index", cache=ctx.cache),
             "tf/checkpoint": BytesFile(checkpoint_state(tf.prefix))}
    for i, (shard, regions) in enumerate(zip(tf.shards, tf.regions)):
        name = data_file_name(tf.prefix, i, n)
        files[f"tf/{name}"] = _data_file(shard, regions, name, ctx.cache)
    note = f"tf: the source's own {tf.prefix}.index and {n} data file(s), byte for byte (numeric tensors CRC-checked)"
    return ViewResult(files=files, notes=[note])
