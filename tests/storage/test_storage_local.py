"""ckptfs.storage.local: ranges of a checkpoint file from the page cache when cached there, else with O_DIRECT."""
from __future__ import annotations

import errno
import mmap
import os
import random
import threading

import pytest

from ckptfs import env
from ckptfs.storage import local
from ckptfs.storage.base import Blob, Folder, ShortRead
from ckptfs.storage.local import ALIGN, LocalFile, LocalFolder


@pytest.fixture(autouse=True)
def _local_disk(monkeypatch, request):
    """The test files count as on a local disk wherever the temporary directory is (one test says otherwise)."""
    if "file_system_type" not in request.node.name:
        monkeypatch.setattr(local, "file_system_type", lambda dev: "ext4")
    if "small_reads" not in request.node.name:
        monkeypatch.setattr(local, "DIRECT_MIN_BYTES", 1)  # the tests' spans are small


def _kernel_has_cachestat() -> bool:
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return (major, minor) >= (6, 5)


def _file(tmp_path, n: int, seed: int = 0):
    data = random.Random(seed).randbytes(n)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    return path, data


def _noting_direct(f: LocalFile) -> list:
    """Whether each of ``f``'s reads was direct, noted as they happen (``del f.read_into`` stops it)."""
    how, real = [], f.read_into

    def read_into(view, offset, need):
        got = real(view, offset, need)
        how.append(got[1])
        return got

    f.read_into = read_into
    return how


def _read_spans(f: LocalFile, spans) -> tuple[list, list]:
    """Each span's bytes, read the way the chunk reader does, and whether each read was direct."""
    how = _noting_direct(f)
    try:
        buf, starts = f.read_spans(spans, lambda n: mmap.mmap(-1, max(n, 1)))
    finally:
        del f.read_into
    for at, (lo, end) in zip(starts, spans):
        if end - lo >= local.DIRECT_MIN_BYTES:  # a large span's slot starts on a block boundary
            assert (at - lo % ALIGN) % ALIGN == 0
    return [bytes(buf[at:at + end - lo]) for at, (lo, end) in zip(starts, spans)], how


def test_cachestat_tells_cached_pages_from_evicted_ones(tmp_path):
    """After a read the pages are cached; after the kernel was told to drop them, they are not."""
    path, data = _file(tmp_path, 5 * ALIGN + 123)
    if not _kernel_has_cachestat():
        assert local.page_cache.cached(0, 0, 1) is None
        return
    with open(path, "rb") as fh:
        fd = fh.fileno()
        os.fsync(fd)
        assert fh.read() == data
        assert local.page_cache.cached(fd, 0, len(data)) is True
        assert local.page_cache.cached(fd, ALIGN + 7, 100) is True
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert local.page_cache.cached(fd, 0, len(data)) is False


@pytest.mark.parametrize("cold", [False, True])
def test_reads_give_the_files_bytes_cached_or_straight_from_the_disk(tmp_path, monkeypatch, cold):
    """Unaligned spans, neighbours in one block, a span ending at the file's end: the file's bytes, whichever way
    they are read; cold ranges are read directly, cached ones from the page cache."""
    path, data = _file(tmp_path, 9 * ALIGN + 777, seed=3)
    monkeypatch.setattr(local.page_cache, "cached", lambda fd, off, n: not cold)
    f = LocalFile(str(path))
    assert f.direct_fd is not None, "O_DIRECT refused on the test file system"
    rng = random.Random(5)
    spans = [(0, 1), (10, ALIGN + 5), (ALIGN - 1, ALIGN + 1), (len(data) - 300, len(data)), (3 * ALIGN, 5 * ALIGN)]
    for _ in range(40):
        lo = rng.randrange(len(data))
        spans.append((lo, rng.randrange(lo + 1, len(data) + 1)))
    got, how = _read_spans(f, spans)
    assert got == [data[lo:end] for lo, end in spans]
    assert how == [cold] * len(spans)


