"""Where ckptfs keeps state between runs: one cache directory and its sub-folders, named here for every layer.

``$CKPTFS_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/ckptfs`` (default ``~/.cache/ckptfs``), holding ``crc/``
(persisted zip CRCs, ``ckptfs.layouts.torchzip.crc_store``), ``catalogs/`` (catalog indexes, ``ckptfs.readers.cerebras.catalog_cache``),
``logs/`` (background servers' logs, ``ckptfs.fuse.mount``), ``exports/`` (what ``ckptfs export`` finished,
``ckptfs.commands.export_record``), ``s3-params/`` (copies of params files found beside checkpoints in S3,
``ckptfs.readers.s3.params``), the model registry's index (``ckptfs.mapping.lang.families``) and ``key``, the secret
that seals them. Nothing here creates a folder: each user does, through ``ckptfs.state.files`` (``s3params`` by its
own rule: a copy is used only when it holds the bytes just fetched), which decides when such a file is trusted, and
copes when it cannot.
"""
from __future__ import annotations

from pathlib import Path

from .. import env

#: how to point ckptfs at another cache directory (said in errors about an unusable one)
CACHE_DIR_ENV = env.CACHE_DIR


def cache_dir() -> Path:
    """ckptfs's cache directory (see the module docstring)."""
    chosen = env.cache_dir_setting()
    return Path(chosen) if chosen else Path(env.xdg_cache_home()) / "ckptfs"


def log_dir() -> Path:
    return cache_dir() / "logs"
