"""Turn the benchmark's measurements into target lines (PASS / FAIL / INFO / ERROR), a table and the JSON report.

PASS/FAIL lines are the issue #7 targets at the issue #14 levels; INFO lines are reported numbers without a target (and unmet stretch
goals); ERROR means the item could not be measured, which makes the whole run incomplete (exit 1).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

CP_TARGET = 1.0  # cp of converted weights ≥ 1.0 × raw h5py read throughput (issue #14; #7 asked 0.7)
CP_STRETCH = 1.5
CP_PASSTHROUGH_TARGET = 0.6  # cp of converted weights ≥ 0.6 × the trivial passthrough's cold cp of the bytes (#32)
EXPORT_TARGET = 1.5  # ckptfs export of the HF view's weights ≥ 1.5 × raw h5py, start-up included (#32)
FROM_PRETRAINED_TARGET = 1.15  # via the mount ≤ 1.15 × the local pre-converted copy (#7: 1.3)
FIRST_READ_WARM_MB_S = 1000  # first read of a file, checkpoint in the page cache ≥ 1 GB/s
PARTIAL_TARGET = 0.15  # 4 KiB from every tensor ≤ 15% of reading every tensor whole
MOUNT_70B_TARGET_S = 0.5  # (#7: 1.0 s)
LS_70B_TARGET_S = 0.5
RSS_BASE_BYTES = 300 * 10**6  # peak server RSS ≤ 300 MB + --cache-size
HF_TO_CS_TARGET = 1.0  # reading an HF folder's mounted .mdl ≥ 1.0 × a plain read of its safetensors (issue 30)
S3_CP_TARGET = 1.0  # cp from an S3-sourced mount ≥ 1.0 × boto3's managed download of the same objects (issue #29)
S3_PEEK_REQUESTS = 3  # a 4 KiB read of one tensor on a mounted checkpoint costs at most 3 requests
# the .mdl as ONE S3 object (benchlib/s3mdl.py)
S3_MDL_CP_TARGET = 1.0  # cp of the shards from its mount: boto3's download time / ckptfs's time ≥ 1.0
S3_FP_DOWNLOAD_TARGET = 1.0  # from_pretrained through its mount ≤ 1.0 × boto3 download + from_pretrained
S3_FP_LOCAL_TARGET = 1.5  # from_pretrained through its mount ≤ 1.5 × through a mount of the local file
S3_EXPORT_TARGET = 1.0  # ckptfs export of the HF view: boto3's download time / the export's ≥ 1.0
S3_READERS = 4  # readers loading the model together through one mount
S3_READERS_BYTES = 1.1  # bytes the server sent for them ≤ 1.1 × the object
S3_READERS_WALL = 1.3  # their wall time ≤ 1.3 × one reader's
S3_INFO_FIRST_REQUEST_S = 0.4  # ckptfs info: process spawned to its first request at the server
S3_FIRST_REQUEST_S = 0.4  # `ckptfs info s3://…`: its first request within 0.4 s of the process's start


@dataclass
class Line:
    target: str
    measured: str
    limit: str
    result: str  # PASS | FAIL | INFO | ERROR


def _err(name: str, errors: dict, keys) -> Line | None:
    for k in keys:
        if k in errors:
            msg = f"not measured: {errors[k]}"
            return Line(name, msg if len(msg) <= 60 else msg[:57] + "...", "", "ERROR")
    return None


def _ratio_lines(d: str, label: str, item: dict | None, raw: dict | None, key: str, errors: dict,
                 stretch: bool = True, passthrough: dict | None = None) -> list:
    name = f"{d}: {label} vs raw h5py"
    e = _err(name, errors, [f"{d}.raw", f"{d}.{key}", f"{d}.layout"])
    if e or item is None or raw is None:
        return [e or Line(name, "not measured", "", "ERROR")]
    ratio = item["mb_s"] / raw["mb_s"]
    measured = f"{ratio:.2f}x ({item['mb_s']:.0f} vs {raw['mb_s']:.0f} MB/s"
    if "server_cpu_s_per_gb" in item:
        measured += f"; server {item['server_cpu_s_per_gb']:.1f} CPU-s/GB"
    measured += ")"
    out = [Line(name, measured, f">= {CP_TARGET:.2f}x", "PASS" if ratio >= CP_TARGET else "FAIL")]
    if stretch:
        out.append(Line(f"{d}: {label} stretch", f"{ratio:.2f}x", f">= {CP_STRETCH:.2f}x",
                        "PASS" if ratio >= CP_STRETCH else "INFO"))
    if passthrough is not None:  # what the binding itself reaches here, cold, for the same bytes
        pt = item["mb_s"] / passthrough["mb_s"]
        out.append(Line(f"{d}: {label} vs trivial passthrough", f"{pt:.2f}x ({item['mb_s']:.0f} vs "
                                                                f"{passthrough['mb_s']:.0f} MB/s)",
                        f">= {CP_PASSTHROUGH_TARGET:.2f}x", _verdict(pt >= CP_PASSTHROUGH_TARGET)))
    return out


def _export_lines(d: str, exp: dict | None, raw: dict | None, errors: dict, cache_bytes: int) -> list:
    """``ckptfs export`` of the HF view's weights against raw h5py (target), its ``--threads`` sweep and its peak RSS
    (within ``--cache-size`` + 300 MB, as a mount's)."""
    name = f"{d}: ckptfs export HF weights vs raw h5py"
    e = _err(name, errors, [f"{d}.export", f"{d}.raw"])
    if e or exp is None or raw is None:
        return [e or Line(name, "not measured", "", "ERROR")]
    ratio = exp["mb_s"] / raw["mb_s"]
    out = [Line(name, f"{ratio:.2f}x ({exp['mb_s']:.0f} MB/s incl. startup, --threads {exp['threads']})",
                f">= {EXPORT_TARGET:.2f}x", _verdict(ratio >= EXPORT_TARGET))]
    sweep = ", ".join(f"{t}: {mb:.0f}" for t, mb in sorted(exp["sweep"].items(), key=lambda kv: int(kv[0])))
    out.append(Line(f"{d}: ckptfs export --threads sweep (MB/s)", sweep, "", "INFO"))
    if exp.get("peak_rss"):  # runs before it was measured have none
        peak, limit = max(exp["peak_rss"]), RSS_BASE_BYTES + cache_bytes
        out.append(Line(f"{d}: ckptfs export peak RSS ({len(exp['peak_rss'])} runs)", f"{peak / 1e6:.0f} MB",
                        f"<= {limit / 1e6:.0f} MB", _verdict(peak <= limit)))
    return out


def target_lines(results: dict, errors: dict, dtypes: list, cache_bytes: int, parts=None) -> list:
    """Every line of a run. ``parts``: which parts ran (``bench.PARTS``: "local", "70b", the S3 items); None:
    every part, as in runs before ``--only`` (lines of parts that did not run are left out, not ERROR)."""
    def ran(part: str) -> bool:
        return parts is None or part in parts

    lines: list = []
    for d in dtypes:
        r = results.get(d, {})
        if ran("local"):
            lines += _local_lines(d, r, errors, cache_bytes)
        if f"{d}.s3" in errors or r.get("s3") is not None:
            lines += _s3_lines(d, r.get("s3"), errors)
        lines += _s3_mdl_lines(d, r, errors, cache_bytes, parts)
    if ran("70b"):
        big = results.get("70b")
        e = _err("70B: mount", errors, ["70b.metadata"])
        if e or big is None:
            lines.append(e or Line("70B: mount", "not measured", "", "ERROR"))
        else:
            floor = big.get("cold_start_floor")
            beside = (f" (floor, cold: python + numpy + h5py {floor['python_numpy_h5py']['median_s']:.2f} s; "
                      f"passthrough mount {floor['passthrough_mount']['median_s']:.2f} s)") if floor else ""
            lines.append(Line("70B: mount (ckptfs mount wall, cold cache)", f"{big['mount']['median_s']:.2f} s{beside}",
                              f"<= {MOUNT_70B_TARGET_S:.1f} s", "PASS" if big["mount"]["median_s"] <= MOUNT_70B_TARGET_S else "FAIL"))
            if big.get("mount_warm_cache"):
                lines.append(Line("70B: mount, warm page cache", f"{big['mount_warm_cache']['median_s']:.2f} s", "", "INFO"))
            if big.get("remount"):
                lines.append(Line("70B: mount again (catalog index), cold cache", f"{big['remount']['median_s']:.2f} s",
                                  "", "INFO"))
            b = big.get("mount_breakdown")
            if b:
                lines.append(Line("70B: mount breakdown (one interpreter)",
                                  f"python {b['python_startup_s']:.2f} + imports {b['imports_s']:.2f} "
                                  f"+ build_tree {b['build_tree_s']:.2f} s", "", "INFO"))
            ceiling = big.get("ls_lR_passthrough")
            beside = f" (passthrough ceiling {ceiling['median_s']:.2f} s)" if ceiling else ""
            lines.append(Line(f"70B: ls -lR ({big['ls_lR'].get('files')} files)", f"{big['ls_lR']['median_s']:.2f} s{beside}",
                              f"<= {LS_70B_TARGET_S:.1f} s", "PASS" if big["ls_lR"]["median_s"] <= LS_70B_TARGET_S else "FAIL"))
            lines.append(Line("70B: read model.safetensors.index.json",
                              f"{big['index_read']['median_s'] * 1000:.1f} ms, server rchar "
                              f"+{max(big['server_rchar_during_ls_and_index']) // 1024} KiB", "", "INFO"))
    mem = results.get("memory", {})
    if mem:
        lines.append(Line("memory: first write / again (s per GB)",
                          " · ".join(f"{when} {m['first_s_per_gb']:.2f} / {m['again_s_per_gb']:.2f}"
                                     for when, m in mem.items()), "", "INFO"))
    peaks = [p["peak_rss"] for p in results.get("servers", []) if p.get("peak_rss")]
    limit = RSS_BASE_BYTES + cache_bytes
    if not peaks:
        lines.append(Line("server peak RSS (VmHWM)", "not measured", "", "ERROR"))
    else:
        lines.append(Line(f"server peak RSS (VmHWM, {len(peaks)} mounts)", f"{max(peaks) / 1e6:.0f} MB",
                          f"<= {limit / 1e6:.0f} MB", "PASS" if max(peaks) <= limit else "FAIL"))
    return lines


def _local_lines(d: str, r: dict, errors: dict, cache_bytes: int) -> list:
    """The lines of dtype ``d`` read from the local file (every line but the S3 ones)."""
    lines: list = []
    raw = r.get("raw")
    if raw is None:
        lines.append(_err(f"{d}: raw h5py read (baseline)", errors, [f"{d}.raw"])
                     or Line(f"{d}: raw h5py read (baseline)", "not measured", "", "ERROR"))
    else:
        lines.append(Line(f"{d}: raw h5py read (baseline)", f"{raw['mb_s']:.0f} MB/s, {raw['median_s']:.2f} s",
                          "", "INFO"))
    disk = r.get("disk")
    name = f"{d}: the .mdl file read whole (disk's ceiling)"
    if raw is not None and (disk is not None or f"{d}.disk" in errors):  # (not in reports of older runs)
        lines.append(_measured(name, errors, [f"{d}.disk", f"{d}.raw"], disk,
                               lambda dk: Line(name, f"{dk['mb_s']:.0f} MB/s = {dk['mb_s'] / raw['mb_s']:.2f}x raw "
                                                     f"h5py (cold, O_DIRECT, nothing decoded)", "", "INFO")))
    pt = r.get("cp_passthrough")
    lines += _ratio_lines(d, "cp safetensors", r.get("cp_safetensors"), raw, "cp_safetensors", errors,
                          passthrough=pt)
    lines += _ratio_lines(d, "cp .bin (crc exact, cold)", r.get("cp_bin_exact"), raw, "cp_bin_exact", errors,
                          passthrough=pt)
    lines += _ratio_lines(d, "cp .bin (crc zero)", r.get("cp_bin_zero"), raw, "cp_bin_zero", errors)
    name = f"{d}: cp, trivial passthrough of the local copy (ceiling)"
    lines.append(_measured(name, errors, [f"{d}.cp_passthrough", f"{d}.raw"], r.get("cp_passthrough"),
                           lambda pt: Line(name, f"{pt['mb_s'] / raw['mb_s']:.2f}x raw h5py ({pt['mb_s']:.0f} "
                                                 f"MB/s, cold, nothing converted)", "", "INFO")))
    lines += _export_lines(d, r.get("export"), raw, errors, cache_bytes)
    name = f"{d}: export's ceiling: the .mdl copied on the output disk"
    if raw is not None and (r.get("copy_ceiling") is not None or f"{d}.copy_ceiling" in errors):  # (newer runs)
        exp = r.get("export")
        lines.append(_measured(name, errors, [f"{d}.copy_ceiling", f"{d}.raw"], r.get("copy_ceiling"),
                               lambda c: Line(name, f"{c['mb_s']:.0f} MB/s = {c['mb_s'] / raw['mb_s']:.2f}x raw h5py "
                                                    "(cold read + write + fsync, nothing decoded)"
                                                    + (f"; export {exp['mb_s'] / c['mb_s']:.2f}x of it" if exp
                                                       else ""), "", "INFO")))
    name = f"{d}: cp -r MNT/tf vs TensorFlow saving from memory"
    if r.get("tf_cp") is not None or f"{d}.tf_cp" in errors:  # (newer runs)
        lines.append(_measured(name, errors, [f"{d}.tf_cp"], r.get("tf_cp"), lambda t: Line(
            name, f"{t['mount']['mb_s']:.0f} vs {t['tensorflow']['mb_s']:.0f} MB/s (TF: startup, reading, "
                  f"{t['tensorflow']['save_s']:.1f} s saving); peak RSS "
                  f"server {max(t['mount']['peak_rss']) / 1e6:.0f} MB vs TF {max(t['tensorflow']['peak_rss']) / 1e6:.0f}"
                  f" MB; {'same' if t['same_bytes'] else 'DIFFERENT'} bytes", "", "INFO")))
    name = f"{d}: from_pretrained mount / local"
    lines.append(_measured(name, errors, [f"{d}.from_pretrained", f"{d}.layout"], r.get("from_pretrained"),
                           lambda fp: Line(name, f"{fp['ratio']:.2f}x ({fp['mount']['median_s']:.2f} vs "
                                                 f"{fp['local']['median_s']:.2f} s; passthrough ceiling "
                                                 f"{fp['passthrough_ratio']:.2f}x)",
                                           f"<= {FROM_PRETRAINED_TARGET:.2f}x",
                                           _verdict(fp["ratio"] <= FROM_PRETRAINED_TARGET))))
    lines += _issue14_lines(d, r, errors)
    if r.get("hf_to_cs") is not None or f"{d}.hf_to_cs" in errors:
        lines += _hf_to_cs_lines(d, r.get("hf_to_cs"), errors, cache_bytes)
    tl = r.get("torch_first_open")
    e = _err(f"{d}: torch.load(mmap) first open", errors, [f"{d}.torch_first_open", f"{d}.layout"])
    if e or tl is None:
        lines.append(e or Line(f"{d}: torch.load(mmap) first open", "not measured", "", "ERROR"))
    else:
        for phase in ("cold", "warm"):
            x = tl[phase]
            read = sorted(x.get("server_rchar", [0]))[len(x.get("server_rchar", [0])) // 2]
            lines.append(Line(f"{d}: torch.load(mmap) first open, CRC {phase}",
                              f"{x['median_s']:.3f} s (server read {read / 1e6:.0f} MB)", "", "INFO"))
    nd = (r.get("layout") or {}).get("no_data_read")
    name = f"{d}: no tensor data read for stat/index"
    e = _err(name, errors, [f"{d}.layout"])
    if e or nd is None:
        lines.append(e or Line(name, "not measured", "", "ERROR"))
    elif nd["method"] == "strace":
        ctl_ok = nd["controls"]["discriminates"] and nd["server_control"]["data_reads"] > 0
        lines.append(Line(name, f"{nd['data_reads']} chunk reads in {nd['preads']} preads "
                                f"(controls {'ok' if ctl_ok else 'BAD'})",
                          "0 reads", "PASS" if nd["ok"] else "FAIL"))
    else:
        lines.append(Line(name, f"rchar +{nd['rchar_delta']} B", f"< {nd['smallest_chunk']} B",
                          "PASS" if nd["ok"] else "FAIL"))
    dc = r.get("datacheck")
    name = f"{d}: HF bytes equal CS tensors (sanity)"
    e = _err(name, errors, [f"{d}.datacheck"])
    if e:
        lines.append(e)
    elif dc is not None:
        same = r.get("export_matches_mount")
        ok = dc["ok"] and same is not False
        lines.append(Line(name, f"{len(dc['checked'])} tensors, export==mount: {same}", "equal",
                          "PASS" if ok else "FAIL"))
    return lines


def _hf_to_cs_lines(d: str, h: dict | None, errors: dict, cache_bytes: int) -> list:
    """Issue 30's lines: the mounted .mdl of an HF folder against a plain read of its safetensors, ckptfs's own eager
    export of it, and the server's peak RSS."""
    name = f"{d}: HF -> CS: cp mounted .mdl vs cp source safetensors"
    e = _err(name, errors, [f"{d}.hf_to_cs"])
    if e or h is None:
        return [e or Line(name, "not measured", "", "ERROR")]
    mdl, plain, exp = h["mdl"], h["plain"], h["export"]
    out = [Line(name, f"{h['ratio']:.2f}x ({mdl['mb_s']:.0f} vs {plain['mb_s']:.0f} MB/s, cold; server "
                      f"{mdl['server_cpu_s_per_gb']:.1f} CPU-s/GB)", f">= {HF_TO_CS_TARGET:.2f}x",
                _verdict(h["ratio"] >= HF_TO_CS_TARGET)),
           Line(f"{d}: HF -> CS: ckptfs export (eager) / cp mounted .mdl",
                f"{exp['median_s']:.2f} vs {mdl['median_s']:.2f} s ({exp['mb_s']:.0f} MB/s incl. startup)", "",
                "INFO")]
    limit = RSS_BASE_BYTES + cache_bytes
    if h["peak_rss"]:
        peak = max(h["peak_rss"])
        out.append(Line(f"{d}: HF -> CS: server peak RSS", f"{peak / 1e6:.0f} MB", f"<= {limit / 1e6:.0f} MB",
                        _verdict(peak <= limit)))
    return out


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _measured(name: str, errors: dict, keys, value, line) -> Line:
    """``line(value)`` when the measurement ran; else the error that stopped it, or "not measured"."""
    e = _err(name, errors, keys)
    if e or value is None:
        return e or Line(name, "not measured", "", "ERROR")
    return line(value)


def _issue14_lines(d: str, r: dict, errors: dict) -> list:
    """First read with a warm source (and the passthrough ceiling), 4 KiB peeks, end to end vs eager export."""
    name_fw = f"{d}: first read, checkpoint in page cache"
    name_pr = f"{d}: 4 KiB of every tensor / every tensor whole"
    name_ee = f"{d}: checkpoint -> loaded model, mount vs eager export"
    return [
        _measured(name_fw, errors, [f"{d}.first_read_warm", f"{d}.layout"], r.get("first_read_warm"), lambda fw: Line(
            name_fw, f"{fw['mount']['mb_s']:.0f} MB/s (passthrough ceiling {fw['passthrough']['mb_s']:.0f} MB/s)",
            f">= {FIRST_READ_WARM_MB_S} MB/s", _verdict(fw["mount"]["mb_s"] >= FIRST_READ_WARM_MB_S))),
        _measured(name_pr, errors, [f"{d}.partial_reads", f"{d}.layout"], r.get("partial_reads"), lambda pr: Line(
            name_pr, f"{pr['ratio'] * 100:.1f}% ({pr['peek']['median_s']:.3f} vs {pr['whole']['median_s']:.2f} s, "
                     f"{pr['peek']['tensors']} tensors)", f"<= {PARTIAL_TARGET * 100:.0f}%",
            _verdict(pr["ratio"] <= PARTIAL_TARGET))),
        _measured(name_ee, errors, [f"{d}.end_to_end", f"{d}.layout"], r.get("end_to_end"), lambda ee: Line(
            name_ee, f"{ee['mount']['median_s']:.2f} vs {ee['eager']['median_s']:.2f} s ({ee['ratio']:.2f}x)", "",
            "INFO")),
    ]


def _s3_lines(d: str, s3: dict | None, errors: dict) -> list:
    """The checkpoint in Cerebras' S3 layout on a local endpoint (benchlib/s3.py); runs before the ``.mdl``-object
    lines (s3mdl.py) also had its ``from_pretrained`` here."""
    names = (f"{d}: S3 cp safetensors vs boto3 download", f"{d}: S3 requests per 4 KiB peek")
    if s3 is None:
        return [_err(n, errors, [f"{d}.s3"]) or Line(n, "not measured", "", "ERROR") for n in names]
    cp, boto, pk = s3["cp"], s3["boto3"], s3["peeks"]
    on = f" on {_host(s3['machine'])}" if s3.get("machine") else ""
    out = [Line(names[0], f"{s3['cp_ratio']:.2f}x ({cp['mb_s']:.0f} vs {boto['mb_s']:.0f} MB/s, {s3['endpoint']}{on})",
                f">= {S3_CP_TARGET:.2f}x", _verdict(s3["cp_ratio"] >= S3_CP_TARGET))]
    fp = s3.get("from_pretrained")
    if fp is not None:
        out.append(Line(f"{d}: S3 from_pretrained / local-file mount",
                        f"{fp['ratio']:.2f}x ({fp['s3']['median_s']:.2f} vs {fp['local']['median_s']:.2f} s)", "",
                        "INFO"))
    at = f"; {s3['endpoint'].split(' server')[0]}{on}" if on else ""
    out.append(Line(names[1], f"max {pk['max_requests']}, mean {pk['mean_requests']:.2f} ({pk['tensors']} tensors{at})",
                    f"<= {S3_PEEK_REQUESTS}", _verdict(pk["max_requests"] <= S3_PEEK_REQUESTS)))
    return out + _first_request(d, s3)


def _host(machine: str) -> str:
    """The host name at the start of ``sysutil.machine()``'s line."""
    return machine.split(":", 1)[0]


#: the S3 items over the ``.mdl`` as one object (benchlib/s3mdl.py), in the order they run
S3_MDL_ITEMS = ("s3_mdl_cp", "s3_from_pretrained", "s3_export_hf", "s3_many_readers", "s3_info_startup")


def _s3_mdl_lines(d: str, r: dict, errors: dict, cache_bytes: int, parts=None) -> list:
    """The lines of the ``.mdl`` stored as one S3 object (benchlib/s3mdl.py), each naming its server's host; the
    first names the server and the machine in full. Items that neither ran nor failed give no line."""
    items = [k for k in S3_MDL_ITEMS if r.get(k) is not None or f"{d}.{k}" in errors
             or (f"{d}.s3_server" in errors and (parts is None or k in parts))]
    lines: list = []
    about = next((r[k] for k in items if r.get(k) is not None), None)
    if about is not None:
        lines.append(Line(f"{d}: S3 .mdl object: server, machine", f"{about['server']}; {about['machine']}", "",
                          "INFO"))
    for k in items:
        keys = [f"{d}.s3_server", f"{d}.{k}", f"{d}.layout"]
        lines += _S3_MDL_LINES[k](d, r.get(k), errors, keys, cache_bytes)
    peaks = {k: max(r[k]["peak_rss"]) for k in ("s3_from_pretrained", "s3_many_readers")
             if r.get(k) is not None and r[k].get("peak_rss")}
    if peaks:
        x = next(r[k] for k in peaks)
        in_flight = x["in_flight_bytes"]
        limit = RSS_BASE_BYTES + cache_bytes + in_flight
        what = {"s3_from_pretrained": "from_pretrained", "s3_many_readers": f"{S3_READERS} readers"}
        lines.append(Line(f"{d}: S3 .mdl: mount server peak RSS",
                          "; ".join(f"{what[k]} {p / 1e6:.0f} MB" for k, p in peaks.items()),
                          f"<= {limit / 1e6:.0f} MB ({RSS_BASE_BYTES / 1e6:.0f} + cache {cache_bytes / 1e6:.0f} + "
                          f"in flight {in_flight / 1e6:.0f})", _verdict(max(peaks.values()) <= limit)))
    return lines


def _tag(x: dict) -> str:
    return f"{x['server'].split(' serve')[0]} on {_host(x['machine'])}"


def _mdl_cp_lines(d, x, errors, keys, cache_bytes) -> list:
    name = f"{d}: S3 .mdl object: cp safetensors vs boto3 download"
    return [_measured(name, errors, keys, x, lambda x: Line(
        name, f"{x['ratio']:.2f}x ({x['ckptfs']['median_s']:.2f} vs {x['boto3']['median_s']:.2f} s; server sent "
              f"{max(x['ckptfs']['server_sent']) / 1e6:.0f} vs {max(x['boto3']['server_sent']) / 1e6:.0f} MB; "
              f"{_tag(x)})", f">= {S3_MDL_CP_TARGET:.2f}x (time)", _verdict(x["ratio"] >= S3_MDL_CP_TARGET)))] + ([
        Line(f"{d}: .mdl local file: cp safetensors vs boto3 download of the object (the conversion's floor)",
             f"{x['local_ratio']:.2f}x ({x['local']['median_s']:.2f} vs {x['boto3']['median_s']:.2f} s, page cache "
             "dropped)", "", "INFO")] if x and "local_ratio" in x else [])


def _from_pretrained_lines(d, x, errors, keys, cache_bytes) -> list:
    names = (f"{d}: S3 .mdl: from_pretrained / boto3 download + from_pretrained",
             f"{d}: S3 .mdl: from_pretrained / local-file mount")
    if x is None:
        return [_measured(n, errors, keys, None, None) for n in names]
    s3, dl, local = x["s3"]["median_s"], x["download"], x["local"]["median_s"]
    return [Line(names[0], f"{x['ratio_download']:.2f}x ({s3:.2f} vs {dl['median_s']:.2f} s, download "
                           f"{sorted(dl['download_s'])[len(dl['download_s']) // 2]:.2f} s; {_tag(x)})",
                 f"<= {S3_FP_DOWNLOAD_TARGET:.2f}x", _verdict(x["ratio_download"] <= S3_FP_DOWNLOAD_TARGET)),
            Line(names[1], f"{x['ratio_local']:.2f}x ({s3:.2f} vs {local:.2f} s; {_tag(x)})",
                 f"<= {S3_FP_LOCAL_TARGET:.2f}x", _verdict(x["ratio_local"] <= S3_FP_LOCAL_TARGET))]


def _export_hf_lines(d, x, errors, keys, cache_bytes) -> list:
    name = f"{d}: S3 .mdl: ckptfs export --views hf vs boto3 download"
    return [_measured(name, errors, keys, x, lambda x: Line(
        name, f"{x['ratio']:.2f}x ({x['ckptfs']['median_s']:.2f} vs {x['boto3']['median_s']:.2f} s, start-up "
              f"included; {_tag(x)})", f">= {S3_EXPORT_TARGET:.2f}x (time)", _verdict(x["ratio"] >= S3_EXPORT_TARGET)))] + ([
        Line(f"{d}: .mdl local file: export --views hf vs boto3 download of the objects (the floor)",
             f"{x['local_ratio']:.2f}x ({x['local']['median_s']:.2f} vs {x['boto3']['median_s']:.2f} s, start-up "
             "included, page cache dropped)", "", "INFO")] if x and "local_ratio" in x else [])


def _many_readers_lines(d, x, errors, keys, cache_bytes) -> list:
    names = (f"{d}: S3 .mdl: {S3_READERS} readers, one mount: bytes sent / object",
             f"{d}: S3 .mdl: {S3_READERS} readers, one mount: wall / one reader")
    if x is None:
        return [_measured(n, errors, keys, None, None) for n in names]
    many, one = x["many"], x["one"]
    return [Line(names[0], f"{x['bytes_ratio']:.2f}x ({max(many['server_sent']) / 1e6:.0f} of "
                           f"{x['object_bytes'] / 1e6:.0f} MB; one reader {max(one['server_sent']) / 1e6:.0f} MB; "
                           f"{_tag(x)})", f"<= {S3_READERS_BYTES:.2f}x", _verdict(x["bytes_ratio"] <= S3_READERS_BYTES)),
            Line(names[1], f"{x['wall_ratio']:.2f}x ({many['median_s']:.2f} vs {one['median_s']:.2f} s; {_tag(x)})",
                 f"<= {S3_READERS_WALL:.2f}x", _verdict(x["wall_ratio"] <= S3_READERS_WALL))] + ([
            Line(f"{d}: {S3_READERS} readers, one mount of the local file: wall / one reader (the machine's floor)",
                 f"{x['local_wall_ratio']:.2f}x ({x['local_many']['median_s']:.2f} vs "
                 f"{x['local_one']['median_s']:.2f} s)", "", "INFO")] if "local_wall_ratio" in x else []) + ([
            Line(f"{d}: {S3_READERS} readers of a plain folder of the same files, no ckptfs: wall / one reader "
                 "(the machine's floor)", f"{x['plain_wall_ratio']:.2f}x ({x['plain_many']['median_s']:.2f} vs "
                 f"{x['plain_one']['median_s']:.2f} s)", "", "INFO")] if "plain_wall_ratio" in x else [])


def _info_startup_lines(d, x, errors, keys, cache_bytes) -> list:
    name = f"{d}: S3 .mdl: ckptfs info, spawn to first request (cold)"
    return [_measured(name, errors, keys, x, lambda x: Line(
        name, f"{x['cold']['first_request_s']['median_s']:.3f} s (total {x['cold']['total_s']['median_s']:.2f} s; "
              f"warm {x['warm']['first_request_s']['median_s']:.3f} s, total {x['warm']['total_s']['median_s']:.2f} s;"
              f" {_tag(x)})", f"<= {S3_INFO_FIRST_REQUEST_S:.2f} s",
        _verdict(x["cold"]["first_request_s"]["median_s"] <= S3_INFO_FIRST_REQUEST_S)))]


_S3_MDL_LINES = {"s3_mdl_cp": _mdl_cp_lines, "s3_from_pretrained": _from_pretrained_lines,
                 "s3_export_hf": _export_hf_lines, "s3_many_readers": _many_readers_lines,
                 "s3_info_startup": _info_startup_lines}


def _first_request(d: str, s3: dict) -> list:
    """The line of ``ckptfs info``'s time to its first request (none in the reports of runs before it was measured)."""
    fr = s3.get("first_request")
    if fr is None:
        return []
    return [Line(f"{d}: S3 layout: ckptfs info, seconds to the first request",
                 f"{fr['median_s']:.2f} s (median of {len(fr['runs_s'])})", f"<= {S3_FIRST_REQUEST_S:.2f} s",
                 _verdict(fr["median_s"] <= S3_FIRST_REQUEST_S))]


def table(lines: list) -> str:
    w0 = max(len(x.target) for x in lines)
    w1 = max(len(x.measured) for x in lines)
    w2 = max(len(x.limit) for x in lines)
    head = f"{'TARGET':<{w0}}  {'MEASURED':<{w1}}  {'LIMIT':<{w2}}  RESULT"
    rows = [head, "-" * len(head)]
    rows += [f"{x.target:<{w0}}  {x.measured:<{w1}}  {x.limit:<{w2}}  {x.result}" for x in lines]
    return "\n".join(rows)


def as_json(lines: list) -> list:
    return [asdict(x) for x in lines]
