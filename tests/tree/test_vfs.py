"""VirtualTree and build_tree without FUSE: structure, stable inodes, attributes, exact reads, view assembly."""
from __future__ import annotations

import errno
import random
import stat

import pytest

from ckptfs.errors import CheckpointError, CkptfsError, TensorReadError
from ckptfs.views.options import MountOptions
from ckptfs.tree.assemble import SourceInfo, assemble_tree, build_tree, outcome_from, run_builder
from ckptfs.tree.base import VirtualPathError
from ckptfs.tree.virtual import VirtualTree
from ckptfs.views.base import README_NAME, BytesFile, ViewContext, ViewResult
from ckptfs.views.registry import View

from helpers.fuse import FAIL_FROM, FAILING, FIXTURES_CKPT, PatternFile, fake_tree

PATHS = ["b/c/d.bin", "a.txt", "b/x", "b/c/e.bin", "z/y/w/v.bin", "b/a"]


def make(paths=PATHS, seed=0, **kw):
    shuffled = list(paths)
    random.Random(seed).shuffle(shuffled)
    return VirtualTree({p: PatternFile(10 * (i + 1), i) for i, p in enumerate(sorted(shuffled))}, **kw)


def test_inodes_follow_sorted_paths_and_do_not_depend_on_insertion_order():
    t1, t2 = make(seed=1), make(seed=2)
    paths = t1.all_paths()
    assert paths == t2.all_paths()
    assert [t1.lookup(p).ino for p in paths] == [t2.lookup(p).ino for p in paths]
    assert t1.lookup("/").ino == 1
    inos = [t1.lookup(p).ino for p in sorted(paths, key=lambda p: tuple(p.split("/")))]
    assert inos == sorted(inos) and len(set(inos)) == len(inos)
    for p in paths:
        assert t1.entry_by_ino(t1.lookup(p).ino).path == p


def test_directories_are_implied_and_listed_sorted():
    t = make()
    assert t.listdir("/") == ["a.txt", "b", "z"]
    assert t.listdir("b") == ["a", "c", "x"]
    assert t.listdir("/z/y/w/") == ["v.bin"]
    assert t.file_count == len(PATHS)
    with pytest.raises(VirtualPathError) as e:
        t.listdir("a.txt")
    assert e.value.errno == errno.ENOTDIR
    with pytest.raises(VirtualPathError) as e:
        t.lookup("b/nope")
    assert e.value.errno == errno.ENOENT and "/b/nope" in str(e.value)
    with pytest.raises(VirtualPathError):
        t.lookup("b/../a.txt")  # never resolved


def test_attributes():
    t = make(mtime_ns=1_234_567_890_123)
    f = t.attr("b/c/d.bin")
    assert stat.S_ISREG(f.mode) and stat.S_IMODE(f.mode) == 0o444
    assert f.size == 10 * (sorted(PATHS).index("b/c/d.bin") + 1)
    assert f.mtime_ns == 1_234_567_890_123 and f.blksize == 1 << 20 and f.nlink == 1
    d = t.attr("b")
    assert stat.S_ISDIR(d.mode) and stat.S_IMODE(d.mode) == 0o555
    assert d.nlink == 2 + 1  # one subdirectory (c)
    assert t.attr("/").nlink == 2 + 2  # b and z


def test_size_is_fixed_at_construction():
    f = PatternFile(100, 1)
    t = VirtualTree({"f": f})
    f.size = 50
    assert t.attr("f").size == 100
    assert t.read("f", 0, 50) == f.read(0, 50)
    with pytest.raises(TensorReadError):  # the file now yields fewer bytes than its fixed size: an error
        t.read("f", 0, 1000)


def test_reads_are_exact_and_clipped():
    f = PatternFile(1000, 3)
    t = VirtualTree({"d/f": f})
    assert t.read("d/f", 0, 1000) == f.read(0, 1000)
    assert t.read("d/f", 990, 100) == f.read(990, 10)
    assert t.read("d/f", 1000, 10) == b"" and t.read("d/f", 5000, 10) == b""
    assert b"".join(t.iter_blocks("d/f", block=64)) == f.read(0, 1000)
    with pytest.raises(VirtualPathError) as e:
        t.read("d", 0, 1)
    assert e.value.errno == errno.EISDIR


class Short(PatternFile):
    def readinto(self, offset, out, cursor=None):
        return super().readinto(offset, out[:-1])


def test_a_file_returning_the_wrong_length_is_an_error_not_wrong_bytes():
    t = VirtualTree({"s": Short(100, 1)})
    with pytest.raises(TensorReadError, match="/s"):
        t.read("s", 0, 50)


