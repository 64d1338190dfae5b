"""Which bytes of each part reads used (``storage.partreads``): spent parts, the bytes left of a part let go of, and a
second pass over an object telling itself apart from a block read twice."""
from ckptfs.storage.partreads import PartReads, add_range, inside

MIB = 1 << 20


def test_ranges_merge_where_they_touch_and_tell_what_they_hold():
    r = add_range([], 10, 20)
    r = add_range(r, 30, 40)
    assert r == [(10, 20), (30, 40)]
    assert add_range(r, 20, 30) == [(10, 40)]
    assert add_range(r, 0, 5) == [(0, 5), (10, 20), (30, 40)]
    assert inside(r, 12, 18) and not inside(r, 15, 35) and not inside(r, 40, 41)


def test_a_part_is_spent_once_all_but_a_few_bytes_were_read():
    reads = PartReads(slack=MIB // 2)
    assert not reads.read("p", 0, 4 * MIB, 8 * MIB)
    assert not reads.spent("p", 8 * MIB)
    assert reads.read("p", 4 * MIB, 8 * MIB - 100_000, 8 * MIB)  # what is left: metadata between datasets
    reads.dropped("p", 8 * MIB)
    assert reads.was_read("p") and "p" not in reads.used


def test_the_bytes_left_of_a_part_let_go_of_are_read_alone_until_a_second_pass():
    reads = PartReads(slack=MIB // 2)
    reads.read("p", 2 * MIB, 8 * MIB, 8 * MIB)
    reads.dropped("p", 8 * MIB)
    assert reads.read_gone("p", 0, 2 * MIB, 8 * MIB)  # bytes no read used: just those
    assert reads.read_gone("p", 3 * MIB, 4 * MIB, 8 * MIB)  # a block converted twice: a few bytes again, alone
    assert not reads.read_gone("p", 0, 4 * MIB, 8 * MIB)  # half a part again: a second pass, fetched whole
    assert not reads.was_read("p")
    assert not reads.read_gone("q", 0, MIB, 8 * MIB)  # never held: as any other part


def test_a_part_little_of_was_read_is_not_remembered():
    reads = PartReads(slack=MIB // 2)
    reads.dropped("p", 8 * MIB)
    reads.read("q", 0, 3 * MIB, 8 * MIB)  # a loader's look at a tensor's first pages: fetched whole again later
    reads.dropped("q", 8 * MIB)
    assert not reads.was_read("p") and not reads.was_read("q")


def test_a_part_read_in_too_many_scattered_pieces_is_not_remembered():
    """The memory of parts let go of stays bounded: a part whose used bytes are more than ``MAX_RANGES`` ranges (a
    crafted object read in tiny scattered pieces) is forgotten, and fetched as any other part again."""
    from ckptfs.storage.partreads import MAX_RANGES

    reads = PartReads(slack=MIB // 2)
    size = 8 * MIB
    unit = size // (MAX_RANGES + 1)
    for k in range(MAX_RANGES + 1):  # three quarters of the part, in MAX_RANGES + 1 pieces with gaps between them
        reads.read("p", k * unit, k * unit + 3 * unit // 4, size)
    assert len(reads.used["p"]) > MAX_RANGES
    reads.dropped("p", size)
    assert not reads.was_read("p")
    reads.read("q", 0, 6 * MIB, size)
    reads.dropped("q", size)
    assert reads.was_read("q")
