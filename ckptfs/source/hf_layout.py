"""How a Hugging Face model folder looks on disk: the file names ``save_pretrained`` writes, the converter's
multi-folder layouts, the Hub cache's ``models--org--name/snapshots/<rev>/``. Recognising one reads only directory
entries (and a Hub repository's ``refs/main``); ``source.kind`` tells an HF folder from a Model Zoo ``model_dir``
(``hf_folder`` opens one).
"""
from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError

#: folder layouts of the converter's multi-component models (each folder a complete HF model)
COMPONENT_LAYOUTS = (("image_model", "text_model"), ("q_encoder", "ctx_encoder"))
CONFIG = "config.json"
#: weight files in the order transformers looks for them
SAFE_SINGLE, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN_SINGLE, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
#: formats ckptfs does not read, named in the error when a folder holds only these
UNREAD_WEIGHTS = ("tf_model.h5", "flax_model.msgpack", "model.ckpt.index", "consolidated.safetensors",
                  "adapter_model.safetensors", "adapter_model.bin")
_REVISION = re.compile(r"[A-Za-z0-9._-]{1,200}")


@dataclass(frozen=True)
class HubSnapshot:
    """A snapshot of the Hugging Face Hub cache: its repository folder, revision and ``org/name``."""

    repo: Path  # .../models--org--name
    revision: str
    repo_id: str


def hub_repo_snapshot(path: Path) -> Path | None:
    """For a Hub cache repository folder (``models--org--name`` with ``snapshots/``), the snapshot ``refs/main``
    names (or its only snapshot); None if ``path`` is not one. ``CheckpointError`` when it cannot be chosen."""
    if not (path.name.startswith(("models--", "datasets--", "spaces--")) and (path / "snapshots").is_dir()):
        return None
    ref = path / "refs" / "main"
    if ref.is_file() and not ref.is_symlink() and ref.stat().st_size <= 256:
        rev = ref.read_text(errors="replace").strip()
        if not _REVISION.fullmatch(rev) or rev in (".", ".."):
            raise CheckpointError(ref, f"names revision {rev[:80]!r}, not a snapshot name")
        snap = path / "snapshots" / rev
        if not snap.is_dir():
            raise CheckpointError(path, f"refs/main names snapshot {rev}, which is not in snapshots/")
        return snap
    snaps = sorted(p.name for p in (path / "snapshots").iterdir() if p.is_dir())
    if len(snaps) == 1:
        return path / "snapshots" / snaps[0]
    raise CheckpointError(path, f"no refs/main and {len(snaps)} snapshots: give one, e.g. "
                                f"{path / 'snapshots' / (snaps[0] if snaps else '<revision>')}")


def hub_snapshot_of(path: Path) -> HubSnapshot | None:
    """The Hub snapshot ``path`` is (``.../models--org--name/snapshots/<rev>``), or None."""
    if path.parent.name != "snapshots" or not path.parent.parent.name.startswith("models--"):
        return None
    repo = path.parent.parent
    repo_id = repo.name[len("models--"):].replace("--", "/")
    return HubSnapshot(repo, path.name, repo_id)


def hub_blobs(hub: HubSnapshot) -> str | None:
    """The real path of a Hub repository's ``blobs/`` when it is a real folder (a link named ``blobs`` could lead
    anywhere: ``/``), else None."""
    blobs = hub.repo / "blobs"
    try:
        st = os.lstat(blobs)
    except OSError:
        return None
    return os.path.realpath(blobs) if stat.S_ISDIR(st.st_mode) else None


def component_folders(path: Path) -> tuple:
    """The component folders of a multi-folder model (``()`` when ``path`` is one model folder or none)."""
    if os.path.lexists(path / CONFIG):
        return ()
    for layout in COMPONENT_LAYOUTS:
        if all(os.path.lexists(path / f / CONFIG) for f in layout):
            return layout
    return ()


def is_hf_folder(path) -> bool:
    """Whether ``path`` is served as a Hugging Face model (a model folder, a multi-folder model, a Hub cache
    repository or snapshot) rather than a Model Zoo ``model_dir``: ``source.kind`` decides (a folder holding
    checkpoint files is a run, whatever else it holds)."""
    from ckptfs.source.kind import classify

    return classify(path).is_hf
