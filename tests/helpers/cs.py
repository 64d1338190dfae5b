"""Helpers shared by the cs/torch view and hdf5 layout tests: copying virtual files out, comparing
catalogs leaf by leaf (values, dtypes, containers, link identity), synthetic tensors, and a legacy
file whose keys are renamed by rewriting its pickled spec (no torch or dill involved)."""
from __future__ import annotations

import io
import pickletools
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from ckptfs.catalog.model import Container, OpaqueLeaf, TensorLeaf, UnreadableLeaf, ValueLeaf
from ckptfs.tensor.base import VirtualTensor
from helpers import FIXTURES  # noqa: F401 - re-exported to the tests



def write_out(vf, path: Path, chunk: int = 1 << 20) -> Path:
    with open(path, "wb") as f:
        for o in range(0, vf.size, chunk):
            f.write(vf.read(o, chunk))
    return path


class RampTensor(VirtualTensor):
    """1-D int32 tensor whose element i is i + offset (< 2**31): large, cheap, and position-checkable."""

    def __init__(self, n: int, offset: int = 0):
        from ckptfs.dtypes import INT32

        super().__init__((n,), INT32)
        self.offset = offset

    def read(self, box):
        (a, b), = box
        return np.arange(a + self.offset, b + self.offset, dtype=np.int32)


# -- comparing catalogs ----------------------------------------------------------------------------
def _leaf_sig(leaf):
    if isinstance(leaf, TensorLeaf):
        t = leaf.tensor
        fill = getattr(t, "fill", "-") if type(t).__name__ == "FullTensor" else "-"
        return ("tensor", t.dtype.name, tuple(t.shape), bool(leaf.numpy), fill, t.read_all().tobytes())
    if isinstance(leaf, ValueLeaf):
        return ("value", type(leaf.value).__name__, leaf.value)
    if isinstance(leaf, OpaqueLeaf):
        return ("opaque", leaf.data)
    if isinstance(leaf, UnreadableLeaf):
        return ("unreadable",)
    raise TypeError(type(leaf))


def tree_sig(node):
    """Containers (kind, keys, defaultdict factory) with leaf signatures, recursively."""
    if isinstance(node, Container):
        extra = {k: v for k, v in (node.extra or {}).items() if k in ("default_factory", "maxlen")}
        return (node.kind, None if node.keys is None else tuple(node.keys), tuple(sorted(extra.items())),
                tuple(tree_sig(c) for c in node.children))
    return _leaf_sig(node)


def link_groups(root) -> list:
    """Positions (paths) of each leaf object that occurs more than once, as sorted groups."""
    where: dict[int, list] = {}

    def walk(n, path):
        if isinstance(n, Container):
            keys = n.keys if n.keys is not None else range(len(n.children))
            for k, c in zip(keys, n.children):
                walk(c, path + (k,))
        else:
            where.setdefault(id(n), []).append(path)

    walk(root, ())
    return sorted(sorted(map(str, v)) for v in where.values() if len(v) > 1)


# -- a renamed legacy file -------------------------------------------------------------------------
def _rewrite_pickle(raw: bytes, renames: dict) -> bytes:
    """The same pickle with some SHORT_BINUNICODE/BINUNICODE strings replaced (FRAME opcodes dropped)."""
    ops = list(pickletools.genops(raw))
    out = bytearray()
    for i, (op, arg, pos) in enumerate(ops):
        end = ops[i + 1][2] if i + 1 < len(ops) else len(raw)
        if op.name == "FRAME":
            continue
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE") and arg in renames:
            s = renames[arg].encode()
            out += (b"\x8c" + bytes([len(s)]) if len(s) < 256 else b"X" + struct.pack("<I", len(s))) + s
        else:
            out += raw[pos:end]
    return bytes(out)


def renamed_legacy_copy(src: Path, dst: Path, renames: dict, *, drop: tuple = (), version=None,
                        cstorch_version=...) -> Path:
    """Copy a legacy (<0.5) fixture with spec keys renamed (datasets moved to the quoted new names).

    ``renames`` maps a spec string (a dict key) to its new text; ``drop`` lists flat keys whose
    dataset is removed (a missing dataset reads as None); ``version``/``cstorch_version`` override
    the file attributes (``None`` deletes ``__cstorch_version__``).
    """
    import urllib.parse

    import h5py

    shutil.copyfile(src, dst)
    with h5py.File(dst, "r+") as f:
        spec = bytes.fromhex(f.attrs["__spec__"])
        f.attrs["__spec__"] = _rewrite_pickle(spec, renames).hex()
        names = [urllib.parse.unquote(n) for n in f.keys()]
        moves = []
        for key in names:
            parts = key.split(".")
            new = ".".join(renames.get(p, p) for p in parts)
            if key == "model.a/b" and "a/b" in renames:
                new = "model." + renames["a/b"]
            moves.append((key, new))
        for key, new in moves:
            q_old, q_new = urllib.parse.quote(key, safe=""), urllib.parse.quote(new, safe="")
            if q_old != q_new:
                f.move(q_old, q_new)
        for key in drop:
            del f[urllib.parse.quote(key, safe="")]
        if version is not None:
            f.attrs["__version__"] = np.float64(version)
        if cstorch_version is None:
            f.attrs.pop("__cstorch_version__", None)
        elif cstorch_version is not ...:
            f.attrs["__cstorch_version__"] = cstorch_version
    return dst


