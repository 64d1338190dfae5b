"""The chunk indexes of an object's datasets fetched ahead by rounds (``readers.s3.index_ahead.IndexAhead``), without
an endpoint: a walk function stands in for the requests."""
from __future__ import annotations

import threading
import time

from ckptfs.readers.cerebras.h5meta import ChunkIndexRoot
from ckptfs.readers.s3.index_ahead import ROUND_MOST, IndexAhead


def _roots(n: int) -> dict:
    return {f"d{k:02d}": ChunkIndexRoot(1000 * (k + 1), 3) for k in range(n)}


class Walk:
    """Records each round's datasets (by root address); a round takes ``pause`` seconds; ``gate`` holds the first."""

    def __init__(self, pause: float = 0.0, gate: threading.Event | None = None):
        self.rounds: list = []
        self.pause, self.gate = pause, gate
        self.lock = threading.Lock()
        self.started = threading.Event()

    def __call__(self, roots: list, most_bytes: int) -> int:
        self.started.set()
        if self.gate is not None and not self.rounds:
            self.gate.wait(10)
        time.sleep(self.pause)
        with self.lock:
            self.rounds.append([r.address for r in roots])
        return 100 * len(roots)


def test_every_index_is_fetched_once_in_rounds_that_grow_in_the_files_order():
    walk = Walk()
    index = IndexAhead(_roots(40), walk, 1 << 20)
    index.need()
    assert index.pending() == 0
    sizes = [len(r) for r in walk.rounds]
    assert sizes[:4] == [1, 2, 4, 8] and max(sizes) == ROUND_MOST and sum(sizes) == 40
    assert [a for r in walk.rounds for a in r] == sorted(1000 * (k + 1) for k in range(40))


def test_a_reader_waits_for_its_own_dataset_only_and_it_comes_next():
    """While the background walk holds a round, a reader of the last dataset asks for it: the next round starts
    with it, and the reader returns before the walk is done."""
    gate = threading.Event()
    walk = Walk(pause=0.05, gate=gate)
    index = IndexAhead(_roots(40), walk, 1 << 20)
    background = threading.Thread(target=index.need)
    background.start()
    assert walk.started.wait(10)
    got = {}

    def reader():
        index.need("d39")
        got["left"] = index.pending()
    r = threading.Thread(target=reader)
    r.start()
    time.sleep(0.05)  # the reader waits for the round under way
    gate.set()
    r.join(10)
    background.join(10)
    assert walk.rounds[1][0] == 40000  # the second round starts with the dataset the reader waits for
    assert got["left"] > 0  # the reader went on while other datasets were still to fetch
    assert index.pending() == 0


def test_a_reader_alone_walks_until_its_dataset_is_in_and_the_next_one_goes_on():
    walk = Walk()
    index = IndexAhead(_roots(10), walk, 1 << 20)
    index.need("d05")
    assert walk.rounds == [[6000]]
    index.need("d00")
    assert walk.rounds[1][0] == 1000 and len(walk.rounds[1]) == 2
    index.need("d00")  # in already: nothing fetched
    assert len(walk.rounds) == 2


def test_a_name_the_headers_did_not_show_waits_for_every_index():
    walk = Walk()
    index = IndexAhead(_roots(5), walk, 1 << 20)
    index.need("group/nested")
    assert index.pending() == 0


def test_the_byte_budget_ends_the_walk_and_a_failed_round_leaves_its_datasets_to_hdf5():
    walk = Walk()
    index = IndexAhead(_roots(10), walk, 250)  # 100 bytes a dataset: the second round passes the budget
    index.need()
    assert index.pending() == 0 and [len(r) for r in walk.rounds] == [1, 2]

    def failing(roots, most_bytes):
        raise OSError("the endpoint failed")
    index = IndexAhead(_roots(3), failing, 1 << 20)
    index.need("d01")
    index.need()
    assert index.pending() == 0