@pytest.mark.parametrize("cold", [False, True])
def test_packed_reads_give_the_files_bytes_cached_or_straight_from_the_disk(tmp_path, monkeypatch, cold):
    """``read_packed`` lays unaligned spans end to end, read through the page cache straight into the room given or,
    when cold, directly through an aligned buffer: the same bytes either way."""
    path, data = _file(tmp_path, 9 * ALIGN + 777, seed=4)
    monkeypatch.setattr(local.page_cache, "cached", lambda fd, off, n: not cold)
    f = LocalFile(str(path))
    direct = _noting_direct(f)
    rng = random.Random(6)
    spans = [(0, 1), (10, ALIGN + 5), (len(data) - 300, len(data)), (3 * ALIGN, 5 * ALIGN)]
    for _ in range(20):
        lo = rng.randrange(len(data))
        spans.append((lo, rng.randrange(lo + 1, len(data) + 1)))
    out = bytearray(sum(end - lo for lo, end in spans))
    f.read_packed(spans, memoryview(out))
    assert bytes(out) == b"".join(data[lo:end] for lo, end in spans)
    assert direct == ([True] * len(spans) if cold else [])
    with pytest.raises(ShortRead):
        f.read_packed([(len(data) - 5, len(data) + 5)], memoryview(bytearray(10)))


def test_small_reads_always_use_the_page_cache(tmp_path, monkeypatch):
    """A peek's chunks are read through the page cache even when cold, so they are cached for the next reader."""
    path, data = _file(tmp_path, 4 * local.DIRECT_MIN_BYTES)
    monkeypatch.setattr(local.page_cache, "cached", lambda fd, off, n: False)
    f = LocalFile(str(path))
    small, big = local.DIRECT_MIN_BYTES - 1, local.DIRECT_MIN_BYTES
    assert _read_spans(f, [(0, small), (big, 2 * big)]) == ([data[:small], data[big:2 * big]], [False, True])


def test_many_small_reads_need_no_more_buffer_than_their_bytes(tmp_path):
    """Small spans are packed (only large ones get block-aligned slots): a chunk index of many tiny chunks far
    apart cannot make the scratch buffer thousands of times larger than the bytes it holds."""
    path, data = _file(tmp_path, 3 << 20)
    f = LocalFile(str(path))
    spans = [(lo, lo + 17) for lo in range(5, 3 << 20, 70_001)]
    sizes = []
    buf, starts = f.read_spans(spans, lambda n: sizes.append(n) or mmap.mmap(-1, max(n, 1)))
    assert sizes == [17 * len(spans)]
    assert [bytes(buf[a:a + 17]) for a in starts] == [data[lo:end] for lo, end in spans]
    big = [(1, 1 + local.DIRECT_MIN_BYTES), (5, 9), (ALIGN + 3, ALIGN + 3 + local.DIRECT_MIN_BYTES)]
    sizes.clear()
    buf, starts = f.read_spans(big, lambda n: sizes.append(n) or mmap.mmap(-1, max(n, 1)))
    assert sizes[0] <= sum(e - lo for lo, e in big) + 2 * 2 * ALIGN
    assert [bytes(buf[a:a + e - lo]) for a, (lo, e) in zip(starts, big)] == [data[lo:e] for lo, e in big]


def test_a_span_past_the_end_of_the_file_is_a_short_read(tmp_path):
    path, data = _file(tmp_path, 2 * ALIGN + 5)
    f = LocalFile(str(path))
    with pytest.raises(ShortRead) as e:
        f.read_spans([(0, 10), (ALIGN, 3 * ALIGN)], lambda n: mmap.mmap(-1, max(n, 1)))
    assert (e.value.k, e.value.got) == (1, ALIGN + 5)