@pytest.mark.parametrize("files", [
    {"a": BytesFile("x"), "a/b": BytesFile("y")},
    {"a/../b": BytesFile("x")},
    {"a/b": BytesFile("x"), "/a//b": BytesFile("y")},
    {"": BytesFile("x")},
    {"a": object()},
])
def test_invalid_trees_are_refused(files):
    with pytest.raises(CkptfsError):
        VirtualTree(files)


def test_empty_directories_can_be_declared():
    t = VirtualTree({"a/f": BytesFile("x")}, dirs=["empty", "a/deeper"])
    assert t.listdir("/") == ["a", "empty"] and t.listdir("empty") == []
    assert t.listdir("a") == ["deeper", "f"]


def test_lookups_stay_exact_across_more_directories_than_a_tree_remembers():
    from ckptfs.tree.virtual import RECENT_DIRS

    paths = [f"d{i % 7}/{i}/w.bin" for i in range(RECENT_DIRS + 300)] + ["d1/x"]
    t = VirtualTree({p: BytesFile(p) for p in paths})
    every = t.all_paths()
    for order in (every, every[::-1], random.Random(3).sample(every, len(every))):
        for p in order:
            e = t.lookup(p)
            assert e.path == p == t.entry_by_ino(e.ino).path and e == t.entry_by_ino(e.ino)
            assert (e.is_dir, t.attr("/" + p + "/").ino) == (p.count("/") < 2 and p != "d1/x", e.ino)
        assert "d1/x/w.bin" not in t and "d0/1/w.bin" not in t and "d1/1/w.bin/x" not in t and "d1/1/w.bin" in t
    assert [t.read(p, 0, 100) for p in paths] == [p.encode() for p in paths]


# ---- assembling views ---------------------------------------------------------------------------------


def test_views_are_placed_under_their_directory_and_readme_explains():
    outcomes = [
        outcome_from("hf", ViewResult(files={"config.json": BytesFile('{"model_type": "llama"}')}, notes=["n1"])),
        outcome_from("tensors", ViewResult(files={"tensors/a/b.npy": PatternFile(8, 1)})),
        outcome_from("cs", CheckpointError("/x.mdl", "cannot upgrade")),
        outcome_from("torch", ViewResult(missing="nothing to write")),
    ]
    info = SourceInfo("/ck/checkpoint.mdl", 0.5, "2.10.0", True, ["a warning"])
    t = assemble_tree(info, outcomes, mtime_ns=5)
    assert set(t.file_paths()) == {"README.txt", "config.json", "tensors/a/b.npy"}
    assert t.listdir("/") == ["README.txt", "config.json", "tensors"]
    readme = t.read(README_NAME, 0, 1 << 20).decode()
    for piece in ["/ck/checkpoint.mdl", "0.5", "2.10.0", "llama", "cs/", "/x.mdl: cannot upgrade",
                  "torch/", "nothing to write", "hf: n1", "a warning", "1 file"]:
        assert piece in readme, piece


def test_fake_tree_through_the_test_hook_respects_views():
    t = fake_tree()
    assert FAILING in t.file_paths()
    assert "cs" not in t  # its builder failed
    readme = t.read(README_NAME, 0, 1 << 20).decode()
    assert "upgrade not possible (synthetic)" in readme and "fakefam" in readme
    only = fake_tree(views=("tensors",))
    assert only.listdir("/") == ["README.txt", "tensors"]
    assert all(p == README_NAME or p.startswith("tensors/") for p in only.file_paths())
    with pytest.raises(TensorReadError):
        t.read(FAILING, FAIL_FROM - 10, 100)
    assert len(t.read(FAILING, 0, FAIL_FROM)) == FAIL_FROM


def _ctx():
    return ViewContext(checkpoint=None, ckpt_path="/nowhere.mdl", stem="nowhere", options=MountOptions())


def test_run_builder_turns_every_failure_into_a_missing_view():
    cs = View("cs", "cs/", "ckptfs.views.cs")

    def raising(exc):
        return lambda ctx: (_ for _ in ()).throw(exc)

    assert run_builder(cs, _ctx(), raising(CheckpointError("/p", "broken thing"))).missing == "/p: broken thing"
    o = run_builder(cs, _ctx(), raising(ZeroDivisionError("oops")))
    assert not o.present and "ZeroDivisionError" in o.missing and "oops" in o.missing
    o = run_builder(cs, _ctx(), lambda ctx: ViewResult(files={"a/../b": BytesFile("x")}))
    assert "invalid file list" in o.missing
    o = run_builder(cs, _ctx(), lambda ctx: {"x": BytesFile("x")})
    assert "builder returned dict" in o.missing
    o = run_builder(View("cs", "cs/", "ckptfs.views.no_such_view"), _ctx())
    assert not o.present and "ModuleNotFoundError" in o.missing


