"""The chunk indexes of an HDF5 object's datasets fetched ahead in rounds, the datasets a reader waits for first.

Over HTTP, a dataset's chunk index is a few round trips HDF5 would wait for one by one; fetched ahead, every node of a
level of many datasets goes at once (``h5meta.chunk_index_spans``). Fetching all of them before any reader may go on
makes a copy started right after a mount wait for the whole walk (a few hundred requests on a checkpoint of 58
datasets) although its first tensor needs two or three of them. So the walk goes by rounds: the datasets readers are
waiting for, then the others in the file's order, the rounds growing from one dataset to ``ROUND_MOST``; a reader
waits until its own dataset is in, the mount's background work until all are (docs/measurements.md, "S3: an .mdl
object's chunk indexes by rounds"). Whoever needs an index walks while nobody else does; a reader stops once its
own is in.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from ...errors import CkptfsError

log = logging.getLogger(__name__)

#: datasets walked in one round at most (rounds start at one and double): a reader arriving meanwhile waits for the
#: round under way, then its own dataset comes first
ROUND_MOST = 16


class IndexAhead:
    """The datasets ``roots`` (name -> ``h5meta.ChunkIndexRoot``) whose indexes are still to fetch; ``walk(roots,
    most_bytes)`` fetches the nodes of those trees (at most that many bytes) and returns the bytes it fetched; at most
    ``budget`` bytes in all. Thread-safe; best effort (a failed round is logged and its datasets are left to HDF5)."""

    def __init__(self, roots: dict, walk: Callable[[list, int], int], budget: int, name: str = "an object"):
        self._todo = dict(sorted(roots.items(), key=lambda item: item[1].address))  # in the file's order
        self._known = frozenset(roots)
        self._wanted: list = []  # names readers wait for, first asked first
        self._walk, self._budget, self._name = walk, budget, name
        self._round = 1
        self._walking = False
        self._cond = threading.Condition()

    def pending(self) -> int:
        """Datasets whose index is still to fetch."""
        with self._cond:
            return len(self._todo)

    def need(self, name: str | None = None) -> None:
        """Return once dataset ``name``'s index was fetched (None, or a name this walk does not know: every
        dataset's). Walks rounds itself while nobody else does, else waits for the one who does (who takes the
        datasets waited for first)."""
        if not self._todo:  # every announcement asks: once all are in, no lock (the dict only shrinks)
            return
        with self._cond:
            if name is not None and name not in self._known:  # not shown by the headers: HDF5 may need any index
                name = None
            while True:
                if not self._todo or (name is not None and name not in self._todo):
                    return
                if name is not None and name not in self._wanted:
                    self._wanted.append(name)
                if not self._walking:
                    break
                self._cond.wait()
            self._walking = True
        try:
            self._walk_rounds(name)
        finally:
            with self._cond:
                self._walking = False
                self._cond.notify_all()

    def _walk_rounds(self, name: str | None) -> None:
        while True:
            with self._cond:
                batch = self._next_round()
                budget = self._budget
            if not batch:
                return
            try:
                spent = self._walk([root for _, root in batch], budget)
            except (CkptfsError, OSError, RuntimeError, ValueError) as e:  # the endpoint's: HDF5 reads them itself
                log.debug("fetching chunk indexes of %s ahead failed: %s", self._name, e)
                spent = 0
            with self._cond:
                self._budget -= spent
                for n, _ in batch:
                    self._todo.pop(n, None)
                self._wanted = [n for n in self._wanted if n in self._todo]
                if self._budget <= 0:  # the rest is left to HDF5, read as it asks
                    self._todo.clear()
                    self._wanted.clear()
                self._cond.notify_all()
                if name is not None and name not in self._todo:
                    return

    def _next_round(self) -> list:
        """``[(name, root)]`` of the next round (called with the lock held): the datasets waited for, then the next
        ones in the file's order, as many as the round's size."""
        size = max(self._round, len(self._wanted))
        self._round = min(ROUND_MOST, self._round * 2)
        batch = [(n, self._todo[n]) for n in self._wanted if n in self._todo]
        taken = {n for n, _ in batch}
        for n, root in self._todo.items():
            if len(batch) >= size:
                break
            if n not in taken:
                batch.append((n, root))
        return batch
