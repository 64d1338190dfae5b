"""Dataloader state from release 1.9 data-iterator files (Model Zoo ``convert_dataloader_checkpoint``).

A 1.9 run with ``cerebras.save_iter_state_path: <dir>`` left ``<dir>/data_iter_checkpoint_state_file_global``
(first line: the data step) and ``<dir>/data_iter_state_file_worker_<id>_step_<step>.txt`` (first line:
samples streamed by that worker). Only worker files of the global data step count. The 2.0 state is

* map style (``GptHDF5MapDataProcessor``): ``{"samples_streamed": Σ, "seed": shuffle_seed}``;
* iterable style (``GptHDF5DataProcessor``): ``{"all_worker_states": [{"samples_streamed": n,
  "shard_index": id}, …]}`` sorted by shard index.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..storage.local import LocalFolder

GLOBAL_FILE = "data_iter_checkpoint_state_file_global"
_WORKER_RE = re.compile(r"^data_iter_state_file_worker_(\d+)_step_(\d+)\.txt$")
PROCESSOR_STYLE = {"GptHDF5DataProcessor": "iterable", "GptHDF5MapDataProcessor": "map"}


@dataclass
class DataloaderState:
    state: dict  # the "dataloader" value
    style: str  # "map" | "iterable"
    data_step: int
    workers: list  # [(worker id, samples streamed)] of the data step
    ignored: list  # .txt files that are not worker files of the data step


#: the most bytes of a data-iterator file read (its first line is one integer)
MAX_STATE_FILE_BYTES = 4096


def _first_int(path: Path) -> int:
    try:
        text = LocalFolder(path.parent).read_text(path.name, MAX_STATE_FILE_BYTES)
        return int(text.splitlines()[0] if text else "")
    except (OSError, ValueError) as e:
        raise ConfigError(path, f"cannot read the first line as an integer ({e})") from None


def data_processor(params: dict | None) -> str | None:
    """``train_input.data_processor`` (legacy layout) or ``trainer.fit.train_dataloader.data_processor``."""
    if not isinstance(params, dict):
        return None
    ti = params.get("train_input")
    if isinstance(ti, dict) and ti.get("data_processor"):
        return ti["data_processor"]
    tr = params.get("trainer")
    for t in (tr if isinstance(tr, (list, tuple)) else [tr]):
        if isinstance(t, dict):
            t = t.get("trainer", t)
            td = ((t.get("fit") or {}).get("train_dataloader") or {}) if isinstance(t.get("fit"), dict) else {}
            if isinstance(td, dict) and td.get("data_processor"):
                return td["data_processor"]
    return None


def convert_data_iter_dir(directory, style: str, shuffle_seed: int = 0) -> DataloaderState:
    """The 2.0 ``dataloader`` state of a 1.9 data-iterator directory; ConfigError if it is unusable."""
    d = Path(directory)
    if style not in ("map", "iterable"):
        raise ConfigError(d, f"unknown dataloader style {style!r} (map or iterable)")
    gfile = d / GLOBAL_FILE
    if not gfile.is_file():
        raise ConfigError(d, f"no {GLOBAL_FILE} (the data step of the 1.9 dataloader state)")
    step = _first_int(gfile)
    workers, ignored = [], []
    for f in sorted(d.iterdir(), key=lambda p: p.name):
        if not f.name.endswith(".txt"):
            continue
        m = _WORKER_RE.match(f.name)
        if not m:
            ignored.append(f.name)
            continue
        if int(m.group(2)) != step:
            ignored.append(f.name)
            continue
        workers.append((int(m.group(1)), _first_int(f)))
    workers.sort()
    if style == "map":
        state = {"samples_streamed": sum(n for _, n in workers), "seed": int(shuffle_seed)}
    else:
        state = {"all_worker_states": [{"samples_streamed": n, "shard_index": w} for w, n in workers]}
    return DataloaderState(state, style, step, workers, ignored)
