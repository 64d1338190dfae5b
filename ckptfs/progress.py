"""A byte-count progress bar on stderr from a maintained library: tqdm when installed, else rich, else none.

``progress_bar(total, desc)`` returns an object with ``update(nbytes)`` and ``close()``; callers create one only
when stderr is a terminal (``ckptfs export``), so scripted runs print nothing.
"""
from __future__ import annotations

import os
import sys


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


class _TqdmBar:
    def __init__(self, total: int, desc: str):
        from tqdm import tqdm

        known = _terminal_width() > 0  # a terminal reporting no size (0x0) would make tqdm print an empty bar
        size = {} if known else {"ncols": 80, "nrows": 24}
        self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                         dynamic_ncols=known, leave=True, **size)

    def update(self, n: int) -> None:
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()


class _RichBar:
    def __init__(self, total: int, desc: str):
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                  TransferSpeedColumn(), TimeRemainingColumn(), console=Console(file=sys.stderr))
        self._task = self._progress.add_task(desc, total=total)
        self._progress.start()

    def update(self, n: int) -> None:
        self._progress.update(self._task, advance=n)

    def close(self) -> None:
        self._progress.stop()


def _terminal_width() -> int:
    """stderr's terminal width, 0 when unknown (a terminal that reports no size)."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError):
        return 0


def progress_bar(total: int, desc: str):
    """A progress bar over ``total`` bytes (tqdm, else rich, else one that shows nothing)."""
    for kind in (_TqdmBar, _RichBar):
        try:
            return kind(total, desc)
        except ImportError:
            continue
    return _NoBar()
