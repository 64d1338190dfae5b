"""Where chunk reads run: the shared pool of decoding threads (their scratch: ``storage.base.thread_scratch``).

Threads per read (the calling thread included): ``set_decode_threads(n)``, else ``CKPTFS_DECODE_THREADS``
(``ckptfs.env``; default ``os.cpu_count()``; 1 = serial, in the calling thread). The pool grows on demand and is
started afresh in a forked child (a fork copies none of its threads).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from .... import env

_pool_lock = threading.Lock()
_threads: int | None = None
_pool: ThreadPoolExecutor | None = None


def decode_threads() -> int:
    """Threads used per read (the caller included): ``set_decode_threads`` or ``$CKPTFS_DECODE_THREADS`` or cores."""
    return _threads if _threads is not None else env.decode_threads()


def set_decode_threads(n: int | None) -> None:
    """Use ``n`` threads per read (1 = serial; None = back to the environment/default). Replaces the shared pool."""
    global _threads, _pool
    with _pool_lock:
        _threads = None if n is None else max(1, int(n))
        old, _pool = _pool, None
    if old is not None:
        old.shutdown(wait=False)


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < workers:  # noqa: SLF001 (grow on demand)
            old, _pool = _pool, ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptfs-lz4")
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's pool threads: start a fresh pool on next use."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def in_parallel(fn, parts: list) -> None:
    """``fn(*part)`` for every part: the first in the calling thread, the others in the shared pool; raises the first
    error once all parts are done."""
    pool = _executor(len(parts) - 1)
    futs = [pool.submit(fn, *p) for p in parts[1:]]
    err = None
    try:
        fn(*parts[0])
    except BaseException as e:  # noqa: BLE001 (wait for the others before raising)
        err = e
    for f in futs:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001
            err = err or e
    if err is not None:
        raise err