def test_a_direct_descriptor_given_up_stays_open_until_the_file_is_dropped(tmp_path, monkeypatch):
    """Another thread may be reading it: closing it at once could hand its number to another open file."""
    path, data = _file(tmp_path, 3 * ALIGN)
    monkeypatch.setattr(local.page_cache, "cached", lambda fd, off, n: False)
    f = LocalFile(str(path))
    dfd = f.direct_fd
    f._no_direct()
    assert f.direct_fd is None and os.fstat(dfd)  # still open
    del f
    with pytest.raises(OSError):
        os.fstat(dfd)


def test_a_read_past_the_end_of_the_file_comes_back_short(tmp_path, monkeypatch):
    path, data = _file(tmp_path, ALIGN + 10)
    monkeypatch.setattr(local.page_cache, "cached", lambda fd, off, n: False)
    f = LocalFile(str(path))
    buf = mmap.mmap(-1, 4 * ALIGN)
    k, direct = f.read_into(memoryview(buf), 0, 3 * ALIGN)
    assert direct and k == len(data) < 3 * ALIGN and bytes(buf[:k]) == data


def test_a_direct_read_the_device_refuses_falls_back_to_the_page_cache_for_good(tmp_path, monkeypatch):
    path, data = _file(tmp_path, 3 * ALIGN)
    monkeypatch.setattr(local.page_cache, "cached", lambda fd, off, n: False)
    f = LocalFile(str(path))
    dfd, real = f.direct_fd, os.preadv

    def preadv(fd, bufs, off, *a):
        if fd == dfd:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, off, *a)

    monkeypatch.setattr(local.os, "preadv", preadv)
    got, how = _read_spans(f, [(5, 2 * ALIGN + 9), (0, 10)])
    assert got == [data[5:2 * ALIGN + 9], data[:10]] and how == [False, False]
    assert f.direct_fd is None


def test_other_read_errors_are_raised(tmp_path, monkeypatch):
    path, _ = _file(tmp_path, ALIGN)
    monkeypatch.setattr(local.page_cache, "cached", lambda fd, off, n: False)
    f = LocalFile(str(path))

    def preadv(fd, bufs, off, *a):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(local.os, "preadv", preadv)
    with pytest.raises(OSError, match="Input/output"):
        f.read_into(memoryview(mmap.mmap(-1, ALIGN)), 0, 10)


def test_direct_reads_can_be_turned_off(tmp_path, monkeypatch):
    path, data = _file(tmp_path, 2 * ALIGN)
    monkeypatch.setattr(local.page_cache, "cached", lambda fd, off, n: False)
    monkeypatch.setenv(env.DIRECT_IO, "0")
    f = LocalFile(str(path))
    assert f.direct_fd is None
    assert _read_spans(f, [(1, 100)]) == ([data[1:100]], [False])


def test_a_path_replaced_between_the_two_opens_gets_no_direct_descriptor(tmp_path, monkeypatch):
    """The direct descriptor must be on the same file as the checked buffered one, or it is not used."""
    path, data = _file(tmp_path, 2 * ALIGN)
    other = tmp_path / "other.bin"
    other.write_bytes(b"x" * (2 * ALIGN))
    real = os.open
    monkeypatch.setattr(local.os, "open", lambda p, flags, *a: real(other if flags & os.O_DIRECT else p, flags, *a))
    monkeypatch.setattr(local.page_cache, "cached", lambda fd, off, n: False)
    f = LocalFile(str(path))
    assert f.direct_fd is None
    assert _read_spans(f, [(0, 2 * ALIGN)]) == ([data], [False])


def test_file_system_type_comes_from_mountinfo(tmp_path):
    info = tmp_path / "mountinfo"
    info.write_text("22 27 0:21 / /proc rw,relatime - proc proc rw\n"
                    "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard\n"
                    "40 27 0:45 / /mnt/nfs rw,relatime shared:9 - nfs4 srv:/x rw,vers=4.2\n")
    assert local.file_system_type(os.makedev(254, 0), str(info)) == "ext4"
    assert local.file_system_type(os.makedev(0, 45), str(info)) == "nfs4"
    assert local.file_system_type(os.makedev(8, 1), str(info)) is None
    assert local.file_system_type(os.makedev(8, 1), str(tmp_path / "missing")) is None
    assert local.file_system_type(os.stat(tmp_path).st_dev) is not None  # this machine's own mountinfo


