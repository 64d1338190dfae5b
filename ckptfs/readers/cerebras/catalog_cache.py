"""The catalog index: what ``open_checkpoint`` read from a checkpoint's metadata, kept between runs.

Reading the catalog of a checkpoint is HDF5's work on every key (its metadata attribute, its dataset's header):
~0.2 s for a 70B llama, ~15 s for 100,000 keys. After a full read, ``save`` writes the catalog as JSON to
``catalogs/`` under ckptfs's cache directory; ``load`` gives it back for the same file version, so opening the
checkpoint again reads no HDF5 metadata (the file itself opens on the first tensor read, and that read checks it is
still the version the index was made from, as every read does).

An index is used only for exactly the file it was made from — its real path and identity (device, inode, size,
mtime, ctime) — and for this index format and this version of the code that reads catalogs (a digest of
``ckptfs/source``); anything else in it, or anything that does not parse as an index, makes ``load`` return None
(the file is read as usual and the index written again). Only plain catalogs are indexed: complete format 0.5
files whose leaves are all datasets of the file itself, constants, values or opaque bytes. A file that refers to
other files is read each time, so that those files are looked up and confined each time; so is a file with an
unreadable leaf (which may be a reference to a file that is missing or refused now and there later).

An index is JSON lines, never a pickle: a header (format, code digest, path, file identity, the catalog's own
facts), then one line per leaf and per key, then the nesting — written and read one line at a time, so that a
100,000-key catalog is not held twice in memory. It is one of ckptfs's own state files (``ckptfs.state.files``):
used only when it is the user's own, in the user's own folder, and its seal verifies (an index edited by hand, cut
short or planted by someone else is not used, and never pruned); at most ``MAX_INDEX_BYTES`` each and
``MAX_INDEXES`` / ``MAX_TOTAL_BYTES`` in all (the least recently written go first). Beyond the seal, what is cheap
to check against the file is checked: a dataset an index names must belong to its key (``name_belongs``), and
every dataset's header is checked against the index's shape and element size when it is opened.
"""
from __future__ import annotations

import base64
import hashlib
import math
import re
from pathlib import Path

from ... import dtypes
from ...env import catalog_index_enabled
from ...state.files import StateDir, StateFileError
from ...storage.local import FileIdentity
from ...catalog.model import Checkpoint, Container, Leaf, OpaqueLeaf, TensorLeaf, ValueLeaf
from ...tensor.regions import FullTensor
from .dataset_tensor import H5DatasetTensor
from ...catalog.validate import shape_problem

#: the layout of an index file (bump when it changes)
INDEX_FORMAT = 1
#: largest index written (a 100,000-key catalog is ~25 MB)
MAX_INDEX_BYTES = 256 << 20
#: indexes kept at most, in count and in bytes: writing one removes the least recently written beyond either
MAX_INDEXES = 256
MAX_TOTAL_BYTES = 1 << 30
#: the index's folder under the cache directory, the kind its header names, and its files' names
FOLDER = "catalogs"
KIND = "catalog-index"
_NAME = re.compile(r"[0-9a-f]{40}\.json")

_CONTAINER_KINDS = frozenset({"dict", "OrderedDict", "defaultdict", "list", "tuple", "set", "namedtuple", "deque"})
_code_digest: str | None = None


class _NotIndexable(Exception):
    """The catalog holds something an index does not keep (its file is read each time)."""


def enabled() -> bool:
    return catalog_index_enabled()


def code_digest() -> str:
    """A digest of the modules that read catalogs (an index made by other code is not used); "" when their sources
    cannot be read (no index is then written or used)."""
    global _code_digest
    if _code_digest is None:
        h = hashlib.sha256(str(INDEX_FORMAT).encode())
        pkg = Path(__file__).resolve().parents[2]  # ckptfs/
        try:
            sources = sorted([*(pkg / "readers" / "cerebras").glob("*.py"), *(pkg / "readers").glob("*.py"),
                              *(pkg / "catalog").glob("*.py"), pkg / "dtypes.py", pkg / "tensor" / "base.py",
                              pkg / "tensor" / "regions.py"])
            for p in sources:
                h.update(str(p.relative_to(pkg)).encode() + b"\0" + p.read_bytes())
            _code_digest = h.hexdigest()[:32] if len(sources) > 3 else ""
        except OSError:
            _code_digest = ""
    return _code_digest


