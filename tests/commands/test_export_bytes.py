"""Every file of a set of fixture mounts, as ``export`` writes it, keeps the sha256 recorded in
tests/export_sha256.json (recorded from the code before the pieces engine replaced the four read loops).

A mount is (checkpoint, options). README.txt names the checkpoint and its params file by absolute paths; the
fixtures folder's path is replaced by ``<FIXTURES>`` before hashing, so the record does not depend on where the
repository lives.

To re-record after a deliberate change of output (say so in the commit message):
    .venv/bin/python tests/commands/test_export_bytes.py --record
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

if __package__ in (None, ""):  # run as a script: make `conftest` importable
    sys.path.insert(0, str(Path(__file__).parent.parent))

from helpers import FIXTURES

RECORD = Path(__file__).parent.parent / "export_sha256.json"

#: mount name -> (checkpoint relative to tests/fixtures, api options)
MOUNTS = {
    "gpt2": ("gpt2/cs/checkpoint.mdl", {}),
    "gpt2_sharded_zero_crc": ("gpt2/cs/checkpoint.mdl", {"max_shard_size": "20KB", "zip_crc": "zero"}),
    "llama": ("llama/cs/checkpoint.mdl", {}),
    "bf16_llama": ("bf16_llama/cs/checkpoint.mdl", {}),
    "train_gpt2": ("train_gpt2/cs/checkpoint.mdl", {}),
    "tied_and_scalars": ("tied_and_scalars/cs/checkpoint.mdl", {}),
    "edge_example": ("cstorch_edge_cases/example.mdl", {}),
    "edge_tied": ("cstorch_edge_cases/tied.mdl", {}),
    "edge_dtypes": ("cstorch_edge_cases/dtypes.mdl", {}),
    "edge_bf16model": ("cstorch_edge_cases/bf16model.mdl", {}),
    "edge_slash": ("cstorch_edge_cases/slash.mdl", {}),
    "edge_numpy": ("cstorch_edge_cases/numpy.mdl", {}),
    "edge_empty_tensor": ("cstorch_edge_cases/empty_tensor.mdl", {}),
    "edge_scalar0d": ("cstorch_edge_cases/scalar0d.mdl", {}),
    "edge_nonctg": ("cstorch_edge_cases/nonctg.mdl", {}),
    "llama_tf": ("llama/cs/checkpoint.mdl", {"views": "tf"}),
    "edge_dtypes_tf_sharded": ("cstorch_edge_cases/dtypes.mdl", {"views": "tf", "tf_max_shard_size": "1KB",
                                                                 "tf_shard_by": 1}),
    "tf2_sharded_source": ("tf/tf2_bert_sharded/tf", {}),  # a TF saver checkpoint: h5/, tensors/, tf/
    "tf1_dtypes_h5": ("tf/tf1_dtypes/h5/model.h5", {}),  # a TF-era Cerebras H5 file: tensors/, tf/
}


def mount_hashes(name: str, tmp: Path) -> dict:
    """sha256 of every file of mount ``name``, each written by ``export_file`` (what ``ckptfs export`` runs)."""
    import ckptfs
    from ckptfs.commands.export import export_file

    rel, options = MOUNTS[name]
    ckpt = FIXTURES / rel
    tree = ckptfs.open(ckpt, **options)
    out = {}
    try:
        for path in tree.file_paths():
            dest = tmp / "out.bin"
            export_file(tree, path, dest)
            data = dest.read_bytes()
            if path.rsplit("/", 1)[-1] == "README.txt":
                data = data.replace(str(FIXTURES.resolve()).encode(), b"<FIXTURES>")
            out[path] = hashlib.sha256(data).hexdigest()
    finally:
        tree.close()
    return out


@pytest.mark.parametrize("name", sorted(MOUNTS))
def test_export_bytes_unchanged(name, tmp_path):
    recorded = json.loads(RECORD.read_text())[name]
    got = mount_hashes(name, tmp_path)
    assert sorted(got) == sorted(recorded), f"{name}: the mount's file list changed"
    changed = [p for p in sorted(got) if got[p] != recorded[p]]
    assert not changed, f"{name}: bytes changed in {changed}"


def record() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        doc = {name: mount_hashes(name, Path(d)) for name in sorted(MOUNTS)}
    RECORD.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"recorded {sum(map(len, doc.values()))} files of {len(doc)} mounts in {RECORD}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(__doc__)
    record()