def test_files_on_other_file_systems_are_read_through_the_page_cache(tmp_path, monkeypatch):
    """NFS, FUSE, tmpfs…: no direct descriptor (their own read-ahead is what makes them fast)."""
    path, data = _file(tmp_path, 2 * ALIGN)
    monkeypatch.setattr(local, "file_system_type", lambda dev: "nfs4")
    monkeypatch.setattr(local.page_cache, "cached", lambda fd, off, n: False)
    f = LocalFile(str(path))
    assert f.direct_fd is None
    assert _read_spans(f, [(3, 2 * ALIGN)]) == ([data[3:]], [False])


def test_without_cachestat_every_read_uses_the_page_cache(tmp_path, monkeypatch):
    """An older kernel (cachestat answers ENOSYS): no direct descriptor, reads as before."""
    path, data = _file(tmp_path, 2 * ALIGN)
    probe = local._PageCacheProbe()
    if not probe.works:
        pytest.fail("no syscall entry point for cachestat on this platform")
    monkeypatch.setattr(probe, "_number", 10**6)  # no such system call: ENOSYS
    assert probe.cached(0, 0, 1) is None and not probe.works
    monkeypatch.setattr(local, "page_cache", probe)
    f = LocalFile(str(path))
    assert f.direct_fd is None
    assert _read_spans(f, [(0, 2 * ALIGN)]) == ([data], [False])


