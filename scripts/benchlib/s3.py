"""The S3 lines of the benchmark (issue #29): a generated checkpoint in Cerebras' S3 layout on a local
S3-compatible endpoint (moto's server, the tests' ``tests/helpers/s3server.py``, started here on 127.0.0.1), read through
ckptfs and against the same endpoint's other readers. The lines over the ``.mdl`` as one object (``from_pretrained``
among them) are in ``s3mdl.py``, on an rclone server: moto's range GET copies the whole object, fine for the S3
layout's one object per tensor, not for a checkpoint in one object.

* ``cp`` of every safetensors shard from a fresh S3-sourced mount to /dev/null, against downloading the same
  checkpoint's objects with boto3's managed transfer (``s3transfer.TransferManager`` at its default concurrency)
  into /dev/null: both fetch the same bytes from the same server;
* requests per 4 KiB peek: 4 KiB read at the start of every tensor's data (``tensors/…npy``) on one mount, the
  requests counted at the endpoint after each.

The objects are what ``cstorch.save("s3://…")`` writes (``tests/fixtures/s3``): one per tensor, the array's bytes
with the ``metadata`` user metadata (``__NUMPY__``, ``compressed`` false, ``data_sizes``, ``boundaries``), and
``__METADATA__`` last: the root attributes and every ``<key>.__metadata__`` of the generated ``.mdl``, pickled.
"""
from __future__ import annotations

import json
import pickle
import sys
import time
from pathlib import Path

from . import sysutil
from .mount import Mount
from .sysutil import drop_caches, median

TESTS = Path(__file__).resolve().parent.parent.parent / "tests"
BUCKET = "bench"


def _local_s3():
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from helpers.s3 import LocalS3  # the tests' endpoint: moto in a process of its own, counting requests

    return LocalS3


def s3_objects(mdl: Path):
    """``(name, body, user metadata)`` of every tensor of the ``.mdl`` as ``cstorch.save`` writes it to S3, then
    ``("__METADATA__", pickle, {})``."""
    import h5py
    import hdf5plugin  # noqa: F401  (the LZ4 filter)

    with h5py.File(mdl, "r") as f:
        meta = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()
                if not k.endswith(".__metadata__")}
        meta = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in meta.items()}
        for k, v in f.attrs.items():
            if not k.endswith(".__metadata__"):
                continue
            key = k[: -len(".__metadata__")]
            md = json.loads(v)
            d = f.get(key)
            if isinstance(d, h5py.Dataset):
                body = d[()].tobytes()
                inner = md[key + ".__metadata__"]
                inner.update({"__NUMPY__": {"shape": list(d.shape), "dtype": str(d.dtype)}, "compressed": False,
                              "data_sizes": [len(body)], "boundaries": [len(body)]})
                yield key, body, {"metadata": json.dumps(inner)}
            meta[k] = json.dumps(md, indent=4)
    meta["__SUCCESS__"] = True
    yield "__METADATA__", pickle.dumps(meta, protocol=4), {}


def _moto_version() -> str:
    from importlib.metadata import version

    return version("moto")


def upload(s3, mdl: Path, prefix: str) -> int:
    """Put the ``.mdl``'s S3-layout objects under ``prefix`` (one PUT each, ``__METADATA__`` last): their bytes."""
    client = s3.client()
    client.create_bucket(Bucket=BUCKET)
    total = 0
    for name, body, metadata in s3_objects(mdl):
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=body, Metadata=metadata)
        total += len(body)
    return total


def _boto3_download(s3, prefix: str) -> tuple:
    """Seconds and bytes to download every object of ``prefix`` to /dev/null with boto3's managed transfer."""
    from boto3.s3.transfer import TransferConfig
    from s3transfer.manager import TransferManager

    client = s3.client()
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
            for o in page.get("Contents", ())]
    sinks = []
    t0 = time.perf_counter()
    with TransferManager(client, TransferConfig()) as tm:  # boto3's defaults: 10 threads, 8 MiB parts
        futures = []
        for k in keys:
            sink = open("/dev/null", "wb")
            sinks.append(sink)
            futures.append(tm.download(BUCKET, k, sink))
        for f in futures:
            f.result()
    secs = time.perf_counter() - t0
    for s in sinks:
        s.close()
    sizes = sum(client.head_object(Bucket=BUCKET, Key=k)["ContentLength"] for k in keys)
    return secs, sizes


class _Relay:
    """A TCP relay on 127.0.0.1 in front of the endpoint, noting when its first connection arrives."""

    def __init__(self, port: int):
        import socket
        import threading

        self.upstream, self.first = port, None
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:  # closed
                return
            if self.first is None:
                self.first = time.perf_counter()
            up = socket.create_connection(("127.0.0.1", self.upstream))
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b) -> None:
        import socket

        try:
            while data := a.recv(1 << 16):
                b.sendall(data)
        except OSError:
            pass
        finally:
            try:
                b.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        self.server.close()


