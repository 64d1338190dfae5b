"""ckptfs's own files between runs are trusted only when they are the user's own (issue 31, attacks 5-7): a shared
cache directory where someone else could plant or swap a catalog index, an index edited by hand, a cache folder that
is a link to the user's own files (pruning must not delete them), a CRC cache that outlives a rewrite of its
checkpoint with the size and mtime restored."""
from __future__ import annotations

import json
import os
import shutil
import zipfile
from io import BytesIO
from pathlib import Path

import pytest

import ckptfs
from ckptfs import env as ckptfs_env
from ckptfs.readers.cerebras import catalog_cache as catalog_index
from ckptfs.readers import open_checkpoint
from helpers import FIXTURES, real_env as _real_env, run_ckptfs

LLAMA = FIXTURES / "llama" / "cs"
Q0 = "model.transformer_decoder.layers.0.self_attn.proj_q_dense_layer.weight"
Q1 = "model.transformer_decoder.layers.1.self_attn.proj_q_dense_layer.weight"
OTHER_UID = 65534  # nobody


def real_env(**extra) -> dict:
    env = _real_env(**extra)
    env.pop(ckptfs_env.CATALOG_INDEX, None)
    return env


def copy_llama(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(LLAMA / "params.yaml", folder / "params.yaml")
    return Path(shutil.copy(LLAMA / "checkpoint.mdl", folder / "checkpoint.mdl"))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("CKPTFS_CACHE_DIR", str(d))
    monkeypatch.delenv(ckptfs_env.CATALOG_INDEX, raising=False)
    return d


def doctor(index: Path, how: str) -> None:
    """Edit an index as an attacker would: swap the datasets of layer 0's and layer 1's q_proj, or turn layer 0's
    q_proj into a constant fill. Every other line (the seal included) is kept as it is."""
    lines = index.read_bytes().splitlines()
    for i, raw in enumerate(lines):
        rec = json.loads(raw)
        if not (isinstance(rec, list) and rec[0] == "leaf" and rec[1].get("t") == "h5"):
            continue
        leaf = rec[1]
        if how == "swap" and leaf["key"] in (Q0, Q1):
            leaf["name"] = Q1 if leaf["name"] == Q0 else Q0
        elif how == "fill" and leaf["key"] == Q0:
            rec[1] = {"t": "full", "key": Q0, "numpy": False, "shape": leaf["shape"], "dtype": leaf["dtype"],
                      "fill": 0.0}
        lines[i] = json.dumps(rec).encode()
    index.write_bytes(b"".join(x + b"\n" for x in lines))


def tensor_bytes(mdl: Path, key: str) -> bytes:
    with open_checkpoint(mdl) as ck:
        t = ck.leaves[key].tensor
        return t.read_bytes(0, t.nbytes)


# -- attack 5: a catalog index someone else wrote, or one edited by hand --------------------------------------------


@pytest.mark.slow  # runs the CLI
def test_an_index_planted_in_a_shared_cache_is_not_served(tmp_path):
    """A shared CKPTFS_CACHE_DIR: another user creates ``catalogs/`` world-writable before the victim's first mount,
    then renames a doctored index over the victim's. The victim's next export must serve the checkpoint's own
    bytes, not layer 1's q_proj as layer 0's."""
    mdl = copy_llama(tmp_path / "ck")
    cache = tmp_path / "shared"
    (cache / "catalogs").mkdir(parents=True)
    os.chmod(cache, 0o755)
    os.chmod(cache / "catalogs", 0o777)  # made by the other user, for everyone
    env = real_env(CKPTFS_CACHE_DIR=str(cache))
    first = run_ckptfs("export", mdl, "model.safetensors", "-", env=env, check=True).stdout
    index = catalog_index.index_path(cache, os.path.realpath(mdl))
    planted = tmp_path / "planted.json"
    if index.exists():  # the victim's own index: the attacker edits a copy and renames it over
        shutil.copy(index, planted)
    else:  # not written into a folder others can write: the attacker brings one from their own cache
        other = tmp_path / "other-cache"
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("CKPTFS_CACHE_DIR", str(other))
            open_checkpoint(mdl).close()
        shutil.copy(catalog_index.index_path(other, os.path.realpath(mdl)), planted)
    doctor(planted, "swap")
    if os.getuid() == 0:
        os.chown(planted, OTHER_UID, OTHER_UID)
    os.replace(planted, index)
    again = run_ckptfs("export", mdl, "model.safetensors", "-", env=env, check=True)
    assert again.stdout == first
    assert "Traceback" not in again.stderr.decode()


@pytest.mark.parametrize("how", ["swap", "fill"])
def test_an_index_edited_by_hand_is_not_served(tmp_path, cache, how):
    mdl = copy_llama(tmp_path / "ck")
    want = tensor_bytes(mdl, Q0)  # writes the index
    index = catalog_index.index_path(cache, os.path.realpath(mdl))
    assert index.exists()
    doctor(index, how)
    assert tensor_bytes(mdl, Q0) == want


def test_an_index_owned_by_someone_else_or_readable_by_others_is_not_used(tmp_path, cache):
    from ckptfs.readers import open as open_mod

    mdl = copy_llama(tmp_path / "ck")
    open_checkpoint(mdl).close()
    index = catalog_index.index_path(cache, os.path.realpath(mdl))
    opened = []
    real = open_mod.open_h5

    def spy(path, *a, **k):
        opened.append(path)
        return real(path, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(open_mod, "open_h5", spy)
        open_checkpoint(mdl).close()
        assert opened == []  # the index as written is used
        os.chmod(index, 0o644)
        open_checkpoint(mdl).close()
        assert opened == [mdl]  # a readable-by-others file is not one ckptfs wrote
        if os.getuid() == 0:
            os.chmod(index, 0o600)
            os.chown(index, OTHER_UID, OTHER_UID)
            open_checkpoint(mdl).close()
            assert opened == [mdl, mdl]


# -- attack 6: pruning never deletes what is not ckptfs's own -------------------------------------------------------


@pytest.mark.parametrize("link", ["catalogs", "cache"])
def test_pruning_through_a_linked_folder_deletes_nothing_of_the_users(tmp_path, monkeypatch, link):
    mine = tmp_path / "mine" / "catalogs"  # the user's own folder of JSON files
    mine.mkdir(parents=True)
    precious = {f"{n:040x}.json" if n % 2 else f"notes-{n}.json": f'{{"n": {n}}}' for n in range(6)}
    for name, text in precious.items():
        (mine / name).write_text(text)
        os.chmod(mine / name, 0o600)
    cache = tmp_path / "cache"
    if link == "catalogs":
        cache.mkdir(mode=0o700)
        (cache / "catalogs").symlink_to(mine)
    else:
        cache.symlink_to(mine.parent)
    monkeypatch.setenv("CKPTFS_CACHE_DIR", str(cache))
    monkeypatch.setattr(catalog_index, "MAX_INDEXES", 1)
    for i in range(2):
        open_checkpoint(copy_llama(tmp_path / f"ck{i}")).close()
    assert {p.name: p.read_text() for p in mine.iterdir() if p.name in precious} == precious


def test_pruning_keeps_files_it_does_not_recognise_as_its_own(tmp_path, cache, monkeypatch):
    """In ckptfs's own private folder, a file named like an index that is not one stays (however old); ckptfs's own
    indexes beyond the bound go, the least recently written first."""
    monkeypatch.setattr(catalog_index, "MAX_INDEXES", 1)
    mdls = [copy_llama(tmp_path / f"ck{i}") for i in range(3)]
    open_checkpoint(mdls[0]).close()
    folder = cache / "catalogs"
    lookalike = folder / ("ab" * 20 + ".json")
    lookalike.write_text('{"mine": true}\n')
    os.chmod(lookalike, 0o600)
    os.utime(lookalike, ns=(1, 1))
    first = catalog_index.index_path(cache, os.path.realpath(mdls[0]))
    os.utime(first, ns=(0, 0))
    for i, m in enumerate(mdls[1:], 1):
        open_checkpoint(m).close()
        os.utime(catalog_index.index_path(cache, os.path.realpath(m)), ns=(i * 10**9, i * 10**9))
    assert lookalike.read_text() == '{"mine": true}\n'
    assert [catalog_index.index_path(cache, os.path.realpath(m)).exists() for m in mdls] == [False, False, True]


# -- attack 7: persisted CRCs keyed on the checkpoint's full identity ----------------------------------------------


def test_crcs_of_a_checkpoint_rewritten_with_size_and_mtime_restored_are_not_reused(tmp_path, cache):
    from helpers.run import write_copy

    mdl = tmp_path / "ck" / "checkpoint.mdl"
    mdl.parent.mkdir()
    shutil.copy(LLAMA / "params.yaml", mdl.parent / "params.yaml")
    write_copy(mdl, 3)
    other = write_copy(tmp_path / "other.mdl", 5)
    assert mdl.stat().st_size == other.stat().st_size  # the norm weight's fill: same compressed size

    def bin_bytes() -> bytes:
        tree = ckptfs.open(mdl, views="hf", hf_format="bin")
        try:
            return tree.read("pytorch_model.bin", 0, tree.lookup("pytorch_model.bin").size)
        finally:
            tree.close()

    first = bin_bytes()  # CRCs computed while streaming, and persisted
    assert zipfile.ZipFile(BytesIO(first)).testzip() is None
    st = mdl.stat()
    with open(mdl, "r+b") as f:  # rewritten in place: same inode, same size
        f.write(other.read_bytes())
    os.utime(mdl, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the mtime put back
    again = bin_bytes()
    assert again != first
    assert zipfile.ZipFile(BytesIO(again)).testzip() is None  # no stale CRC