def test_an_unknown_view_name_is_refused_before_anything_is_built():
    from ckptfs.views.options import from_kwargs

    with pytest.raises(ValueError, match="nope"):
        from_kwargs(views="hf,nope")
    t = build_tree(FIXTURES_CKPT, MountOptions(views=("tensors", "nope")))  # given as a tuple: not parsed
    try:
        assert "unknown view" in t.read(README_NAME, 0, 1 << 20).decode()
    finally:
        t.close()


def test_build_tree_refuses_a_bad_checkpoint(tmp_path):
    bad = tmp_path / "garbage.mdl"
    bad.write_bytes(b"not an hdf5 file at all" * 100)
    with pytest.raises(CheckpointError):
        build_tree(bad)
    with pytest.raises(CheckpointError):
        build_tree(tmp_path / "missing.mdl")


def test_build_tree_on_a_real_checkpoint():
    t = build_tree(FIXTURES_CKPT, MountOptions())
    try:
        readme = t.read(README_NAME, 0, 1 << 20).decode()
        assert str(FIXTURES_CKPT.resolve()) in readme and "format version" in readme
        top = t.listdir("/")
        for view in ("hf", "cs", "torch", "tensors"):
            present = "config.json" in top if view == "hf" else view in top
            assert present or f"{view}:" in readme  # present, or explained
        for p in t.file_paths():  # every file's size is exact: reading it all gives exactly size bytes
            assert sum(len(b) for b in t.iter_blocks(p)) == t.attr(p).size
    finally:
        t.close()


def test_content_identity_names_the_file_and_the_options_that_shape_content(tmp_path):
    from ckptfs.tree.assemble import content_identity

    ck = tmp_path / "c.mdl"
    ck.write_bytes(b"x")
    cfg = tmp_path / "p.yaml"
    cfg.write_text("model: {}\n")
    base = content_identity(ck, MountOptions())
    assert base == content_identity(ck, MountOptions())  # stable
    assert str(ck.resolve()) in base
    assert content_identity(ck, MountOptions(config=cfg)) != base
    assert content_identity(ck, MountOptions(model="llama")) != base
    assert content_identity(tmp_path / "missing.mdl", MountOptions()) is None
    ck.write_bytes(b"xy")  # a rewritten checkpoint never reuses old CRCs
    assert content_identity(ck, MountOptions()) != base


def test_deferred_files_are_sized_on_first_use_and_warmed_in_the_background():
    import threading

    from ckptfs.views.base import DeferredFile

    built = threading.Event()
    release = threading.Event()

    def factory():
        release.wait(10)
        built.set()
        return BytesFile(b"0123456789")

    def broken():
        raise TensorReadError("/x.mdl", "cannot lay out")

    warmers_done_at_close = []
    t = VirtualTree({"a/slow.bin": DeferredFile(factory), "bad.bin": DeferredFile(broken), "c": BytesFile(b"c")},
                    closers=[lambda: warmers_done_at_close.append(not any(th.is_alive() for th in warmers))])
    assert t.file_count == 3 and not built.is_set()  # building the tree sized nothing deferred
    t.warm()
    warmers = list(t._warmers)
    assert len(warmers) == 2  # one per deferred file
    release.set()
    assert t.attr("a/slow.bin").size == 10 and built.is_set()
    assert t.read("a/slow.bin", 3, 4) == b"3456"
    with pytest.raises(TensorReadError):  # a failed build is reported on every use, never as a wrong size
        t.attr("bad.bin")
    with pytest.raises(TensorReadError):
        t.read("bad.bin", 0, 1)
    t.close()  # joins the warm-up threads before closing sources
    assert warmers_done_at_close == [True]


def test_a_trees_background_work_starts_with_warm_and_is_stopped_and_waited_for_at_close():
    """A source's background work (``Checkpoint.warm``: an S3 object's chunk indexes) runs once the tree warms, sees
    the tree closing, and is over before the sources close (the closers run after it)."""
    import threading

    from ckptfs.views.base import BytesFile

    order, started = [], threading.Event()

    def work(stopped):
        started.set()
        stopped.wait(30)  # a long job, checking for the tree closing
        order.append("work ended" if stopped.is_set() else "work timed out")

    tree = VirtualTree({"a.txt": BytesFile(b"x")}, background=[work], closers=[lambda: order.append("closed")])
    assert not started.is_set()
    tree.warm()
    assert started.wait(10)
    tree.close()
    assert order == ["work ended", "closed"]
