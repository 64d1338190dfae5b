"""Measurements that must run in a fresh interpreter (cold Python-side state); each prints one JSON line.

Usage: ``python probes.py NAME ARGS…``. Imports happen before the clock starts, so the timings cover only the
work itself:

* ``raw CKPT``: h5py reads every dataset of a checkpoint in full (the baseline);
* ``from_pretrained DIR``: ``AutoModelForCausalLM.from_pretrained(DIR, dtype="auto")``, then one byte of every
  4 KiB page of every parameter is touched, so lazily mapped weights are really read;
* ``from_pretrained_gated GATE INDEX DIR``: ``from_pretrained DIR`` started when the bench says go (imports done,
  ``GATE/ready-INDEX`` written, then waiting for ``GATE/go``), so that readers started together load together;
* ``s3_download BUCKET DEST KEY…``: boto3's managed download (``download_file``, s3transfer at its defaults) of
  each object into the folder DEST (its name the key's last part), from the endpoint of ``AWS_ENDPOINT_URL``;
* ``first_touch``: seconds per GB to write fresh memory, and the same memory again;
* ``torchload FILE``: ``torch.load(FILE, mmap=True, weights_only=True)`` (the first-open latency);
* ``mount_breakdown CKPT PARAMS``: import time of the ckptfs mount modules and one ``build_tree``;
* ``peek SAFETENSORS…`` / ``whole SAFETENSORS…``: 4 KiB from the start of every tensor, or every tensor whole;
* ``tf_save CKPT OUT [PREFIX]``: TensorFlow writing the checkpoint's tensors from memory with a TF1 Saver;
* ``datacheck CKPT SAFETENSORS…``: HF tensors that are plain copies (embeddings, lm_head, a down_proj, the final
  norm) hold exactly the CS datasets' bytes.
"""
from __future__ import annotations

import json
import struct
import sys
import time


def raw(ckpt: str) -> dict:
    import h5py
    import hdf5plugin  # noqa: F401  (registers the LZ4 filter)

    t0 = time.perf_counter()
    nbytes = count = 0
    with h5py.File(ckpt, "r") as f:
        names: list = []
        f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        for name in names:
            d = f[name]
            if d.shape is None:
                continue
            a = d[()]
            nbytes += a.nbytes
            count += 1
    return {"seconds": time.perf_counter() - t0, "bytes": nbytes, "datasets": count}


def from_pretrained(path: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    t1 = time.perf_counter()
    touched = 0
    nbytes = 0
    for t in model.state_dict().values():
        b = t.detach().contiguous().reshape(-1).view(torch.uint8)
        touched += int(b[::4096].sum())
        nbytes += b.numel()
    t2 = time.perf_counter()
    return {"seconds": t2 - t0, "load_seconds": t1 - t0, "touch_seconds": t2 - t1, "bytes": nbytes,
            "class": type(model).__name__, "dtype": str(next(model.parameters()).dtype)}


def from_pretrained_gated(gate: str, index: str, path: str) -> dict:
    """``from_pretrained(path)`` once ``gate/go`` exists (its imports done first, ``gate/ready-<index>`` written);
    with the wall-clock times it saw go and finished, to time readers that run together from one start."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    del torch, AutoModelForCausalLM  # imported before go, as ``from_pretrained`` does before its clock
    open(os.path.join(gate, f"ready-{index}"), "w").close()
    go = os.path.join(gate, "go")
    while not os.path.exists(go):
        time.sleep(0.002)
    t_go = time.time()
    out = from_pretrained(path)
    return {**out, "t_go": t_go, "t_end": time.time()}


def s3_download(bucket: str, dest: str, *keys: str) -> dict:
    """boto3's managed download of ``keys`` into the folder ``dest`` (one after the other, each with s3transfer's
    default concurrency), as a user's script fetching a checkpoint before loading it does."""
    import os

    import boto3

    client = boto3.client("s3")
    t0 = time.perf_counter()
    nbytes = 0
    for key in keys:
        target = os.path.join(dest, key.rsplit("/", 1)[-1])
        client.download_file(bucket, key, target)
        nbytes += os.path.getsize(target)
    return {"seconds": time.perf_counter() - t0, "bytes": nbytes, "objects": len(keys)}


def first_touch() -> dict:
    """Write 256 MiB of fresh memory, then the same memory again: seconds per GB of each (see
    ``measure.memory_first_touch``)."""
    import numpy as np

    n = 256 << 20
    t0 = time.perf_counter()
    a = np.empty(n, np.uint8)
    a.fill(1)
    t1 = time.perf_counter()
    a.fill(2)
    t2 = time.perf_counter()
    return {"first_s_per_gb": (t1 - t0) * 1e9 / n, "again_s_per_gb": (t2 - t1) * 1e9 / n}


def torchload(path: str) -> dict:
    import torch

    t0 = time.perf_counter()
    sd = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    return {"seconds": time.perf_counter() - t0, "tensors": len(sd)}


