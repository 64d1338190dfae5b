#!/usr/bin/env python
"""ckptfs benchmark (issues #7, #14): generated llama checkpoints, throughput and latency through the mount, PASS/FAIL.

    .venv/bin/python scripts/bench.py [--size 1.5GiB] [--dtype bf16|fp32|both] [--workdir DIR]
                                      [--json bench-out/bench.json] [--quick] [--repeat 3] [--cache-size 256MiB]
                                      [--only local,70b,s3,s3_mdl_cp,…] [--no-s3]

1. Writes, in the real cstorch 2.10 layout (scripts/benchlib/gen.py), one llama-shaped checkpoint of ``--size``
   tensor bytes per dtype with random weights, plus a llama-2-70b-shaped bf16 one whose datasets are declared but
   never written (metadata only), and a params YAML next to each.
2. Measures (each 3x, median; page cache dropped before every run when root; every FUSE run on a fresh mount):
   raw h5py read of every tensor (the baseline); ``cp`` of the safetensors and .bin weights (CRC exact, cold CRC
   store, and CRC zero) to /dev/null, beside ``cp`` of the local copy of the same files through a trivial
   passthrough FUSE filesystem of the same binding (the ceiling of the cp lines); ``ckptfs export`` (its wall time
   and peak RSS), beside the .mdl file copied on the output's disk (its ceiling: read, write, fsync);
   ``from_pretrained`` through the mount vs a local copy of the same files (and through the passthrough, its
   ceiling); first read of the weights with the checkpoint in the page cache, beside a trivial passthrough
   FUSE filesystem of the same binding (the ceiling); 4 KiB from every tensor vs every tensor whole; checkpoint ->
   loaded model end to end (mount + from_pretrained + umount) vs ``ckptfs export`` + local from_pretrained;
   ``torch.load(mmap=True)`` first open of a .bin (cold and warm CRC store); ``cp -r`` of the tf view (a TF
   saver checkpoint, cold CRC store) vs TensorFlow's Saver writing the same variables from memory, with both peak
   RSS and whether the bytes are the same; for the first dtype, the checkpoint in
   Cerebras' S3 layout on a local S3-compatible endpoint (``benchlib/s3.py``: ``cp`` from the S3-sourced mount vs
   boto3's managed download, requests per 4 KiB peek) and the ``.mdl`` as ONE object on a local ``rclone serve s3``
   (``benchlib/s3mdl.py``: ``cp`` vs boto3's download, ``from_pretrained`` vs boto3's download + a local load and vs
   the local-file mount, ``ckptfs export`` vs boto3's download, 4 readers on one mount, ``ckptfs info``'s time to
   its first request, the mount servers' peak RSS); 70B mount and
   ``ls -lR`` time and index read; that no tensor data is read to answer stat/index; for bf16, the local copy (an HF
   folder) mounted as a Cerebras checkpoint: ``cp`` of its ``checkpoint.mdl`` vs ``cp`` of the source safetensors,
   and ``ckptfs export`` of it (issue 30); the servers' peak RSS; at the start and
   the end, what writing fresh memory costs on this machine (a VM whose balloon hands freed memory back to the
   host makes every page a FUSE server writes into the page cache wait for the host).
   ``--only`` runs some parts alone (``--only s3``: every S3 line, a few minutes at ``--size 256MB``).

3. Prints one line per target, writes the JSON report. Exit 0 when every item was measured (targets may FAIL),
   1 when something crashed or could not be measured, 2 on bad arguments.

Generated data lives in ``--workdir`` (default /tmp/ckptfs-bench) and is removed at the end unless ``--keep``;
``--reuse`` reuses kept checkpoints of the same shape.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
import zlib
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

from benchlib import gen, measure, report, sysutil  # noqa: E402
from benchlib import s3 as s3bench  # noqa: E402
from benchlib import s3mdl  # noqa: E402
from ckptfs.units import parse_size  # noqa: E402

DEFAULT_SIZE = "1.5GiB"
QUICK_SIZE = "24MB"
#: the S3 items: the checkpoint in Cerebras' S3 layout on moto (``s3_layout``), the .mdl as one object on rclone
S3_PARTS = ("s3_layout", *report.S3_MDL_ITEMS)
#: what ``--only`` can name: the lines of the local files, the 70B-shaped metadata lines, every S3 item or one
PARTS = ("local", "70b", *S3_PARTS)
ONLY_GROUPS = {"s3": S3_PARTS}


def parse_parts(text: str) -> frozenset:
    """``--only``'s comma-separated names (``PARTS``, or ``s3`` for every S3 item) as a set of parts."""
    out = set()
    for name in filter(None, (x.strip() for x in text.split(","))):
        if name in ONLY_GROUPS:
            out.update(ONLY_GROUPS[name])
        elif name in PARTS:
            out.add(name)
        else:
            raise ValueError(f"--only: unknown part {name!r} (known: s3, {', '.join(PARTS)})")
    if not out:
        raise ValueError("--only: no part named")
    return frozenset(out)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", help=f"tensor bytes of each generated checkpoint (default {DEFAULT_SIZE}; "
                                  f"{QUICK_SIZE} with --quick)")
    p.add_argument("--dtype", choices=("bf16", "fp32", "both"), default="both")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/ckptfs-bench"))
    p.add_argument("--json", type=Path, default=REPO / "bench-out" / "bench.json")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run of every measurement")
    p.add_argument("--repeat", type=int, default=3, help="runs per measurement (median reported)")
    p.add_argument("--cache-size", default="256MiB", help="the mounts' --cache-size")
    p.add_argument("--max-shard-size", help="the mounts' --max-shard-size (default: ckptfs's)")
    p.add_argument("--keep", action="store_true", help="keep the generated checkpoints in the workdir")
    p.add_argument("--reuse", action="store_true", help="reuse kept checkpoints when their shape matches")
    p.add_argument("--no-s3", action="store_true", help="leave out the S3 lines (the first dtype's checkpoint in "
                                                         "Cerebras' S3 layout on a local moto endpoint, and as one "
                                                         ".mdl object on a local rclone endpoint)")
    p.add_argument("--only", help="run only these parts, comma-separated: local, 70b, s3 (every S3 item), or one S3 "
                                  f"item ({', '.join(S3_PARTS)})")
    args = p.parse_args(argv)
    args.size = args.size or (QUICK_SIZE if args.quick else DEFAULT_SIZE)
    try:
        args.size_bytes = parse_size(args.size)
        args.cache_bytes = parse_size(args.cache_size)
        if args.max_shard_size:
            parse_size(args.max_shard_size)
    except ValueError as e:
        p.error(str(e))
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    try:
        parts = parse_parts(args.only) if args.only else frozenset(PARTS)
    except ValueError as e:
        p.error(str(e))
    if args.no_s3:
        parts -= set(S3_PARTS)
    args.parts = sorted(parts)
    args.dtypes = ["bf16", "fp32"] if args.dtype == "both" else [args.dtype]
    if "local" not in parts:  # the S3 items run for the first dtype only
        args.dtypes = args.dtypes[:1]
    return args


