"""tensors/ names for any key (issue 16): escaped per component (NUL, "/", "%", ".", "..", empty, over 255 bytes),
collisions after escaping resolved deterministically with every tensor reachable and README.txt naming each move."""
from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import ckptfs
from ckptfs.views.tensors import NAME_MAX, escape_component, plan_paths
from helpers.untrusted import craft_names


def _ok_name(name: str) -> bool:
    raw = name.encode("utf-8", "surrogatepass")
    return 0 < len(raw) <= NAME_MAX and b"/" not in raw and b"\0" not in raw and name not in (".", "..")


@settings(max_examples=300)
@given(st.lists(st.lists(st.sampled_from(list("ab.%/@~\0é") + ["x" * 200]), max_size=6).map("".join), min_size=1,
                max_size=12, unique=True))
def test_every_key_gets_its_own_valid_path(keys):
    paths, notes = plan_paths([(k, ".npy") for k in keys])
    assert sorted(paths) == sorted(keys)
    assert len(set(paths.values())) == len(keys)  # nobody hidden
    for path in paths.values():
        assert all(_ok_name(p) for p in path.split("/")), path
    assert plan_paths([(k, ".npy") for k in keys]) == (paths, notes)  # deterministic


def test_escaping_is_one_to_one_on_ordinary_components():
    comps = ["a", "%", "%25", "/", "%2F", "\0", "%00", "", ".", "..", "%2E", "a.b"]
    assert len({escape_component(c) for c in comps}) == len(comps)


def test_crafted_names_all_reachable_with_notes(tmp_path):
    ckpt = craft_names(tmp_path / "ck")
    tree = ckptfs.open(ckpt, views="tensors")
    try:
        from ckptfs.readers import open_checkpoint

        served = {tree.lookup(p).file.name: p for p in tree.file_paths() if p.startswith("tensors/")}
        with open_checkpoint(ckpt) as c:
            leaves = c.tensors()
            assert sorted(served) == sorted(leaves)
            for key, path in served.items():
                assert all(_ok_name(p) for p in path.split("/")), path
                arr = np.load(io.BytesIO(tree.read(path, 0, tree.attr(path).size)))
                assert arr.tobytes() == leaves[key].tensor.read_all().tobytes(), key
        readme = tree.read("README.txt", 0, 1 << 20).decode()
        for key in ("model.tied", "fu\0ll" + "F" * 300, "model." + "D" * 300 + ".leaf"):
            assert f"key {key!r}" in readme and served[key][len("tensors/"):] in readme, key
    finally:
        tree.close()
