"""Untrusted checkpoints in the source layer (issue 16), without FUSE: references are confined to the checkpoint's
folder (``--allow-external`` opts a folder in), HDF5's own indirections are refused, hostile metadata makes one
tensor unreadable with a reason, nothing opens a FIFO, and a file changed after it was opened fails reads instead of
mixing versions. The same crafted files go through a real mount in test_fuse_untrusted.py."""
from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from ckptfs.errors import SourceChangedError, TensorReadError
from ckptfs.catalog.model import TensorLeaf, UnreadableLeaf
from ckptfs.readers import open_checkpoint
from ckptfs.guard.confine import Confinement, RefusedReference
from helpers import run_ckptfs
from helpers.untrusted import (ALLOWED_WITH_OUTSIDE, EDGE, FIXTURES, HOSTILE_KEYS, MARK, REFERENCE_KEYS, SECRET,
                            craft_hostile_metadata, craft_references, secret_files)

pytestmark = pytest.mark.timeout(300)  # the harness bound: a FIFO opened by mistake would block forever
ROOT = Path(__file__).parent.parent.parent


@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
    d = tmp_path_factory.mktemp("refs")
    return craft_references(d / "ck", d / "outside"), d / "outside"


def test_references_outside_the_folder_are_refused_with_a_reason(crafted):
    ckpt, _ = crafted
    with open_checkpoint(ckpt) as c:
        for key, why in REFERENCE_KEYS.items():
            leaf = c.leaves[key]
            assert isinstance(leaf, UnreadableLeaf), key
            assert why in leaf.reason, (key, leaf.reason)
            assert any(w.startswith(f"{key}: ") for w in c.warnings), key
        local = c.leaves["ok_local"]
        assert isinstance(local, TensorLeaf) and np.array_equal(local.tensor.read_all(), np.arange(16, dtype=np.float32))
        assert isinstance(c.leaves["model.lm_head.weight"], TensorLeaf)  # the rest of the checkpoint is unaffected


def test_allow_external_opts_a_folder_in_but_never_hdf5_indirection(crafted):
    ckpt, outside = crafted
    with open_checkpoint(ckpt, allow_external=[outside]) as c:
        for key in REFERENCE_KEYS:
            leaf = c.leaves[key]
            if key in ALLOWED_WITH_OUTSIDE:
                assert isinstance(leaf, TensorLeaf), (key, getattr(leaf, "reason", ""))
                assert leaf.tensor.read_all().tobytes() == SECRET.tobytes(), key
            else:
                assert isinstance(leaf, UnreadableLeaf), key


