"""Budgets of parts fetched from S3 are their tree's: two trees in one process keep their own ``--cache-size``, the
checkpoints of a run share the run's remote share, a closed tree's pool holds nothing and its request threads end,
and a process forked from one that read through a pool (a loader's workers) reads through it too. Against the local
endpoint (moto's server on 127.0.0.1)."""
from __future__ import annotations

import os
import threading
import time
import warnings

import pytest

from helpers.s3 import LocalS3, generated_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A generated checkpoint uploaded in Cerebras' S3 layout as two checkpoints of one run: ``(endpoint, run URL,
    local .mdl, params.yaml)``."""
    tmp = tmp_path_factory.mktemp("budgets")
    mdl, params = generated_checkpoint(tmp / "ck", ffn=2048)
    from benchlib import s3 as bench_s3  # importable once generated_checkpoint has put scripts/ on the path

    srv = LocalS3(tmp / "s3")
    try:
        for step in (0, 100):
            bench_s3.upload(srv, mdl, f"run/checkpoint_{step}.mdl")
        yield srv, f"s3://{bench_s3.BUCKET}/run/", mdl, params
    finally:
        srv.stop()


@pytest.fixture
def endpoint(run, monkeypatch, tmp_path):
    """The environment pointed at the endpoint, a cache folder of this test's own, parts of 1 MiB (groups of 4 MiB:
    several fit in a budget of a few MiB)."""
    from ckptfs.storage import s3object

    srv, url, mdl, params = run
    for k, v in srv.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CKPTFS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(s3object, "PART_BYTES", 1 << 20)
    return run


def _held(pool) -> int:
    """Bytes of parts ``pool`` holds that arrived (parts in flight are outside the budget until they arrive)."""
    with pool.lock:
        return sum(size for fut, size in pool.parts.values() if fut.done())


def _streaming(tree) -> None:
    """Reads announced ahead as the FUSE server's are."""
    from ckptfs.fuse import operations as fusefs

    tree.cache.streaming, tree.cache.read_ahead = True, fusefs.SERVER_READ_AHEAD
    tree.cache.announce_ahead = fusefs.SERVER_ANNOUNCE_AHEAD


def _threads_of(pool) -> set:
    alive = {t.ident for t in threading.enumerate()}
    return set(pool.request_threads) & alive


def _wait(predicate, seconds: float = 20) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_two_trees_in_one_process_keep_their_own_budgets(endpoint):
    """A small tree opened first and a large one after it (before, the last tree opened set the budget of all):
    reading both in turn, each pool holds at most its own tree's remote share, the large one more than the small
    one's, and each reads the local checkpoint's bytes."""
    import ckptfs
    from ckptfs.tree.memory import remote_bytes

    srv, url, mdl, params = endpoint
    local = ckptfs.open(mdl, config=str(params)).read("model.safetensors", 0, 1 << 40)
    small = ckptfs.open(url + "checkpoint_0.mdl", config=str(params), cache_size=8 << 20)
    large = ckptfs.open(url + "checkpoint_100.mdl", config=str(params), cache_size=48 << 20)
    try:
        assert small.parts is not large.parts
        assert small.parts.budget == remote_bytes(8 << 20) and large.parts.budget == remote_bytes(48 << 20)
        for tree in (small, large):
            _streaming(tree)
        got = {small: bytearray(), large: bytearray()}
        peak = {small: 0, large: 0}
        for off in range(0, len(local), 1 << 20):
            for tree in (large, small):
                got[tree] += tree.read("model.safetensors", off, 1 << 20)
                for t in (small, large):
                    peak[t] = max(peak[t], _held(t.parts))
                    assert _held(t.parts) <= t.parts.budget, (t is small, _held(t.parts), t.parts.budget)
        assert bytes(got[small]) == local and bytes(got[large]) == local
        assert len(local) > 2 * large.parts.budget  # both had to keep to their budgets
        assert 0 < peak[small] <= small.parts.budget < peak[large] <= large.parts.budget, peak
    finally:
        small.close()
        large.close()


