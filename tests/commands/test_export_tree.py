"""``ckptfs export CKPT OUTDIR`` (issue 15): the whole tree as real files — equal to ``cp -r`` of a real FUSE mount,
decoded in parallel, resumable (finished files are not redone), with a tqdm progress bar on a terminal."""
from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

import ckptfs
from ckptfs.commands.export_tree import export_tree
from ckptfs.errors import CkptfsError
from helpers import FIXTURES, needs_fuse, real_env, run_ckptfs
from helpers.fuse import mounted
from helpers.tokens import make_tokenizer

pytestmark = pytest.mark.timeout(600)

LLAMA = FIXTURES / "llama" / "cs" / "checkpoint.mdl"
GPT2 = FIXTURES / "gpt2" / "cs" / "checkpoint.mdl"


def listing(root: Path) -> dict:
    """{relative path: bytes} of every file, and the directories (value None)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        out[rel] = None if p.is_dir() else p.read_bytes()
    return out


class CountingTree:
    """A tree whose reads are counted per path (and that can fail after a number of reads)."""

    def __init__(self, tree, fail_after: int | None = None):
        self.tree, self.fail_after, self.reads = tree, fail_after, {}

    def read(self, entry, offset, n):
        if self.fail_after is not None and sum(self.reads.values()) >= self.fail_after:
            raise CkptfsError("/" + entry.path, "simulated failure")
        self.reads[entry.path] = self.reads.get(entry.path, 0) + 1
        return self.tree.read(entry, offset, n)

    def __getattr__(self, name):
        return getattr(self.tree, name)


@needs_fuse
@pytest.mark.parametrize("case, args", [("llama", []), ("gpt2", ["--max-shard-size", "20KB", "--views", "hf,torch"])],
                         ids=["llama-all-views", "gpt2-sharded"])
def test_export_equals_cp_r_of_the_mount(case, args, tmp_path):
    ckpt = FIXTURES / case / "cs" / "checkpoint.mdl"
    tok = make_tokenizer(tmp_path / "tok")
    args = [*args, "--overlay", tok]
    with mounted(ckpt, *args, env=real_env()) as mnt:
        r = subprocess.run(["cp", "-r", f"{mnt}/.", str(tmp_path / "copy")], capture_output=True, timeout=300)
        assert r.returncode == 0, r.stderr
    r = run_ckptfs("export", ckpt, tmp_path / "export", *args)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stderr == b""  # no progress bar without a terminal
    copy, export = listing(tmp_path / "copy"), listing(tmp_path / "export")
    assert copy.keys() == export.keys()
    assert [p for p in copy if copy[p] != export[p]] == []
    assert "tokenizer.json" in export and ("bin/pytorch_model.bin" in export or
                                           "bin/pytorch_model.bin.index.json" in export)
    hub = [p for p in export if p.startswith("hub/") and export[p] is not None]
    assert "hub/tokenizer.json" in hub and "hub/config.json" in hub
    for p in hub:  # written once: the repository folder's files are hard links to the root's
        assert (tmp_path / "export" / p).stat().st_ino == (tmp_path / "export" / p[4:]).stat().st_ino, p


def test_parallel_small_blocks_give_the_trees_bytes(tmp_path):
    tree = ckptfs.open(GPT2, max_shard_size="20KB")
    try:
        report = export_tree(tree, tmp_path / "out", threads=4, block=4096)
        want = {p: b"".join(tree.iter_blocks(p)) for p in tree.file_paths()}
    finally:
        tree.close()
    got = {p: b for p, b in listing(tmp_path / "out").items() if b is not None}
    assert got == want and report.files == len(want) and report.kept == 0
    assert not list((tmp_path / "out").rglob("*.part"))


def test_blocks_read_whole_are_not_kept(tmp_path):
    """An export reads every block once: the tree's cache lets each go once read whole (its memory serves the next
    block) and is as before afterwards."""
    tree = ckptfs.open(LLAMA, views=["hf"], hf_format="safetensors")
    try:
        assert tree.cache.size == 0 and not tree.cache.streaming
        report = export_tree(tree, tmp_path / "out", threads=2)
        assert report.bytes > 0
        assert tree.cache.size == 0 and not tree.cache.streaming
        assert (tmp_path / "out" / "model.safetensors").read_bytes() == b"".join(tree.iter_blocks("model.safetensors"))
    finally:
        tree.close()


def test_a_rerun_redoes_only_what_is_not_finished(tmp_path):
    out = tmp_path / "out"
    tree = ckptfs.open(LLAMA)
    try:
        export_tree(tree, out)
        want = {p: b"".join(tree.iter_blocks(p)) for p in tree.file_paths()}
        (out / "config.json").unlink()  # missing
        with open(out / "model.safetensors", "r+b") as f:  # cut short by a crash: wrong size
            f.truncate(100)
        (out / "bin" / "pytorch_model.bin.part").write_bytes(b"stale")  # left by an interrupted run
        os.utime(out / "README.txt", ns=(0, 0))  # not what this export wrote
        inode = (out / "generation_config.json").stat().st_ino
        counting = CountingTree(tree)
        report = export_tree(counting, out)
    finally:
        tree.close()
    assert set(counting.reads) == {"config.json", "model.safetensors", "README.txt"}
    # the other names of the two rewritten files (hub/model.safetensors, hub/config.json, bin/config.json) are
    # linked to the new files again, not read
    assert report.files == 6 and report.kept == len(want) - 6
    assert (out / "hub" / "config.json").stat().st_ino == (out / "bin" / "config.json").stat().st_ino
    assert (out / "generation_config.json").stat().st_ino == inode
    assert (out / "hub" / "model.safetensors").stat().st_ino == (out / "model.safetensors").stat().st_ino
    assert {p: b for p, b in listing(out).items() if b is not None} == want


def test_an_interrupted_export_leaves_no_part_file_and_resumes(tmp_path):
    out = tmp_path / "out"
    tree = ckptfs.open(LLAMA)
    try:
        with pytest.raises(CkptfsError, match="simulated failure"):
            export_tree(CountingTree(tree, fail_after=10), out, threads=1, block=1 << 12)
        assert not list(out.rglob("*.part"))
        done_before = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
        assert done_before, "some files were finished before the failure"
        counting = CountingTree(tree)
        export_tree(counting, out)
        want = {p: b"".join(tree.iter_blocks(p)) for p in tree.file_paths()}
    finally:
        tree.close()
    assert not (set(counting.reads) & done_before)
    assert {p: b for p, b in listing(out).items() if b is not None} == want


@pytest.mark.slow  # runs the CLI
def test_outdir_that_is_a_file_is_a_usage_error(tmp_path):
    (tmp_path / "f").write_text("x")
    r = run_ckptfs("export", LLAMA, tmp_path / "f")
    assert r.returncode == 2 and b"not a directory" in r.stderr


@pytest.mark.slow  # runs the CLI
def test_progress_bar_on_a_terminal(tmp_path):
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "ckptfs", "export", str(LLAMA), str(tmp_path / "out"),
                                 "--views", "hf"], stdout=subprocess.PIPE, stderr=slave, env=real_env())
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(120) == 0
    finally:
        os.close(master)
    shown = b"".join(chunks).decode(errors="replace")
    assert "100%" in shown and "|" in shown  # tqdm's bar
    assert "files written" in shown
