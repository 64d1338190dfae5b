"""Nothing from a checkpoint is ever unpickled or executed: pickled objects stay opaque bytes, and the
legacy spec decoder refuses every global that is not a pytree spec class."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import h5py
import hdf5plugin  # noqa: F401
import numpy as np
import pytest

from ckptfs.errors import CheckpointError
from ckptfs.catalog.model import OpaqueLeaf
from ckptfs.readers import open_checkpoint
from ckptfs.readers.cerebras.dill_spec import SpecUnpickler, decode_legacy_spec
from ckptfs.catalog.materialize import Opaque, to_torch
from ckptfs.catalog.pytree import SpecError
from helpers import FIXTURES as FIX, run_ckptfs

ROOT = Path(__file__).parent.parent.parent


class _CreatesFile:
    """Unpickling an instance would call open(path, "w"), creating the file."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.slow  # starts processes
def test_pickled_object_is_never_unpickled(tmp_path):
    marker = tmp_path / "pwned"
    crafted = pickle.dumps(_CreatesFile(marker), protocol=4)
    ck = tmp_path / "obj.mdl"
    ck.write_bytes((FIX / "cstorch_edge_cases" / "obj.mdl").read_bytes())
    with h5py.File(ck, "a") as f:
        f["obj"].attrs["__BYTES__"] = np.frombuffer(crafted, dtype="V1")
    with open_checkpoint(ck) as ckpt:
        leaf = ckpt.leaves["obj"]
        assert isinstance(leaf, OpaqueLeaf) and leaf.data == crafted
        obj = to_torch(ckpt)["obj"]
        assert isinstance(obj, Opaque) and obj.data == crafted
    for cmd in (["info", ck], ["info", "--json", ck], ["ls", "-l", ck]):
        r = run_ckptfs(*cmd, text=True)
        assert r.returncode == 0, r.stderr
    assert "opaque pickled object" in run_ckptfs("ls", "-l", ck, text=True).stdout
    assert not marker.exists()
    # sanity: the crafted bytes really are dangerous when unpickled
    pickle.loads(crafted).close()
    assert marker.exists()


@pytest.mark.slow  # starts processes
def test_legacy_object_value_stays_opaque(tmp_path):
    marker = tmp_path / "pwned"
    crafted = pickle.dumps(_CreatesFile(marker), protocol=4)
    ck = tmp_path / "legacy04.mdl"
    ck.write_bytes((FIX / "legacy_emulated" / "legacy04.mdl").read_bytes())
    with h5py.File(ck, "a") as f:  # turn the string leaf into a legacy ObjectH5Type holding the crafted pickle
        d = f["optimizer.param_groups.0.name"]
        d.attrs["__H5_TYPE__"] = "ObjectH5Type"
        d.attrs["object_value"] = crafted.hex()
    with open_checkpoint(ck) as ckpt:
        leaf = ckpt.leaves["optimizer.param_groups.0.name"]
        assert isinstance(leaf, OpaqueLeaf) and leaf.data == crafted
        to_torch(ckpt)
    assert run_ckptfs("ls", "-l", ck, text=True).returncode == 0
    assert not marker.exists()


@pytest.mark.slow  # starts processes
def test_legacy_spec_refuses_foreign_globals(tmp_path):
    marker = tmp_path / "pwned"
    ck = tmp_path / "legacy04.mdl"
    ck.write_bytes((FIX / "legacy_emulated" / "legacy04.mdl").read_bytes())
    with h5py.File(ck, "a") as f:
        f.attrs["__spec__"] = pickle.dumps(_CreatesFile(marker), protocol=4).hex()
    with pytest.raises(CheckpointError) as ei:
        open_checkpoint(ck)
    assert "open" in ei.value.problem and "refuses" in ei.value.problem
    r = run_ckptfs("info", ck, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and ck.name in r.stderr
    assert not marker.exists()


@pytest.mark.parametrize("payload", [
    pickle.dumps(os.system, protocol=4),
    pickle.dumps(np.zeros(2), protocol=4),  # numpy reconstruct globals
    pickle.dumps(pickle.loads, protocol=2),
])
def test_spec_unpickler_admits_only_pytree_classes(payload):
    with pytest.raises(SpecError, match="refuses"):
        decode_legacy_spec(payload.hex())
    with pytest.raises(pickle.UnpicklingError):
        SpecUnpickler.find_class(SpecUnpickler(__import__("io").BytesIO(b"")), "os", "system")


@pytest.mark.slow  # starts processes
def test_legacy_spec_decodes_without_torch_or_dill(tmp_path):
    """The decoder runs in a process where importing torch or dill is impossible."""
    code = (
        "import sys, h5py\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'dill'): raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from ckptfs.readers.cerebras.dill_spec import decode_legacy_spec\n"
        "from ckptfs.catalog.pytree import leaf_keys\n"
        f"f = h5py.File({str(FIX / 'legacy_emulated' / 'legacy04.mdl')!r}, 'r')\n"
        "print(len(leaf_keys(decode_legacy_spec(f.attrs['__spec__']))))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with open_checkpoint(FIX / "legacy_emulated" / "legacy04.mdl") as ckpt:
        assert int(r.stdout) == len(ckpt.leaves)
