"""The cs view past HDF5's attribute limit (issue 16): missing with a clear reason before anything is built,
never an error on the first stat (EINVAL through FUSE); the other views mount as usual."""
from __future__ import annotations

import ckptfs
import ckptfs.views.cs as cs_view
from helpers import FIXTURES


def test_too_many_keys_for_the_cs_view_is_a_clear_reason(monkeypatch):
    monkeypatch.setattr(cs_view, "MAX_KEYS", 5)  # the llama fixture has 22 keys
    tree = ckptfs.open(FIXTURES / "llama" / "cs" / "checkpoint.mdl")
    try:
        readme = tree.read("README.txt", 0, 1 << 20).decode()
        line = next(ln for ln in readme.splitlines() if ln.strip().startswith("cs/"))
        assert "missing" in line and "22 keys" in line and "more than the 5" in line, line
        assert "cs" not in tree.listdir("") and "config.json" in tree.listdir("") and "torch" in tree.listdir("")
    finally:
        tree.close()


def test_the_limit_is_hdf5s():
    assert cs_view.MAX_KEYS + 4 == 65_535
    assert "65,531" in cs_view.too_many_keys("checkpoint", 100_003) and "100,003" in cs_view.too_many_keys("c", 100_003)
