"""A Hugging Face Hub repository id (``ORG/NAME``) -> its snapshot folder in the local Hub cache, as transformers
finds it offline (``HF_HUB_OFFLINE=1``): never a download.

The cache folder is the one ``huggingface_hub`` uses: ``HF_HUB_CACHE`` (or the older ``HUGGINGFACE_HUB_CACHE``),
else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``. A repository
lives in ``models--ORG--NAME/``: ``blobs/<hash>`` hold the files, ``snapshots/<commit>/<file>`` link to them, and
``refs/<branch or tag>`` holds the commit a name points at. A revision is a name under ``refs/`` (``main`` unless
``--revision`` says otherwise) or a commit hash with a snapshot of its own.

Everything read here is untrusted: a ref is read with a size bound and must hold a commit-like name; the snapshot
must be a real folder of the repository (not a link out of it).
"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from ckptfs.errors import CheckpointError
from ckptfs.readers.hf.names import MAX_REF_BYTES, ref_text

#: ``ORG/NAME`` as the Hub spells repository ids (``huggingface_hub``'s own check, with the namespace required)
REPO_ID = re.compile(r"^(?P<org>[A-Za-z0-9][\w.-]{0,95})/(?P<name>[A-Za-z0-9][\w.-]{0,95})$")
#: what a ref file may name, and what a revision argument may be
_REVISION = re.compile(r"^[A-Za-z0-9][\w./-]{0,199}$")


def looks_like_repo_id(text) -> bool:
    """Whether ``text`` reads as a Hub repository id (``ORG/NAME``: no ``--``, no ``..``, no leading ``./``)."""
    if not isinstance(text, str):
        return False
    m = REPO_ID.match(text)
    return m is not None and "--" not in text and ".." not in text and not text.endswith((".", "-"))


def hub_cache_dir(env=None) -> Path:
    """The Hub cache folder ``huggingface_hub`` uses in this environment (see the module docstring)."""
    env = os.environ if env is None else env
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return Path(os.path.expanduser(os.path.expandvars(env[name])))
    if env.get("HF_HOME"):
        return Path(os.path.expanduser(os.path.expandvars(env["HF_HOME"]))) / "hub"
    xdg = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "huggingface" / "hub"


def repo_folder(cache: Path, repo_id: str) -> Path:
    """``models--ORG--NAME`` of ``repo_id`` in ``cache``."""
    return cache / ("models--" + repo_id.replace("/", "--"))


def _ref(repo: Path, revision: str) -> str | None:
    """The commit ``refs/<revision>`` names, or None without such a ref (``CheckpointError`` for a bad one)."""
    ref = repo / "refs" / revision
    try:
        st = os.lstat(ref)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise CheckpointError(ref, f"cannot read the ref ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_REF_BYTES:
        raise CheckpointError(ref, "is not a ref file (a regular file holding one commit hash)")
    commit = ref_text(ref, "ascii")
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,200}", commit) or commit in (".", ".."):
        raise CheckpointError(ref, f"names revision {commit[:80]!r}, not a commit hash")
    return commit


def _snapshot(repo: Path, commit: str) -> Path | None:
    """``snapshots/<commit>`` when it is a real folder of the repository, else None."""
    snap = repo / "snapshots" / commit
    try:
        st = os.lstat(snap)
    except OSError:
        return None
    return snap if stat.S_ISDIR(st.st_mode) else None


def snapshot_of_repo(repo: Path, revision: str | None) -> Path:
    """The snapshot of a Hub cache repository folder a revision names (``main`` when None): a ref under ``refs/``,
    or a commit hash with a snapshot. ``CheckpointError`` saying what the repository holds when there is none."""
    rev = revision or "main"
    if not _REVISION.match(rev) or ".." in rev.split("/"):
        raise CheckpointError(repo, f"--revision {rev[:80]!r} is not a branch, tag or commit name")
    commit = _ref(repo, rev)
    if commit is not None:
        snap = _snapshot(repo, commit)
        if snap is None:
            raise CheckpointError(repo, f"refs/{rev} names commit {commit}, which has no folder in snapshots/ (the "
                                        f"download did not finish: download it again)")
        return snap
    snap = _snapshot(repo, rev)
    if snap is not None:
        return snap
    raise CheckpointError(repo, f"no revision {rev!r} in the cache (refs: {_names(repo / 'refs') or 'none'}; "
                                f"snapshots: {_names(repo / 'snapshots') or 'none'}): give --revision one of them, "
                                f"or download it")


def _names(folder: Path) -> str:
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return ""
    shown = ", ".join(names[:5])
    return shown + (f"… ({len(names)} in all)" if len(names) > 5 else "")


def resolve_repo_id(repo_id: str, revision: str | None = None, cache: Path | None = None) -> Path:
    """The snapshot folder of ``repo_id`` at ``revision`` in the local Hub cache; ``CheckpointError`` saying where
    it looked and how to get it when the repository is not there."""
    cache = hub_cache_dir() if cache is None else cache
    repo = repo_folder(cache, repo_id)
    if not os.path.isdir(repo / "snapshots"):
        rev = f" --revision {revision}" if revision else ""
        raise CheckpointError(repo_id, f"no such local path, and not in the Hugging Face Hub cache (looked for "
                                       f"{repo}; the cache is HF_HUB_CACHE, else HF_HOME/hub): get it with "
                                       f"`huggingface-cli download {repo_id}{rev}` (ckptfs never downloads)")
    return snapshot_of_repo(repo, revision)
