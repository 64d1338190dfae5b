"""resolve_checkpoint: a file is itself; a model_dir means its latest checkpoint."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from ckptfs.errors import CheckpointError
from ckptfs.readers import open_checkpoint, resolve_checkpoint
from helpers import FIXTURES

SRC = FIXTURES / "cstorch_edge_cases" / "src.mdl"


def _ckpt(d: Path, name: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(SRC, d / name)
    return d / name


def test_file_is_itself():
    assert resolve_checkpoint(SRC) == SRC


def test_highest_step_wins_numerically(tmp_path):
    _ckpt(tmp_path, "checkpoint_9.mdl")
    best = _ckpt(tmp_path, "checkpoint_100.mdl")
    _ckpt(tmp_path, "checkpoint_20.mdl")
    _ckpt(tmp_path, "trainer_state_500.mdl")  # not a model checkpoint
    _ckpt(tmp_path, "checkpoint_final.mdl")  # not a step
    assert resolve_checkpoint(tmp_path) == best
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.path == best


def test_subdirectories_and_timestamp_suffix(tmp_path):
    _ckpt(tmp_path / "run1", "checkpoint_50.mdl")
    _ckpt(tmp_path / "run2", "checkpoint_70.mdl")
    later = _ckpt(tmp_path / "run2", "checkpoint_70_1700000000.mdl")  # name clash: <step>_<unix time>
    assert resolve_checkpoint(tmp_path) == later


def test_model_zoo_date_stamps_are_checkpoints_and_order_by_date(tmp_path):
    """Model Zoo's ``checkpoint_<step>_<YYYYmmdd_HHMMSS>.mdl`` names: the same names a run mount shows (one parser,
    ``checkpoint_name``), the later date of a step wins, a name whose date is invalid is not a checkpoint."""
    _ckpt(tmp_path, "checkpoint_70.mdl")
    later = _ckpt(tmp_path, "checkpoint_70_20240102_030405.mdl")
    _ckpt(tmp_path, "checkpoint_70_20231231_235959.mdl")
    _ckpt(tmp_path, "checkpoint_70_20241399_000000.mdl")  # month 13: not a checkpoint
    assert resolve_checkpoint(tmp_path) == later
    only = tmp_path / "only"
    dated = _ckpt(only, "checkpoint_5_20240102_030405.mdl")
    assert resolve_checkpoint(only) == dated  # was: "is a directory with no checkpoint_<step>.mdl file"


def test_latest_pointer_file_and_symlink(tmp_path):
    old = _ckpt(tmp_path, "checkpoint_10.mdl")
    _ckpt(tmp_path, "checkpoint_20.mdl")
    (tmp_path / "latest").write_text("checkpoint_10.mdl\n")
    assert resolve_checkpoint(tmp_path) == old
    (tmp_path / "latest").unlink()
    os.symlink("checkpoint_10.mdl", tmp_path / "latest")
    assert resolve_checkpoint(tmp_path).resolve() == old.resolve()


def test_latest_pointer_to_missing_file(tmp_path):
    _ckpt(tmp_path, "checkpoint_10.mdl")
    (tmp_path / "latest").write_text("checkpoint_99.mdl")
    with pytest.raises(CheckpointError, match="latest"):
        resolve_checkpoint(tmp_path)


def test_empty_directory_and_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint_"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no such file"):
        resolve_checkpoint(tmp_path / "missing.mdl")
