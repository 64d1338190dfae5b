"""How a Hugging Face model folder looks on disk: the file names ``save_pretrained`` writes, the converter's
multi-folder layouts, the Hub cache's ``models--org--name/snapshots/<rev>/``. Recognising one reads only directory
entries (and a Hub repository's ``refs/main``; every component of a Hub repository must resolve inside it); ``source.kind`` tells an HF folder from a Model Zoo ``model_dir``
(``hf_folder`` opens one).
"""
from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from ...errors import CheckpointError
from ...guard.confine import RefusedReference, read_regular

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
#: a ref file (``refs/main``) names one revision: 40 hex digits, or a tag or branch name
MAX_REF_BYTES = 256


@dataclass(frozen=True)
class HubSnapshot:
    """A snapshot of the Hugging Face Hub cache: its repository folder, revision and ``org/name``."""

    repo: Path  # .../models--org--name
    revision: str
    repo_id: str


def _hub_repo(path: Path) -> bool:
    return path.name.startswith(("models--", "datasets--", "spaces--"))


def inside_repository(repo: Path, path: Path, what: str) -> str:
    """The real path of ``path``, a component of the Hub repository folder ``repo`` (``snapshots/``, a snapshot,
    ``refs/``, ``blobs/``), when, every link resolved, it is inside ``repo`` (itself resolved: the root of the
    confinement); else ``CheckpointError`` in one line. A Hub cache's components are folders and files of its
    repository: a link out of it (a snapshot folder linked to another model) would serve foreign bytes."""
    root = os.path.realpath(repo)
    real = os.path.realpath(path)
    if real != root and not real.startswith(root.rstrip("/") + "/"):
        raise CheckpointError(path, f"{what} leads to {real}, outside its repository {root} (a Hub cache's "
                                    f"snapshots, refs and blobs are folders and files of the repository)")
    return real


def ref_text(ref: Path, encoding: str = "utf-8") -> str:
    """The stripped text of a Hub cache ref file found regular by an ``lstat`` (at most ``MAX_REF_BYTES``), read
    without following a link; ``CheckpointError`` when it was swapped since or cannot be read."""
    try:
        return read_regular(ref, MAX_REF_BYTES).decode(encoding, "replace").strip()
    except RefusedReference as e:  # swapped since the lstat
        raise CheckpointError(ref, e.problem) from None
    except OSError as e:
        raise CheckpointError(ref, f"cannot read the ref ({e.strerror or e})") from None


def _read_ref(repo: Path, ref: Path) -> str:
    """The revision the ref file ``ref`` names: a small regular file of the repository, not a link."""
    inside_repository(repo, ref.parent, "refs/")
    st = os.lstat(ref)
    if stat.S_ISLNK(st.st_mode):
        raise CheckpointError(ref, f"is a link (to {os.readlink(ref)[:200]}), not a file naming a revision: a Hub "
                                   f"cache's refs are files of the repository")
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_REF_BYTES:
        raise CheckpointError(ref, f"is not a file of at most {MAX_REF_BYTES} bytes naming a revision")
    rev = ref_text(ref)
    if not _REVISION.fullmatch(rev) or rev in (".", ".."):
        raise CheckpointError(ref, f"names revision {rev[:80]!r}, not a snapshot name")
    return rev


def hub_repo_snapshot(path: Path) -> Path | None:
    """For a Hub cache repository folder (``models--org--name`` with ``snapshots/``), the snapshot ``refs/main``
    names (or its only snapshot); None if ``path`` is not one. ``CheckpointError`` when it cannot be chosen, or
    when ``snapshots/``, ``refs/``, ``refs/main`` or the snapshot lead out of the repository."""
    if not (_hub_repo(path) and (path / "snapshots").is_dir()):
        return None
    inside_repository(path, path / "snapshots", "snapshots/")
    ref = path / "refs" / "main"
    if os.path.lexists(ref):
        rev = _read_ref(path, ref)
        snap = path / "snapshots" / rev
        if not snap.is_dir():
            raise CheckpointError(path, f"refs/main names snapshot {rev}, which is not in snapshots/")
        inside_repository(path, snap, "the snapshot folder")
        return snap
    snaps = sorted(p.name for p in (path / "snapshots").iterdir() if p.is_dir())
    if len(snaps) == 1:
        snap = path / "snapshots" / snaps[0]
        inside_repository(path, snap, "the snapshot folder")
        return snap
    raise CheckpointError(path, f"no refs/main and {len(snaps)} snapshots: give one, e.g. "
                                f"{path / 'snapshots' / (snaps[0] if snaps else '<revision>')}")


def hub_snapshot_of(path: Path) -> HubSnapshot | None:
    """The Hub snapshot ``path`` is (``.../models--org--name/snapshots/<rev>``), or None. ``CheckpointError`` when
    the snapshot folder (or ``snapshots/``) leads out of its repository folder."""
    if path.parent.name != "snapshots" or not path.parent.parent.name.startswith("models--"):
        return None
    repo = path.parent.parent
    inside_repository(repo, path, "the snapshot folder")
    repo_id = repo.name[len("models--"):].replace("--", "/")
    return HubSnapshot(repo, path.name, repo_id)


def hub_blobs(hub: HubSnapshot) -> str | None:
    """The real path of a Hub repository's ``blobs/`` when it is a real folder inside the repository (a link named
    ``blobs`` could lead anywhere: ``/``), else None."""
    blobs = hub.repo / "blobs"
    try:
        st = os.lstat(blobs)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    return inside_repository(hub.repo, blobs, "blobs/")


def component_folders(path: Path) -> tuple:
    """The component folders of a multi-folder model (``()`` when ``path`` is one model folder or none)."""
    if os.path.lexists(path / CONFIG):
        return ()
    for layout in COMPONENT_LAYOUTS:
        if all(os.path.lexists(path / f / CONFIG) for f in layout):
            return layout
    return ()