def first_request_s(s3, url: str, env: dict, repeat: int) -> list:
    """Seconds from the start of ``ckptfs info URL`` to its first connection at the endpoint, each of ``repeat``
    runs after one not counted (it warms the page cache)."""
    relay = _Relay(s3.port)
    runs = []
    try:
        for i in range(repeat + 1):
            relay.first = None
            t0 = time.perf_counter()
            sysutil.run([sys.executable, "-m", "ckptfs", "info", url], env=dict(env, AWS_ENDPOINT_URL=relay.url))
            if relay.first is None:
                raise sysutil.StepError(f"ckptfs info {url} made no request")
            if i:
                runs.append(relay.first - t0)
    finally:
        relay.close()
    return runs


def _mount(ctx, url_or_path, label: str, env: dict, config=None) -> Mount:
    from .measure import _ids  # one numbering of mount points per run

    n = next(_ids)
    return Mount(url_or_path, ctx.workdir / "mnt" / f"{n:03d}", config=config, cache_size=ctx.cache_size,
                 max_shard_size=ctx.max_shard_size, cache_dir=ctx.workdir / "ckptfs-cache" / f"s3-{n:03d}",
                 label=label, env=env, on_stop=ctx._record)


def measure_s3(ctx, ck, layout: dict) -> dict:
    """Every S3 measurement of the module docstring for checkpoint ``ck`` (its mount ``layout``)."""
    s3 = _local_s3()(ctx.workdir / "s3")
    try:
        t0 = time.perf_counter()
        url = f"s3://{BUCKET}/run/{ck.path.stem}.mdl"
        nbytes = upload(s3, ck.path, f"run/{ck.path.stem}.mdl")
        out = {"objects_bytes": nbytes, "upload_s": round(time.perf_counter() - t0, 1),
               "endpoint": f"moto {_moto_version()} server, 127.0.0.1", "machine": sysutil.machine()}
        env = {**{k: v for k, v in ctx.env.items() if not k.startswith("AWS_")},
               **{k: v for k, v in s3.env().items() if k.startswith("AWS_")}}
        runs = first_request_s(s3, url, dict(env, CKPTFS_CACHE_DIR=str(ctx.workdir / "ckptfs-cache" / "s3-info")),
                               ctx.repeat)
        out["first_request"] = {"runs_s": [round(r, 3) for r in runs], "median_s": round(median(runs), 3)}
        names = layout["safetensors"]
        st_bytes = sum(layout["sizes"][n] for n in names)
        cp_runs, boto_runs = [], []
        for _ in range(ctx.repeat):  # interleaved: the endpoint's state is the same for both
            with _mount(ctx, url, f"{ck.name}:s3-cp", env, ck.params) as m:
                drop_caches()
                src = m.mountpoint / layout["hf_rel"]
                cp_runs.append(sum(sysutil.timed(["cp", src / n, "/dev/null"])[0] for n in names))
            drop_caches()
            secs, got = _boto3_download(s3, f"run/{ck.path.stem}.mdl")
            boto_runs.append(secs)
        cp_mb_s = sysutil.mb_per_s(st_bytes, median(cp_runs))
        boto_mb_s = sysutil.mb_per_s(got, median(boto_runs))
        out["cp"] = {"runs_s": [round(r, 3) for r in cp_runs], "bytes": st_bytes, "mb_s": round(cp_mb_s, 1)}
        out["boto3"] = {"runs_s": [round(r, 3) for r in boto_runs], "bytes": got, "mb_s": round(boto_mb_s, 1)}
        out["cp_ratio"] = round(cp_mb_s / boto_mb_s, 3)

        # where each tensor's data starts, read on a mount of the local file: touching the S3 mount's files first
        # would bring the start of their data into the page cache
        with _mount(ctx, ck.path, f"{ck.name}:s3-peek-offsets", env, ck.params) as m:
            starts = {}
            for npy in sorted((m.mountpoint / "tensors").rglob("*.npy")):
                with open(npy, "rb") as f:
                    head = f.read(10)
                starts[npy.relative_to(m.mountpoint)] = 10 + int.from_bytes(head[8:10], "little")
        with _mount(ctx, url, f"{ck.name}:s3-peek", env, ck.params) as m:
            counts = []
            for rel, start in starts.items():
                s3.reset()
                with open(m.mountpoint / rel, "rb") as f:
                    f.seek(start)
                    f.read(4096)
                counts.append(sum(s3.counts().values()))
        out["peeks"] = {"tensors": len(counts), "max_requests": max(counts), "mean_requests": round(sum(counts) /
                                                                                                   len(counts), 2)}
        return out
    finally:
        s3.stop()
