"""An HDF5 ``.mdl`` stored as one S3 object (``aws s3 sync`` of a local run) reads its LZ4 chunks the way a local
file does: through the storage layer's concurrent span reads (``S3Object.read_spans``), not chunk by chunk through
HDF5's C library — and serves the same bytes as the local file."""
from __future__ import annotations

from pathlib import Path
import pytest

pytestmark = pytest.mark.slow  # processes: the CLI, a server, TensorFlow

FIXTURES = Path(__file__).parent.parent.parent / "fixtures"


def test_an_hdf5_object_reads_its_chunks_through_the_blobs_span_reads(tmp_path, monkeypatch):
    import ckptfs
    from ckptfs.storage import s3object
    from helpers.s3 import LocalS3, mdl_object

    case = FIXTURES / "llama" / "cs"
    srv = LocalS3(tmp_path / "s3")
    spans = []
    real = s3object.S3Object.read_spans

    def counting(self, spans_, scratch, hint=True, **kw):
        spans_ = list(spans_)
        spans.append(sum(b - a for a, b in spans_))
        return real(self, spans_, scratch, hint, **kw)

    try:
        url = mdl_object(srv, monkeypatch, tmp_path, case / "checkpoint.mdl", case / "params.yaml")
        monkeypatch.setattr(s3object.S3Object, "read_spans", counting)
        local = ckptfs.open(case / "checkpoint.mdl", config=str(case / "params.yaml"))
        remote = ckptfs.open(url)
        for name in ("model.safetensors", "tensors/model/embedding_layer/word_embeddings/weight.npy"):
            want = local.read(name, 0, 1 << 40)
            assert remote.read(name, 0, 1 << 40) == want
        # the chunks came through the blob's span reads: at least the embedding's stored bytes
        assert spans and sum(spans) > 1000, spans
    finally:
        srv.stop()


@pytest.mark.parametrize("cache_size, most", [("256MiB", 1.05), ("64MiB", 1.8)])
def test_cp_of_an_mdl_object_fetches_each_byte_about_once(tmp_path, cache_size, most):
    """``cp model.safetensors`` from a mount of an ``.mdl`` stored as one object reads the object's tensors in the
    safetensors file's order (sorted names), not the object's, and several tensors share each part: the server sends
    about the object's bytes once (a part is kept until its other tensors are read; a part read up is never fetched
    again), and the copy is the local mount's bytes. (Before: 1.68x at 256MiB, 3.0x at 64MiB, whose 32 MiB of parts
    cannot hold every part a layer's tensors share: there, still 1.56-1.65x, parts less than half read when let go of
    being fetched whole again.)"""
    import re
    import subprocess

    from helpers.fuse import mounted
    from helpers.s3 import BUCKET, LocalS3, generated_checkpoint

    from ckptfs.storage.s3object import PART_BYTES

    mdl, params = generated_checkpoint(tmp_path / "ck", ffn=5120)
    size = mdl.stat().st_size
    assert size > 6 * PART_BYTES
    srv = LocalS3(tmp_path / "s3")
    try:
        env = srv.env(CKPTFS_CACHE_DIR=str(tmp_path / "cache"))
        c = srv.client()
        c.create_bucket(Bucket=BUCKET)
        c.put_object(Bucket=BUCKET, Key="run/checkpoint_0.mdl", Body=mdl.read_bytes())
        c.put_object(Bucket=BUCKET, Key="run/params.yaml", Body=params.read_bytes())
        with mounted(mdl, "--config", params, env=env) as here:
            want = (here / "model.safetensors").read_bytes()
        with mounted(f"s3://{BUCKET}/run/checkpoint_0.mdl", "--cache-size", cache_size, env=env) as mnt:
            srv.reset()
            subprocess.run(["cp", str(mnt / "model.safetensors"), str(tmp_path / "copy")], check=True, timeout=300)
            sent = 0
            for r in srv.requests():
                if r.kind == "GET" and r.range:
                    lo, hi = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", r.range).groups())
                    sent += hi + 1 - lo
        assert (tmp_path / "copy").read_bytes() == want
        assert sent <= most * size, (sent, size, round(sent / size, 3))
    finally:
        srv.stop()