def test_a_runs_checkpoints_share_its_remote_share(endpoint):
    """A run of two checkpoints in S3: each checkpoint's tree built has its own pool, an equal share of the run's
    remote share (the two within it together), and reads within it; a tree closed gives its share back; the run
    closed leaves no pool holding anything."""
    import ckptfs
    from ckptfs.tree.memory import remote_bytes

    srv, url, mdl, params = endpoint
    size = 32 << 20
    share = remote_bytes(size)
    local = ckptfs.open(mdl, config=str(params)).read("model.safetensors", 0, 1 << 40)
    tree = ckptfs.open_run(url, config=str(params), cache_size=size)
    try:
        assert tree.listdir("") == ["README.txt", "latest", "checkpoint_0", "checkpoint_100"]
        assert tree.cache.max_bytes == size - share  # the block cache: the rest, shared by the run's trees
        names = ("checkpoint_0/model.safetensors", "checkpoint_100/model.safetensors")
        assert tree.parts.pools == []  # listing the run builds no checkpoint's tree
        tree.listdir("checkpoint_0")
        assert [p.budget for p in tree.parts.pools] == [share]  # one checkpoint built: all of it
        tree.listdir("checkpoint_100")
        got = {n: bytearray() for n in names}
        peak = 0
        for off in range(0, len(local), 1 << 20):
            for n in names:
                got[n] += tree.read(n, off, 1 << 20)
                pools = tree.parts.pools
                assert len(pools) == 2 and all(p.budget <= share // 2 for p in pools), [p.budget for p in pools]
                held = [_held(p) for p in pools]
                assert all(h <= share // 2 for h in held), held
                peak = max(peak, sum(held))
        assert all(bytes(got[n]) == local for n in names)
        assert 0 < peak <= share
        first = tree._slots["checkpoint_0"]
        first_pool = tree._tree_of(first).parts
        tree._close_tree(first)  # as when the tree is evicted: its share goes to the other
        assert first_pool.closed and _held(first_pool) == 0
        assert [p.budget for p in tree.parts.pools] == [share]
        pools = tree.parts.pools
    finally:
        tree.close()
    assert all(p.closed and not p.parts and p.bytes == 0 for p in pools)
    assert tree.parts.pools == []


def test_a_closed_trees_pool_holds_nothing_and_its_threads_end(endpoint):
    """Closing a tree empties its pool and stops its request threads; a read asking for parts afterwards fails (an
    OSError: EIO in a mount) instead of starting threads again."""
    import ckptfs

    srv, url, mdl, params = endpoint
    tree = ckptfs.open(url + "checkpoint_0.mdl", config=str(params), cache_size=32 << 20)
    pool = tree.parts
    assert not pool.request_threads  # started on the first read, not before
    size = tree.attr(tree.lookup("model.safetensors")).size
    tree.read("model.safetensors", size // 2, 4 << 20)
    assert _threads_of(pool) and pool.bytes > 0
    tree.close()
    assert pool.closed and not pool.parts and pool.bytes == 0
    assert _wait(lambda: not _threads_of(pool)), _threads_of(pool)
    late = pool.part(("b", "k", "e", 0), lambda bufs, filled: 0, 1)
    with pytest.raises(OSError):
        late.result(5)
    assert pool.executor is None and not pool.parts


def test_a_forked_child_reads_through_a_pool_made_before_the_fork(endpoint):
    """A process forked after reads started the pool's threads (a data loader's workers over an API tree): the child
    has none of them, and reads through the same tree all the same, its pool emptied of the parent's parts."""
    import ckptfs

    srv, url, mdl, params = endpoint
    local = ckptfs.open(mdl, config=str(params)).read("model.safetensors", 0, 1 << 40)
    tree = ckptfs.open(url + "checkpoint_0.mdl", config=str(params), cache_size=32 << 20)
    try:
        assert tree.read("model.safetensors", 0, 8 << 20) == local[:8 << 20]
        assert _threads_of(tree.parts) and tree.parts.parts
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: what the at-fork reset is for
            pid = os.fork()
        if pid == 0:
            code = 1
            try:
                pool = tree.parts
                fresh = not pool.parts and not pool.request_threads and pool.budget > 0
                ok = tree.read("model.safetensors", 4 << 20, 16 << 20) == local[4 << 20:20 << 20]
                code = 0 if fresh and ok and _threads_of(pool) else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert tree.read("model.safetensors", 20 << 20, 4 << 20) == local[20 << 20:24 << 20]  # the parent's own
    finally:
        tree.close()