def _safetensors_header(path: str) -> tuple:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def datacheck(ckpt: str, *st_paths: str) -> dict:
    """HF tensors that are plain copies of CS tensors must hold exactly the CS bytes."""
    import h5py
    import hdf5plugin  # noqa: F401

    pairs = {"model.embed_tokens.weight": "model.embedding_layer.word_embeddings.weight",
             "lm_head.weight": "model.lm_head.weight",
             "model.layers.0.mlp.down_proj.weight": "model.transformer_decoder.layers.0.ffn.ffn.1.linear_layer.weight",
             "model.norm.weight": "model.transformer_decoder.norm.weight"}
    checked, bad = [], []
    with h5py.File(ckpt, "r") as f:
        for st_path in st_paths:
            header, base = _safetensors_header(st_path)
            with open(st_path, "rb") as st:
                for hf_name, cs_key in pairs.items():
                    if hf_name not in header:
                        continue
                    a, b = header[hf_name]["data_offsets"]
                    st.seek(base + a)
                    got = st.read(b - a)
                    want = f[cs_key][()].astype(f[cs_key].dtype.newbyteorder("<"), copy=False).tobytes()
                    checked.append(hf_name)
                    if got != want:
                        bad.append(hf_name)
    return {"checked": checked, "mismatched": bad, "ok": len(checked) == len(pairs) and not bad}


def mount_breakdown(ckpt: str, params: str) -> dict:
    """Where ``ckptfs mount`` time goes: importing ckptfs (CLI, mount, FUSE modules) and building the tree once (in
    one interpreter, without the forked cs-skeleton build the server starts). The background mount starts two
    interpreters: the CLI (which imports no tree code) and the server, which builds the tree once and reports."""
    t0 = time.perf_counter()
    import ckptfs.cli  # noqa: F401
    import ckptfs.commands.mount  # noqa: F401
    import ckptfs.fuse.mount  # noqa: F401
    from ckptfs.tree.assemble import build_tree
    from ckptfs.views.base import MountOptions

    t1 = time.perf_counter()
    tree = build_tree(ckpt, MountOptions(config=params))
    t2 = time.perf_counter()
    tree.close()
    modules = sorted({m.split(".")[0] for m in sys.modules})
    heavy = [m for m in ("torch", "transformers", "safetensors", "h5py", "numpy", "yaml", "mfusepy") if m in modules]
    return {"imports_s": t1 - t0, "build_tree_s": t2 - t1, "heavy_modules_loaded": heavy}


def _tensor_ranges(paths) -> list:
    """(path, absolute start, end) of every tensor of the safetensors files (headers read before the clock)."""
    out = []
    for p in paths:
        header, base = _safetensors_header(p)
        for name, v in header.items():
            if name != "__metadata__":
                a, b = v["data_offsets"]
                if b > a:
                    out.append((p, base + a, base + b))
    return out


def peek(*paths: str) -> dict:
    """4 KiB from the start of every tensor of the safetensors files (``pread`` on one open file each)."""
    import os

    ranges = _tensor_ranges(paths)
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}
    t0 = time.perf_counter()
    got = sum(len(os.pread(fds[p], min(4096, b - a), a)) for p, a, b in ranges)
    secs = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return {"seconds": secs, "tensors": len(ranges), "bytes": got}


def whole(*paths: str) -> dict:
    """Every tensor of the safetensors files read whole, in file order (8 MiB reads)."""
    import os

    ranges = _tensor_ranges(paths)
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}
    t0 = time.perf_counter()
    got = 0
    for p, a, b in ranges:
        for off in range(a, b, 8 << 20):
            got += len(os.pread(fds[p], min(8 << 20, b - off), off))
    secs = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return {"seconds": secs, "tensors": len(ranges), "bytes": got}


def tf_save(ckpt: str, out: str, prefix: str = "model.ckpt") -> dict:
    """Real TensorFlow writing a checkpoint's tensors as ``h5-to-tensorflow`` does: every tensor read into memory,
    a ``tf.Variable`` each, a TF1 ``Saver`` saving them to ``OUT/PREFIX``; also written to ``OUT/probe.json``."""
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    from ckptfs.layouts.tfsaver import tf_dtype
    from ckptfs.readers import open_checkpoint

    t0 = time.perf_counter()
    src = open_checkpoint(ckpt)
    arrays = {k: (leaf.tensor.dtype.name, leaf.tensor.read_all()) for k, leaf in src.tensors().items()
              if tf_dtype(leaf.tensor) is not None}
    src.close()
    t1 = time.perf_counter()
    variables = {}
    for k, (dtype, a) in arrays.items():
        value = tf.constant(a)
        variables[k] = tf.Variable(tf.bitcast(value, tf.bfloat16) if dtype == "bfloat16" else value)
    saver = tf.compat.v1.train.Saver(var_list=variables)
    t2 = time.perf_counter()
    saver.save(None, os.path.join(out, prefix), write_meta_graph=False)
    t3 = time.perf_counter()
    result = {"seconds": t3 - t0, "read_s": t1 - t0, "variables_s": t2 - t1, "save_s": t3 - t2,
              "bytes": sum(a.nbytes for _, a in arrays.values()), "variables": len(arrays)}
    with open(os.path.join(out, "probe.json"), "w") as f:
        json.dump(result, f)
    return result


PROBES = {"tf_save": tf_save, "peek": peek, "whole": whole, "mount_breakdown": mount_breakdown, "raw": raw, "from_pretrained": from_pretrained,
          "from_pretrained_gated": from_pretrained_gated, "s3_download": s3_download, "first_touch": first_touch, "torchload": torchload, "datacheck": datacheck}

if __name__ == "__main__":
    print(json.dumps(PROBES[sys.argv[1]](*sys.argv[2:])))
