"""An HDF5 ``.mdl`` stored as one S3 object: its metadata comes in a few rounds of requests in flight together, not one
request per HDF5 read. Opening the checkpoint fetches every dataset's header together (``will_read_headers``); a
loader's open of ``model.safetensors`` (which indexes every dataset) fetches every chunk index node level by level
(``will_index``). Counted as the reads HDF5 had to wait for one at a time (``RangedFile._block``): before, one per
object header and one per index node (45 and 127 on the bench's 256 MB checkpoint)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # a server process


def test_opening_and_indexing_an_mdl_object_waits_for_few_reads_one_by_one(tmp_path, monkeypatch):
    import ckptfs
    from ckptfs.storage import rangedfile
    from helpers.s3 import BUCKET, LocalS3, generated_checkpoint

    mdl, params = generated_checkpoint(tmp_path / "ck", ffn=2048)
    srv = LocalS3(tmp_path / "s3")
    one_by_one = []
    real = rangedfile.RangedFile._block

    def counting(self, blk):
        with self._lock:
            held = blk in self._blocks
        if not held:
            one_by_one.append(blk)
        return real(self, blk)

    try:
        for k, v in srv.env().items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("CKPTFS_CACHE_DIR", str(tmp_path / "cache"))
        c = srv.client()
        c.create_bucket(Bucket=BUCKET)
        c.put_object(Bucket=BUCKET, Key="run/checkpoint_0.mdl", Body=mdl.read_bytes())
        c.put_object(Bucket=BUCKET, Key="run/params.yaml", Body=params.read_bytes())
        monkeypatch.setattr(rangedfile.RangedFile, "_block", counting)
        tree = ckptfs.open(f"s3://{BUCKET}/run/checkpoint_0.mdl")
        opening = len(one_by_one)
        entry = tree.lookup("model.safetensors")
        tensors = len([n for n in tree.walk("tensors")])
        one_by_one.clear()
        tree.opened(entry)  # a loader's open: every dataset indexed, its parts announced
        indexing = len(one_by_one)
        local = ckptfs.open(mdl, config=str(params))
        assert tree.read(entry, 0, 1 << 40) == local.read("model.safetensors", 0, 1 << 40)
        tree.close()
        local.close()
    finally:
        srv.stop()
    assert tensors >= 15
    # the superblock, the root group's symbol table and heap: a handful, whatever the number of datasets
    assert opening <= 12, opening
    assert indexing <= 3, indexing
