"""An HDF5 ``.mdl`` stored as one S3 object: its metadata comes in a few rounds of requests in flight together, not one
request per HDF5 read. Opening the checkpoint fetches every dataset's header together (``will_read_headers``); a
loader's open of ``model.safetensors`` (which indexes every dataset) fetches every chunk index node level by level
(``will_index``). Counted as the reads HDF5 had to wait for one at a time (``RangedFile._block``): before, one per
object header and one per index node (45 and 127 on the bench's 256 MB checkpoint)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # a server process


@pytest.fixture
def waited(monkeypatch) -> list:
    """The blocks HDF5 waited for one by one (not held when asked for), as they come."""
    from ckptfs.storage import rangedfile

    blocks: list = []
    real = rangedfile.RangedFile._block

    def counting(self, blk):
        with self._lock:
            if blk not in self._blocks:
                blocks.append(blk)
        return real(self, blk)

    monkeypatch.setattr(rangedfile.RangedFile, "_block", counting)
    return blocks


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A generated checkpoint stored as one object of the local endpoint: ``(url, mdl, params)``."""
    from helpers.s3 import LocalS3, generated_checkpoint, mdl_object

    mdl, params = generated_checkpoint(tmp_path / "ck", ffn=2048)
    srv = LocalS3(tmp_path / "s3")
    try:
        yield mdl_object(srv, monkeypatch, tmp_path, mdl, params), mdl, params
    finally:
        srv.stop()


def test_opening_and_indexing_an_mdl_object_waits_for_few_reads_one_by_one(served, waited):
    import ckptfs

    url, mdl, params = served
    tree = ckptfs.open(url)
    opening = len(waited)
    entry = tree.lookup("model.safetensors")
    tensors = len([n for n in tree.walk("tensors")])
    waited.clear()
    tree.opened(entry)  # a loader's open: every dataset indexed, its parts announced
    indexing = len(waited)
    local = ckptfs.open(mdl, config=str(params))
    assert tree.read(entry, 0, 1 << 40) == local.read("model.safetensors", 0, 1 << 40)
    tree.close()
    local.close()
    assert tensors >= 15
    # the superblock, the root group's symbol table and heap: a handful, whatever the number of datasets
    assert opening <= 12, opening
    assert indexing <= 3, indexing


def test_a_mount_of_an_mdl_object_reads_every_chunk_index_in_the_background(served, waited, monkeypatch):
    """``warm`` (the mount server's, once serving): every dataset's chunk index is read in the background, so that
    a loader's first open of ``model.safetensors`` waits for no metadata read at all; closing the tree stops the work
    and waits for it."""
    import ckptfs
    from ckptfs.readers.cerebras.dataset_tensor import H5DatasetTensor

    url, mdl, params = served
    seen = []
    real_index = H5DatasetTensor.read_index
    monkeypatch.setattr(H5DatasetTensor, "read_index", lambda self: (seen.append(self.key), real_index(self)))
    tree = ckptfs.open(url)
    tree.warm()
    threads = list(tree._warmers)
    for th in threads:
        th.join(60)
    waited.clear()
    entry = tree.lookup("model.safetensors")
    tree.opened(entry)
    assert waited == []
    assert len(seen) >= 15
    local = ckptfs.open(mdl, config=str(params))
    assert tree.read(entry, 0, 1 << 40) == local.read("model.safetensors", 0, 1 << 40)
    local.close()
    tree.close()
    assert threads and all(not th.is_alive() for th in threads)
