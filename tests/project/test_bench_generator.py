"""The benchmark's checkpoint generator (scripts/benchlib/gen.py) writes files in the real cstorch 0.5 layout that
h5py, ckptfs's source reader and ``ckptfs info`` accept. Tiny sizes only; no timing assertions."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import hdf5plugin  # noqa: F401
import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from benchlib import gen, noread  # noqa: E402
from helpers import run_ckptfs  # noqa: E402

FIXTURE_DIMS = gen.LlamaDims(hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, vocab=128, max_positions=64, tied=True)
TINY = gen.LlamaDims(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=96)


def _attr_type(obj, name):
    a = obj.attrs.get_id(name)
    return a.dtype, a.shape, a.get_type().get_class()


def test_matches_real_fixture_layout(tmp_path, fixtures):
    """Same dims as the llama fixture → identical attributes, metadata strings, chunking, filters and params YAML."""
    out = tmp_path / "checkpoint.mdl"
    gen.write_checkpoint(out, FIXTURE_DIMS, "fp32")
    ref_dir = fixtures / "llama" / "cs"
    with h5py.File(out, "r") as a, h5py.File(ref_dir / "checkpoint.mdl", "r") as b:
        assert sorted(a.attrs) == sorted(b.attrs)
        for name in b.attrs:
            assert a.attrs[name] == b.attrs[name], name
            assert _attr_type(a, name) == _attr_type(b, name), name
        assert sorted(a) == sorted(b)
        for key in b:
            da, db = a[key], b[key]
            assert (da.shape, da.dtype, da.chunks, da._filters) == (db.shape, db.dtype, db.chunks, db._filters), key
            assert sorted(da.attrs) == sorted(db.attrs)
            for n in db.attrs:
                assert np.array_equal(da.attrs[n], db.attrs[n]), (key, n)
                assert _attr_type(da, n) == _attr_type(db, n), (key, n)
    assert gen.write_params(tmp_path / "params.yaml", FIXTURE_DIMS).read_text() == (ref_dir / "params.yaml").read_text()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_data_round_trips_through_h5py_and_source_reader(tmp_path, dtype):
    from ckptfs.readers import open_checkpoint

    out = tmp_path / "checkpoint_0.mdl"
    info = gen.write_checkpoint(out, TINY, dtype, seed=7)
    keys = ["model." + k for k, _ in gen.cs_tensors(TINY)]
    assert info["keys"] == len(keys) == 9 * TINY.layers + 4
    assert not list(tmp_path.glob("*.tmp"))
    rng = np.random.default_rng(7)
    with h5py.File(out, "r") as f:
        assert f.attrs["__version__"] == 0.5 and bool(f.attrs["__SUCCESS__"])
        for key, (_, shape) in zip(keys, gen.cs_tensors(TINY)):
            want = gen.random_tensor(rng, shape, dtype, norm=len(shape) == 1)
            got = f[key][()]
            assert got.dtype == (np.int16 if dtype == "bf16" else np.float32)
            assert np.array_equal(got, want), key
            meta = json.loads(f.attrs[key + ".__metadata__"])
            assert meta["__objects__"] == [key]
            assert meta[key + ".__metadata__"]["shapes"] == [list(shape)]
    with open_checkpoint(out) as ck:
        assert ck.format_version == 0.5 and ck.success and ck.release == "2.10.0"
        tensors = ck.tensors()
        assert list(tensors) == keys
        emb = tensors["model.embedding_layer.word_embeddings.weight"].tensor
        assert tuple(emb.shape) == (TINY.vocab, TINY.hidden)
        assert emb.dtype.name == ("bfloat16" if dtype == "bf16" else "float32")


def test_unallocated_checkpoint_is_metadata_only(tmp_path):
    from ckptfs.readers import open_checkpoint

    dims = gen.LlamaDims(hidden=1024, layers=3, heads=8, kv_heads=2, ffn=2816, vocab=32000)
    out = tmp_path / "big.mdl"
    info = gen.write_checkpoint(out, dims, "bf16", allocate=False)
    assert info["tensor_bytes"] == dims.params() * 2 > 50 * info["disk_bytes"]
    with h5py.File(out, "r") as f:
        d = f["model.lm_head.weight"]
        assert d.id.get_storage_size() == 0 and d.chunks is not None and "32004" in d._filters
        assert not d[:2, :3].any()  # fill value
    with open_checkpoint(out) as ck:
        assert len(ck.tensors()) == info["keys"]


@pytest.mark.slow  # starts processes
def test_ckptfs_info_accepts_generated_checkpoint(tmp_path):
    out = tmp_path / "checkpoint_0.mdl"
    gen.write_checkpoint(out, TINY, "bf16")
    gen.write_params(tmp_path / "params.yaml", TINY)
    r = run_ckptfs("info", out, cwd=REPO, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


@pytest.mark.parametrize("target", ["8MB", "100MB", "768MB", "1.5GiB"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_dims_for_size_is_close(target, dtype):
    from ckptfs.units import parse_size

    n = parse_size(target)
    d = gen.dims_for_size(n, dtype)
    assert d.layers >= 4 and d.hidden % d.heads == 0 and d.heads % d.kv_heads == 0
    assert abs(d.params() * (2 if dtype == "bf16" else 4) / n - 1) < 0.3


def test_noread_classification():
    ranges = [(100, 2100), (5000, 9000)]
    r = noread.classify([(0, 100), (2100, 512), (90, 40), (5000, 4000), (4000, 6000)], ranges)
    assert r == {"preads": 5, "data_reads": 2, "data_read_bytes": 10000, "partial_overlaps": 1}
    trace = (f"12 pread64(3</x/c.mdl>, \"\"..., 4000, 5000) = 4000\n"
             f"12 pread64(4</x/other>, \"\"..., 10, 0) = 10\n12 read(3</x/c.mdl>, \"\"..., 8) = 8\n")
    assert noread.parse_trace(trace, "/x/c.mdl") == ([(5000, 4000)], 1)


def test_report_marks_unmeasured_items_as_errors():
    from benchlib import report

    lines = report.target_lines({}, {"bf16.raw": "StepError: boom"}, ["bf16"], 256 << 20)
    assert lines and all(x.result == "ERROR" for x in lines)
    assert "boom" in lines[0].measured
    assert "RESULT" in report.table(lines).splitlines()[0]


def test_report_reproduces_a_real_run():
    """The measurements of the README's bench run give back exactly the lines that run printed, the ceilings beside
    the cp, from_pretrained and first-read lines and the fresh-memory line included (fails when a line's wording,
    verdict or source changes without the README's run being redone)."""
    from benchlib import report

    run = json.loads((REPO / "tests" / "bench_report_684d6d7.json").read_text())
    lines = report.target_lines(run["results"], run["errors"], run["args"]["dtypes"], run["args"]["cache_bytes"])
    assert report.as_json(lines) == run["targets"]
    text = report.table(lines)
    assert "passthrough ceiling 1.04x" in text and "882 MB/s, cold, nothing converted" in text
    assert "start 3.25 / 0.06" in text and "1: 170, 2: 230" in text  # the export's --threads sweep
    assert "0.58x (515 vs 882 MB/s)" in text  # cp safetensors against the passthrough's cold cp, bf16
    assert "641 MB/s = 0.85x raw h5py" in text  # the disk's own ceiling, bf16
    assert sum(x.result == "PASS" for x in lines) == 11


def test_report_of_a_run_before_the_disk_line_has_none():
    """A report from before the disk's ceiling was measured gives back exactly the lines that run printed: no disk
    line, no error for it."""
    from benchlib import report

    run = json.loads((REPO / "tests" / "bench_report_e8e8f5a.json").read_text())
    lines = report.target_lines(run["results"], run["errors"], run["args"]["dtypes"], run["args"]["cache_bytes"])
    assert report.as_json(lines) == run["targets"]
    assert not any("disk's ceiling" in x.target for x in lines)


def test_report_ceilings_follow_the_measurements():
    """The ceiling lines are computed from the passthrough's own runs, not copied: halving its cp time doubles the
    reported ceiling."""
    from benchlib import report

    run = json.loads((REPO / "tests" / "bench_report_684d6d7.json").read_text())
    res = run["results"]
    before = res["bf16"]["cp_passthrough"]["mb_s"]
    res["bf16"]["cp_passthrough"]["mb_s"] = 2 * before
    res["bf16"]["from_pretrained"]["passthrough_ratio"] = 0.5
    lines = {x.target: x for x in report.target_lines(res, run["errors"], ["bf16"], run["args"]["cache_bytes"])}
    ceiling = lines["bf16: cp, trivial passthrough of the local copy (ceiling)"].measured
    assert f"({2 * before:.0f} MB/s," in ceiling and f"{before:.0f} MB/s" not in ceiling
    assert "passthrough ceiling 0.50x" in lines["bf16: from_pretrained mount / local"].measured


def test_report_shows_the_mount_again_beside_the_first_mount():
    """The 70B mount target is judged on first mounts (an empty cache directory); mounting again with the catalog
    index of the first is its own INFO line, shown when measured."""
    from benchlib import report

    run = json.loads((REPO / "tests" / "bench_report_e8e8f5a.json").read_text())
    res = run["results"]
    again = res["70b"].pop("remount")
    names = [x.target for x in report.target_lines(res, run["errors"], ["bf16"], run["args"]["cache_bytes"])]
    assert "70B: mount again (catalog index), cold cache" not in names and "70B: mount, warm page cache" in names
    res["70b"]["remount"] = again
    lines = {x.target: x for x in report.target_lines(res, run["errors"], ["bf16"], run["args"]["cache_bytes"])}
    line = lines["70B: mount again (catalog index), cold cache"]
    assert line.measured == f"{again['median_s']:.2f} s" and line.result == "INFO"
    first = lines["70B: mount (ckptfs mount wall, cold cache)"]
    assert first.result == "FAIL" and first.measured == f"{res['70b']['mount']['median_s']:.2f} s"

def test_report_puts_the_machines_floor_beside_the_70b_lines():
    """The 70B mount and ``ls -lR`` lines show the floors measured beside them (a cold Python importing numpy and
    h5py, the passthrough's cold mount, its ``ls -lR`` of the same tree shape), computed from those runs; a run from
    before they were measured shows the lines as it printed them."""
    from benchlib import report

    run = json.loads((REPO / "tests" / "bench_report_e8e8f5a.json").read_text())
    res = run["results"]
    res["70b"]["cold_start_floor"] = {"python_numpy_h5py": {"median_s": 0.386}, "passthrough_mount": {"median_s": 0.19}}
    res["70b"]["ls_lR_passthrough"] = {"median_s": 0.613}
    lines = {x.target: x for x in report.target_lines(res, run["errors"], ["bf16"], run["args"]["cache_bytes"])}
    mount = lines["70B: mount (ckptfs mount wall, cold cache)"]
    assert mount.measured == (f"{res['70b']['mount']['median_s']:.2f} s (floor, cold: python + numpy + h5py 0.39 s; "
                              "passthrough mount 0.19 s)")
    ls = lines[f"70B: ls -lR ({res['70b']['ls_lR']['files']} files)"]
    assert ls.measured == f"{res['70b']['ls_lR']['median_s']:.2f} s (passthrough ceiling 0.61 s)"
    assert ls.result == ("PASS" if res["70b"]["ls_lR"]["median_s"] <= report.LS_70B_TARGET_S else "FAIL")


def test_report_reproduces_the_run_with_the_70b_floors():
    """The README's sixth run (the 70B lines with the machine's floor beside them) gives back exactly the lines it
    printed."""
    from benchlib import report

    run = json.loads((REPO / "tests" / "bench_report_cf0c97c.json").read_text())
    lines = report.target_lines(run["results"], run["errors"], run["args"]["dtypes"], run["args"]["cache_bytes"])
    assert report.as_json(lines) == run["targets"]
    text = report.table(lines)
    assert "1.31 s (floor, cold: python + numpy + h5py 0.35 s; passthrough mount 0.21 s)" in text
    assert "0.86 s (passthrough ceiling 0.61 s)" in text
    assert sum(x.result == "PASS" for x in lines) == 13


def test_mirror_tree_copies_the_shape_without_data(tmp_path):
    """The passthrough's ``ls -lR`` serves a copy of the mounted tree's shape: the same folders, files of the same
    sizes holding no data blocks, links with the same targets."""
    from benchlib.measure import mirror_tree

    src, dest = tmp_path / "src", tmp_path / "mirror"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "big.bin").write_bytes(b"x" * 100_000)
    (src / "empty.txt").write_bytes(b"")
    (src / "link").symlink_to("a/b/big.bin")
    (src / "dirlink").symlink_to("a")
    dest.mkdir()
    (dest / "stale").write_text("left from an earlier run")
    assert mirror_tree(src, dest) == 2
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*")) == \
        ["a", "a/b", "a/b/big.bin", "dirlink", "empty.txt", "link"]
    big = dest / "a" / "b" / "big.bin"
    assert big.stat().st_size == 100_000 and big.stat().st_blocks == 0
    assert (dest / "link").readlink() == Path("a/b/big.bin") and (dest / "dirlink").readlink() == Path("a")


