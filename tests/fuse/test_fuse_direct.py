"""Through a real mount: a checkpoint that is not in the page cache is read straight from the disk (issue 14's direct
reads, ``ckptfs.storage.local``): ``cp`` gives the tree's bytes and leaves the checkpoint out of the page cache,
which a buffered read (``CKPTFS_DIRECT_IO=0``, the control) fills; peeks at every tensor of a cold mount (read as
only the rows asked for, ``lz4chunks.reader``) give the file's bytes."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from ckptfs.env import DIRECT_IO
from ckptfs.storage import local
from helpers import needs_fuse, real_env
from helpers.fuse import mounted

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from benchlib import gen  # noqa: E402

#: tensors of 1-2 MiB: a cache block's chunks are one span of at least ``DIRECT_MIN_BYTES``
DIMS = gen.LlamaDims(hidden=512, layers=1, heads=8, kv_heads=8, ffn=1024, vocab=2048)


def _cached_fraction(path: Path, window: int = 64 << 10) -> float:
    """The share of the file's 64 KiB windows that are wholly in the page cache (``cachestat``)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        hits = [local.page_cache.cached(f.fileno(), lo, min(window, size - lo)) for lo in range(0, size, window)]
    return sum(bool(h) for h in hits) / len(hits)


def _evict(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    assert _cached_fraction(path) < 0.05


@needs_fuse
def test_a_cold_checkpoint_is_read_straight_from_the_disk_through_the_mount(tmp_path):
    assert local.page_cache.works, "this kernel has no cachestat (Linux 6.5+)"
    ck = tmp_path / "checkpoint_0.mdl"
    gen.write_checkpoint(ck, DIMS, "bf16", seed=5)
    gen.write_params(tmp_path / "params.yaml", DIMS)
    env = real_env()
    got = {}
    for direct in ("1", "0"):
        _evict(ck)
        with mounted(ck, env={**env, DIRECT_IO: direct}) as mnt:
            shutil.copyfile(mnt / "model.safetensors", tmp_path / f"copy-{direct}.safetensors")
        got[direct] = _cached_fraction(ck)
    assert (tmp_path / "copy-1.safetensors").read_bytes() == (tmp_path / "copy-0.safetensors").read_bytes()
    assert got["1"] < 0.3 < 0.9 < got["0"], got  # the control proves the measure: a buffered cp caches it all


@needs_fuse
def test_peeks_at_every_tensor_of_a_cold_mount_give_the_files_bytes(tmp_path):
    """4 KiB from the start of every tensor of model.safetensors through a fresh mount of a cold checkpoint (how a
    user inspects weights; the server reads only each raw chunk's header and the rows asked for): the same bytes as
    the whole file copied through another mount."""
    import json
    import struct

    ck = tmp_path / "checkpoint_0.mdl"
    gen.write_checkpoint(ck, DIMS, "bf16", seed=6)
    gen.write_params(tmp_path / "params.yaml", DIMS)
    env = real_env()
    with mounted(ck, env=env) as mnt:
        whole = (mnt / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", whole[:8])
    header = json.loads(whole[8:8 + n])
    starts = sorted(8 + n + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    assert len(starts) > 5
    _evict(ck)
    with mounted(ck, env=env) as mnt:
        fd = os.open(mnt / "model.safetensors", os.O_RDONLY)
        try:
            peeks = {a: os.pread(fd, 4096, a) for a in starts}
        finally:
            os.close(fd)
    assert all(got == whole[a:a + 4096] for a, got in peeks.items())
