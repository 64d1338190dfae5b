"""Process, page-cache and timing helpers for the benchmark (Linux only: /proc and /proc/sys/vm/drop_caches)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: seconds any single benchmark subprocess may take before it counts as hung
STEP_TIMEOUT = 900


class StepError(RuntimeError):
    """A benchmark step failed (non-zero exit, timeout, missing output); the message says which and why."""


def is_root() -> bool:
    return os.geteuid() == 0


def drop_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches`` (clean page cache, dentries, inodes). False when not root."""
    os.sync()
    if not is_root():
        return False
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    return True


def median(xs) -> float:
    return float(statistics.median(xs))


def _tail(text: str | bytes | None, n: int = 6) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])


def run(argv: list, *, env: dict | None = None, timeout: float = STEP_TIMEOUT, stdout=subprocess.PIPE,
        cwd=None) -> subprocess.CompletedProcess:
    """Run ``argv``; raise StepError (with the stderr tail) on a non-zero exit or timeout."""
    try:
        r = subprocess.run([str(a) for a in argv], env=env, stdout=stdout, stderr=subprocess.PIPE,
                           timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired:
        raise _timed_out(argv, timeout) from None
    if r.returncode != 0:
        raise _exited(argv, r.returncode, r.stderr)
    return r


def _timed_out(argv: list, timeout: float) -> StepError:
    return StepError(f"{' '.join(map(str, argv[:4]))} …: timed out after {timeout:.0f} s")


def _exited(argv: list, code: int, stderr) -> StepError:
    return StepError(f"{' '.join(map(str, argv[:6]))}: exit {code}: {_tail(stderr)}")


def timed(argv: list, **kw) -> tuple:
    """(wall seconds, CompletedProcess) of one command."""
    t0 = time.perf_counter()
    r = run(argv, **kw)
    return time.perf_counter() - t0, r


#: runs a command in a child of its own and prints ``wall seconds, ru_maxrss KiB`` of that child: a process's
#: ``ru_maxrss`` counts the memory of the process it was forked from (the address space its exec replaced), so the
#: command is forked from this small interpreter, not from the benchmark
_PEAK_HELPER = """\
import os, sys, time
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.execvp(sys.argv[1], sys.argv[1:])
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
print(time.perf_counter() - t0, usage.ru_maxrss)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def timed_peak(argv: list, *, env: dict | None = None, timeout: float = STEP_TIMEOUT) -> tuple:
    """(wall seconds, peak RSS in bytes) of one command, both measured by ``_PEAK_HELPER`` around the command alone
    (its peak includes the helper's ~10 MB it was forked from, not the benchmark's memory). StepError as ``run``."""
    import signal

    proc = subprocess.Popen([sys.executable, "-c", _PEAK_HELPER, *map(str, argv)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the helper and the command it runs
        proc.communicate()
        raise _timed_out(argv, timeout) from None
    if proc.returncode != 0:
        raise _exited(argv, proc.returncode, err)
    wall, kib = out.split()
    return float(wall), int(kib) * 1024


def probe(name: str, *args, env: dict | None = None, timeout: float = STEP_TIMEOUT) -> dict:
    """Run ``benchlib/probes.py NAME ARGS…`` in a fresh interpreter; return the JSON it prints last."""
    script = Path(__file__).with_name("probes.py")
    r = run([sys.executable, str(script), name, *args], env=env, timeout=timeout)
    out = r.stdout.decode(errors="replace").strip().splitlines()
    if not out:
        raise StepError(f"probe {name}: no output; stderr: {_tail(r.stderr)}")
    return json.loads(out[-1])


def proc_status(pid: int) -> dict:
    """VmRSS / VmHWM (bytes) of a live process."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    return out


def proc_io(pid: int) -> dict:
    """/proc/<pid>/io counters (rchar: bytes returned by read-like syscalls; read_bytes: fetched from storage)."""
    out = {}
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            k, v = line.split(":", 1)
            out[k.strip()] = int(v)
    return out


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds a process has used so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


def mb_per_s(nbytes: int, seconds: float) -> float:
    """Throughput in MB/s (10^6 bytes per second, as in the docs)."""
    return nbytes / seconds / 1e6 if seconds > 0 else float("inf")


def machine() -> str:
    """The machine a measurement ran on, in one line: host name, CPUs (their model), memory, kernel."""
    import platform

    model = "?"
    mem_kib = 0
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
        with open("/proc/meminfo") as f:
            mem_kib = next((int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:")), 0)
    except OSError:
        pass
    return (f"{platform.node()}: {os.cpu_count()} CPUs ({model}), {mem_kib / (1 << 20):.0f} GiB RAM, "
            f"Linux {platform.release()}")
