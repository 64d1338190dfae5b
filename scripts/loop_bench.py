"""``cp`` MB/s of one file of a fresh mount under several settings, runs interleaved (docs/read-path.md, "Slow reads do
not stall the mount").

    python scripts/loop_bench.py CKPT.mdl FILE RUNS NAME=VAR=VALUE[,VAR=VALUE] ...
    python scripts/loop_bench.py --s3 [--zstd] CKPT.mdl FILE RUNS ...

Each setting is environment variables for the server, e.g. ``single=CKPTFS_FUSE_THREADS=0
multi=CKPTFS_FUSE_THREADS=1``, or ``before=PYTHONPATH=/tmp/base after=PYTHONPATH=.`` to compare two checkouts.
``--s3`` serves the checkpoint from the tests' local S3 endpoint (``tests/helpers/s3.py``) in Cerebras' S3 layout, one
object per tensor (``--zstd``: each object zstd-compressed, as ``S3Writer`` writes it when asked); ``params.yaml``
beside the ``.mdl`` is put beside it in the bucket. Prints each run and the medians (MB/s, server CPU-s per GiB).
"""
from __future__ import annotations

import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def server_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(ckpt: str, rel: str, env: dict) -> tuple:
    """``(MB/s, server CPU-s per GiB)`` of ``cp`` of ``rel`` from a fresh mount of ``ckpt``."""
    mnt = Path(tempfile.mkdtemp(prefix="loop-bench-"))
    with open(mnt.with_suffix(".log"), "wb") as log:
        p = subprocess.Popen([sys.executable, "-m", "ckptfs", "mount", ckpt, str(mnt), "--foreground"], env=env,
                             stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while not (os.path.ismount(mnt) and (mnt / "README.txt").exists()):
            if p.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(mnt.with_suffix(".log").read_text())
            time.sleep(0.05)
        time.sleep(1.0)  # background builds at mount time
        size = (mnt / rel).stat().st_size
        c0, t0 = server_cpu(p.pid), time.perf_counter()
        subprocess.run(["cp", str(mnt / rel), "/dev/null"], check=True)
        secs, cpu = time.perf_counter() - t0, server_cpu(p.pid) - c0
        return size / secs / 1e6, cpu / (size / 2 ** 30)
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        p.wait(30)
        mnt.rmdir()
        mnt.with_suffix(".log").unlink()


def s3_upload(s3, mdl: Path, zstd: bool) -> str:
    """Put ``mdl`` in Cerebras' S3 layout into the local endpoint: its ``s3://`` URL."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from benchlib import s3 as bench_s3

    client = s3.client()
    client.create_bucket(Bucket=bench_s3.BUCKET)
    prefix = "run/checkpoint_0.mdl"
    packer = None
    if zstd:
        import zstandard

        packer = zstandard.ZstdCompressor(level=3)
    entries = {}
    for name, body, metadata in bench_s3.s3_objects(mdl):
        if name == "__METADATA__" and entries:  # what it says of each object must match the compressed objects
            meta = pickle.loads(body)
            for key, inner in entries.items():
                entry = json.loads(meta[key + ".__metadata__"])
                entry[key + ".__metadata__"] = inner
                meta[key + ".__metadata__"] = json.dumps(entry)
            body = pickle.dumps(meta, protocol=4)
        elif packer is not None and name != "__METADATA__":
            inner = json.loads(metadata["metadata"])
            body = packer.compress(body)
            inner.update(compressed=True, boundaries=[len(body)])
            metadata = {"metadata": json.dumps(inner)}
            entries[name] = inner
        client.put_object(Bucket=bench_s3.BUCKET, Key=f"{prefix}/{name}", Body=body, Metadata=metadata)
    params = mdl.with_name("params.yaml")
    if params.exists():
        client.put_object(Bucket=bench_s3.BUCKET, Key="run/params.yaml", Body=params.read_bytes())
    return f"s3://{bench_s3.BUCKET}/{prefix}"


def main(argv: list) -> None:
    s3_mode, zstd = "--s3" in argv, "--zstd" in argv
    argv = [a for a in argv if a not in ("--s3", "--zstd")]
    ckpt, rel, runs = argv[0], argv[1], int(argv[2])
    settings = {}
    for spec in argv[3:]:
        name, _, rest = spec.partition("=")
        settings[name] = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    base = {**os.environ, "PYTHONPATH": str(ROOT)}
    s3 = None
    if s3_mode:
        sys.path.insert(0, str(ROOT / "tests"))
        from helpers.s3 import LocalS3

        s3 = LocalS3(Path(tempfile.mkdtemp(prefix="loop-bench-s3-")))
        ckpt = s3_upload(s3, Path(ckpt).resolve(), zstd)
        base.update(s3.env())
    try:
        results: dict = {name: [] for name in settings}
        for i in range(runs):
            for name in (list(settings) if i % 2 == 0 else list(reversed(settings))):
                mbs, cpu = one_run(ckpt, rel, {**base, **settings[name]})
                results[name].append((mbs, cpu))
                print(f"run {i} {name}: {mbs:.0f} MB/s, server {cpu:.2f} CPU-s/GiB", flush=True)
    finally:
        if s3 is not None:
            s3.stop()
    for name, got in results.items():
        speeds = [m for m, _ in got]
        print(f"{name}: median {statistics.median(speeds):.0f} MB/s (range {min(speeds):.0f}-{max(speeds):.0f}), "
              f"{statistics.median(c for _, c in got):.2f} CPU-s/GiB")


if __name__ == "__main__":
    main(sys.argv[1:])