def test_report_judges_the_exports_peak_rss_against_the_cache_bound():
    """An export's peak RSS is a line of its own, judged as a mount's (300 MB + --cache-size); a run from before it
    was measured has no such line."""
    from benchlib import report

    run = json.loads((REPO / "tests" / "bench_report_684d6d7.json").read_text())
    res, cache = run["results"], run["args"]["cache_bytes"]
    name = "bf16: ckptfs export peak RSS (3 runs)"
    assert name not in [x.target for x in report.target_lines(res, run["errors"], ["bf16"], cache)]
    limit = report.RSS_BASE_BYTES + cache
    for peak, verdict in ((limit, "PASS"), (limit + 1, "FAIL")):
        res["bf16"]["export"]["peak_rss"] = [limit // 2, peak, limit // 3]
        lines = {x.target: x for x in report.target_lines(res, run["errors"], ["bf16"], cache)}
        assert lines[name].result == verdict and lines[name].measured == f"{peak / 1e6:.0f} MB"


@pytest.mark.slow  # starts processes
def test_timed_peak_reports_the_commands_own_peak_rss():
    """``timed_peak`` gives the peak RSS of the command it ran, neither that of the largest child waited for before
    nor the memory of the process that starts it (a forked child's ``ru_maxrss`` counts its parent's): a child holding
    200 MB, then one holding nothing, started from this test process (hundreds of MB in a test worker)."""
    import sys

    from benchlib import sysutil

    hold = "b = bytearray(200_000_000); b[::4096] = b'x' * len(b[::4096])"
    _, big = sysutil.timed_peak([sys.executable, "-c", hold])
    _, small = sysutil.timed_peak([sys.executable, "-c", "pass"])
    assert big >= 200_000_000 and small < 100_000_000, (big, small)
    with pytest.raises(sysutil.StepError, match="exit 3"):
        sysutil.timed_peak([sys.executable, "-c", "import sys; sys.exit(3)"])


def test_report_puts_the_exports_ceiling_beside_it():
    """The copy of the .mdl on the output's disk is the export's ceiling: its line gives its speed against raw h5py
    and the export's share of it, computed from both measurements; runs before it have no such line."""
    from benchlib import report

    run = json.loads((REPO / "tests" / "bench_report_684d6d7.json").read_text())
    res, cache = run["results"], run["args"]["cache_bytes"]
    name = "bf16: export's ceiling: the .mdl copied on the output disk"
    assert name not in [x.target for x in report.target_lines(res, run["errors"], ["bf16"], cache)]
    exp, raw = res["bf16"]["export"]["mb_s"], res["bf16"]["raw"]["mb_s"]
    res["bf16"]["copy_ceiling"] = {"mb_s": 2 * exp, "median_s": 1.0, "runs_s": [1.0]}
    line = {x.target: x for x in report.target_lines(res, run["errors"], ["bf16"], cache)}[name]
    assert line.result == "INFO" and f"{2 * exp:.0f} MB/s = {2 * exp / raw:.2f}x raw h5py" in line.measured
    assert line.measured.endswith("export 0.50x of it")


def test_report_reproduces_the_run_with_the_exports_lines():
    """The README's fourth run (the export's peak RSS and ceiling lines) gives back exactly the lines it printed."""
    from benchlib import report

    run = json.loads((REPO / "tests" / "bench_report_1e9d6c6.json").read_text())
    lines = report.target_lines(run["results"], run["errors"], run["args"]["dtypes"], run["args"]["cache_bytes"])
    assert report.as_json(lines) == run["targets"]
    text = report.table(lines)
    assert "322 MB/s = 0.43x raw h5py" in text and "export 0.77x of it" in text
    assert "516 MB" in text and "452 MB" in text
    assert sum(x.result == "PASS" for x in lines) == 14


def _s3_mdl_results(**over) -> dict:
    """Measurements of the S3 lines over one ``.mdl`` object as ``benchlib/s3mdl.py`` records them (made up)."""
    about = {"server": "rclone v1.75.2 serve s3 over a local folder, 127.0.0.1", "object_bytes": 1000 * 10**6,
             "machine": "benchhost: 2 CPUs (Some CPU), 24 GiB RAM, Linux 6.18", "in_flight_bytes": 64 << 20}
    r = {"s3_mdl_cp": {**about, "ckptfs": {"median_s": 4.0, "server_sent": [1001 * 10**6]},
                       "boto3": {"median_s": 5.0, "server_sent": [1000 * 10**6]}, "ratio": 1.25},
         "s3_from_pretrained": {**about, "s3": {"median_s": 9.0}, "local": {"median_s": 7.0},
                                "download": {"median_s": 10.0, "download_s": [4.0, 5.0, 6.0]}, "peak_rss": [400e6],
                                "ratio_download": 0.9, "ratio_local": 1.286},
         "s3_export_hf": {**about, "ckptfs": {"median_s": 5.0}, "boto3": {"median_s": 6.0}, "ratio": 1.2},
         "s3_many_readers": {**about, "one": {"median_s": 10.0, "server_sent": [1002 * 10**6]},
                             "many": {"median_s": 12.0, "server_sent": [1050 * 10**6]}, "peak_rss": [420e6],
                             "bytes_ratio": 1.05, "wall_ratio": 1.2},
         "s3_info_startup": {**about, "cold": {"first_request_s": {"median_s": 0.35}, "total_s": {"median_s": 1.1}},
                             "warm": {"first_request_s": {"median_s": 0.2}, "total_s": {"median_s": 0.8}}}}
    for k, v in over.items():
        item, _, field = k.partition("__")
        r[item][field] = v
    return r


def _s3_mdl_lines(results: dict, errors: dict | None = None, parts=None) -> dict:
    from benchlib import report

    lines = report.target_lines({"bf16": results, "servers": [{"peak_rss": 400e6}]}, errors or {}, ["bf16"],
                                256 << 20, parts if parts is not None else frozenset(report.S3_MDL_ITEMS))
    return {x.target: x for x in lines}


def test_report_s3_mdl_lines_judge_each_target():
    """Each line of the .mdl-object S3 items is judged against its own target from the recorded ratio, names the
    server's host, and the first names the server and the machine in full; the local lines are left out when only
    the S3 items ran."""
    lines = _s3_mdl_lines(_s3_mdl_results())
    assert not any(n.startswith("bf16: raw") or n.startswith("70B") for n in lines)
    head = lines["bf16: S3 .mdl object: server, machine"].measured
    assert "rclone v1.75.2" in head and "benchhost: 2 CPUs (Some CPU)" in head
    s3 = [x for n, x in lines.items() if "S3 .mdl" in n and "server, machine" not in n and "peak RSS" not in n]
    assert len(s3) == 7 and all(x.result == "PASS" and "rclone v1.75.2 on benchhost" in x.measured for x in s3)
    assert lines["bf16: S3 .mdl: ckptfs info, spawn to first request (cold)"].measured.startswith("0.350 s (total 1.10")
    rss = lines["bf16: S3 .mdl: mount server peak RSS"]
    assert rss.measured == "from_pretrained 400 MB; 4 readers 420 MB" and rss.result == "PASS" and "in flight 67" in rss.limit

    failing = _s3_mdl_results(s3_mdl_cp__ratio=0.9, s3_from_pretrained__ratio_download=1.1,
                              s3_from_pretrained__ratio_local=1.6, s3_export_hf__ratio=0.8,
                              s3_many_readers__bytes_ratio=1.2, s3_many_readers__wall_ratio=1.4,
                              s3_many_readers__peak_rss=[900e6],
                              s3_info_startup__cold={"first_request_s": {"median_s": 0.5}, "total_s": {"median_s": 1}})
    lines = _s3_mdl_lines(failing)
    judged = [x for n, x in lines.items() if "S3 .mdl" in n and "server, machine" not in n]
    assert len(judged) == 8 and all(x.result == "FAIL" for x in judged)


def test_report_s3_mdl_floor_lines_show_the_local_file_beside_the_download():
    """The cp and export items also time the same work on the local file: an INFO line each, with the ratio to the
    download, when recorded (runs before they were measured have none)."""
    lines = _s3_mdl_lines(_s3_mdl_results(s3_mdl_cp__local={"median_s": 4.5}, s3_mdl_cp__local_ratio=1.111,
                                          s3_export_hf__local={"median_s": 7.5}, s3_export_hf__local_ratio=0.8))
    cp = lines["bf16: .mdl local file: cp safetensors vs boto3 download of the object (the conversion's floor)"]
    export = lines["bf16: .mdl local file: export --views hf vs boto3 download of the objects (the floor)"]
    assert cp.result == export.result == "INFO"
    assert cp.measured.startswith("1.11x (4.50 vs 5.00 s") and export.measured.startswith("0.80x (7.50 vs 6.00 s")
    assert not any("local file" in n for n in _s3_mdl_lines(_s3_mdl_results()))


def test_report_s3_many_readers_floor_lines():
    """Many readers are also timed on a mount of the local file and on a plain folder of the same files (no
    ckptfs): an INFO line each, when recorded."""
    lines = _s3_mdl_lines(_s3_mdl_results(s3_many_readers__local_one={"median_s": 2.0},
                                          s3_many_readers__local_many={"median_s": 3.5},
                                          s3_many_readers__local_wall_ratio=1.75,
                                          s3_many_readers__plain_one={"median_s": 1.6},
                                          s3_many_readers__plain_many={"median_s": 3.2},
                                          s3_many_readers__plain_wall_ratio=2.0))
    local = lines["bf16: 4 readers, one mount of the local file: wall / one reader (the machine's floor)"]
    plain = lines["bf16: 4 readers of a plain folder of the same files, no ckptfs: wall / one reader (the machine's "
                  "floor)"]
    assert local.result == plain.result == "INFO"
    assert local.measured == "1.75x (3.50 vs 2.00 s)" and plain.measured == "2.00x (3.20 vs 1.60 s)"
    assert not any("plain folder" in n or "local file: wall" in n for n in _s3_mdl_lines(_s3_mdl_results()))


def test_report_s3_mdl_lines_of_items_that_could_not_run():
    """The server not starting makes every S3 item asked for an ERROR line; an item not asked for gives none."""
    lines = _s3_mdl_lines({}, {"bf16.s3_server": "RuntimeError: rclone serve s3 did not start"},
                          frozenset({"s3_mdl_cp", "s3_info_startup"}))
    s3 = {n: x for n, x in lines.items() if "S3" in n}
    assert sorted(s3) == ["bf16: S3 .mdl object: cp safetensors vs boto3 download",
                          "bf16: S3 .mdl: ckptfs info, spawn to first request (cold)"]
    assert all(x.result == "ERROR" and "did not start" in x.measured for x in s3.values())


def test_first_request_at_the_server_is_read_from_rclones_log():
    from benchlib import s3mdl

    log = ("2026/12/07 02:41:49.249923 NOTICE: Local file system at /x: Starting s3 server on [http://127.0.0.1:1/]\n"
           "2026/12/07 02:41:51.316691 DEBUG : serve s3: HEAD OBJECT bench run/checkpoint_0.mdl\n"
           "2026/12/07 02:41:51.324262 DEBUG : serve s3: GET OBJECT Bucket: bench Object: run/checkpoint_0.mdl\n")
    from datetime import datetime, timezone

    want = datetime(2026, 12, 7, 2, 41, 51, 316691, tzinfo=timezone.utc).timestamp()
    assert s3mdl.first_request(log) == want
    assert s3mdl.first_request(log.splitlines()[0]) is None


def test_bench_only_names_parts():
    import bench

    assert bench.parse_parts("s3") == frozenset(bench.S3_PARTS)
    assert bench.parse_parts("local, s3_info_startup") == {"local", "s3_info_startup"}
    with pytest.raises(ValueError, match="unknown part 'S3'"):
        bench.parse_parts("S3")
    assert bench.parse_args(["--only", "s3", "--dtype", "both"]).dtypes == ["bf16"]
    assert set(bench.parse_args(["--no-s3"]).parts) == {"local", "70b"}