def generate(name: str, dims: gen.LlamaDims, dtype: str, root: Path, *, allocate: bool, reuse: bool) -> measure.Ckpt:
    d = root / name
    path, params, meta = d / "checkpoint_0.mdl", d / "params.yaml", d / "gen.json"
    want = {"dims": asdict(dims), "dtype": dtype, "allocated": allocate}
    if reuse and path.exists() and meta.exists():
        info = json.loads(meta.read_text())
        if all(info.get(k) == v for k, v in want.items()):
            info["reused"] = True
            return measure.Ckpt(name, path, params, info)
    d.mkdir(parents=True, exist_ok=True)
    info = gen.write_checkpoint(path, dims, dtype, allocate=allocate, seed=zlib.crc32(name.encode()))
    gen.write_params(params, dims)
    meta.write_text(json.dumps(info, indent=2))
    return measure.Ckpt(name, path, params, info)


def environment() -> dict:
    def git(*a):
        r = subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    return {"python": sys.version.split()[0], "kernel": platform.release(), "cpus": os.cpu_count(),
            "root": sysutil.is_root(), "cold_runs": sysutil.is_root(), "loadavg_start": os.getloadavg(),
            "git_head": git("rev-parse", "--short", "HEAD"), "git_dirty_files": len((git("status", "--short") or "").splitlines()),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


class Runner:
    """Runs items one by one; an item that raises is recorded in ``errors`` and the run goes on."""

    def __init__(self):
        self.results: dict = {}
        self.errors: dict = {}

    def item(self, key: str, fn, *a, store: bool = True, **kw):
        group, name = key.split(".", 1)
        t0 = time.perf_counter()
        print(f"[bench] {key} …", file=sys.stderr, flush=True)
        try:
            val = fn(*a, **kw)
        except Exception as e:  # noqa: BLE001  (recorded, reported as ERROR, exit 1)
            self.errors[key] = f"{type(e).__name__}: {e}"
            print(f"[bench] {key} FAILED: {self.errors[key]}", file=sys.stderr, flush=True)
            if os.environ.get("BENCH_DEBUG"):
                traceback.print_exc()
            return None
        if store:
            self.results.setdefault(group, {})[name] = val
        print(f"[bench] {key} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        return val


def run_dtype(r: Runner, ctx: measure.Ctx, ck: measure.Ckpt, parts: frozenset) -> None:
    """The lines of checkpoint ``ck`` among ``parts`` (its S3 items only when they are in ``parts``)."""
    d = ck.name
    local = ctx.workdir / "local" / d
    if "local" in parts:
        r.item(f"{d}.raw", measure.raw_read, ctx, ck)
        r.item(f"{d}.disk", measure.disk_read, ctx, ck)
    layout = r.item(f"{d}.layout", measure.discover, ctx, ck, local)
    if layout is None:
        return
    if "local" in parts:
        run_local(r, ctx, ck, layout, local)
    if "s3_layout" in parts:
        r.item(f"{d}.s3", s3bench.measure_s3, ctx, ck, layout)
    if parts & set(report.S3_MDL_ITEMS):
        run_s3_mdl(r, ctx, ck, layout, parts)
    shutil.rmtree(local, ignore_errors=True)


def run_local(r: Runner, ctx: measure.Ctx, ck: measure.Ckpt, layout: dict, local: Path) -> None:
    d = ck.name
    r.item(f"{d}.cp_safetensors", measure.cp_weights, ctx, ck, layout, "safetensors", "exact")
    r.item(f"{d}.cp_bin_exact", measure.cp_weights, ctx, ck, layout, "bins", "exact")
    r.item(f"{d}.cp_bin_zero", measure.cp_weights, ctx, ck, layout, "bins", "zero")
    r.item(f"{d}.export", measure.export_weights, ctx, ck, layout, local)
    r.item(f"{d}.copy_ceiling", measure.copy_ceiling, ctx, ck)
    how = r.item(f"{d}.local_copy", measure.ensure_local_copy, ctx, ck, layout, local)
    if how is None:
        return
    r.item(f"{d}.cp_passthrough", measure.cp_passthrough, ctx, layout, local)
    if d == "bf16":  # issue 30: the local copy is an HF folder; mounted as a Cerebras checkpoint
        r.item(f"{d}.hf_to_cs", measure.hf_to_cs, ctx, layout, local)
    r.item(f"{d}.export_matches_mount", measure.export_matches_mount, ctx, ck, layout, local)
    r.item(f"{d}.datacheck", sysutil.probe, "datacheck", ck.path, *[local / n for n in layout["safetensors"]],
           env=ctx.env)
    r.item(f"{d}.from_pretrained", measure.from_pretrained, ctx, ck, layout, local)
    r.item(f"{d}.first_read_warm", measure.first_read_warm, ctx, ck, layout, local)
    r.item(f"{d}.partial_reads", measure.partial_reads, ctx, ck, layout)
    r.item(f"{d}.end_to_end", measure.end_to_end, ctx, ck, layout)
    r.item(f"{d}.torch_first_open", measure.torch_first_open, ctx, ck, layout)
    r.item(f"{d}.tf_cp", measure.tf_cp, ctx, ck)


def run_s3_mdl(r: Runner, ctx: measure.Ctx, ck: measure.Ckpt, layout: dict, parts: frozenset) -> None:
    """The items over the .mdl as one S3 object (benchlib/s3mdl.py), one rclone server for them all."""
    d = ck.name
    served = r.item(f"{d}.s3_server", s3mdl.serve, ctx, ck, store=False)
    if served is None:
        return
    try:
        for key, fn in (("s3_mdl_cp", s3mdl.mdl_cp), ("s3_from_pretrained", s3mdl.from_pretrained),
                        ("s3_export_hf", s3mdl.export_hf), ("s3_many_readers", s3mdl.many_readers)):
            if key in parts:
                r.item(f"{d}.{key}", fn, ctx, ck, layout, served)
        if "s3_info_startup" in parts:
            r.item(f"{d}.s3_info_startup", s3mdl.info_startup, ctx, ck)
    finally:
        served.stop()


def byte_compile() -> None:
    """Byte-compile ckptfs as ``pip install`` of a wheel does, so that every interpreter the bench starts (the CLI,
    the mount server, probes) loads cached bytecode like a user's install: this repository is installed editable,
    and an environment with ``PYTHONDONTWRITEBYTECODE=1`` (this machine's) would otherwise compile all ~100 modules
    from source in every process (~0.2 s each time)."""
    import compileall

    compileall.compile_dir(str(REPO / "ckptfs"), quiet=1)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    created = not args.workdir.exists()
    ckpt_root = args.workdir / "ckpt"
    run_dir = args.workdir / f"run-{os.getpid()}"
    parts = frozenset(args.parts)
    # the local lines' copies of each checkpoint; the S3 lines' download or export of one beside them
    need = args.size_bytes * len(args.dtypes) * 2.2 + (1 << 30) + (args.size_bytes * 1.1 if parts & set(S3_PARTS) else 0)
    args.workdir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.workdir).free
    if free < need:
        print(f"bench: {args.workdir} has {free / 1e9:.1f} GB free, needs about {need / 1e9:.1f} GB", file=sys.stderr)
        return 1
    if not sysutil.is_root():
        print("bench: not root: page caches cannot be dropped, runs after the first are warm", file=sys.stderr)
    byte_compile()
    r = Runner()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO), env.get("PYTHONPATH")) if x)
    ctx = measure.Ctx(workdir=run_dir, repeat=args.repeat, cache_size=args.cache_size,
                      max_shard_size=args.max_shard_size, env=env)
    meta = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "environment": environment(), "checkpoints": {}}
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        r.item("memory.start", measure.memory_first_touch, ctx)
        cks = {}
        for d in args.dtypes:
            dims = gen.dims_for_size(args.size_bytes, d)
            ck = r.item(f"generate.{d}", generate, d, dims, d, ckpt_root, allocate=True,
                        reuse=args.reuse, store=False)
            if ck:
                cks[d] = ck
                meta["checkpoints"][d] = ck.info
        big = None
        if "70b" in parts:
            big = r.item("generate.70b", generate, "70b", gen.LLAMA2_70B, "bf16", ckpt_root, allocate=False,
                         reuse=args.reuse, store=False)
        if big:
            meta["checkpoints"]["70b"] = big.info
        for i, d in enumerate(args.dtypes):
            if d in cks:  # the S3 items for the first dtype only
                run_dtype(r, ctx, cks[d], parts if i == 0 else parts - set(S3_PARTS))
        if big:
            r.item("70b.metadata", measure.metadata_scale, ctx, big)
        r.item("memory.end", measure.memory_first_touch, ctx)
    except KeyboardInterrupt:
        r.errors["interrupted"] = "KeyboardInterrupt"
    finally:
        r.results["servers"] = ctx.peaks
        shutil.rmtree(run_dir, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(ckpt_root, ignore_errors=True)
            if created:
                shutil.rmtree(args.workdir, ignore_errors=True)
    big_results = r.results.get("70b", {}).get("metadata")
    if big_results is not None:
        r.results["70b"] = big_results
    lines = report.target_lines(r.results, r.errors, [d for d in args.dtypes], args.cache_bytes,
                                None if parts == frozenset(PARTS) else parts)
    complete = not r.errors and all(x.result != "ERROR" for x in lines)
    meta["environment"]["loadavg_end"] = os.getloadavg()
    meta["seconds"] = round(time.perf_counter() - t_start, 1)
    out = {**meta, "results": r.results, "errors": r.errors, "targets": report.as_json(lines), "complete": complete}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(report.table(lines))
    print(f"\n{sum(x.result == 'PASS' for x in lines)} PASS, {sum(x.result == 'FAIL' for x in lines)} FAIL, "
          f"{sum(x.result == 'ERROR' for x in lines)} ERROR; {meta['seconds']:.0f} s; JSON: {args.json}")
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
