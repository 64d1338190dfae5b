"""Crafted (hostile) checkpoints for the issue-16 tests, made by editing copies of genuine fixtures with h5py.

Everything a crafted checkpoint should never reach holds the bytes ``SECRET`` (a 16-byte marker repeated), so a
test can search every byte a mount serves for it. ``secret_files(outside)`` writes them (a safetensors file, an
HDF5 checkpoint-like file and a raw file) into a folder next to — not inside — the checkpoint's folder.
``add_leaves(ckpt, {key: metadata})`` adds top-level keys to a format-0.5 checkpoint (its ``__spec__`` and one
``<key>.__metadata__`` attribute each), the way cstorch would have written them.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import hdf5plugin  # noqa: F401
import numpy as np
from safetensors.numpy import save_file

from helpers import FIXTURES
LLAMA_CS = FIXTURES / "llama" / "cs"
EDGE = FIXTURES / "cstorch_edge_cases"
MARK = b"CKPTFS-SECRET-16"
SECRET = np.frombuffer(MARK * 4, dtype=np.float32).copy()  # 16 float32 values whose bytes are the marker
_LEAF = {"type": None, "context": None, "children_spec": []}


def copy_llama(folder: Path) -> Path:
    """The llama fixture (checkpoint + params) copied into ``folder``; returns the checkpoint path."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(LLAMA_CS / "params.yaml", folder / "params.yaml")
    return Path(shutil.copy(LLAMA_CS / "checkpoint.mdl", folder / "checkpoint.mdl"))


def secret_files(outside: Path) -> dict:
    """Files outside the checkpoint's folder holding the marker: ``st`` (safetensors, tensor "s"), ``h5`` (dataset
    "s" with cstorch attributes), ``raw`` (the bytes alone)."""
    outside.mkdir(parents=True, exist_ok=True)
    st = outside / "secret.safetensors"
    save_file({"s": SECRET}, str(st))
    h5 = outside / "secret.mdl"
    with h5py.File(h5, "w") as f:
        d = f.create_dataset("s", data=SECRET)
        d.attrs["__TYPE__"] = "TorchTensorSerializer"
    raw = outside / "secret.bin"
    raw.write_bytes(SECRET.tobytes())
    return {"st": st, "h5": h5, "raw": raw}


def tensor_md(shape, dtype: str = "torch.float32", kind: str = "TorchTensorSerializer") -> dict:
    md = {"shapes": [list(shape)], "dtypes": [dtype], "__TYPE__": kind}
    if kind == "TorchTensorSerializer":
        md.update({"__TORCH__": True, "__NUMPY__": True, "rtfx_dtypes": [11], "compressed": False})
    return md


def _tree(key: str, node: dict) -> str:
    return json.dumps([1, {"type": "builtins.dict", "context": json.dumps([key]), "children_spec": [node]}])


def leaf_metadata(key: str, md: dict) -> dict:
    """The ``<key>.__metadata__`` document of a leaf serialized by one serializer."""
    return {"__spec__": [{key: "*"}, _tree(key, _LEAF)], "__objects__": [key], f"{key}.__metadata__": md}


def safetensor_ref(key: str, path: str, name: str = "s") -> dict:
    return leaf_metadata(key, {"path": path, "key": name, "__TYPE__": "DeferredSafeTensor", "__NONE__": True})


def numpy_ref(key: str, path: str, name: str = "s", shape=(16,)) -> dict:
    """A DeferredNumpyArray (a tensor stored in another HDF5 file) as cstorch nests it."""
    nested = {"type": "collections.namedtuple", "context": "NestedObject", "children_spec": [_LEAF, _LEAF]}
    return {"__spec__": [{key: ["*", "*"]}, _tree(key, nested)], "__objects__": [f"{key}.0"],
            f"{key}.0.__metadata__": {"deferred_object_cls": "DeferredNumpyArray", "path": path, "key": name,
                                      "index": 0, "metadata": tensor_md(shape), "__TYPE__": "DeferredNumpyArray",
                                      "__NONE__": True},
            f"{key}.1.__metadata__": {"shapes": [list(shape)], "dtypes": ["torch.float32"],
                                      "__TYPE__": "DeferredTorchTensor"}}