def test_consecutive_block_hints_announce_only_the_new_part_of_the_window(tmp_path, monkeypatch):
    """The kernel walks every page of an announced range, cached or not, so a run of block reads must not announce
    the same 8 MiB again and again: each announcement covers only bytes past the previous one, once half a window
    is new; a jump elsewhere in the file starts a new window."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"\0" * 4096)
    calls = []
    monkeypatch.setattr(local.os, "posix_fadvise", lambda fd, off, n, advice: calls.append((off, n)),
                        raising=False)
    w = local.HINT_AHEAD
    f = LocalFile(str(path))
    f.will_need(1000)
    assert calls == [(1000, w)]
    for step in range(1, 4):  # blocks of 1 MiB: less than half a window new
        f.will_need(1000 + step * (1 << 20))
    assert calls == [(1000, w)]
    f.will_need(1000 + w // 2)  # half a window new: only that half is announced
    assert calls[1:] == [(1000 + w, w // 2)]
    f.will_need(1000 + 3 * w)  # a jump past the window
    assert calls[2:] == [(1000 + 3 * w, w)]
    f.will_need(10)  # a jump back before it
    assert calls[3:] == [(10, w)]




def test_a_local_file_is_a_blob_with_its_size_and_version(tmp_path):
    """The storage interface over a local file: its size and version when opened, the version stored now (another
    once the file changes), the default ``read_spans`` of ``Blob`` giving the same bytes as the local one, and a
    short read at the end of the file."""
    path, data = _file(tmp_path, 3 * ALIGN + 5)
    f = LocalFile(str(path))
    assert isinstance(f, Blob) and f.name == str(path) and f.size == len(data)
    assert f.current_version() == f.version
    spans = [(1, 100), (ALIGN, 2 * ALIGN + 7), (3 * ALIGN, len(data))]
    buf, starts = Blob.read_spans(f, spans, lambda n: mmap.mmap(-1, max(n, 1)))
    assert [bytes(buf[at:at + end - lo]) for at, (lo, end) in zip(starts, spans)] == [data[lo:end] for lo, end in spans]
    with pytest.raises(ShortRead):
        Blob.read_spans(f, [(len(data) - 3, len(data) + 1)], lambda n: mmap.mmap(-1, max(n, 1)))
    with open(path, "ab") as out:
        out.write(b"more")
    assert f.current_version() != f.version and f.version.difference(f.current_version()).startswith("size changed")
    f.close()
    with pytest.raises(OSError):  # never a read of whatever file reuses the descriptor's number
        f.read_into(memoryview(bytearray(ALIGN)), 0, 10)


def test_a_local_folder_lists_stats_opens_and_reads_its_entries(tmp_path):
    (tmp_path / "checkpoint_1.mdl").write_bytes(b"x" * 10)
    (tmp_path / "notes.txt").write_text("latest\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.mdl").symlink_to(tmp_path / "checkpoint_1.mdl")
    (tmp_path / "dangling.mdl").symlink_to(tmp_path / "gone")
    folder = LocalFolder(tmp_path)
    assert isinstance(folder, Folder)
    entries = {e.name: e for e in folder.entries()}
    assert sorted(entries) == ["checkpoint_1.mdl", "link.mdl", "notes.txt", "sub"]  # a dangling link is left out
    assert entries["link.mdl"].is_file and entries["link.mdl"].size == 10  # links are followed
    assert not entries["sub"].is_file
    assert entries["link.mdl"].version == entries["checkpoint_1.mdl"].version
    mdl = folder.entries(match=lambda n: n.endswith(".mdl"))
    assert sorted(e.name for e in mdl) == ["checkpoint_1.mdl", "link.mdl"]
    assert folder.stat("nope") is None and folder.stat("notes.txt").size == 7
    assert folder.read_text("notes.txt") == "latest\n" and folder.read_text("notes.txt", limit=3) == "lat"
    blob = folder.open("checkpoint_1.mdl")
    buf = bytearray(10)
    assert blob.read_into(memoryview(buf), 0, 10)[0] == 10 and bytes(buf) == b"x" * 10
    assert folder.folder("sub").entries() == []


def _announcing_file(tmp_path, monkeypatch) -> tuple:
    """A sparse file of three announcement windows and the list its ``posix_fadvise`` calls go to (offset, length)."""
    path = tmp_path / "f.bin"
    with open(path, "wb") as f:
        f.truncate(3 * local.HINT_AHEAD)
    calls = []
    monkeypatch.setattr(local.os, "posix_fadvise", lambda fd, off, n, advice: calls.append((off, n)),
                        raising=False)
    return path, calls


def test_reads_inside_the_announced_range_announce_nothing_more(tmp_path, monkeypatch):
    """A block read from the page cache announces the bytes after it; the blocks read next from inside that range
    are cached because they were announced, and announcing on from them would load the whole file through the page
    cache, block after block: they announce nothing, and the first cached read past the range announces again."""
    path, calls = _announcing_file(tmp_path, monkeypatch)
    monkeypatch.setattr(local.page_cache, "cached", lambda fd, off, n: True)
    mib, w = 1 << 20, local.HINT_AHEAD
    f = LocalFile(str(path))
    scratch = lambda n: mmap.mmap(-1, max(n, 1))  # noqa: E731
    f.read_spans([(0, mib)], scratch)
    assert calls == [(mib, w)]
    for k in range(1, 9):  # the announced range [1 MiB, 9 MiB), and a block ending on its end
        f.read_spans([(k * mib, (k + 1) * mib)], scratch)
    assert calls == [(mib, w)]
    f.read_spans([(9 * mib, 10 * mib)], scratch)  # past it: cached of its own accord
    assert calls == [(mib, w), (10 * mib, w)]


def test_a_read_partly_straight_from_the_disk_announces_nothing(tmp_path, monkeypatch):
    """A block whose small span came through the page cache (small spans always do) while its large one was read
    straight from the disk is a cold read: announcing the bytes after it would have the kernel load them into the page
    cache while the next blocks read them again directly (a cold read of a 1 GB checkpoint read 11-15% more from the
    disk). A block read wholly through the page cache still announces."""
    path, calls = _announcing_file(tmp_path, monkeypatch)
    cold = {"now": True}
    monkeypatch.setattr(local.page_cache, "cached", lambda fd, off, n: not cold["now"])
    monkeypatch.setattr(local, "DIRECT_MIN_BYTES", 512 << 10)  # the rule of the server: small spans buffered
    mib, small = 1 << 20, 64 << 10
    f = LocalFile(str(path))
    if f.direct_fd is None:  # tmp_path on a file system without O_DIRECT: give the reads a direct descriptor
        f.direct_fd = f.fd
    scratch = lambda n: mmap.mmap(-1, max(n, 1))  # noqa: E731
    f.read_spans([(0, small), (small, small + mib)], scratch)
    assert calls == []  # the small span buffered, the large one direct: nothing announced
    cold["now"] = False
    f.read_spans([(2 * mib, 2 * mib + small), (2 * mib + small, 3 * mib + small)], scratch)
    assert calls == [(3 * mib + small, local.HINT_AHEAD)]  # all from the page cache: the next bytes announced


def test_only_pages_cached_before_they_were_announced_count_as_served_from_memory(tmp_path, monkeypatch):
    """A block-sized read whose pages are all in the page cache counts as served from memory (the read-ahead then
    stops computing ahead); pages cached because ckptfs announced them while they were not (a cold read's own
    WILLNEED) do not, and a read from the disk counts as waited."""
    from ckptfs.storage.base import memory_reads, waited_reads

    n = 16 * ALIGN  # whole blocks: a direct read needs them
    path, _ = _file(tmp_path, 64 * ALIGN + n)
    cached = {"now": True}
    monkeypatch.setattr(local.page_cache, "cached", lambda fd, off, n: cached["now"])
    monkeypatch.setattr(local, "hint_will_need", lambda fd, off, n: None)
    f = LocalFile(str(path))
    assert f.direct_fd is not None, "O_DIRECT refused on the test file system"
    view = memoryview(mmap.mmap(-1, n))  # page-aligned, as direct reads need

    def counts():
        return memory_reads(), waited_reads()

    m, w = counts()
    assert f.read_into(view, 0, n)[0] == n
    assert counts() == (m + 1, w)  # cached before anything was announced
    cached["now"] = False
    f.will_need(8 * ALIGN, 16 * ALIGN)  # announced while not cached
    cached["now"] = True  # ... and now cached because of it
    f.read_into(view, 8 * ALIGN, n)
    assert counts() == (m + 1, w)
    f.read_into(view, 40 * ALIGN, n)  # past the announced range, cached of its own accord
    assert counts() == (m + 2, w)
    cached["now"] = False
    assert f.read_into(view, 48 * ALIGN, n) == (n, True)  # from the disk
    assert counts() == (m + 2, w + 1)


def test_a_folder_reads_a_regular_file_s_text_and_refuses_a_fifo_without_waiting(tmp_path):
    """``Folder.read_text`` reads at most ``limit`` bytes of a regular file (a link to one too); a FIFO is refused at
    once (opening it for reading would wait for a writer forever) — ``open_if_regular`` says None for it."""
    (tmp_path / "latest").write_text("checkpoint_100.mdl\n" + "x" * 100)
    (tmp_path / "link").symlink_to("latest")
    os.mkfifo(tmp_path / "fifo")
    folder = LocalFolder(tmp_path)
    assert folder.read_text("latest", 18) == "checkpoint_100.mdl"
    assert folder.read_text("link", 18) == "checkpoint_100.mdl"
    got = {}

    def read():
        try:
            folder.read_text("fifo")
        except OSError as e:
            got["error"] = e

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # unblock the reader before failing
        os.close(os.open(tmp_path / "fifo", os.O_WRONLY | os.O_NONBLOCK))
    assert "error" in got and got["error"].errno == errno.EINVAL
    assert local.open_if_regular(tmp_path / "fifo") is None
    f = local.open_if_regular(tmp_path / "link")
    assert f is not None and f.read(0, 10) == b"checkpoint"
    f.close()
