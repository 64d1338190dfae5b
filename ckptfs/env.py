"""The environment: every variable ckptfs reads is read here, and nowhere else (README.md, "Environment variables",
lists them). Each is read when asked, not at import, so that a test or a caller may set it first.
"""
from __future__ import annotations

import os

#: the folder ckptfs keeps state in (``ckptfs.state.dirs``)
CACHE_DIR = "CKPTFS_CACHE_DIR"
#: ``0``: read every catalog from its file, never from an index (``ckptfs.readers.cerebras.catalog_cache``)
CATALOG_INDEX = "CKPTFS_CATALOG_INDEX"
#: ``0``: read cold ranges of a local checkpoint through the page cache, never with ``O_DIRECT``
#: (``ckptfs.storage.local``)
DIRECT_IO = "CKPTFS_DIRECT_IO"
#: threads that decode one read's LZ4 chunks (default: the CPUs; ``1``: in the reading thread)
DECODE_THREADS = "CKPTFS_DECODE_THREADS"
#: background threads computing the blocks after a sequential read (``ckptfs.tensor.readahead``)
READ_AHEAD_THREADS = "CKPTFS_READ_AHEAD_THREADS"
#: ``1``: libfuse's multi-threaded loop for every mount; ``0``: one loop thread for every mount (default: the
#: multi-threaded loop for a checkpoint in object storage only: ``ckptfs.fuse.operations.serve``)
FUSE_THREADS = "CKPTFS_FUSE_THREADS"
#: mfusepy's own: the libfuse to load, by path or by name (``ckptfs.fuse.operations`` sets the path to libfuse 3 otherwise)
FUSE_LIBRARY_PATH = "FUSE_LIBRARY_PATH"
FUSE_LIBRARY_NAME = "FUSE_LIBRARY_NAME"
#: boto3's own (endpoint, profile, credentials…): ckptfs keeps one S3 client per set of them
#: (``ckptfs.storage.s3client.client_for``) and never logs their values
AWS_PREFIX = "AWS_"


def _text(name: str, default: str = "") -> str:
    return os.environ.get(name, default).strip()


def _count(name: str, default: int) -> int:
    """A positive whole number from ``name`` (``default`` when unset, empty or not a number)."""
    try:
        return max(1, int(_text(name) or default))
    except ValueError:
        return max(1, default)


def cache_dir_setting() -> str | None:
    """``$CKPTFS_CACHE_DIR`` when set and not empty."""
    return os.environ.get(CACHE_DIR) or None


def xdg_cache_home() -> str:
    """``$XDG_CACHE_HOME``, else ``~/.cache``."""
    return os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")


def catalog_index_enabled() -> bool:
    return _text(CATALOG_INDEX, "1") != "0"


def direct_io_enabled() -> bool:
    return _text(DIRECT_IO, "1") != "0"


def decode_threads() -> int:
    return _count(DECODE_THREADS, os.cpu_count() or 1)


def read_ahead_threads() -> int:
    return _count(READ_AHEAD_THREADS, 2)


def fuse_threads() -> bool | None:
    """True (``1``), False (``0``) or None (unset or anything else: ``ckptfs.fuse.operations.serve`` decides)."""
    return {"1": True, "0": False}.get(_text(FUSE_THREADS))


def fuse_library_chosen() -> bool:
    """Whether the user chose the libfuse mfusepy loads (``FUSE_LIBRARY_PATH`` or ``FUSE_LIBRARY_NAME``)."""
    return bool(os.environ.get(FUSE_LIBRARY_PATH) or os.environ.get(FUSE_LIBRARY_NAME))


def choose_fuse_library(path: str) -> None:
    """Tell mfusepy (which reads ``FUSE_LIBRARY_PATH`` when imported) to load the libfuse at ``path``."""
    os.environ[FUSE_LIBRARY_PATH] = path


def aws_environment() -> tuple:
    """The ``AWS_*`` variables, ``((name, value), …)`` sorted by name: what boto3 configures a client from."""
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(AWS_PREFIX)))
