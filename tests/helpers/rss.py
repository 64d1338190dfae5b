"""Peak memory of one ``ckptfs`` command, as the tests of untrusted input bound it: run it under a probe process
that reports its child's ``ru_maxrss`` (``RUSAGE_CHILDREN``), so each measurement is of that command alone."""
from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass

from helpers import real_env

_PROBE = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True); "
          "sys.stderr.buffer.write(r.stderr); sys.stdout.buffer.write(r.stdout); "
          "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode, file=sys.stderr)")


@dataclass
class Measured:
    returncode: int
    stdout: str
    stderr: str  # the command's own stderr
    peak_mib: float
    seconds: float


def measure_ckptfs(*args, timeout: float = 300, env=None) -> Measured:
    """Run ``ckptfs ARGS``; its exit code, output, peak RSS (MiB) and wall time."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", _PROBE, sys.executable, "-m", "ckptfs", *map(str, args)],
                       env=env or real_env(), capture_output=True, text=True, timeout=timeout)
    seconds = time.monotonic() - t0
    *err, last = r.stderr.rstrip("\n").split("\n")
    kib, code = last.split()
    return Measured(int(code), r.stdout, "\n".join(err), int(kib) / 1024, seconds)
