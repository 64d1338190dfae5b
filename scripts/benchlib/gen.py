"""Write llama-shaped Cerebras checkpoints in the real cstorch 2.10 on-disk layout (format 0.5).

The layout copies what ``cstorch.save`` writes for a converter-made llama checkpoint (see
``tests/fixtures/llama/cs/checkpoint.mdl``):

* root attributes ``__spec__`` (JSON ``[skeleton, treespec]``, indent 4), ``__version__`` (float64 0.5) and
  ``__cstorch_version__`` written first, then the datasets, then one ``<key>.__metadata__`` JSON attribute per
  key and ``__SUCCESS__`` last; the file is written as ``<name>.<8 hex>.tmp`` and renamed, like cstorch;
* one dataset per tensor, named by its flat key, created with ``hdf5plugin.LZ4()`` and h5py's automatic chunk
  guess; bf16 tensors stored as int16 bit patterns; each dataset also carries the leaf metadata as attributes.

For the same dimensions as the fixture, ``__spec__`` and every ``__metadata__`` string come out byte-identical to
the fixture's (tests/project/test_bench_generator.py checks this).

``allocate=False`` declares the datasets (shape, dtype, chunks, LZ4 filter, attributes) but never writes them:
HDF5 allocates chunks on first write, so the file holds only metadata and reads return the fill value. That is
how the 70B-shaped checkpoint is built in a second or two and a few MB of disk.
"""
from __future__ import annotations

import json
import math
import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import h5py
import hdf5plugin
import numpy as np
import yaml

CSTORCH_VERSION = "2.10.0"
FORMAT_VERSION = 0.5
_LEAF_SPEC = {"type": None, "context": None, "children_spec": []}
_TORCH_DTYPES = {  # dtype flag -> (torch name, rtfx ElementType, element bytes)
    "bf16": ("torch.bfloat16", 15, 2),
    "fp32": ("torch.float32", 11, 4),
}


@dataclass(frozen=True)
class LlamaDims:
    """The dimensions that shape a llama checkpoint (HF names in comments)."""

    hidden: int  # hidden_size
    layers: int  # num_hidden_layers
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    ffn: int  # intermediate_size
    vocab: int  # vocab_size
    max_positions: int = 2048
    tied: bool = False  # share_embedding_weights (the converter still writes lm_head.weight)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params(self) -> int:
        return sum(math.prod(s) for _, s in cs_tensors(self))


#: llama-2-70b
LLAMA2_70B = LlamaDims(hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=32000, max_positions=4096)

#: (hidden, heads, kv_heads, ffn, vocab) candidates for sized benchmark models, largest first
_SHAPES = [
    (4096, 32, 8, 11008, 32000),
    (2048, 16, 4, 5504, 32000),
    (1024, 8, 2, 2816, 32000),
    (512, 8, 2, 1408, 8000),
    (256, 4, 1, 704, 4000),
    (128, 2, 1, 352, 1000),
]
_MIN_LAYERS = 4


def dims_for_size(target_bytes: int, dtype: str) -> LlamaDims:
    """The widest llama shape with at least 4 layers whose tensor bytes come closest to ``target_bytes``."""
    item = _TORCH_DTYPES[dtype][2]
    n = target_bytes / item
    for hidden, heads, kv, ffn, vocab in _SHAPES:
        probe = LlamaDims(hidden, 1, heads, kv, ffn, vocab)
        fixed = LlamaDims(hidden, 0, heads, kv, ffn, vocab).params()
        per_layer = probe.params() - fixed
        layers = round((n - fixed) / per_layer)
        if layers >= _MIN_LAYERS:
            return LlamaDims(hidden, layers, heads, kv, ffn, vocab)
    hidden, heads, kv, ffn, vocab = _SHAPES[-1]
    return LlamaDims(hidden, _MIN_LAYERS, heads, kv, ffn, vocab)


def cs_tensors(d: LlamaDims) -> list:
    """[(flat key without the ``model.`` prefix, shape)] in the order the Model Zoo converter writes them."""
    h, kvd = d.hidden, d.kv_heads * d.head_dim
    out = [("embedding_layer.word_embeddings.weight", (d.vocab, h))]
    for i in range(d.layers):
        p = f"transformer_decoder.layers.{i}."
        out += [
            (p + "self_attn.proj_q_dense_layer.weight", (d.heads * d.head_dim, h)),
            (p + "self_attn.proj_k_dense_layer.weight", (kvd, h)),
            (p + "self_attn.proj_v_dense_layer.weight", (kvd, h)),
            (p + "self_attn.proj_output_dense_layer.weight", (h, d.heads * d.head_dim)),
            (p + "ffn.ffn.0.linear_layer_for_glu.weight", (d.ffn, h)),
            (p + "ffn.ffn.0.linear_layer.weight", (d.ffn, h)),
            (p + "ffn.ffn.1.linear_layer.weight", (h, d.ffn)),
            (p + "norm1.weight", (h,)),
            (p + "norm3.weight", (h,)),
        ]
    # the converter writes the final norm twice (ln_f is a CS 1.7 carry-over) and always writes lm_head
    out += [("transformer_decoder.norm.weight", (h,)), ("ln_f.weight", (h,)), ("lm_head.weight", (d.vocab, h))]
    return out


def _treespec_dict(keys: list, children: list) -> dict:
    return {"type": "builtins.dict", "context": json.dumps(keys), "children_spec": children}


