"""ckptfs.upgrade dataloader state from 1.9 data-iterator files (map and iterable style)."""
from __future__ import annotations

import numpy as np
import pytest

from ckptfs.errors import ConfigError
from ckptfs.catalog.model import Checkpoint, Container, TensorLeaf, ValueLeaf
from ckptfs.tensor.base import ArrayTensor
from ckptfs.upgrade import state_tree as T, upgrade_checkpoint
from ckptfs.upgrade.dataloader import convert_data_iter_dir
from ckptfs.views.base import MountOptions


def make_iter_dir(d, step=20, workers=((0, 11), (2, 5), (1, 7)), stale=((0, 10, 99),)):
    d.mkdir(parents=True, exist_ok=True)
    (d / "data_iter_checkpoint_state_file_global").write_text(f"{step}\n")
    for w, n in workers:
        (d / f"data_iter_state_file_worker_{w}_step_{step}.txt").write_text(f"{n}\n")
    for w, s, n in stale:
        (d / f"data_iter_state_file_worker_{w}_step_{s}.txt").write_text(f"{n}\n")
    return d


def test_map_and_iterable_styles(tmp_path):
    d = make_iter_dir(tmp_path / "it")
    m = convert_data_iter_dir(d, "map", shuffle_seed=3)
    assert m.state == {"samples_streamed": 23, "seed": 3} and m.data_step == 20
    assert m.ignored == ["data_iter_state_file_worker_0_step_10.txt"]
    it = convert_data_iter_dir(d, "iterable")
    assert it.state == {"all_worker_states": [{"samples_streamed": 11, "shard_index": 0},
                                              {"samples_streamed": 7, "shard_index": 1},
                                              {"samples_streamed": 5, "shard_index": 2}]}


def test_missing_global_file_is_a_config_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as e:
        convert_data_iter_dir(tmp_path / "empty", "map")
    assert "data_iter_checkpoint_state_file_global" in str(e.value) and e.value.path


def _ckpt(tmp_path, root, release="1.9"):
    return Checkpoint(tmp_path / "c.mdl", 0.3, release, True, root, {})


def _root():
    return Container("dict", ["model", "global_step"],
                     [Container("dict", ["w"], [TensorLeaf("w", ArrayTensor(np.ones(2, np.float32)))]),
                      ValueLeaf("global_step", 20)])


def test_yaml_save_iter_state_path_triggers_iterable(tmp_path):
    make_iter_dir(tmp_path / "iters")
    (tmp_path / "params.yaml").write_text("train_input:\n  data_processor: GptHDF5DataProcessor\n"
                                          "cerebras:\n  save_iter_state_path: iters\nmodel:\n  name: gpt2\n")
    up = upgrade_checkpoint(_ckpt(tmp_path, _root()))
    dl = T.to_python(T.get(up.root, "dataloader"))
    assert [w["shard_index"] for w in dl["all_worker_states"]] == [0, 1, 2]
    # the cerebras section (and the path with it) is gone from the upgraded params
    assert "cerebras" not in up.params and "trainer" in up.params
    hist = T.to_python(T.get(up.root, "__metadata__"))[-1]
    assert hist["version"] == "2.10.0" and "cerebras" not in hist["params"]


def test_option_dir_defaults_to_map_style_with_seed(tmp_path):
    d = make_iter_dir(tmp_path / "x")
    up = upgrade_checkpoint(_ckpt(tmp_path, _root(), "2.10.0"), MountOptions(data_iter_dir=d, shuffle_seed=5))
    assert T.to_python(T.get(up.root, "dataloader")) == {"samples_streamed": 23, "seed": 5}
    assert any("map-style" in n for n in up.notes)


def test_existing_dataloader_is_kept(tmp_path):
    d = make_iter_dir(tmp_path / "x")
    root = _root()
    old = Container("dict", ["samples_streamed"], [ValueLeaf("s", 1)])
    T.put(root, "dataloader", old)
    up = upgrade_checkpoint(_ckpt(tmp_path, root), MountOptions(data_iter_dir=d))
    assert T.get(up.root, "dataloader").children == old.children
    assert any("already in the checkpoint" in n for n in up.notes)


def test_unknown_processor_from_yaml_is_noted_not_fatal(tmp_path):
    make_iter_dir(tmp_path / "iters")
    (tmp_path / "params.yaml").write_text("train_input:\n  data_processor: Other\ncerebras:\n  save_iter_state_path: iters\n")
    up = upgrade_checkpoint(_ckpt(tmp_path, _root()))
    assert not T.has(up.root, "dataloader") and any("Other" in n for n in up.notes)
