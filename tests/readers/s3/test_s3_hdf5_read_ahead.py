"""An HDF5 ``.mdl`` stored as ONE S3 object keeps read-ahead now that the object keeps no stream state of its own: a
reader's cursor announces the bytes its stream reads next (``VirtualTensor.will_need``), the chunked dataset tensor
turns tensor bytes into the file ranges of the stored chunks under them, and the object fetches those parts ahead."""
from __future__ import annotations

import threading

import pytest

pytestmark = pytest.mark.slow  # a local S3 server

MiB = 1 << 20


def _mounted_object(srv, monkeypatch, tmp_path):
    """A generated checkpoint (MiB-sized LZ4-chunked tensors) put on ``srv`` as one object, opened as a tree over it
    with the FUSE server's read settings: ``(tree, local tree)``."""
    import ckptfs
    from ckptfs.fuse import operations as fusefs
    from helpers.s3 import generated_checkpoint, mdl_object

    mdl, params = generated_checkpoint(tmp_path / "ck", ffn=2048)
    tree = ckptfs.open(mdl_object(srv, monkeypatch, tmp_path, mdl, params))
    tree.cache.streaming, tree.cache.read_ahead = True, fusefs.SERVER_READ_AHEAD
    tree.cache.announce_ahead = fusefs.SERVER_ANNOUNCE_AHEAD
    return tree, ckptfs.open(mdl, config=str(params))


@pytest.mark.parametrize("with_cursor", [True, False])
def test_a_sequential_copy_announces_the_chunks_ahead_to_the_object(tmp_path, monkeypatch, with_cursor):
    """A copy in order (``cp``: one handle, one cursor) of a file generated from the object announces the stored
    chunks ahead of it to the object (past the server's own read-ahead window, into the tensors that follow); one-off
    reads without a cursor announce nothing. The bytes are the local file's either way."""
    from ckptfs.layouts.cursor import ReadCursor
    from ckptfs.storage import s3object
    from helpers.s3 import LocalS3

    noted, lock = [], threading.Lock()
    real = s3object.S3Object.will_need

    def noting(self, offset, length=None, announced=True):
        with lock:
            noted.append((offset, length))
        return real(self, offset, length, announced)

    srv = LocalS3(tmp_path / "s3")
    trees = []
    try:
        tree, local = _mounted_object(srv, monkeypatch, tmp_path)
        trees += [tree, local]
        monkeypatch.setattr(s3object.S3Object, "will_need", noting)
        name = "model.safetensors"
        size = tree.attr(tree.lookup(name)).size
        assert size > 32 * MiB
        cursor = ReadCursor() if with_cursor else None
        got = bytearray()
        for off in range(0, size, MiB):
            got += tree.read(name, off, MiB, cursor)
        assert bytes(got) == local.read(name, 0, size)
        if not with_cursor:
            assert noted == []
            return
        assert len(noted) >= 4, noted
        blob_size = (tmp_path / "ck" / "checkpoint_0.mdl").stat().st_size
        assert all(0 <= a and a + n <= blob_size for a, n in noted), noted
        # ranges of stored chunks ahead of the reader: together they span most of the object
        assert sum(n for _, n in noted) > blob_size // 4, (sum(n for _, n in noted), blob_size)
    finally:
        for t in trees:  # a tree closes its part pool
            t.close()
        srv.stop()
