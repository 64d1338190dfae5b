"""What a process shows as its command line (``/proc/PID/cmdline``, ``ps``), rewritten in place.

A background mount server forked from ``ckptfs mount`` inherits the invoking command line — ``--endpoint-url
http://user:PASSWORD@host`` included — for the mount's whole life, readable by every user of the machine.
``show_only(args)`` overwrites the process's argument area (from ``arg_start`` to ``arg_end`` in ``/proc/self/stat``,
written through ``/proc/self/mem``) with ``args``, padded with NULs: nothing of the former arguments remains there.
Linux only; False when it cannot be done (the caller then must not rely on it).
"""
from __future__ import annotations

import sys


def argument_area() -> tuple[int, int] | None:
    """``(arg_start, arg_end)`` of this process (fields 48 and 49 of ``/proc/self/stat``), or None."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2:].split()  # from field 3 on (the name may hold spaces)
        return int(fields[45]), int(fields[46])
    except (OSError, ValueError, IndexError):
        return None


def show_only(args: list) -> bool:
    """Make the command line show ``args`` (truncated to the area's size) and nothing of what it held; whether it
    could."""
    area = argument_area()
    if area is None:
        return False
    start, end = area
    size = end - start
    if size <= 0:
        return False
    text = b"\0".join(str(a).encode("utf-8", "replace") for a in args)[:size - 1]
    try:
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(text.ljust(size, b"\0"))
    except (OSError, ValueError, OverflowError):
        return False
    return True


def read_cmdline(pid: int | str = "self") -> list:
    """The arguments ``/proc/PID/cmdline`` shows (empty ones dropped)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def interpreter_prefix() -> list:
    """The leading part of this process's command line that runs ckptfs (``python -m ckptfs``, or the ``ckptfs``
    script with its interpreter), without the command's own arguments."""
    orig = list(getattr(sys, "orig_argv", []) or [])
    n = len(sys.argv) - 1
    if orig and 0 <= n < len(orig):
        return orig[:len(orig) - n]
    return [sys.executable, "-m", "ckptfs"]
