"""``storage.base.thread_scratch``: a thread's scratch buffers are kept for its next read by its native thread id, so a
thread libfuse started (whose Python thread state lasts one callback) reuses them instead of mapping fresh memory for
every read it serves."""
from __future__ import annotations

import threading

from ckptfs.storage import base


def _in_new_python_thread(fn):
    """Run ``fn`` in a new Python thread state (as each FUSE callback of a libfuse thread is) and return its result."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_the_same_native_thread_gets_its_buffer_back_across_python_thread_states(monkeypatch):
    monkeypatch.setattr(base, "_scratch", base._ThreadScratch())
    monkeypatch.setattr(base.threading, "get_native_id", lambda: 4242)
    first = _in_new_python_thread(lambda: base.thread_scratch("raw", 1 << 20))
    again = _in_new_python_thread(lambda: base.thread_scratch("raw", 1000))
    assert again is first and len(first) >= 1 << 20
    bigger = _in_new_python_thread(lambda: base.thread_scratch("raw", 2 << 20))
    assert bigger is not first and len(bigger) >= 2 << 20
    assert _in_new_python_thread(lambda: base.thread_scratch("dec", 10)) is not bigger  # one buffer per name


def test_threads_have_buffers_of_their_own_and_only_the_latest_are_kept(monkeypatch):
    monkeypatch.setattr(base, "_scratch", base._ThreadScratch())
    monkeypatch.setattr(base, "KEEP_SCRATCH_THREADS", 3)
    tid = [0]
    monkeypatch.setattr(base.threading, "get_native_id", lambda: tid[0])
    kept = {}
    for t in range(4):
        tid[0] = t
        kept[t] = base.thread_scratch("raw", 4096)
    assert len({id(b) for b in kept.values()}) == 4
    for t in (1, 2, 3):
        tid[0] = t
        assert base.thread_scratch("raw", 4096) is kept[t]
    tid[0] = 0  # the thread used longest ago was let go of: a new buffer (its old one stays its holder's)
    assert base.thread_scratch("raw", 4096) is not kept[0] and len(kept[0]) >= 4096


def test_a_buffer_past_the_kept_size_is_not_kept(monkeypatch):
    monkeypatch.setattr(base, "_scratch", base._ThreadScratch())
    monkeypatch.setattr(base, "KEEP_SCRATCH_BYTES", 1 << 16)
    big = base.thread_scratch("raw", 1 << 17)
    assert base.thread_scratch("raw", 1 << 17) is not big
    small = base.thread_scratch("raw", 1 << 10)
    assert base.thread_scratch("raw", 1 << 10) is small


def test_a_forked_child_starts_with_no_buffer_and_no_lock_held():
    """A fork while another thread holds the buffers' lock would leave it held in the child: the child starts
    afresh."""
    import os

    if not hasattr(os, "fork"):
        return
    held = base.thread_scratch("raw", 4096)
    base._scratch._lock.acquire()  # as another thread of the parent might at the moment of the fork
    try:
        pid = os.fork()
        if pid == 0:
            ok = base.thread_scratch("raw", 4096) is not held and not base._scratch._lock.locked()
            os._exit(0 if ok else 1)
    finally:
        base._scratch._lock.release()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