def h5_bytes_file(data: bytes):
    import h5py

    return h5py.File(io.BytesIO(data), "r")


def copy_view_file_in_subprocess(view: str, src: Path, name: str, dest: Path, cache_bytes: int = 8 << 20) -> tuple:
    """In a fresh process with a ``cache_bytes`` block cache, build view ``ckptfs.views.<view>`` of checkpoint
    ``src`` and copy its file ``name`` to ``dest`` 1 MiB at a time; returns (file size, tracemalloc peak bytes)."""
    script = textwrap.dedent("""
        import tracemalloc
        from pathlib import Path
        from ckptfs.readers import open_checkpoint
        from ckptfs.views import %s as view
        from ckptfs.views.base import MountOptions, ViewContext
        p = Path(%r)
        tracemalloc.start()
        ck = open_checkpoint(p)
        vf = view.build(ViewContext(ck, p, p.stem, MountOptions(cache_size=%d))).files[%r]
        with open(%r, "wb") as f:
            for off in range(0, vf.size, 1 << 20):
                f.write(vf.read(off, 1 << 20))
        print(vf.size, tracemalloc.get_traced_memory()[1])
    """) % (view, str(src), cache_bytes, name, str(dest))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    size, peak = map(int, out.split())
    return size, peak


# -- a format-0.5 checkpoint rewritten: keys left out or replaced ---------------------------------------------
def rewrite_checkpoint(src: Path, dst: Path, *, keep=lambda key: True, replace: dict | None = None) -> Path:
    """A copy of format-0.5 checkpoint ``src`` at ``dst`` as cstorch lays it out (``__spec__`` from ckptfs's own
    ``hdf5_spec``, one ``<key>.__metadata__`` per key, ``__SUCCESS__`` last) holding only the keys ``keep(key)``
    accepts. A kept dataset is copied with HDF5's object copy: its chunks are the same stored bytes. ``replace``
    maps a tensor key to a numpy array (bf16 as ``(uint16 bits, "bfloat16")``) written LZ4-chunked as cstorch does,
    with its metadata's shape and dtype updated. Keys whose metadata is a link must be kept with their target."""
    import json

    import h5py
    import hdf5plugin

    from ckptfs.layouts.hdf5.layout import RTFX_CODES
    from ckptfs.layouts.hdf5.spec_attr import spec_attr
    from ckptfs.readers import open_checkpoint

    replace = dict(replace or {})
    with open_checkpoint(src) as ck:
        def prune(node, key):
            if not isinstance(node, Container):
                return node if keep(key) else None
            names = node.keys if node.keys is not None else range(len(node.children))
            kept = [(k, c) for k, c in ((k, prune(c, f"{key}.{k}" if key else str(k)))
                                        for k, c in zip(names, node.children)) if c is not None]
            if not kept:
                return None
            return Container(node.kind, [k for k, _ in kept] if node.keys is not None else None,
                             [c for _, c in kept], node.extra)

        root = prune(ck.root, "")
        keys = [k for k in ck.leaves if keep(k)]
    with h5py.File(src, "r") as f, h5py.File(dst, "w") as out:
        out.attrs["__spec__"] = spec_attr(root)
        for name in ("__version__", "__cstorch_version__"):
            out.attrs[name] = f.attrs[name]
        metas = {}
        for key in keys:
            meta = json.loads(f.attrs[f"{key}.__metadata__"])
            if key in replace:
                value = replace.pop(key)
                array, dtype = value if isinstance(value, tuple) else (value, str(value.dtype))
                inner = meta[f"{key}.__metadata__"]
                inner.update(shapes=[list(array.shape)], dtypes=[f"torch.{dtype}"], rtfx_dtypes=[RTFX_CODES[dtype]])
                stored = array.view(np.int16) if dtype == "bfloat16" else array
                ds = out.create_dataset(key, data=stored, chunks=True, **hdf5plugin.LZ4())
                for name, v in f[key].attrs.items():
                    ds.attrs[name] = v
                ds.attrs["shapes"] = np.array([array.shape], dtype=np.int64)
                ds.attrs["dtypes"] = np.array([f"torch.{dtype}"], dtype=h5py.string_dtype())
                ds.attrs["rtfx_dtypes"] = np.array([RTFX_CODES[dtype]], dtype=np.int64)
            elif key in f:
                f.copy(f[key], out, name=key)
            metas[key] = json.dumps(meta, indent=4)
        assert not replace, f"keys to replace that {src} does not hold: {sorted(replace)}"
        for key, text in metas.items():
            out.attrs[f"{key}.__metadata__"] = text
        out.attrs["__SUCCESS__"] = np.bool_(True)
    return dst
