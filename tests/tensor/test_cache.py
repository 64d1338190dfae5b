"""BlockCache bounds: what a kept block costs beyond its bytes is charged against --cache-size."""
from ckptfs.tensor.cache import BLOCK_OVERHEAD, BlockCache


def test_many_tiny_blocks_stay_within_the_bound():
    cache = BlockCache(100 << 10)
    for i in range(10_000):
        cache.get_or_compute(("t", i), lambda: b"x")
    kept = len(cache._data)
    assert cache.size <= cache.max_bytes
    assert kept == (100 << 10) // (1 + BLOCK_OVERHEAD)  # not 100 KiB of one-byte blocks
    assert cache.get_or_compute(("t", 9_999), lambda: b"other") == b"x"  # the newest are the ones kept


def test_streaming_drop_gives_back_the_whole_charge():
    cache = BlockCache(1 << 20)
    cache.streaming = True
    cache.get_or_compute("a", lambda: b"y" * 1000)
    assert cache.size == 1000 + BLOCK_OVERHEAD
    cache.taken("a", 1000)
    assert cache.size == 0 and not cache.peek("a")


def test_sequential_turns_streaming_and_read_ahead_on_and_restores_them():
    c = BlockCache(1 << 20)
    c.read_ahead = 1 << 20
    with c.sequential(8 << 20) as inside:
        assert inside is c and c.streaming and c.read_ahead == 8 << 20
    assert not c.streaming and c.read_ahead == 1 << 20
    c.streaming, c.read_ahead = True, 16 << 20  # a FUSE server's cache keeps its larger setting
    try:
        with c.sequential(8 << 20):
            raise KeyError("x")
    except KeyError:
        pass
    assert c.streaming and c.read_ahead == 16 << 20