def add_leaves(ckpt: Path, leaves: dict) -> None:
    """Add top-level keys (``{key: metadata document}``) to a format-0.5 checkpoint whose root is a dict."""
    with h5py.File(ckpt, "a") as f:
        skeleton, tree = json.loads(f.attrs["__spec__"])
        version, root = json.loads(tree)
        keys = json.loads(root["context"])
        for key, doc in leaves.items():
            keys.append(key)
            root["children_spec"].append(_LEAF)
            skeleton[key] = "*"
            f.attrs[f"{key}.__metadata__"] = json.dumps(doc, indent=4)
        root["context"] = json.dumps(keys)
        f.attrs["__spec__"] = json.dumps([skeleton, json.dumps([version, root])], indent=4)


def all_served_bytes(root: Path) -> dict:
    """{relative path: bytes} of every file under ``root`` (a mount point), read through the file system."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def craft_references(folder: Path, outside: Path) -> Path:
    """The llama fixture in ``folder`` plus keys whose bytes would come from ``outside`` (see ``REFERENCE_KEYS``),
    and one confined reference (``ok_local``, to a safetensors file inside ``folder``)."""
    ckpt = copy_llama(folder)
    sec = secret_files(outside)
    save_file({"s": np.arange(16, dtype=np.float32)}, str(folder / "local.safetensors"))
    (folder / "link.safetensors").symlink_to(sec["st"])
    rel = Path("..") / outside.name / sec["st"].name
    add_leaves(ckpt, {
        "ok_local": safetensor_ref("ok_local", "local.safetensors"),
        "evil_st_abs": safetensor_ref("evil_st_abs", str(sec["st"])),
        "evil_st_rel": safetensor_ref("evil_st_rel", str(rel)),
        "evil_st_link": safetensor_ref("evil_st_link", "link.safetensors"),
        "evil_np_abs": numpy_ref("evil_np_abs", str(sec["h5"])),
        "evil_h5_extlink": leaf_metadata("evil_h5_extlink", tensor_md((16,))),
        "evil_h5_vds": leaf_metadata("evil_h5_vds", tensor_md((16,))),
        "evil_h5_external": leaf_metadata("evil_h5_external", tensor_md((16,))),
    })
    with h5py.File(ckpt, "a") as f:
        f["evil_h5_extlink"] = h5py.ExternalLink(str(sec["h5"]), "/s")
        layout = h5py.VirtualLayout(shape=(16,), dtype="<f4")
        layout[:] = h5py.VirtualSource(str(sec["h5"]), "s", shape=(16,))
        f.create_virtual_dataset("evil_h5_vds", layout)
        f.create_dataset("evil_h5_external", shape=(16,), dtype="<f4", external=[(str(sec["raw"]), 0, 64)])
    return ckpt


#: every key of ``craft_references`` that reads from outside the checkpoint's folder, and what refuses it
REFERENCE_KEYS = {"evil_st_abs": "outside the checkpoint's folder", "evil_st_rel": "outside the checkpoint's folder",
                  "evil_st_link": "outside the checkpoint's folder", "evil_np_abs": "outside the checkpoint's folder",
                  "evil_h5_extlink": "external link", "evil_h5_vds": "virtual dataset",
                  "evil_h5_external": "external raw file"}
#: the keys ``--allow-external OUTSIDE`` makes readable (HDF5's own indirections stay refused)
ALLOWED_WITH_OUTSIDE = ("evil_st_abs", "evil_st_rel", "evil_st_link", "evil_np_abs")


def craft_hostile_metadata(folder: Path) -> Path:
    """The llama fixture in ``folder`` plus keys whose metadata cannot be served (see ``HOSTILE_KEYS``): a negative
    dimension (dataset present), a negative and an overflowing constant fill, a shape that disagrees with its
    dataset, and a reference to a FIFO in the checkpoint's own folder."""
    import os

    ckpt = copy_llama(folder)
    os.mkfifo(folder / "fifo.safetensors")
    add_leaves(ckpt, {
        "bad_negative": leaf_metadata("bad_negative", tensor_md((-1, 4))),
        "bad_full_negative": leaf_metadata("bad_full_negative", tensor_md((-5,), kind="DeferredFullTensor")),
        "bad_overflow": leaf_metadata("bad_overflow", tensor_md((1 << 40, 1 << 40), kind="DeferredFullTensor")),
        "bad_mismatch": leaf_metadata("bad_mismatch", tensor_md((8,))),
        "bad_fifo": safetensor_ref("bad_fifo", "fifo.safetensors"),
    })
    with h5py.File(ckpt, "a") as f:
        f.create_dataset("bad_negative", data=np.zeros((4, 4), np.float32))
        f.create_dataset("bad_mismatch", data=np.zeros(4, np.float32))
    return ckpt


