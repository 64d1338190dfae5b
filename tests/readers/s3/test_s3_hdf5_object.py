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
    from helpers.s3 import BUCKET, LocalS3

    case = FIXTURES / "llama" / "cs"
    srv = LocalS3(tmp_path / "s3")
    spans = []
    real = s3object.S3Object.read_spans

    def counting(self, spans_, scratch, hint=True):
        spans_ = list(spans_)
        spans.append(sum(b - a for a, b in spans_))
        return real(self, spans_, scratch, hint)

    try:
        for k, v in srv.env().items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("CKPTFS_CACHE_DIR", str(tmp_path / "cache"))
        c = srv.client()
        c.create_bucket(Bucket=BUCKET)
        c.put_object(Bucket=BUCKET, Key="run/checkpoint_0.mdl", Body=(case / "checkpoint.mdl").read_bytes())
        c.put_object(Bucket=BUCKET, Key="run/params.yaml", Body=(case / "params.yaml").read_bytes())
        monkeypatch.setattr(s3object.S3Object, "read_spans", counting)
        local = ckptfs.open(case / "checkpoint.mdl", config=str(case / "params.yaml"))
        remote = ckptfs.open(f"s3://{BUCKET}/run/checkpoint_0.mdl")
        for name in ("model.safetensors", "tensors/model/embedding_layer/word_embeddings/weight.npy"):
            want = local.read(name, 0, 1 << 40)
            assert remote.read(name, 0, 1 << 40) == want
        # the chunks came through the blob's span reads: at least the embedding's stored bytes
        assert spans and sum(spans) > 1000, spans
    finally:
        srv.stop()