def index_name(real: str) -> str:
    """The file name of the index of the checkpoint at real path ``real`` (one file per checkpoint path)."""
    return hashlib.sha256(real.encode("utf-8", "surrogatepass")).hexdigest()[:40] + ".json"


def index_path(cache: Path, real: str) -> Path:
    """Where the index of the checkpoint at real path ``real`` is kept."""
    return Path(cache) / FOLDER / index_name(real)


def name_belongs(name: str, key: str) -> bool:
    """Whether dataset ``name`` can hold a tensor of key ``key``: cstorch stores a key's objects as the dataset of
    the key itself or of its sub-keys (``key.0`` for a nested object's payload)."""
    return name == key or name.startswith(key + ".")


def _identity_dict(ident: FileIdentity) -> dict:
    return {"dev": ident.dev, "ino": ident.ino, "size": ident.size, "mtime_ns": ident.mtime_ns,
            "ctime_ns": ident.ctime_ns}


# ---- writing ----------------------------------------------------------------------------------------------------


def _value_ok(v) -> bool:
    return v is None or type(v) in (bool, int, float, str)


def _leaf_record(leaf: Leaf, store) -> dict:
    if type(leaf) is TensorLeaf:
        t = leaf.tensor
        if type(t) is H5DatasetTensor and t.store is store:
            return {"t": "h5", "key": leaf.key, "numpy": bool(leaf.numpy), "name": t.name, "tkey": t.key,
                    "shape": list(t.shape), "dtype": t.dtype.name,
                    "chunks": None if t._chunks is None else list(t._chunks)}
        if type(t) is FullTensor and _value_ok(t.fill):
            return {"t": "full", "key": leaf.key, "numpy": bool(leaf.numpy), "shape": list(t.shape),
                    "dtype": t.dtype.name, "fill": t.fill}
        raise _NotIndexable(f"tensor {type(t).__name__}")
    if type(leaf) is ValueLeaf and _value_ok(leaf.value):
        return {"t": "value", "key": leaf.key, "v": leaf.value}
    if type(leaf) is OpaqueLeaf:
        return {"t": "opaque", "key": leaf.key, "data": base64.b64encode(leaf.data).decode("ascii"),
                "reason": leaf.reason}
    # an unreadable leaf may be one that refers to another file, missing or refused now and there later
    raise _NotIndexable(type(leaf).__name__)


def _node_record(node, ids: dict):
    if isinstance(node, Leaf):
        i = ids.get(id(node))
        if i is None:
            raise _NotIndexable("a leaf in the tree that no key names")
        return i
    if type(node) is not Container or node.kind not in _CONTAINER_KINDS:
        raise _NotIndexable(type(node).__name__)
    if node.keys is not None and any(type(k) not in (str, int) for k in node.keys):
        raise _NotIndexable("container keys other than str and int")
    return {"c": node.kind, "k": node.keys, "x": _extra_record(node.extra),
            "ch": [_node_record(c, ids) for c in node.children]}


def _extra_record(extra: dict) -> dict:
    """A container's ``extra`` (``ckptfs.catalog.pytree``): scalars, and a namedtuple's ``fields`` as a tuple of str."""
    out = {}
    for k, v in extra.items():
        if k == "fields" and type(v) is tuple and all(type(x) is str for x in v):
            v = list(v)
        elif not (v is None or type(v) in (bool, int, str)):
            raise _NotIndexable(f"container extra {k!r}")
        out[k] = v
    return out


