"""The catalog index (``ckptfs.readers.cerebras.catalog_cache``): a checkpoint opened again reads its catalog from the index
— the same catalog, the same bytes in every view — and only for the exact file version and code it was made from."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from ckptfs import env
from ckptfs.errors import CheckpointError
from ckptfs.readers.cerebras import catalog_cache as catalog_index
from ckptfs.readers import open_checkpoint
from ckptfs.readers import open as open_mod
from ckptfs.catalog.model import Container, Leaf, OpaqueLeaf, TensorLeaf, UnreadableLeaf, ValueLeaf
from ckptfs.tensor.regions import FullTensor
from ckptfs.readers.cerebras.dataset_tensor import H5DatasetTensor
from helpers import needs_fuse, real_env
from helpers.fuse import mounted_server

FIX = Path(__file__).parent.parent / "fixtures"
ALL_MDL = sorted(FIX.glob("**/*.mdl"))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("CKPTFS_CACHE_DIR", str(d))
    monkeypatch.delenv(env.CATALOG_INDEX, raising=False)
    return d


@pytest.fixture
def hdf5_opens(monkeypatch) -> list:
    """Every HDF5 open of a checkpoint by ``open_checkpoint`` itself (the catalog read)."""
    seen: list = []
    real = open_mod.open_h5

    def spy(path, *a, **k):
        seen.append(Path(path))
        return real(path, *a, **k)

    monkeypatch.setattr(open_mod, "open_h5", spy)
    return seen


def _leaf_facts(leaf: Leaf) -> tuple:
    if isinstance(leaf, TensorLeaf):
        t = leaf.tensor
        if isinstance(t, H5DatasetTensor):
            return ("h5", leaf.key, leaf.numpy, t.name, t.key, t.shape, t.dtype.name, t._chunks)
        if isinstance(t, FullTensor):
            return ("full", leaf.key, leaf.numpy, t.shape, t.dtype.name, repr(t.fill))
        return ("tensor", leaf.key, type(t).__name__)
    if isinstance(leaf, ValueLeaf):
        return ("value", leaf.key, type(leaf.value).__name__, repr(leaf.value))
    if isinstance(leaf, OpaqueLeaf):
        return ("opaque", leaf.key, leaf.data, leaf.reason)
    if isinstance(leaf, UnreadableLeaf):
        return ("unreadable", leaf.key, leaf.reason, leaf.shape, leaf.dtype)
    return (type(leaf).__name__, leaf.key)


def _tree_facts(node, ids: dict):
    if isinstance(node, Leaf):
        return ("leaf", ids.setdefault(id(node), len(ids)), _leaf_facts(node))
    assert isinstance(node, Container)
    return (node.kind, None if node.keys is None else [(type(k).__name__, k) for k in node.keys],
            sorted((k, repr(v), type(v).__name__) for k, v in node.extra.items()),
            [_tree_facts(c, ids) for c in node.children])


def catalog_facts(ckpt) -> tuple:
    """Everything a catalog says, leaf sharing (links) included, as plain comparable values."""
    ids: dict = {}
    keys = [(k, ids.setdefault(id(v), len(ids)), _leaf_facts(v)) for k, v in ckpt.leaves.items()]
    return (ckpt.format_version, ckpt.release, ckpt.success, list(ckpt.warnings), dict(ckpt.links), keys,
            _tree_facts(ckpt.root, ids))


@pytest.mark.parametrize("mdl", ALL_MDL, ids=[str(p.relative_to(FIX)) for p in ALL_MDL])
def test_every_fixture_reopens_from_its_index_with_the_same_catalog(mdl, cache, hdf5_opens):
    index = catalog_index.index_path(cache, os.path.realpath(mdl))
    try:
        with open_checkpoint(mdl) as first:
            facts = catalog_facts(first)
    except CheckpointError as e:  # a fixture that must fail keeps failing the same way, read from the file
        assert not index.exists()
        hdf5_opens.clear()
        with pytest.raises(CheckpointError) as again:
            open_checkpoint(mdl)
        assert str(again.value) == str(e) and hdf5_opens == [mdl]
        return
    hdf5_opens.clear()
    with open_checkpoint(mdl) as again:
        assert catalog_facts(again) == facts
    assert hdf5_opens == ([] if index.exists() else [mdl])


def _plain(ckpt, mdl: Path) -> bool:
    """What an index keeps: a complete format 0.5 file whose leaves are datasets of the file itself, constants,
    values or opaque bytes."""
    def own(leaf):
        t = leaf.tensor
        return isinstance(t, FullTensor) or (isinstance(t, H5DatasetTensor) and os.path.samefile(t.store.path, mdl))

    return ckpt.format_version >= 0.5 and ckpt.success and all(
        isinstance(v, (ValueLeaf, OpaqueLeaf)) or (isinstance(v, TensorLeaf) and own(v)) for v in ckpt.leaves.values())


def test_plain_catalogs_are_indexed_and_others_are_not(cache):
    """Exactly the plain catalogs are indexed: not legacy formats, not files whose tensors live in other files, not
    files with an unreadable leaf (a reference missing or refused now may be there later)."""
    indexed, plain, why_not = set(), set(), []
    for mdl in ALL_MDL:
        try:
            with open_checkpoint(mdl) as ck:
                if _plain(ck, mdl):
                    plain.add(mdl)
                else:
                    unreadable = any(isinstance(v, UnreadableLeaf) for v in ck.leaves.values())
                    why_not.append((ck.format_version >= 0.5, unreadable))
        except CheckpointError:
            continue
        if catalog_index.index_path(cache, os.path.realpath(mdl)).exists():
            indexed.add(mdl)
    assert indexed == plain and len(plain) > 60
    assert (True, True) in why_not and (False, False) in why_not  # both exclusions are exercised
    refer_elsewhere = {FIX / "cstorch_edge_cases" / "external" / n for n in ("ext.mdl", "from_st.mdl")}
    assert refer_elsewhere <= set(ALL_MDL) and not refer_elsewhere & indexed


@pytest.mark.parametrize("family", ["llama", "gpt2", "lora_llama", "t5", "cstorch_edge_cases", "tied_and_scalars"])
def test_a_tree_from_the_index_serves_the_same_bytes(family, cache, monkeypatch):
    from ckptfs.views.options import MountOptions
    from ckptfs.tree.assemble import build_tree

    mdl = next((FIX / family).glob("**/*.mdl"))
    monkeypatch.setenv(env.CATALOG_INDEX, "0")
    plain = build_tree(mdl, MountOptions())
    monkeypatch.delenv(env.CATALOG_INDEX)
    build_tree(mdl, MountOptions()).close()  # writes the index
    assert catalog_index.index_path(cache, os.path.realpath(mdl)).exists()
    indexed = build_tree(mdl, MountOptions())
    try:
        paths = plain.file_paths()
        assert indexed.file_paths() == paths and len(paths) > 3
        for p in paths:
            a, b = plain.lookup(p), indexed.lookup(p)
            assert a.size == b.size, p
            assert indexed.read(b, 0, b.size) == plain.read(a, 0, a.size), p
    finally:
        plain.close()
        indexed.close()


def _copy(tmp_path: Path, family: str = "llama") -> Path:
    src = next((FIX / family).glob("**/*.mdl"))
    dst = tmp_path / "ck" / "checkpoint.mdl"
    dst.parent.mkdir()
    shutil.copy2(src, dst)
    for extra in src.parent.glob("*.yaml"):
        shutil.copy2(extra, dst.parent / extra.name)
    return dst


def test_a_changed_file_is_read_again_and_indexed_again(tmp_path, cache, hdf5_opens):
    mdl = _copy(tmp_path)
    open_checkpoint(mdl).close()
    index = catalog_index.index_path(cache, os.path.realpath(mdl))
    before = _lines(index)[0]["identity"]
    st = os.stat(mdl)
    os.utime(mdl, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # same bytes, another version of the file
    hdf5_opens.clear()
    open_checkpoint(mdl).close()
    assert hdf5_opens == [mdl]
    assert _lines(index)[0]["identity"] != before
    hdf5_opens.clear()
    open_checkpoint(mdl).close()
    assert hdf5_opens == []


def _lines(index: Path) -> list:
    return [json.loads(x) for x in index.read_bytes().splitlines()]


def _write_lines(index: Path, values: list) -> None:
    index.write_bytes(b"".join(json.dumps(v).encode() + b"\n" for v in values))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "cut before the root", "other code", "other path",
                                    "bad dtype", "bad leaf number", "negative shape", "line after the root"])
def test_an_index_that_is_not_exactly_right_is_not_used(damage, tmp_path, cache, hdf5_opens):
    mdl = _copy(tmp_path)
    with open_checkpoint(mdl) as ck:
        facts = catalog_facts(ck)
    index = catalog_index.index_path(cache, os.path.realpath(mdl))
    raw = index.read_bytes()
    lines = _lines(index)
    head = lines[0]
    h5 = next(rec[1] for rec in lines[1:] if rec[0] == "leaf" and rec[1]["t"] == "h5")
    key = next(rec for rec in lines[1:] if rec[0] == "key")
    if damage == "garbage":
        index.write_bytes(b"\x00not json")
    elif damage == "truncated":
        index.write_bytes(raw[: len(raw) // 2])
    else:
        if damage == "cut before the root":
            lines = lines[:-1]
        elif damage == "other code":
            head["code"] = "0" * 32
        elif damage == "other path":
            head["path"] = str(tmp_path / "elsewhere.mdl")
        elif damage == "bad dtype":
            h5["dtype"] = "float128x"
        elif damage == "bad leaf number":
            key[2] = 10**6
        elif damage == "negative shape":
            h5["shape"] = [-1, 4]
        elif damage == "line after the root":
            lines.append(["key", "extra", 0])
        _write_lines(index, lines)
    hdf5_opens.clear()
    with open_checkpoint(mdl) as ck:
        assert catalog_facts(ck) == facts
    assert hdf5_opens == [mdl]  # read from the file, and indexed again
    assert index.read_bytes() == raw


def test_a_file_changed_after_the_index_was_read_fails_its_reads(tmp_path, cache):
    """The index is checked against the file when opened; the file is opened by the first tensor read, which checks
    the version again (as every read of a mounted checkpoint does): never bytes of another version."""
    from ckptfs.errors import TensorReadError

    mdl = _copy(tmp_path)
    open_checkpoint(mdl).close()
    with open_checkpoint(mdl) as ck:
        t = next(leaf.tensor for leaf in ck.tensors().values() if isinstance(leaf.tensor, H5DatasetTensor))
        data = mdl.read_bytes()
        os.unlink(mdl)
        mdl.write_bytes(data)  # the same bytes in another file
        with pytest.raises(TensorReadError, match="changed|replaced"):
            t.read_bytes(0, t.nbytes)


def test_no_index_with_allow_external_or_when_turned_off(tmp_path, cache, monkeypatch, hdf5_opens):
    mdl = _copy(tmp_path)
    open_checkpoint(mdl, allow_external=[tmp_path]).close()
    index = catalog_index.index_path(cache, os.path.realpath(mdl))
    assert not index.exists()
    monkeypatch.setenv(env.CATALOG_INDEX, "0")
    open_checkpoint(mdl).close()
    assert not index.exists()
    monkeypatch.delenv(env.CATALOG_INDEX)
    open_checkpoint(mdl).close()
    assert index.exists()
    hdf5_opens.clear()
    open_checkpoint(mdl, allow_external=[tmp_path]).close()  # refers elsewhere maybe: read, confined, every time
    assert hdf5_opens == [mdl]


def test_an_unwritable_cache_directory_only_costs_the_index(tmp_path, monkeypatch, hdf5_opens):
    mdl = _copy(tmp_path)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("CKPTFS_CACHE_DIR", str(blocker))
    for _ in range(2):
        with open_checkpoint(mdl) as ck:
            assert ck.tensors()
    assert hdf5_opens == [mdl, mdl]


def test_indexes_are_private_to_the_user(tmp_path, cache):
    mdl = _copy(tmp_path)
    open_checkpoint(mdl).close()
    index = catalog_index.index_path(cache, os.path.realpath(mdl))
    assert index.stat().st_mode & 0o077 == 0 and index.parent.stat().st_mode & 0o077 == 0


def test_the_indexes_kept_are_bounded_newest_first(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(catalog_index, "MAX_INDEXES", 2)
    src = next((FIX / "llama").glob("**/*.mdl"))
    made = []
    for i in range(4):
        d = tmp_path / f"ck{i}"
        d.mkdir()
        shutil.copy2(src, d / "checkpoint.mdl")
        open_checkpoint(d / "checkpoint.mdl").close()
        made.append(catalog_index.index_path(cache, os.path.realpath(d / "checkpoint.mdl")))
        os.utime(made[-1], ns=(i * 10**9, i * 10**9))  # written in this order
    assert [p.exists() for p in made] == [False, False, True, True]


def test_a_writer_killed_mid_way_leaves_nothing_for_long(tmp_path, cache):
    mdl = _copy(tmp_path)
    folder = cache / "catalogs"
    folder.mkdir(parents=True, mode=0o700)
    old, new = folder / ".tmp-00000000000000aa", folder / ".tmp-00000000000000bb"
    foreign = folder / ".tmp-00000000000000cc"  # readable by others: not a temporary file ckptfs made
    for p in (old, new, foreign):
        p.write_text("half an index")
        os.chmod(p, 0o600)
    os.chmod(foreign, 0o644)
    os.utime(old, (0, 0))
    os.utime(foreign, (0, 0))
    open_checkpoint(mdl).close()
    assert not old.exists() and new.exists()  # another writer may still be writing the new one
    assert foreign.exists()


def _open_fds_on(pid: int, path: Path) -> int:
    real = os.path.realpath(path)
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}") == real
        except OSError:
            continue
    return n


@needs_fuse
def test_mounting_again_serves_the_same_files_from_the_index(tmp_path):
    """As a user would: ``ckptfs mount`` a checkpoint, unmount, mount it again. The second server builds its tree
    from the index without opening the checkpoint (it opens it for the first tensor read) and serves every file
    byte for byte as the first did."""
    mdl = _copy(tmp_path)
    env = real_env(CKPTFS_CACHE_DIR=str(tmp_path / "cache"))

    def everything(mnt: Path) -> dict:
        return {str(p.relative_to(mnt)): p.read_bytes() for p in sorted(mnt.rglob("*")) if p.is_file()}

    with mounted_server(mdl, env=env) as srv:
        first = everything(srv.mnt)
    assert catalog_index.index_path(tmp_path / "cache", os.path.realpath(mdl)).exists()
    with mounted_server(mdl, env=env) as srv:
        assert (srv.mnt / "README.txt").read_bytes() == first["README.txt"]
        assert (srv.mnt / "config.json").read_bytes() == first["config.json"]
        assert _open_fds_on(srv.proc.pid, mdl) == 0  # the tree came from the index
        again = everything(srv.mnt)
        assert _open_fds_on(srv.proc.pid, mdl) >= 1  # tensor reads opened the file
    assert again == first and any(k.endswith(".safetensors") for k in first) and len(first) > 10