@pytest.mark.slow  # runs the CLI
def test_info_and_ls_show_why(crafted):
    ckpt, _ = crafted
    info = run_ckptfs("info", ckpt, text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    for key, why in REFERENCE_KEYS.items():
        line = next(ln for ln in info.stdout.splitlines() if ln.strip().startswith(f"unreadable {key}:"))
        assert why in line
    ls = run_ckptfs("ls", "-l", ckpt, text=True, timeout=120)
    assert ls.returncode == 0, ls.stderr
    assert all(any(ln.strip().startswith(key) and "unreadable" in ln for ln in ls.stdout.splitlines())
               for key in REFERENCE_KEYS)
    assert MARK.decode() not in info.stdout + ls.stdout


def test_hostile_metadata_is_unreadable_from_the_catalog(tmp_path):
    ckpt = craft_hostile_metadata(tmp_path / "ck")  # includes a reference to a FIFO: never opened
    with open_checkpoint(ckpt) as c:
        for key, why in HOSTILE_KEYS.items():
            leaf = c.leaves[key]
            assert isinstance(leaf, UnreadableLeaf) and why in leaf.reason, (key, getattr(leaf, "reason", leaf))
        assert isinstance(c.leaves["model.lm_head.weight"], TensorLeaf)


@pytest.mark.slow  # runs the CLI
def test_checkpoint_that_is_a_fifo_is_refused_without_opening_it(tmp_path):
    os.mkfifo(tmp_path / "checkpoint.mdl")
    r = run_ckptfs("info", tmp_path / "checkpoint.mdl", text=True, timeout=120)
    assert r.returncode == 2 and "FIFO" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def _legacy_with(tmp_path, attrs: dict) -> Path:
    ck = tmp_path / "ck" / "legacy04.mdl"
    ck.parent.mkdir()
    shutil.copy(FIXTURES / "legacy_emulated" / "legacy04.mdl", ck)
    with h5py.File(ck, "a") as f:
        del f["model.a%2Fb"]
        d = f.create_dataset("model.a%2Fb", data=h5py.Empty("f4"))
        for k, v in attrs.items():
            d.attrs[k] = v
    return ck


@pytest.mark.parametrize("kind", ["DeferredFileTensor", "DeferredH5Tensor"])
def test_legacy_references_are_confined(tmp_path, kind):
    sec = secret_files(tmp_path / "outside")
    if kind == "DeferredFileTensor":
        attrs = {"__H5_TYPE__": kind, "filepath": str(sec["raw"]), "shape": np.array([16]),
                 "dtype": pickle.dumps(torch.float32).hex()}
    else:
        attrs = {"__H5_TYPE__": kind, "filepath": "../outside/secret.mdl", "key": "s"}
    ck = _legacy_with(tmp_path, attrs)
    with open_checkpoint(ck) as c:
        leaf = c.leaves["model.a/b"]
        assert isinstance(leaf, UnreadableLeaf) and "outside the checkpoint's folder" in leaf.reason
    with open_checkpoint(ck, allow_external=[tmp_path / "outside"]) as c:
        assert c.leaves["model.a/b"].tensor.read_all().tobytes() == SECRET.tobytes()


def test_a_symlink_swapped_in_after_the_catalog_is_refused_at_read(crafted, tmp_path):
    ckpt, outside = crafted
    ck = tmp_path / "ck"
    shutil.copytree(ckpt.parent, ck, symlinks=True)
    with open_checkpoint(ck / "checkpoint.mdl") as c:
        t = c.leaves["ok_local"].tensor
        (ck / "local.safetensors").unlink()
        (ck / "local.safetensors").symlink_to(outside / "secret.safetensors")
        with pytest.raises(TensorReadError, match="refused|changed"):
            t.read_all()


def test_confinement_rule():
    c = Confinement("/data/run", ("/shared/weights",))
    assert c.contains("/data/run/x.mdl") and c.contains("/shared/weights/a/b") and not c.contains("/data/runner/x")
    with pytest.raises(RefusedReference, match="NUL"):
        c.resolve("a\0b")


# -- change detection -------------------------------------------------------------------------------------------


def _copy(tmp_path, name="src.mdl") -> Path:
    return Path(shutil.copy(EDGE / name, tmp_path / name))


def _stored_at(ck: Path, name: str) -> tuple:
    """(file offset, size) of the first stored chunk of dataset ``name``."""
    with h5py.File(ck, "r") as f:
        info = f[name].id.get_chunk_info(0)
    return info.byte_offset, info.size


def overwrite_in_place(ck: Path, offset: int, size: int) -> None:
    """Flip ``size`` bytes at ``offset`` (same inode: what ``cp new.mdl checkpoint.mdl`` does to a region)."""
    with open(ck, "r+b") as fh:
        fh.seek(offset)
        old = fh.read(size)
        fh.seek(offset)
        fh.write(bytes(b ^ 0xFF for b in old))


def test_rewritten_in_place_fails_reads_instead_of_mixing(tmp_path):
    ck = _copy(tmp_path)
    where = _stored_at(ck, "a")
    with open_checkpoint(ck) as c:
        t = c.leaves["a"].tensor
        t.read_all()
        ino = ck.stat().st_ino
        overwrite_in_place(ck, *where)
        assert ck.stat().st_ino == ino
        with pytest.raises(SourceChangedError, match="changed since it was opened"):
            t.read_all()


def test_renamed_over_keeps_the_open_version_and_truncated_fails(tmp_path):
    ck = _copy(tmp_path)
    with open_checkpoint(ck) as c:
        t = c.leaves["a"].tensor
        before = t.read_all().copy()
        other = tmp_path / "new.mdl"
        shutil.copy(EDGE / "src.mdl", other)
        where = _stored_at(other, "a")
        overwrite_in_place(other, *where)
        os.replace(other, ck)  # the open file still holds the version that was opened: served whole
        assert np.array_equal(t.read_all(), before)
    with open_checkpoint(ck) as c:
        t = c.leaves["b"].tensor
        with open(ck, "r+b") as fh:
            fh.truncate(ck.stat().st_size - 1)
        with pytest.raises(SourceChangedError, match="size changed"):
            t.read_all()


def test_external_file_modified_after_opening(tmp_path):
    shutil.copytree(EDGE / "external", tmp_path / "ext")
    with open_checkpoint(tmp_path / "ext" / "from_st.mdl") as c:
        t = c.leaves["model.v"].tensor
        data = t.read_all().copy()
        st = tmp_path / "ext" / "m.safetensors"
        raw = bytearray(st.read_bytes())
        raw[-1] ^= 0xFF
        st.write_bytes(bytes(raw))  # same size, same inode, new bytes
        with pytest.raises(SourceChangedError):
            t.read_all()
    with open_checkpoint(tmp_path / "ext" / "from_st.mdl") as c:  # reopened: the new version is served
        assert c.leaves["model.v"].tensor.read_all().shape == data.shape


# -- loops over tensor bytes make progress or fail -------------------------------------------------------------




def test_a_tensor_that_yields_no_bytes_fails_instead_of_spinning():
    from ckptfs.dtypes import FLOAT32
    from ckptfs.layouts.npy import NpyLayout
    from ckptfs.layouts.torchzip.layout import TorchZipLayout
    from ckptfs.tensor.base import VirtualTensor

    class NoBytes(VirtualTensor):  # announces 4 KiB but produces nothing (what a bad shape once did)
        def read(self, box):
            return np.empty(0, np.float32)

    t = NoBytes((1024,), FLOAT32)
    zf = TorchZipLayout({"w": t}, "archive", crc="exact")
    with pytest.raises(TensorReadError, match="no bytes"):
        zf.read(zf.cd_offset, zf.cd_size)  # the central directory needs the CRC: its pass stops with an error
    npy = NpyLayout(t)
    with pytest.raises(TensorReadError):
        npy.read(0, npy.size)