def records(ckpt: Checkpoint, store):
    """The index's lines after its header, as JSON-able values, one at a time (a 100,000-key catalog is never held
    twice in memory): a ``["leaf", record]`` per distinct leaf, a ``["key", key, leaf number]`` per key, then
    ``["root", tree]``; ``_NotIndexable`` for a leaf or container an index does not keep (``plain_file`` first)."""
    ids: dict = {}
    for key, leaf in ckpt.leaves.items():
        i = ids.get(id(leaf))
        if i is None:
            i = ids[id(leaf)] = len(ids)
            yield ["leaf", _leaf_record(leaf, store)]
        yield ["key", key, i]
    yield ["root", _node_record(ckpt.root, ids)]


def plain_file(ckpt: Checkpoint) -> bool:
    """Whether the file can be indexed at all (a complete format 0.5 file), before any leaf is looked at."""
    return ckpt.format_version >= 0.5 and ckpt.success is True


def _header(real: str, identity: FileIdentity, ckpt: Checkpoint) -> dict:
    return {"ckptfs": KIND, "index_format": INDEX_FORMAT, "code": code_digest(), "path": real,
            "identity": _identity_dict(identity), "format_version": ckpt.format_version, "release": ckpt.release,
            "warnings": list(ckpt.warnings), "links": ckpt.links}


def save(cache: Path, real: str, identity: FileIdentity, ckpt: Checkpoint, store) -> bool:
    """Write the index of ``ckpt`` (read from the file at real path ``real``, version ``identity``): one JSON value
    per line, the header first. False when the catalog is not indexable, the index would exceed ``MAX_INDEX_BYTES``,
    or the cache directory cannot be written or is not the user's own (an index is an optimisation)."""
    if not code_digest() or not plain_file(ckpt):
        return False  # nothing written: a legacy or partial file costs no I/O here
    folder = StateDir.open(cache, FOLDER)
    if folder is None:
        return False
    name = index_name(real)
    with folder:
        try:
            ok = folder.write(name, _header(real, identity, ckpt), records(ckpt, store), max_bytes=MAX_INDEX_BYTES)
        except _NotIndexable:
            return False
        if ok:
            folder.prune(_NAME, KIND, keep={name}, max_count=MAX_INDEXES, max_bytes=MAX_TOTAL_BYTES)
        return ok


# ---- reading ----------------------------------------------------------------------------------------------------


class _Bad(Exception):
    """The index does not hold what an index holds."""


def _int_list(v, what: str) -> tuple:
    if type(v) is not list or any(type(n) is not int or n < 0 for n in v):
        raise _Bad(what)
    return tuple(v)


def _str(v, what: str) -> str:
    if type(v) is not str:
        raise _Bad(what)
    return v


def _dtype(name):
    try:
        return dtypes.by_name(_str(name, "dtype"))
    except KeyError:
        raise _Bad(f"dtype {name!r}") from None


def _leaf(rec, store) -> Leaf:
    if type(rec) is not dict:
        raise _Bad("leaf")
    kind, key = rec.get("t"), _str(rec.get("key"), "key")
    if kind in ("h5", "full"):
        shape, dt = _int_list(rec.get("shape"), "shape"), _dtype(rec.get("dtype"))
        if shape_problem(shape, dt.itemsize):
            raise _Bad("shape")
        if kind == "h5":
            if not name_belongs(_str(rec.get("name"), "name"), key):
                raise _Bad(f"dataset {rec.get('name')!r} for key {key!r}")
            chunks = rec.get("chunks")
            chunks = None if chunks is None else _int_list(chunks, "chunks")
            tensor = H5DatasetTensor(store, _str(rec.get("name"), "name"), _str(rec.get("tkey"), "tensor key"),
                                     shape, dt, chunks=chunks)
        else:
            fill = rec.get("fill")
            if not _value_ok(fill):
                raise _Bad("fill")
            tensor = FullTensor(shape, dt, fill)
        return TensorLeaf(key, tensor, numpy=rec.get("numpy") is True)
    if kind == "value":
        v = rec.get("v")
        if not _value_ok(v):
            raise _Bad("value")
        return ValueLeaf(key, v)
    if kind == "opaque":
        try:
            data = base64.b64decode(_str(rec.get("data"), "data"), validate=True)
        except ValueError:
            raise _Bad("opaque data") from None
        return OpaqueLeaf(key, data, _str(rec.get("reason"), "reason"))
    raise _Bad(f"leaf kind {kind!r}")


