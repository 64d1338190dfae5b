"""Exceptions of ckptfs: every error carries the path it concerns and a one-line problem."""
from __future__ import annotations


class CkptfsError(Exception):
    """Base error: ``str(err)`` is the one line shown to users: ``<path>: <problem>``."""

    def __init__(self, path, problem: str):
        self.path = str(path) if path is not None else None
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" if self.path else problem)


class CheckpointError(CkptfsError):
    """The checkpoint file cannot be opened or is not a valid Cerebras checkpoint."""


class TensorReadError(CkptfsError):
    """One tensor's data cannot be read (corrupt chunk, missing external file, unreadable kind)."""


class MappingError(CkptfsError):
    """A mapping YAML is invalid or does not fit the checkpoint."""


class ConfigError(CkptfsError):
    """The Cerebras params YAML is missing, ambiguous or cannot be converted."""


class UsageError(CkptfsError):
    """Bad command-line arguments (exit code 2)."""


class SourceChangedError(TensorReadError):
    """A file the mount reads from (the checkpoint, or a file it refers to) was replaced or modified after it was
    opened: its bytes would no longer match what was already served, so reads fail instead."""


class StorageError(CkptfsError):
    """A storage backend (an S3 endpoint) refused or failed a request. ``kind`` says how: "missing" (no such bucket,
    object or prefix), "denied", "credentials", "unreachable", "timeout", "refused" (an answer ckptfs will not use)
    or "failed"."""

    def __init__(self, path, problem: str, kind: str = "failed"):
        super().__init__(path, problem)
        self.kind = kind


def one_line(text) -> str:
    """Collapse a message to a single line (HDF5 errors can span several)."""
    return " ".join(str(text).split())


def exit_code(run, debug: bool = False) -> int:
    """The exit code of a command: ``run()``'s (0 for None); 2 with the error's one line on stderr for a
    ``CkptfsError`` (raised as it is with ``debug``); 130 when interrupted; 0 when the reader closed the pipe."""
    import sys

    try:
        return int(run() or 0)
    except CkptfsError as e:
        if debug:
            raise
        print(f"ckptfs: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
