"""The benchmark's measurements. Each returns a JSON-able dict with the per-run numbers and their median.

Rules shared by all of them:
* every timed run starts cold: page cache dropped (``sync; echo 3 > drop_caches``, when root) and, for anything
  read through FUSE, a freshly started mount (so the server's block cache is empty too) with its own empty
  ``CKPTFS_CACHE_DIR`` (so the torch-zip CRC store is cold) unless the measurement is about a warm CRC store;
* ``cp`` copies to /dev/null, so the numbers are about producing the bytes, not about the destination disk;
* interpreters are started before the clock (see ``probes.py``), except for ``ckptfs export`` and ``ckptfs mount``,
  whose wall time is what a user waits for.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import noread, sysutil
from .mount import Mount, ckptfs_argv
from .sysutil import StepError, drop_caches, median, probe

_ids = itertools.count(1)


@dataclass
class Ctx:
    """Settings and shared state of one benchmark run."""

    workdir: Path
    repeat: int = 3
    cache_size: str = "256MiB"
    max_shard_size: str | None = None
    env: dict = field(default_factory=lambda: dict(os.environ))
    peaks: list = field(default_factory=list)  # [{"label", "peak_rss"}] of every server, filled on unmount

    def mount(self, ck, label: str, *, zip_crc: str = "exact", cache_dir: Path | None = None,
              extra: tuple = ()) -> Mount:
        """A new (not yet started) mount of checkpoint ``ck`` on a fresh mount point (``extra``: more flags)."""
        n = next(_ids)
        if cache_dir is None:
            cache_dir = self.workdir / "ckptfs-cache" / f"{n:03d}"
        return Mount(ck.path, self.workdir / "mnt" / f"{n:03d}", config=ck.params, zip_crc=zip_crc,
                     cache_size=self.cache_size, max_shard_size=self.max_shard_size, cache_dir=cache_dir,
                     label=f"{ck.name}:{label}", env=self.env, on_stop=self._record, extra=extra)

    def _record(self, m: Mount) -> None:
        self.peaks.append({"label": m.label, "pid": m.pid, "peak_rss": m.peak_rss})


@dataclass
class Ckpt:
    """A generated checkpoint: name ("bf16", "fp32", "70b"), .mdl path, params YAML, generator summary."""

    name: str
    path: Path
    params: Path
    info: dict


def _summary(runs: list, nbytes: int | None = None, **extra) -> dict:
    out = {"runs_s": [round(r, 4) for r in runs], "median_s": round(median(runs), 4), **extra}
    if nbytes is not None:
        out["bytes"] = nbytes
        out["mb_s"] = round(sysutil.mb_per_s(nbytes, median(runs)), 1)
    return out


def disk_read(ctx: Ctx, ck: Ckpt) -> dict:
    """The disk's own ceiling for every cold line: the .mdl file read whole, in order, 8 MiB at a time with O_DIRECT
    (no page cache, nothing decoded), cold. Nothing that reads the checkpoint cold can be faster than this."""
    return _stream_cold(ctx, ck.path)


def copy_ceiling(ctx: Ctx, ck: Ckpt) -> dict:
    """The export's ceiling on this machine: the .mdl file copied whole into the export's output folder, cold (read
    as ``disk_read`` does, written through the page cache, fsync'ed at the end, as ``ckptfs export`` does), nothing
    decoded. An export reads the checkpoint and writes about as many bytes to the same disk."""
    out = ctx.workdir / "export-out"
    out.mkdir(parents=True, exist_ok=True)
    target = out / "copy-ceiling.bin"
    try:
        return _stream_cold(ctx, ck.path, target)
    finally:
        target.unlink(missing_ok=True)


def _stream_cold(ctx: Ctx, path: Path, copy_to: Path | None = None) -> dict:
    """``path`` read whole in order, 8 MiB at a time with O_DIRECT, page cache dropped before each run; with
    ``copy_to``, each block also written there (a new file each run) and fsync'ed at the end, inside the timing."""
    import mmap

    buf = mmap.mmap(-1, 8 << 20)  # page-aligned, as O_DIRECT asks
    runs, nbytes = [], 0
    for _ in range(ctx.repeat):
        if copy_to is not None:
            copy_to.unlink(missing_ok=True)
        drop_caches()
        src = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        dst = None if copy_to is None else os.open(copy_to, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            t0, off = time.perf_counter(), 0
            while n := os.preadv(src, [buf], off):
                if dst is not None:
                    os.write(dst, memoryview(buf)[:n])
                off += n
            if dst is not None:
                os.fsync(dst)
            runs.append(time.perf_counter() - t0)
            nbytes = off
        finally:
            os.close(src)
            if dst is not None:
                os.close(dst)
    return _summary(runs, nbytes, o_direct=hasattr(os, "O_DIRECT"))


def raw_read(ctx: Ctx, ck: Ckpt) -> dict:
    """Baseline: h5py reads every dataset, cold page cache."""
    runs, nbytes = [], None
    for _ in range(ctx.repeat):
        drop_caches()
        r = probe("raw", ck.path, env=ctx.env)
        runs.append(r["seconds"])
        nbytes = r["bytes"]
    return _summary(runs, nbytes)


def hf_dir(mnt: Path) -> Path:
    """Where the HF files are inside a mount (``hf/`` when views are in subdirectories)."""
    return mnt / "hf" if (mnt / "hf").is_dir() else mnt


def discover(ctx: Ctx, ck: Ckpt, local: Path) -> dict:
    """One fresh mount: the no-data-read check first (before anything else touches it), then list the HF files and
    copy the small ones (config, index) into ``local``, the pre-converted copy used as the from_pretrained baseline."""
    m = ctx.mount(ck, "discover")
    m.start()
    try:
        check = stat_and_index_check(ctx, ck, m)
        hf = hf_dir(m.mountpoint)
        names = sorted(os.listdir(hf))
        if (hf / "bin").is_dir():  # --hf-format both: the .bin files are in the HF folder's bin/ folder
            names = [n for n in names if n != "bin"] + sorted(f"bin/{n}" for n in os.listdir(hf / "bin"))
        sizes = {n: os.stat(hf / n).st_size for n in names}
        local.mkdir(parents=True, exist_ok=True)
        small = [n for n in names if n.endswith(".json") and "/" not in n]
        for n in small:
            shutil.copyfile(hf / n, local / n)
        rel = str(hf.relative_to(m.mountpoint)) if hf != m.mountpoint else ""
    finally:
        m.stop()
    st = [n for n in names if n.startswith("model") and n.endswith(".safetensors")]
    bins = [n for n in names if n.rpartition("/")[2].startswith("pytorch_model") and n.endswith(".bin")]
    if not st or not bins:
        raise StepError(f"HF view has no weights (files: {names})")
    return {"hf_rel": rel, "files": names, "sizes": sizes, "safetensors": st, "bins": bins, "small": small,
            "no_data_read": check}


def stat_and_index_check(ctx: Ctx, ck: Ckpt, m: Mount) -> dict:
    """``ls -lR`` of the whole mount plus reading every ``*.index.json`` must not read tensor data (see noread)."""
    ranges = noread.chunk_ranges(ck.path)
    out: dict = {"chunks": len(ranges), "method": "strace" if noread.strace_available() else "rchar"}
    trace = ctx.workdir / f"server-{m.pid}.strace"
    drop_caches()
    io0 = m.io()
    tracer = noread.Tracer(m.pid, trace) if out["method"] == "strace" else None
    with tracer or contextlib.nullcontext():
        sysutil.run(["ls", "-lR", m.mountpoint], stdout=subprocess.DEVNULL, timeout=120)
        index_bytes = sum(len(p.read_bytes()) for p in sorted(m.mountpoint.rglob("*.index.json")))
    io1 = m.io()
    if tracer:  # positive control: the same tracer set-up must see chunk reads when weight bytes are read
        ctl = ctx.workdir / f"server-{m.pid}-control.strace"
        weights = sorted(hf_dir(m.mountpoint).glob("*.safetensors"))[0]
        with noread.Tracer(m.pid, ctl) as t2:
            with open(weights, "rb") as f:
                f.seek(os.path.getsize(weights) // 2)
                f.read(1 << 20)
        preads2, unknown2 = noread.parse_trace(t2.text(), ck.path)
        ctl.unlink(missing_ok=True)
        out["server_control"] = {**noread.classify(preads2, ranges), "unknown_reads": unknown2,
                                 "what": f"1 MiB from the middle of {weights.name}"}
    out["index_bytes"] = index_bytes
    out["rchar_delta"] = io1["rchar"] - io0["rchar"]
    out["read_bytes_delta"] = io1["read_bytes"] - io0["read_bytes"]
    if tracer:
        preads, unknown = noread.parse_trace(tracer.text(), ck.path)
        trace.unlink(missing_ok=True)
        out.update(noread.classify(preads, ranges), unknown_reads=unknown)
        out["controls"] = noread.controls(ck.path, ctx.workdir, ranges)
        out["ok"] = (out["data_reads"] == 0 and out["unknown_reads"] == 0 and out["controls"]["discriminates"]
                     and out["server_control"]["data_reads"] > 0)
    else:
        # without strace: a data read pulls at least one whole stored chunk, so fewer bytes read in total than the
        # smallest stored chunk means no chunk was read (rchar also counts metadata and FUSE requests: cautious)
        smallest = min(b - a for a, b in ranges)
        out["smallest_chunk"] = smallest
        out["ok"] = out["rchar_delta"] < smallest
    return out


def _cp_to_null(src: Path, names: list) -> float:
    """Seconds ``cp`` takes to copy each of the files ``names`` in ``src`` to /dev/null, one after the other."""
    return sum(sysutil.timed(["cp", src / n, "/dev/null"])[0] for n in names)


def cp_weights(ctx: Ctx, ck: Ckpt, layout: dict, kind: str, zip_crc: str) -> dict:
    """``cp`` every weight shard of ``kind`` ("safetensors"/"bins") out of a fresh mount to /dev/null."""
    names = layout[kind]
    nbytes = sum(layout["sizes"][n] for n in names)
    runs, cpu = [], []
    for _ in range(ctx.repeat):
        with ctx.mount(ck, f"cp-{kind}-{zip_crc}", zip_crc=zip_crc) as m:
            src = m.mountpoint / layout["hf_rel"]
            drop_caches()
            c0 = m.cpu()
            runs.append(_cp_to_null(src, names))
            cpu.append(m.cpu() - c0)
    return _summary(runs, nbytes, files=names, zip_crc=zip_crc, server_cpu_s=[round(c, 2) for c in cpu],
                    server_cpu_s_per_gb=round(median(cpu) / (nbytes / 1e9), 2))


def export_weights(ctx: Ctx, ck: Ckpt, layout: dict, local: Path) -> dict:
    """``ckptfs export CKPT OUTDIR --views hf --hf-format safetensors`` (no FUSE; wall time incl. interpreter start,
    cold) with ``--threads`` 1, 2 and the CPU count; the last run's shards are moved into ``local``."""
    names = layout["safetensors"]
    nbytes = sum(layout["sizes"][n] for n in names)
    cores = os.cpu_count() or 1
    out = ctx.workdir / "export-out"
    sweep, peaks = {}, []
    for threads in sorted({1, 2, cores}):
        runs = []
        for _ in range(ctx.repeat):
            shutil.rmtree(out, ignore_errors=True)
            drop_caches()
            argv = ckptfs_argv("export", ck.path, out, "--views", "hf", "--hf-format", "safetensors",
                               "--threads", str(threads), "--config", ck.params, "--cache-size", ctx.cache_size)
            if ctx.max_shard_size:
                argv += ["--max-shard-size", ctx.max_shard_size]
            dt, peak = sysutil.timed_peak(argv, env=_env_with_cache(ctx, "export"))
            runs.append(dt)
            peaks.append(peak)
        sweep[threads] = _summary(runs, nbytes)
    local.mkdir(parents=True, exist_ok=True)
    folder = out / layout["hf_rel"] if layout["hf_rel"] else out
    for n in names:
        os.replace(folder / n, local / n)
    shutil.rmtree(out, ignore_errors=True)
    sizes_ok = all((local / n).stat().st_size == layout["sizes"][n] for n in names)
    return {**sweep[cores], "threads": cores, "sweep": {str(t): v["mb_s"] for t, v in sweep.items()},
            "files": names, "sizes_match_mount": sizes_ok, "includes_startup": True, "peak_rss": peaks}


def _env_with_cache(ctx: Ctx, tag: str) -> dict:
    env = dict(ctx.env)
    env["CKPTFS_CACHE_DIR"] = str(ctx.workdir / "ckptfs-cache" / f"{tag}-{next(_ids):03d}")
    return env


def ensure_local_copy(ctx: Ctx, ck: Ckpt, layout: dict, local: Path) -> str:
    """Make sure ``local`` holds every safetensors shard (from export; else copied from a mount). Returns how."""
    missing = [n for n in layout["safetensors"]
               if not (local / n).exists() or (local / n).stat().st_size != layout["sizes"][n]]
    if not missing:
        return "ckptfs export"
    with ctx.mount(ck, "local-copy") as m:
        for n in missing:
            shutil.copyfile(m.mountpoint / layout["hf_rel"] / n, local / n)
    return "cp from the mount"


def same_bytes(a: Path, b: Path, block: int = 8 << 20) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(block), fb.read(block)
            if x != y:
                return False
            if not x:
                return True


def export_matches_mount(ctx: Ctx, ck: Ckpt, layout: dict, local: Path) -> bool:
    """The exported/copied local shards are byte-identical to what a fresh mount serves."""
    with ctx.mount(ck, "compare") as m:
        return all(same_bytes(m.mountpoint / layout["hf_rel"] / n, local / n) for n in layout["safetensors"])


def from_pretrained(ctx: Ctx, ck: Ckpt, layout: dict, local: Path) -> dict:
    """``from_pretrained`` + touching every weight page: through a fresh mount vs the local copy, and, as the
    ceiling of the binding, through the trivial passthrough serving that local copy (cold too), interleaved."""
    runs: dict = {"mount": [], "local": [], "passthrough": []}
    server_cpu = []
    for _ in range(ctx.repeat):
        with ctx.mount(ck, "from_pretrained") as m:
            drop_caches()
            c0 = m.cpu()
            runs["mount"].append(probe("from_pretrained", m.mountpoint / layout["hf_rel"], env=_hf_env(ctx)))
            server_cpu.append(round(m.cpu() - c0, 2))
        drop_caches()
        runs["local"].append(probe("from_pretrained", local, env=_hf_env(ctx)))
        with passthrough_mount(ctx, local) as mnt:
            drop_caches()
            runs["passthrough"].append(probe("from_pretrained", mnt, env=_hf_env(ctx)))
    out = {}
    for side, rs in runs.items():
        out[side] = {**_summary([r["seconds"] for r in rs]),
                     "load_s": [round(r["load_seconds"], 3) for r in rs],
                     "touch_s": [round(r["touch_seconds"], 3) for r in rs],
                     "model": {k: rs[-1][k] for k in ("class", "dtype", "bytes")}}
    out["mount"]["server_cpu_s"] = server_cpu
    out["ratio"] = round(out["mount"]["median_s"] / out["local"]["median_s"], 3)
    out["passthrough_ratio"] = round(out["passthrough"]["median_s"] / out["local"]["median_s"], 3)
    return out


def hf_to_cs(ctx: Ctx, layout: dict, local: Path) -> dict:
    """The other direction (issue 30): the local copy (config.json + safetensors shards + index: a Hugging Face model
    folder) mounted as a Cerebras checkpoint. Per run, cold: ``cp`` of the source safetensors to /dev/null (the
    plain read, the baseline); ``cp`` of the mounted ``checkpoint.mdl`` (fresh mount, sized by one stat first, as
    a user's loader does); ``ckptfs export`` of the folder's ``cs`` view (eager, no FUSE, wall time with startup)."""
    names = layout["safetensors"]
    src_bytes = sum(layout["sizes"][n] for n in names)
    plain, mdl, cpu, export, peaks = [], [], [], [], []
    size = None
    for _ in range(ctx.repeat):
        drop_caches()
        plain.append(_cp_to_null(local, names))
        n = next(_ids)
        m = Mount(local, ctx.workdir / "mnt" / f"{n:03d}", cache_size=ctx.cache_size,
                  cache_dir=ctx.workdir / "ckptfs-cache" / f"{n:03d}", label="hf-to-cs:mdl", env=ctx.env,
                  on_stop=ctx._record)
        with m:
            size = os.stat(m.mountpoint / "checkpoint.mdl").st_size
            drop_caches()
            c0 = m.cpu()
            mdl.append(_cp_to_null(m.mountpoint, ["checkpoint.mdl"]))
            cpu.append(m.cpu() - c0)
        peaks.append(m.peak_rss)
        out = ctx.workdir / "hf-to-cs-export"
        shutil.rmtree(out, ignore_errors=True)
        drop_caches()
        dt, _ = sysutil.timed(ckptfs_argv("export", local, out, "--views", "cs", "--cache-size", ctx.cache_size),
                              env=_env_with_cache(ctx, "hf-to-cs-export"))
        if (out / "checkpoint.mdl").stat().st_size != size:
            raise StepError("the exported checkpoint.mdl differs in size from the mounted one")
        export.append(dt)
        shutil.rmtree(out, ignore_errors=True)
    res = {"plain": _summary(plain, src_bytes, files=names),
           "mdl": _summary(mdl, size, server_cpu_s=[round(c, 2) for c in cpu],
                           server_cpu_s_per_gb=round(median(cpu) / (size / 1e9), 2)),
           "export": _summary(export, size, includes_startup=True),
           "peak_rss": [p for p in peaks if p]}
    res["ratio"] = round(res["mdl"]["mb_s"] / res["plain"]["mb_s"], 3)
    return res


def cp_passthrough(ctx: Ctx, layout: dict, local: Path) -> dict:
    """The ceiling of the cp lines: ``cp`` of the local copy of the safetensors weights to /dev/null through the
    trivial passthrough (same binding and options as ckptfs, nothing to convert), page cache dropped first."""
    names = layout["safetensors"]
    nbytes = sum(layout["sizes"][n] for n in names)
    runs = []
    for _ in range(ctx.repeat):
        with passthrough_mount(ctx, local) as mnt:
            drop_caches()
            runs.append(_cp_to_null(mnt, names))
    return _summary(runs, nbytes, files=names)


def memory_first_touch(ctx: Ctx) -> dict:
    """Seconds per GB to write 256 MiB of memory the first time and again (``probes.first_touch``). On a VM whose
    balloon reports free pages to the host, memory freed a few seconds ago is taken back, and the first write to
    each page then waits for the host: every byte a FUSE server puts into the kernel's page cache pays that on the
    server's CPU, while a disk read into the page cache lands there without the guest's CPU."""
    return probe("first_touch", env=ctx.env)


def _hf_env(ctx: Ctx) -> dict:
    env = dict(ctx.env)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def torch_first_open(ctx: Ctx, ck: Ckpt, layout: dict) -> dict:
    """``torch.load(mmap=True, weights_only=True)`` of the first .bin shard on a fresh mount (exact CRC): with an
    empty CRC store (cold) and, on a new mount, with the store the cold run left behind (warm)."""
    name = layout["bins"][0]
    dirs = [ctx.workdir / "ckptfs-cache" / f"crc-{next(_ids):03d}" for _ in range(ctx.repeat)]
    out = {"file": name, "bytes": layout["sizes"][name]}
    for phase in ("cold", "warm"):  # warm reuses the CRC store each cold run left behind
        secs, cpu, rchar = [], [], []
        for cache_dir in dirs:
            with ctx.mount(ck, f"torch.load-{phase}", cache_dir=cache_dir) as m:
                drop_caches()
                c0, r0 = m.cpu(), m.io()["rchar"]
                secs.append(probe("torchload", m.mountpoint / layout["hf_rel"] / name, env=ctx.env)["seconds"])
                cpu.append(round(m.cpu() - c0, 2))
                rchar.append(m.io()["rchar"] - r0)
        out[phase] = {**_summary(secs), "server_cpu_s": cpu, "server_rchar": rchar}
    return out


def mirror_tree(src: Path, dest: Path) -> int:
    """Copy the shape of the tree at ``src`` to ``dest`` (removed first): its folders, its files as sparse files of
    the same sizes (no data), its links with the same targets. Returns the number of files."""
    shutil.rmtree(dest, ignore_errors=True)
    files = 0
    for root, dirs, names in os.walk(src):
        rel = Path(root).relative_to(src)
        (dest / rel).mkdir(parents=True, exist_ok=True)
        for name in names + [d for d in dirs if (Path(root) / d).is_symlink()]:
            path = Path(root) / name
            if path.is_symlink():
                os.symlink(os.readlink(path), dest / rel / name)
            else:
                with open(dest / rel / name, "wb") as f:
                    f.truncate(path.stat().st_size)
                files += 1
    return files


def _ls_lR(path: Path) -> tuple:
    """(seconds, files listed) of ``ls -lR path`` (output discarded)."""
    t0 = time.perf_counter()
    r = sysutil.run(["ls", "-lR", path], timeout=120)
    secs = time.perf_counter() - t0
    return secs, sum(1 for ln in r.stdout.decode(errors="replace").splitlines() if ln.startswith("-"))


def _passthrough_ls(ctx: Ctx, mirror: Path) -> float:
    """``ls -lR`` through the trivial passthrough serving ``mirror``, whose own metadata is read once before (the
    ceiling of a listing with this binding on this machine: FUSE round trips, no tree to compute)."""
    _ls_lR(mirror)
    with passthrough_mount(ctx, mirror) as mnt:
        return _ls_lR(mnt)[0]


def _cold_start_floor(ctx: Ctx, mirror: Path) -> dict:
    """What any mount of an HDF5 checkpoint waits for with the page cache dropped, whatever it computes: a Python
    that imports numpy and h5py, and the trivial passthrough's whole mount (Python, the FUSE binding, the mount)."""
    imports, passthrough = [], []
    for _ in range(ctx.repeat):
        drop_caches()
        imports.append(sysutil.timed([sys.executable, "-c", "import numpy, h5py"], env=ctx.env)[0])
        drop_caches()
        t0 = time.perf_counter()
        with passthrough_mount(ctx, mirror):
            passthrough.append(time.perf_counter() - t0)
    return {"python_numpy_h5py": _summary(imports), "passthrough_mount": _summary(passthrough)}


def metadata_scale(ctx: Ctx, ck: Ckpt) -> dict:
    """70B-shaped (unallocated) checkpoint: mount wall time (cold page cache, and warm; each a first mount, with an
    empty cache directory), mounting it again (cold page cache, the catalog index of the first mount in the cache
    directory), ``ls -lR`` time right after mounting, index read time, server read bytes; plus where the mount time
    goes (``probes.mount_breakdown``). Beside them, the machine's floor for each: ``ls -lR`` of the same tree shape
    through the trivial passthrough (interleaved), and a cold Python importing numpy and h5py and the passthrough's
    cold mount (``_cold_start_floor``)."""
    mounts, lss, idx, rchar, nfiles, ceiling = [], [], [], [], None, []
    mirror = ctx.workdir / "mirror-70b"
    for i in range(ctx.repeat):
        m = ctx.mount(ck, "70b")
        drop_caches()
        mounts.append(m.start())
        try:
            io0 = m.io()
            secs, nfiles = _ls_lR(m.mountpoint)
            lss.append(secs)
            index = m.mountpoint / ("hf" if (m.mountpoint / "hf").is_dir() else "") / "model.safetensors.index.json"
            t0 = time.perf_counter()
            with open(index, "rb") as f:
                data = f.read()
            idx.append(time.perf_counter() - t0)
            rchar.append(m.io()["rchar"] - io0["rchar"])
            if i == 0:
                mirror_tree(m.mountpoint, mirror)
        finally:
            m.stop()
        ceiling.append(_passthrough_ls(ctx, mirror))
    warm = []  # the same mount with the page cache left warm (Python modules, checkpoint metadata)
    for _ in range(ctx.repeat):
        m = ctx.mount(ck, "70b-warm")
        warm.append(m.start())
        m.stop()
    # mounting it again: one cache directory, whose catalog index (ckptfs.readers.cerebras.catalog_cache) the first mount writes
    shared = ctx.workdir / "ckptfs-cache" / "70b-remount"
    m = ctx.mount(ck, "70b-index", cache_dir=shared)
    m.start()
    m.stop()
    remount = []
    for _ in range(ctx.repeat):
        m = ctx.mount(ck, "70b-remount", cache_dir=shared)
        drop_caches()
        remount.append(m.start())
        m.stop()
    t_python, _ = sysutil.timed([sys.executable, "-c", "pass"])
    breakdown = probe("mount_breakdown", ck.path, ck.params, env=ctx.env)
    breakdown["python_startup_s"] = t_python
    return {"mount": _summary(mounts), "mount_warm_cache": _summary(warm), "remount": _summary(remount),
            "mount_breakdown": breakdown, "cold_start_floor": _cold_start_floor(ctx, mirror),
            "ls_lR": _summary(lss, files=nfiles), "ls_lR_passthrough": _summary(ceiling),
            "index_read": _summary(idx, index_bytes=len(data)),
            "server_rchar_during_ls_and_index": rchar,
            "note": "datasets are unallocated, so no tensor bytes exist on disk; rchar is metadata + FUSE requests"}


def first_read_warm(ctx: Ctx, ck: Ckpt, layout: dict, local: Path) -> dict:
    """First read of the safetensors weights from a fresh mount with the checkpoint already in the page cache
    (so the server's own cost shows, not the disk's), beside a trivial passthrough FUSE filesystem of the same
    binding serving the local copy of the same files (warm too): the ceiling for this binding and machine. Dirty
    pages are written back before each timed copy (``os.sync``), so that no earlier step's writeback lands in it
    (the first of three runs was 2-4x slower than the others for the mount and the passthrough alike)."""
    names = layout["safetensors"]
    nbytes = sum(layout["sizes"][n] for n in names)
    runs, ceiling = [], []
    for _ in range(ctx.repeat):
        with ctx.mount(ck, "first-read-warm") as m:
            src = m.mountpoint / layout["hf_rel"]
            _read_through(ck.path)
            os.sync()
            runs.append(_cp_to_null(src, names))
        with passthrough_mount(ctx, local) as mnt:
            for n in names:
                _read_through(local / n)
            os.sync()
            ceiling.append(_cp_to_null(mnt, names))
    return {"mount": _summary(runs, nbytes), "passthrough": _summary(ceiling, nbytes)}


def _read_through(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass


@contextlib.contextmanager
def passthrough_mount(ctx: Ctx, src: Path):
    """``benchlib/passthrough.py`` serving ``src`` on a fresh mount point (foreground process, unmounted after)."""
    mnt = ctx.workdir / "mnt" / f"passthrough-{next(_ids):03d}"
    mnt.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("passthrough.py")), str(src), str(mnt)],
                            env=ctx.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not os.path.ismount(mnt):
            if proc.poll() is not None:
                raise StepError(f"passthrough server exited: {proc.stderr.read().decode(errors='replace')[-300:]}")
            if time.monotonic() > deadline:
                raise StepError("passthrough server did not mount within 60 s")
            time.sleep(0.02)
        yield mnt
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            mnt.rmdir()


def partial_reads(ctx: Ctx, ck: Ckpt, layout: dict) -> dict:
    """4 KiB from the start of every tensor of the safetensors weights vs every tensor read whole, each on a fresh
    mount with the page cache dropped (interleaved runs)."""
    runs: dict = {"peek": [], "whole": []}
    info: dict = {}
    for _ in range(ctx.repeat):
        for kind in ("peek", "whole"):
            with ctx.mount(ck, f"partial-{kind}") as m:
                files = [m.mountpoint / layout["hf_rel"] / n for n in layout["safetensors"]]
                drop_caches()
                r = probe(kind, *files, env=ctx.env)
                runs[kind].append(r["seconds"])
                info[kind] = {"tensors": r["tensors"], "bytes": r["bytes"]}
    out = {k: {**_summary(v), **info[k]} for k, v in runs.items()}
    out["ratio"] = round(out["peek"]["median_s"] / out["whole"]["median_s"], 4)
    return out


def end_to_end(ctx: Ctx, ck: Ckpt, layout: dict) -> dict:
    """Checkpoint -> loaded HF model, cold: ``ckptfs mount`` + ``from_pretrained`` (touching every weight page) +
    ``ckptfs umount``, beside the eager path it replaces: ``ckptfs export`` of the HF files (safetensors) to a local
    folder + ``from_pretrained`` of it. Wall time of everything a user waits for."""
    runs: dict = {"mount": [], "eager": []}
    for _ in range(ctx.repeat):
        m = ctx.mount(ck, "end-to-end")
        drop_caches()
        t0 = time.perf_counter()
        m.start()
        try:
            probe("from_pretrained", m.mountpoint / layout["hf_rel"], env=_hf_env(ctx))
        finally:
            m.stop()
        runs["mount"].append(time.perf_counter() - t0)
        out_dir = ctx.workdir / f"eager-{next(_ids):03d}"
        drop_caches()
        t0 = time.perf_counter()
        argv = ckptfs_argv("export", ck.path, out_dir, "--config", ck.params, "--views", "hf", "--hf-format",
                           "safetensors")
        if ctx.max_shard_size:
            argv += ["--max-shard-size", ctx.max_shard_size]
        sysutil.run(argv, env=_env_with_cache(ctx, "eager"))
        hf = out_dir / "hf" if (out_dir / "hf").is_dir() else out_dir
        probe("from_pretrained", hf, env=_hf_env(ctx))
        runs["eager"].append(time.perf_counter() - t0)
        shutil.rmtree(out_dir, ignore_errors=True)
    out = {k: _summary(v) for k, v in runs.items()}
    out["ratio"] = round(out["mount"]["median_s"] / out["eager"]["median_s"], 3)
    return out


def tf_cp(ctx: Ctx, ck: Ckpt) -> dict:
    """``cp -r MNT/tf`` out of a fresh mount with ``--views tf`` (cold CRC store: the first read of the index reads
    every tensor once for its CRC) into a local folder, beside real TensorFlow writing the same variables from
    memory (probe ``tf_save``: the tensors read into memory, a TF1 ``Saver`` saving them, as ``h5-to-tensorflow``
    does): wall times, MB/s, both peak RSS, and whether the two wrote the same bytes."""
    out, theirs = ctx.workdir / "tf-cp", ctx.workdir / "tf-save"
    runs, peaks = [], []
    for _ in range(ctx.repeat):
        shutil.rmtree(out, ignore_errors=True)
        m = ctx.mount(ck, "cp-tf", extra=("--views", "tf"))
        with m:
            drop_caches()
            runs.append(sysutil.timed(["cp", "-r", m.mountpoint / "tf", out])[0])
        peaks.append(m.peak_rss)
    nbytes = sum(p.stat().st_size for p in out.iterdir())
    prefix = next(p.name for p in out.iterdir() if p.name.endswith(".index"))[:-len(".index")]
    tf_runs, tf_peaks, info = [], [], {}
    for _ in range(ctx.repeat):
        shutil.rmtree(theirs, ignore_errors=True)
        theirs.mkdir(parents=True)
        drop_caches()
        wall, peak = sysutil.timed_peak([sys.executable, str(Path(__file__).with_name("probes.py")), "tf_save",
                                         ck.path, theirs, prefix], env=ctx.env)
        info = json.loads((theirs / "probe.json").read_text())
        tf_runs.append(wall)
        tf_peaks.append(peak)
    same = all(same_bytes(out / p.name, p) for p in theirs.iterdir() if p.name.startswith(prefix + "."))
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(theirs, ignore_errors=True)
    return {"mount": _summary(runs, nbytes, peak_rss=peaks),
            "tensorflow": _summary(tf_runs, nbytes, peak_rss=tf_peaks, save_s=round(info.get("save_s", 0), 3),
                                   includes_startup=True),
            "same_bytes": same}