def _node(rec, leaves: list, depth: int = 0):
    if depth > 10_000:
        raise _Bad("nesting")
    if type(rec) is int:
        if not 0 <= rec < len(leaves):
            raise _Bad("leaf number")
        return leaves[rec]
    if type(rec) is not dict or rec.get("c") not in _CONTAINER_KINDS or type(rec.get("ch")) is not list:
        raise _Bad("container")
    keys, extra = rec.get("k"), rec.get("x")
    if keys is not None and (type(keys) is not list or len(keys) != len(rec["ch"])
                             or any(type(k) not in (str, int) for k in keys)):
        raise _Bad("container keys")
    if type(extra) is not dict:
        raise _Bad("container extra")
    for k, v in extra.items():
        if k == "fields" and type(v) is list and all(type(x) is str for x in v):
            extra[k] = tuple(v)
        elif not (v is None or type(v) in (bool, int, str)):
            raise _Bad("container extra")
    return Container(rec["c"], keys, [_node(c, leaves, depth + 1) for c in rec["ch"]], extra)


def _check_header(doc, real: str, identity: FileIdentity) -> dict:
    """The header line, if the index is this index format and code, for this path and file version (else ``_Bad``)."""
    if (type(doc) is not dict or doc.get("ckptfs") != KIND or doc.get("index_format") != INDEX_FORMAT or doc.get("code") != code_digest()
            or doc.get("path") != real or doc.get("identity") != _identity_dict(identity)):
        raise _Bad("another file, version or code")
    fv, release, warnings, links = doc.get("format_version"), doc.get("release"), doc.get("warnings"), doc.get("links")
    if type(fv) not in (int, float) or not math.isfinite(fv) or fv < 0.5:
        raise _Bad("format version")
    if release is not None:
        _str(release, "release")
    if type(warnings) is not list or any(type(w) is not str for w in warnings):
        raise _Bad("warnings")
    if type(links) is not dict or any(type(v) is not str for v in links.values()):
        raise _Bad("links")
    return doc


def decode(values, real: str, identity: FileIdentity, path: Path, store) -> Checkpoint:
    """The ``Checkpoint`` an index's values (its lines, parsed) describe (``_Bad`` if they do not, or describe
    another file or version); tensors read through ``store``."""
    it = iter(values)
    head = _check_header(next(it, None), real, identity)
    made: list = []
    leaves: dict = {}
    root = None
    for rec in it:
        if root is not None:
            raise _Bad("lines after the root")
        if type(rec) is not list or not rec:
            raise _Bad("line")
        if rec[0] == "leaf" and len(rec) == 2:
            made.append(_leaf(rec[1], store))
        elif rec[0] == "key" and len(rec) == 3:
            key, i = rec[1], rec[2]
            if type(key) is not str or type(i) is not int or not 0 <= i < len(made) or key in leaves:
                raise _Bad("key")
            leaves[key] = made[i]
        elif rec[0] == "root" and len(rec) == 2:
            root = _node(rec[1], made)
        else:
            raise _Bad("line")
    if root is None:
        raise _Bad("no root: the index is cut short")
    return Checkpoint(path=path, format_version=float(head["format_version"]), release=head["release"], success=True,
                      root=root, leaves=leaves, links=dict(head["links"]), warnings=list(head["warnings"]))


def load(cache: Path, real: str, identity: FileIdentity, path: Path, store) -> Checkpoint | None:
    """The catalog indexed for the file at real path ``real`` in version ``identity``, tensors reading through
    ``store``; None when there is no usable index (missing, not the user's own, unsealed, another version or code,
    not an index)."""
    if not code_digest():
        return None
    folder = StateDir.open(cache, FOLDER, create=False)
    if folder is None:
        return None
    with folder:
        try:
            return decode(folder.read(index_name(real), KIND, MAX_INDEX_BYTES), real, identity, path, store)
        except (StateFileError, _Bad, KeyError, TypeError, ValueError, RecursionError):
            return None
