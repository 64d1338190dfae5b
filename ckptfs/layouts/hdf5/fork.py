"""An HDF5 skeleton built in a forked child process, on another CPU and outside this process's GIL
(``Hdf5Layout.fork_build``; the mount server's cs view).

The child writes the metadata into a ``ScratchBuffer``'s temporary file (the descriptor is shared across the fork) and
sends back through a pipe, as JSON, what the parent needs to adopt it: the written ranges, the data regions' offsets
in the order of the tensors, the size. It makes the same calls as a build in the parent, so the bytes are the same.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import weakref
from typing import Callable

from .buffers import ScratchBuffer, new_buffer
from .skeleton import Skeleton, check_disjoint

#: ``build(buffer) -> Skeleton``: what the child runs (the same build as in the parent, into the given buffer)
Build = Callable[[ScratchBuffer], Skeleton]


class ChildBuild:
    """A skeleton being built by the forked child ``pid``, its result coming through the pipe ``fd`` into ``buffer``.
    Dropped unused, the child is killed and reaped."""

    def __init__(self, pid: int, fd: int, buffer: ScratchBuffer):
        self.pid, self.fd, self.buffer = pid, fd, buffer
        self._finalizer = weakref.finalize(self, ChildBuild._reap, pid, fd, True)

    @staticmethod
    def _reap(pid: int, fd: int, kill: bool) -> int | None:
        """Close the pipe and wait for the child (killed first when its result is not wanted); its exit status."""
        try:
            os.close(fd)
        except OSError:
            pass
        if kill:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            return os.waitpid(pid, 0)[1]
        except ChildProcessError:
            return None

    def result(self, tensors: list) -> Skeleton | None:
        """The child's skeleton, ``tensors`` being those with data regions in build order (waits for it; the GIL is
        free meanwhile), or None if it failed (the caller then builds in this process, which raises the error the
        child met)."""
        chunks = []
        try:
            while True:
                data = os.read(self.fd, 1 << 20)
                if not data:
                    break
                chunks.append(data)
        except OSError:
            chunks = []
        self._finalizer.detach()
        status = ChildBuild._reap(self.pid, self.fd, False)  # None: reaped by someone else; the JSON tells
        if status not in (0, None) or not chunks:
            return None
        try:
            msg = json.loads(b"".join(chunks))
            if len(tensors) != len(msg["offsets"]):
                return None
            buf = self.buffer
            buf.eof = int(msg["size"])
            skel = Skeleton(buf, [(int(a), int(b)) for a, b in msg["spans"]],
                            [(int(o), t) for o, t in zip(msg["offsets"], tensors)], buf.eof)
        except (ValueError, KeyError, TypeError):
            return None
        check_disjoint(skel)
        return skel


def start(build: Build) -> ChildBuild | None:
    """Fork a child running ``build`` into a new ``ScratchBuffer``; None (nothing started) unless this process has a
    single thread (a fork copies no other thread, and any lock another thread held would stay held in the child),
    ``os.fork`` exists and a temporary file can be made."""
    if not hasattr(os, "fork") or threading.active_count() != 1:
        return None
    buf = new_buffer()
    if not isinstance(buf, ScratchBuffer):
        return None
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return None
    if pid == 0:
        os.close(r)
        build_in_child(build, buf, w)  # never returns
    os.close(w)
    return ChildBuild(pid, r, buf)


def build_in_child(build: Build, buf: ScratchBuffer, fd: int) -> None:
    """In the forked child: build, send the result through ``fd``, exit (never returns; no cleanup of the parent's
    state runs)."""
    code = 1
    try:
        try:  # die with the server (Linux): the child must not outlive the process that waits for it
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        skel = build(buf)
        data = memoryview(json.dumps({"spans": skel.spans, "offsets": [o for o, _ in skel.regions],
                                      "size": skel.size}).encode())
        while data:
            data = data[os.write(fd, data):]
        code = 0
    except BaseException:  # noqa: BLE001 - any failure: the parent builds itself and reports it (no logging
        pass  # here: a forked child may hold a copy of a logging lock another thread of the parent had taken)
    finally:
        os._exit(code)