HOSTILE_KEYS = {"bad_negative": "negative dimension", "bad_full_negative": "negative dimension",
                "bad_overflow": "overflows", "bad_mismatch": "metadata says", "bad_fifo": "FIFO"}


def craft_names(folder: Path) -> Path:
    """The legacy 0.4 fixture with keys renamed so that the tensors/ view must escape and separate them: a key that
    is a prefix of another (``model.tied`` / ``model.tied.z``) next to a key written like the prefix's moved file
    (``model.tied@``), a NUL plus an over-long (>255 bytes) file name, and an over-long directory name."""
    from helpers.cs import renamed_legacy_copy

    folder.mkdir(parents=True, exist_ok=True)
    return renamed_legacy_copy(FIXTURES / "legacy_emulated" / "legacy04.mdl", folder / "checkpoint.mdl",
                               {"b": "tied.z", "w": "tied@", "full": "fu\0ll" + "F" * 300, "a/b": "D" * 300 + ".leaf"})


def write_many_keys(folder: Path, layers: int) -> Path:
    """A llama-shaped format-0.5 checkpoint (plus params.yaml) with ``9 * layers + 4`` tiny tensors, written the
    way cstorch lays it out but with HDF5's newer format (dense attribute storage: 100,000 keys in seconds instead of
    hours). Datasets are declared, never written (reads give zeros). HDF5's low-level calls with one creation
    property list per shape and one string type: h5py's per-call checks took a minute for 100,000 keys."""
    import sys

    sys.path.insert(0, str(FIXTURES.parent.parent / "scripts"))
    from benchlib import gen

    dims = gen.LlamaDims(hidden=8, layers=layers, heads=2, kv_heads=1, ffn=8, vocab=16, max_positions=16)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = gen.cs_tensors(dims)
    path = folder / "checkpoint.mdl"
    with h5py.File(path, "w", libver="latest") as f:
        f.attrs["__spec__"] = gen.global_spec([k for k, _ in tensors])
        f.attrs["__version__"] = np.float64(0.5)
        f.attrs["__cstorch_version__"] = "2.10.0"
        text = h5py.h5a.open(f.id, b"__cstorch_version__").get_type()  # the type h5py gives a str
        scalar = h5py.h5s.create(h5py.h5s.SCALAR)
        made: dict = {}  # shape -> (creation property list, type, space) of its first dataset
        for sub, shape in tensors:
            key = "model." + sub
            if shape in made:
                h5py.h5d.create(f.id, key.encode(), made[shape][1], made[shape][2], dcpl=made[shape][0])
            else:
                d = f.create_dataset(key, shape=shape, dtype=np.float32, **hdf5plugin.LZ4())
                made[shape] = (d.id.get_create_plist(), d.id.get_type(), d.id.get_space())
            attr = h5py.h5a.create(f.id, f"{key}.__metadata__".encode(), text, scalar)
            attr.write(np.array(json.dumps(leaf_metadata(key, tensor_md(shape))).encode(), dtype=object))
        f.attrs["__SUCCESS__"] = True
    gen.write_params(folder / "params.yaml", dims)
    return path
