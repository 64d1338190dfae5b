"""Did a process read tensor data from a checkpoint? A check based on the file offsets it read.

Why this is sound: HDF5 keeps every chunk of a chunked dataset as one contiguous byte range of the file, and it
reads a chunk with a single ``pread`` of the whole stored chunk (then decompresses it). Metadata (superblock,
object headers, attributes, B-tree nodes, heaps) lives in other byte ranges. So we list every chunk's
``[byte_offset, byte_offset + size)`` with h5py's ``chunk_iter`` and trace the process's read syscalls on the
checkpoint with ``strace -y`` (which prints the file behind each fd, and for ``pread64`` the offset):

* a read that covers a whole chunk is a tensor-data read — this is exactly what h5py does for ``dset[...]``;
* a read that overlaps chunk bytes only partially is reported separately: HDF5's speculative metadata reads
  (512 bytes) can run a few bytes into an adjacent chunk without touching tensor data; a real data read never
  looks like that. Chunks smaller than 1 KiB are ignored for the same reason (a 512-byte speculative read can
  span one); in the benchmark models every chunk is larger.
* a plain ``read`` on the checkpoint has no offset, so it is counted as "unknown" and fails the check.

``controls()`` runs the same classification on two reference processes, a plain-h5py metadata scan (must show
no data read) and a read of one tensor (must show one), so every report also shows that the check can tell the two
apart. For the 70B-shaped checkpoint this check would be empty (its datasets have no chunks at all: they were
never written), so there it only serves as a time and ``/proc/<pid>/io`` figure; the check runs on the allocated
benchmark checkpoints, through the same code paths.

``/proc/<pid>/io`` ``rchar`` is recorded too, but it cannot be the check on its own: it also counts the FUSE
requests the server reads from /dev/fuse and any metadata reads.
"""
from __future__ import annotations

import bisect
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import hdf5plugin  # noqa: F401

MIN_CHUNK = 1024  # chunks smaller than this are not used as evidence (see module docstring)

_PREAD = re.compile(r"^(?:\d+\s+)?(pread64|preadv2?)\(\d+<(?P<path>[^>]*)>, .*, (?P<off>\d+)(?:, \d+)?\)\s+=\s+(?P<ret>-?\d+)")
_READ = re.compile(r"^(?:\d+\s+)?(read|readv)\(\d+<(?P<path>[^>]*)>, .*\)\s+=\s+(?P<ret>-?\d+)")


def chunk_ranges(ckpt) -> list:
    """Sorted ``(start, end)`` file byte ranges of every stored chunk (and contiguous dataset) of ``ckpt``."""
    out = []
    with h5py.File(ckpt, "r") as f:
        dsets: list = []
        f.visititems(lambda n, o: dsets.append(o) if isinstance(o, h5py.Dataset) else None)
        for d in dsets:
            if d.chunks is not None:
                d.id.chunk_iter(lambda si: out.append((si.byte_offset, si.byte_offset + si.size)))
            elif d.shape is not None and d.id.get_offset() is not None:
                out.append((d.id.get_offset(), d.id.get_offset() + d.id.get_storage_size()))
    out.sort()
    return out


def parse_trace(text: str, ckpt) -> tuple:
    """([(offset, nbytes)] preads of ``ckpt``, number of offset-less reads of it) from ``strace -y`` output."""
    real = os.path.realpath(str(ckpt))
    preads, unknown = [], 0
    for line in text.splitlines():
        if real not in line:
            continue
        m = _PREAD.match(line)
        if m and m.group("path") == real:
            ret = int(m.group("ret"))
            if ret > 0:
                preads.append((int(m.group("off")), ret))
            continue
        m = _READ.match(line)
        if m and m.group("path") == real and int(m.group("ret")) > 0:
            unknown += 1
        elif "unfinished" in line or "resumed" in line:
            unknown += 1
    return preads, unknown


def classify(preads: list, ranges: list) -> dict:
    """Count reads that cover whole chunks (data reads) or touch chunk bytes partially."""
    starts = [a for a, _ in ranges]
    data_reads = partial = 0
    data_bytes = 0
    for off, n in preads:
        end = off + n
        i = max(bisect.bisect_right(starts, off) - 1, 0)
        covered = touched = False
        while i < len(ranges) and ranges[i][0] < end:
            a, b = ranges[i]
            if b > off:
                if off <= a and b <= end and b - a >= MIN_CHUNK:
                    covered = True
                else:
                    touched = True
            i += 1
        if covered:
            data_reads += 1
            data_bytes += n
        elif touched:
            partial += 1
    return {"preads": len(preads), "data_reads": data_reads, "data_read_bytes": data_bytes,
            "partial_overlaps": partial}


def strace_available() -> bool:
    return shutil.which("strace") is not None


class Tracer:
    """``strace -f -y`` attached to a running process, recording read syscalls to a file."""

    def __init__(self, pid: int, out: Path):
        self.pid, self.out = pid, Path(out)
        self.proc: subprocess.Popen | None = None

    def __enter__(self):
        self.proc = subprocess.Popen(["strace", "-f", "-qq", "-y", "-s", "0", "-e",
                                      "trace=read,pread64,readv,preadv,preadv2", "-o", str(self.out),
                                      "-p", str(self.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while not self._attached():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                self.__exit__()
                raise RuntimeError(f"strace could not attach to {self.pid}: {err.strip()}")
            time.sleep(0.02)
        return self

    def _attached(self) -> bool:
        try:
            tasks = os.listdir(f"/proc/{self.pid}/task")
            for t in tasks:
                with open(f"/proc/{self.pid}/task/{t}/status") as f:
                    if not any(ln.startswith("TracerPid:") and ln.split()[1] != "0" for ln in f):
                        return False
            return True
        except OSError:
            return False

    def __exit__(self, *exc):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # detach; strace flushes its output
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def text(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""


_CONTROL = {
    "metadata_scan": "import h5py,hdf5plugin,sys\nf=h5py.File(sys.argv[1],'r')\nn=[]\n"
                     "f.visititems(lambda k,o: n.append(k) if isinstance(o,h5py.Dataset) else None)\n"
                     "[(f[k].shape,f[k].dtype,f[k].chunks,dict(f[k].attrs)) for k in n]\n[f.attrs[k] for k in f.attrs]\n",
    "one_tensor_read": "import h5py,hdf5plugin,sys\nf=h5py.File(sys.argv[1],'r')\n"
                       "f['model.embedding_layer.word_embeddings.weight'][()]\n",
}


def controls(ckpt, workdir: Path, ranges: list) -> dict:
    """Classify a metadata-only h5py scan and a one-tensor read of ``ckpt`` (expected: 0 and >0 data reads)."""
    out = {}
    for name, code in _CONTROL.items():
        trace = Path(workdir) / f"control-{name}.strace"
        subprocess.run(["strace", "-f", "-qq", "-y", "-s", "0", "-e", "trace=read,pread64,readv,preadv,preadv2",
                        "-o", str(trace), sys.executable, "-c", code, str(ckpt)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
        preads, unknown = parse_trace(trace.read_text(errors="replace"), ckpt)
        out[name] = {**classify(preads, ranges), "unknown_reads": unknown}
        trace.unlink()
    out["discriminates"] = (out["metadata_scan"]["data_reads"] == 0 and out["metadata_scan"]["unknown_reads"] == 0
                            and out["one_tensor_read"]["data_reads"] > 0)
    return out