def global_spec(subkeys: list) -> str:
    """The root ``__spec__`` of ``{"model": {subkey: tensor, …}}``."""
    skeleton = {"model": {k: "*" for k in subkeys}}
    tree = [1, _treespec_dict(["model"], [_treespec_dict(subkeys, [_LEAF_SPEC] * len(subkeys))])]
    return json.dumps([skeleton, json.dumps(tree)], indent=4)


def leaf_metadata(key: str, shape: tuple, dtype: str) -> tuple:
    """(``<key>.__metadata__`` JSON string, the inner metadata dict) of one torch tensor leaf."""
    torch_name, rtfx, _ = _TORCH_DTYPES[dtype]
    inner = {"__TORCH__": True, "shapes": [list(shape)], "dtypes": [torch_name], "rtfx_dtypes": [rtfx],
             "__TYPE__": "TorchTensorSerializer", "__NUMPY__": True, "compressed": False}
    tree = [1, _treespec_dict([key], [_LEAF_SPEC])]
    outer = {"__spec__": [{key: "*"}, json.dumps(tree)], "__objects__": [key], key + ".__metadata__": inner}
    return json.dumps(outer, indent=4), inner


def _dataset_attrs(dset, inner: dict) -> None:
    """``dset.attrs.update(metadata)`` with the HDF5 types cstorch ends up with."""
    for name, val in inner.items():
        if isinstance(val, bool):
            dset.attrs[name] = np.bool_(val)
        elif name == "shapes":
            dset.attrs[name] = np.array(val, dtype=np.int64).reshape(1, -1) if val[0] else np.zeros((1, 0))
        elif name == "dtypes":
            dset.attrs[name] = np.array(val, dtype=h5py.string_dtype())
        elif name == "rtfx_dtypes":
            dset.attrs[name] = np.array(val, dtype=np.int64)
        else:
            dset.attrs[name] = val


def random_tensor(rng: np.random.Generator, shape: tuple, dtype: str, *, norm: bool = False) -> np.ndarray:
    """N(0, 0.02²) weights (norm weights around 1), as stored on disk: float32, or bf16 bits as int16."""
    a = rng.standard_normal(shape, dtype=np.float32)
    a *= 0.02
    if norm:
        a += 1.0
    if dtype == "bf16":
        return (a.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)
    return a


def write_checkpoint(path: Path, dims: LlamaDims, dtype: str, *, allocate: bool = True, seed: int = 0) -> dict:
    """Write a llama checkpoint to ``path``; returns a summary (keys, tensor bytes, file bytes, seconds)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np_dtype = np.int16 if dtype == "bf16" else np.float32
    tensors = cs_tensors(dims)
    rng = np.random.default_rng(seed)
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp")
    t0 = time.perf_counter()
    tensor_bytes = 0
    metas = []
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["__spec__"] = global_spec([k for k, _ in tensors])
            f.attrs["__version__"] = np.float64(FORMAT_VERSION)
            f.attrs["__cstorch_version__"] = CSTORCH_VERSION
            for sub, shape in tensors:
                key = "model." + sub
                meta_json, inner = leaf_metadata(key, shape, dtype)
                if allocate:
                    data = random_tensor(rng, shape, dtype, norm=len(shape) == 1)
                    dset = f.create_dataset(key, data=data, **hdf5plugin.LZ4())
                    del data
                else:
                    dset = f.create_dataset(key, shape=shape, dtype=np_dtype, **hdf5plugin.LZ4())
                _dataset_attrs(dset, inner)
                tensor_bytes += math.prod(shape) * np.dtype(np_dtype).itemsize
                metas.append((key, meta_json))
            for key, meta_json in metas:
                f.attrs[key + ".__metadata__"] = meta_json
            f.attrs["__SUCCESS__"] = True
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return {"path": str(path), "dtype": dtype, "dims": asdict(dims), "allocated": allocate, "keys": len(tensors),
            "tensor_bytes": tensor_bytes, "file_bytes": path.stat().st_size,
            "disk_bytes": path.stat().st_blocks * 512, "seconds": round(time.perf_counter() - t0, 3)}


def params_dict(d: LlamaDims) -> dict:
    """The ``model:`` section of a Cerebras llama params YAML, shaped like the fixture's."""
    return {"model": {
        "attention_dropout_rate": 0.0,
        "attention_module": "multiquery_attention",
        "attention_type": "scaled_dot_product",
        "dropout_rate": 0.0,
        "embedding_dropout_rate": 0.0,
        "embedding_layer_norm": False,
        "extra_attention_params": {"num_kv_groups": d.kv_heads},
        "filter_size": d.ffn,
        "hidden_size": d.hidden,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1.0e-06,
        "max_position_embeddings": d.max_positions,
        "name": "llama",
        "nonlinearity": "swiglu",
        "norm_first": True,
        "norm_type": "rmsnorm",
        "num_heads": d.heads,
        "num_hidden_layers": d.layers,
        "pos_scaling_factor": 1.0,
        "position_embedding_type": "rotary",
        "rope_theta": 10000.0,
        "rotary_dim": d.head_dim,
        "share_embedding_weights": d.tied,
        "use_bias_in_output": False,
        "use_ff_layer1_dropout": False,
        "use_ffn_bias": False,
        "use_ffn_bias_in_attention": False,
        "use_projection_bias_in_attention": False,
        "vocab_size": d.vocab,
    }}


def write_params(path: Path, dims: LlamaDims) -> Path:
    path = Path(path)
    path.write_text(yaml.safe_dump(params_dict(dims), indent=4, sort_keys=True))
    return path
