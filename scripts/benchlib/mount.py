"""Run ``python -m ckptfs mount`` / ``umount`` as a user would, and watch the background server process.

The server is the pid ``ckptfs mount`` prints; failing that, it is found from ``/proc``: the process whose command line
is a ``ckptfs mount`` of the (unique) mount point once the command has returned (``ckptfs.fuse.mount.start_background``
forks the command itself, or starts ``python -m ckptfs mount … MNT --foreground``). Its peak RSS
(``VmHWM``) is read just before unmounting, and ``/proc/<pid>/io`` on demand.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from . import sysutil
from .sysutil import StepError

MOUNT_TIMEOUT = 180  # ckptfs waits up to 120 s for its server to answer


def ckptfs_argv(*args) -> list:
    return [sys.executable, "-m", "ckptfs", *map(str, args)]


def find_server(mountpoint: str) -> int | None:
    """PID of the ckptfs server process serving ``mountpoint`` (its argv is a ``ckptfs mount`` of that path), once
    the mount command has returned."""
    mp = os.path.abspath(mountpoint)
    me = os.getpid()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        if any(a == "ckptfs" or a.endswith("/ckptfs") for a in args) and "mount" in args and mp in args:
            return int(d)
    return None


class Mount:
    """One background ckptfs mount. ``start()`` returns the wall seconds of the mount command;
    ``stop()`` reads the server's peak RSS, unmounts and waits for the server to exit."""

    def __init__(self, ckpt, mountpoint, *, config=None, zip_crc="exact", cache_size="256MiB",
                 max_shard_size=None, cache_dir=None, label="", env=None, on_stop=None, extra=()):
        self.ckpt = ckpt if str(ckpt).startswith("s3://") else Path(ckpt)  # a local file or an s3:// URL
        self.mountpoint = Path(mountpoint)
        self.config, self.zip_crc, self.cache_size = config, zip_crc, cache_size
        self.max_shard_size, self.cache_dir, self.label = max_shard_size, cache_dir, label
        self.env = dict(env if env is not None else os.environ)
        if cache_dir is not None:
            self.env["CKPTFS_CACHE_DIR"] = str(cache_dir)
        self.on_stop = on_stop
        self.extra = tuple(extra)  # further flags of the mount command (``--views tf``)
        self.pid: int | None = None
        self.stdout = ""
        self.peak_rss: int | None = None

    def argv(self) -> list:
        a = ["mount", self.ckpt, self.mountpoint, "--zip-crc", self.zip_crc, "--cache-size", self.cache_size]
        if self.config:
            a += ["--config", self.config]
        if self.max_shard_size:
            a += ["--max-shard-size", self.max_shard_size]
        return ckptfs_argv(*a, *self.extra)

    def start(self) -> float:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        if self.cache_dir is not None:
            Path(self.cache_dir).mkdir(parents=True, exist_ok=True)
        try:
            secs, r = sysutil.timed(self.argv(), env=self.env, timeout=MOUNT_TIMEOUT)
        except StepError:
            self.pid = find_server(str(self.mountpoint))
            self.stop(quiet=True)
            raise
        self.stdout = r.stdout.decode(errors="replace")
        m = re.search(r"\bpid[ =:]+(\d+)", self.stdout, re.IGNORECASE)
        self.pid = int(m.group(1)) if m and sysutil.pid_alive(int(m.group(1))) else find_server(str(self.mountpoint))
        if self.pid is None:
            self.stop(quiet=True)
            raise StepError(f"mounted {self.mountpoint} but found no server process (mount printed: {self.stdout.strip()!r})")
        return secs

    def status(self) -> dict:
        return sysutil.proc_status(self.pid)

    def io(self) -> dict:
        return sysutil.proc_io(self.pid)

    def cpu(self) -> float:
        return sysutil.proc_cpu(self.pid)

    def stop(self, quiet: bool = False) -> None:
        """Record the peak RSS, ``ckptfs umount``, wait for the server; fall back to SIGTERM / lazy unmount."""
        if self.pid is not None and sysutil.pid_alive(self.pid):
            try:
                self.peak_rss = self.status()["VmHWM"]
            except (OSError, KeyError):
                pass
        errors = []
        if fuse_connection(self.mountpoint) is not None:
            try:
                sysutil.run(ckptfs_argv("umount", self.mountpoint), env=self.env, timeout=60)
            except StepError as e:
                errors.append(str(e))
        if self.pid is not None and not sysutil.wait_gone(self.pid, 30):
            os.kill(self.pid, signal.SIGTERM)  # our own server, by its pid
            if not sysutil.wait_gone(self.pid, 10):
                errors.append(f"server {self.pid} did not exit after unmount; aborted its FUSE connection")
                abort_connection(self.mountpoint)
                sysutil.wait_gone(self.pid, 10)
        if fuse_connection(self.mountpoint) is not None:
            abort_connection(self.mountpoint)
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)
        try:
            self.mountpoint.rmdir()
        except OSError:
            pass
        if self.on_stop is not None:
            self.on_stop(self)
        if errors and not quiet:
            raise StepError("; ".join(errors))

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


def fuse_connection(mountpoint) -> str | None:
    """The /sys/fs/fuse/connections entry of a mount, from /proc/self/mountinfo (never touches the mount)."""
    mp = os.path.abspath(str(mountpoint))
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 4 and parts[4] == mp and " - fuse" in line:
                    return parts[2].split(":")[1]
    except OSError:
        pass
    return None


def abort_connection(mountpoint) -> bool:
    """Abort a hung FUSE connection (its waiting requests fail with ENOTCONN), so it can be unmounted."""
    conn = fuse_connection(mountpoint)
    ctl = Path("/sys/fs/fuse/connections")
    if conn is None:
        return False
    if not (ctl / conn).exists():
        subprocess.run(["mount", "-t", "fusectl", "none", str(ctl)], capture_output=True)
    try:
        (ctl / conn / "abort").write_text("1")
        return True
    except OSError:
        return False

