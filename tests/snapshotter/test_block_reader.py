"""BlockReader: byte ranges over the uncompressed image, the decoded-sector LRU, the access
log that becomes a startup profile."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pytest
from datapath_support import SECTOR, Image, wait_until
from support import in_threads

from snapshotter.cache.sectors import SectorCache
from snapshotter.config import FetchConfig
from snapshotter.datapath import reader as reader_module
from snapshotter.datapath.fetcher import SectorFetcher
from snapshotter.datapath.reader import READAHEAD_MARGIN, BlockReader
from snapshotter.errors import FetchError, InvalidReadError

MakeFetcher = Callable[..., SectorFetcher]


def test_reads_match_the_image(image: Image, make_fetcher: MakeFetcher) -> None:
    reader = BlockReader(image.index, make_fetcher(), memory_sectors=4)
    size = image.index.image_size
    assert reader.size == size
    rng = random.Random(5)
    cases = [(0, 10), (SECTOR - 3, 6), (0, size), (size - 100, 100), (5 * SECTOR, 3 * SECTOR)]
    cases += [(rng.randrange(size), rng.randrange(1, 3 * SECTOR)) for _ in range(50)]
    for offset, length in cases:
        assert reader.read(offset, length) == image.data[offset : offset + length], (offset, length)


def test_reads_at_and_past_the_end_are_short(image: Image, make_fetcher: MakeFetcher) -> None:
    reader = BlockReader(image.index, make_fetcher())
    size = image.index.image_size
    assert reader.read(size - 10, 100) == image.data[-10:]
    assert reader.read(size, 10) == b""
    assert reader.read(size + 5000, 10) == b""
    assert reader.read(100, 0) == b""
    with pytest.raises(InvalidReadError):
        reader.read(-1, 10)
    with pytest.raises(InvalidReadError):
        reader.read(0, -1)


def test_small_reads_of_one_sector_decode_it_once(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    reader = BlockReader(image.index, fetcher, memory_sectors=2)
    chunk = 4096
    for offset in range(SECTOR, 2 * SECTOR, chunk):  # sector 1, in kernel-sized pieces
        assert reader.read(offset, chunk) == image.data[offset : offset + chunk]
    assert len(store.requests) == 1
    assert fetcher.metrics.cache_hits.value == 0  # not even the disk cache was asked again
    assert fetcher.metrics.memory_hits.value == SECTOR // chunk - 1


def test_memory_lru_is_bounded(image: Image, make_fetcher: MakeFetcher) -> None:
    fetcher = make_fetcher()
    reader = BlockReader(image.index, fetcher, memory_sectors=2)
    for n in (1, 2, 3, 1):  # 3 pushes 1 out of memory; reading 1 again goes to the cache
        reader.read(n * SECTOR, 10)
    assert fetcher.metrics.cache_hits.value == 1
    reader.drop_memory()
    reader.read(3 * SECTOR, 10)
    assert fetcher.metrics.cache_hits.value == 2


def test_access_log_in_first_access_order(image: Image, make_fetcher: MakeFetcher) -> None:
    reader = BlockReader(image.index, make_fetcher())
    reader.read(30 * SECTOR + 5, 50)  # /etc/hosts
    reader.read(3 * SECTOR + 100, 200)  # /app/main.py (sector 3, shared with python3)
    reader.read(30 * SECTOR, 10)  # again: not logged twice
    reader.read(9 * SECTOR, 10)  # inside /app/weights.bin
    assert reader.touched_sectors() == [30, 3, 9]
    assert reader.touched_files() == [
        "/etc/hosts",
        "/usr/bin/python3",
        "/app/main.py",
        "/app/weights.bin",
    ]


def test_concurrent_readers_get_correct_bytes(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    reader = BlockReader(image.index, make_fetcher(), memory_sectors=3)
    store.before_read = lambda *_: time.sleep(0.005)

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(30):
            offset = rng.randrange(image.index.image_size)
            length = rng.randrange(1, 2 * SECTOR)
            assert reader.read(offset, length) == image.data[offset : offset + length]

    in_threads(work, 8, timeout=30)
    counts = store.fetch_counts(image)
    assert all(c == 1 for c in counts.values()), counts


def test_store_failure_is_a_fetch_error(image: Image, store, make_fetcher: MakeFetcher) -> None:
    reader = BlockReader(image.index, make_fetcher(), timeout=0.5)
    store.mode = "down"
    with pytest.raises(FetchError) as info:
        reader.read(2 * SECTOR, 10)
    assert info.value.errno == 5  # EIO at the FUSE layer
    store.mode = "ok"
    assert reader.read(2 * SECTOR, 10) == image.data[2 * SECTOR : 2 * SECTOR + 10]


def test_a_read_that_waited_elsewhere_gives_up_that_much_sooner(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    reader = BlockReader(image.index, make_fetcher(FetchConfig(deadline=30.0)), timeout=1.0)
    store.hang()
    try:
        for waited, most in ((0.0, 3.0), (0.7, 0.9)):
            start = time.monotonic()
            with pytest.raises(FetchError):
                reader.read_parts(2 * SECTOR, 10, waited=waited)
            took = time.monotonic() - start
            # the read's timeout is 1 s in all, the time it waited in the compiled loop too
            assert 1.0 - waited - 0.05 <= took <= most, (waited, took)
    finally:
        store.release()


def test_a_sequential_reader_gets_sectors_fetched_ahead(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    reader = BlockReader(image.index, fetcher, memory_sectors=12, readahead_bytes=8 * SECTOR)
    chunk = 16 << 10
    for offset in range(0, 3 * SECTOR, chunk):  # two sectors' worth makes it a stream
        assert reader.read(offset, chunk) == image.data[offset : offset + chunk]
    # the next sectors are fetched before anybody asks for them (zero ones never are)
    ahead = [n for n in range(3, 10) if not image.index.sectors[n].is_zero]
    wait_until(lambda: all(image.index.sectors[n].checksum in fetcher.cache for n in ahead))
    assert fetcher.readahead_sectors.value >= len(ahead)
    metrics = fetcher.metrics
    hits = metrics.cache_hits.value + metrics.memory_hits.value
    for offset in range(3 * SECTOR, 10 * SECTOR, chunk):
        assert reader.read(offset, chunk) == image.data[offset : offset + chunk]
    # served from memory (read-ahead lands there) or the cache: the reader never waited for
    # the store
    served = metrics.cache_hits.value + metrics.memory_hits.value - hits
    assert served >= len(ahead) * SECTOR // chunk
    counts = store.fetch_counts(image)
    assert all(c == 1 for c in counts.values()), counts  # nothing fetched twice


def test_a_sector_read_whole_is_evicted_before_unread_ones(
    image: Image, make_fetcher: MakeFetcher
) -> None:
    a, b, c = [n for n, s in enumerate(image.index.sectors) if not s.is_zero][:3]
    fetcher = make_fetcher()
    reader = BlockReader(image.index, fetcher, memory_sectors=2, readahead_bytes=0)

    def read(n: int, at: int, length: int = 4096) -> None:
        offset = n * SECTOR + at
        assert reader.read(offset, length) == image.data[offset : offset + length]

    read(a, SECTOR - 4096)  # the kernel's requests come in any order: the end first
    read(b, 0)  # memory: a, b (b unread but for its start, as read-ahead leaves it)
    read(a, 4096, SECTOR - 8192)  # a is the most recently used...
    read(a, 0)  # ...until its every byte has been read: used up, it goes first
    read(c, 0)  # room for c
    hits = fetcher.metrics.memory_hits.value
    read(b, 8192)
    assert fetcher.metrics.memory_hits.value == hits + 1  # b stayed
    read(a, 0)
    assert fetcher.metrics.memory_hits.value == hits + 1  # a went


def test_read_ahead_stays_within_the_memory_lru(image: Image, make_fetcher: MakeFetcher) -> None:
    # what it fetches is kept in memory; further ahead, it would be pushed out unread
    # (less the sectors the reader is in)
    reader = BlockReader(image.index, make_fetcher(), memory_sectors=9, readahead_bytes=8 * SECTOR)
    assert reader.readahead_sectors == 9 - READAHEAD_MARGIN
    reader = BlockReader(image.index, make_fetcher(), memory_sectors=3, readahead_bytes=8 * SECTOR)
    assert reader.readahead_sectors == 1
    reader = BlockReader(image.index, make_fetcher(), memory_sectors=0, readahead_bytes=8 * SECTOR)
    assert reader.readahead_sectors == 8


def test_a_sequential_pass_never_reads_back_what_read_ahead_fetched(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    # Read-ahead as deep as memory pushed out sectors the reader was about to read (fetched
    # longest ago), which were then read back from the disk cache. The kernel reads a file a
    # window at a time, the window's requests served in any order: here two sectors'
    # worth, back to front.
    fetcher = make_fetcher()
    reader = BlockReader(image.index, fetcher, memory_sectors=8, readahead_bytes=8 * SECTOR)
    chunk = 16 << 10
    size = image.index.image_size
    for window in range(0, size, 2 * SECTOR):
        for offset in reversed(range(window, min(size, window + 2 * SECTOR), chunk)):
            assert reader.read(offset, chunk) == image.data[offset : offset + chunk]
    assert fetcher.readahead_sectors.value > 0
    # only sectors whose content an earlier one had come from the cache (that entry)
    seen: set[str] = set()
    repeats = 0
    for sector in image.index.sectors:
        repeats += not sector.is_zero and sector.checksum in seen
        seen.add(sector.checksum)
    assert repeats and fetcher.metrics.cache_hits.value == repeats * SECTOR // chunk
    assert all(c == 1 for c in store.fetch_counts(image).values())


def test_random_reads_do_not_read_ahead(image: Image, store, make_fetcher: MakeFetcher) -> None:
    fetcher = make_fetcher()
    reader = BlockReader(image.index, fetcher, readahead_bytes=8 * SECTOR, stream_slack=SECTOR // 4)
    rng = random.Random(3)
    for _ in range(100):
        offset = rng.randrange(image.index.image_size - 4096)
        assert reader.read(offset, 4096) == image.data[offset : offset + 4096]
    assert fetcher.readahead_sectors.value == 0


def test_random_reads_close_together_do_not_read_ahead(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    # Within the first four sectors, with the default slack (larger than the image): every
    # read lands near the one stream and the bytes add up to many sectors' worth, but few
    # of the reads move the stream's end forward. Sectors follow that could be read ahead.
    fetcher = make_fetcher()
    reader = BlockReader(image.index, fetcher, readahead_bytes=8 * SECTOR)
    assert reader.stream_slack > image.index.image_size > 12 * SECTOR
    rng = random.Random(4)
    for _ in range(600):
        offset = rng.randrange(4 * SECTOR - 2048)
        assert reader.read(offset, 2048) == image.data[offset : offset + 2048]
    assert fetcher.readahead_sectors.value == 0


def test_read_ahead_nobody_waits_for_is_cancelled(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher(FetchConfig(max_parallel=1, max_parallel_prefetch=1, deadline=5.0))
    store.hang()
    assert fetcher.readahead([1]) == 1  # taken by the only worker, which now hangs
    wait_until(lambda: store.hanging == 1)
    assert fetcher.readahead([3, 4, 7]) == 3  # queued behind it
    assert fetcher.readahead([3]) == 0  # already on its way
    assert fetcher.cancel_readahead([3, 4, 7]) == 3
    assert fetcher.cancel_readahead([1]) == 0  # running: cannot be taken back
    store.release()
    wait_until(lambda: image.index.sectors[1].checksum in fetcher.cache)
    assert fetcher.get([3]) == {3: image.sector(3)}  # a cancelled sector is simply fetched
    assert image.index.sectors[7].checksum not in fetcher.cache
    # a reader waiting on a read-ahead fetch keeps it from being cancelled
    store.hang()
    fetcher.readahead([8])
    wait_until(lambda: store.hanging == 1)
    fetcher.readahead([9])
    waiter = threading.Thread(target=fetcher.get, args=([9],))
    waiter.start()
    time.sleep(0.05)
    assert fetcher.cancel_readahead([9]) == 0
    store.release()
    waiter.join(5)
    assert image.index.sectors[9].checksum in fetcher.cache


class _Mirror:
    """A copy of a reader's memory, as the compiled loop's table keeps it."""

    def __init__(self) -> None:
        self.sectors: dict[int, bytes] = {}

    def put(self, n: int, data: object) -> None:
        self.sectors[n] = bytes(data)  # type: ignore[call-overload]

    def drop(self, n: int) -> None:
        del self.sectors[n]

    def clear(self) -> None:
        self.sectors.clear()

    def cached(self, n: int, path: str, digests: bytes, block: int, buffered: bool = False) -> bool:
        return False  # sectors in memory only

    def uncache(self, n: int) -> None:
        pass


def test_the_mirror_of_memory_holds_what_memory_holds(
    image: Image, make_fetcher: MakeFetcher
) -> None:
    reader = BlockReader(image.index, make_fetcher(), memory_sectors=3, readahead_bytes=0)
    reader.read(0, 10)  # in memory before the mirror: copied over
    mirror = _Mirror()
    reader.mirror_memory(mirror)
    for n in (1, 2, 3, 4, 5):
        reader.read(n * SECTOR, 10)
    with reader._lock:
        held = dict(reader._memory)
    assert sorted(mirror.sectors) == sorted(held) and len(held) == 3
    for n, data in mirror.sectors.items():
        assert data == image.data[n * SECTOR : n * SECTOR + len(data)]
    reader.drop_memory()
    assert mirror.sectors == {}


def test_reads_answered_from_the_mirror_are_counted_and_move_read_ahead(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    reader = BlockReader(image.index, fetcher, memory_sectors=12, readahead_bytes=8 * SECTOR)
    reader.mirror_memory(_Mirror())
    reader.read(0, 10)  # sector 0 in memory
    metrics = fetcher.metrics
    reads, hits = metrics.reads.value, metrics.memory_hits.value
    cache_hits = metrics.cache_hits.value
    # a sequential reader's requests for three sectors, answered elsewhere, out of order:
    # sector 0 from memory, 1 and 2 from their cache entries
    chunk = SECTOR // 2
    served = [(o, chunk) for o in range(0, 3 * SECTOR, chunk)]
    served[1], served[2] = served[2], served[1]
    reader.account_served(served)
    assert metrics.reads.value - reads == len(served)
    assert metrics.memory_hits.value - hits == 2
    assert metrics.cache_hits.value - cache_hits == 4
    assert reader.touched_sectors()[:3] == [0, 1, 2]
    # they made a stream: the sectors after it are fetched ahead
    ahead = [n for n in range(3, 9) if not image.index.sectors[n].is_zero]
    wait_until(lambda: all(image.index.sectors[n].checksum in fetcher.cache for n in ahead))
    assert fetcher.readahead_sectors.value >= len(ahead)


class _EntryMirror(_Mirror):
    """... that also takes cache entries."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: dict[int, str] = {}
        self.buffered: set[int] = set()  # entries read through the page cache
        self.given = 0

    def cached(self, n: int, path: str, digests: bytes, block: int, buffered: bool = False) -> bool:
        assert 0 < len(digests) <= 8 * -(-SECTOR // block)  # (the last sector is short)
        if n in self.entries:
            return False  # the table keeps what it holds
        self.entries[n] = path
        if buffered:
            self.buffered.add(n)
        self.given += 1
        return True

    def uncache(self, n: int) -> None:
        self.entries.pop(n, None)
        self.buffered.discard(n)

    def drop(self, n: int) -> None:
        self.sectors.pop(n, None)
        self.uncache(n)

    def clear(self) -> None:
        super().clear()
        self.entries.clear()
        self.buffered.clear()


def test_random_reads_give_the_mirror_their_entries_and_a_stream_reads_them_buffered(
    image: Image, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    reader = BlockReader(image.index, fetcher, memory_sectors=8, readahead_bytes=4 * SECTOR,
                         stream_slack=SECTOR // 2)  # fmt: skip
    mirror = _EntryMirror()
    reader.mirror_memory(mirror)
    stored = [n for n in range(3, 9) if not image.index.sectors[n].is_zero]
    for n in stored:
        reader.read(n * SECTOR + 100, 10)  # fetched, and in the cache
    reader.drop_memory()
    for n in stored:  # small reads far apart: from the cache, no stream
        assert reader.read(n * SECTOR + 200, 10) == image.data[n * SECTOR + 200 :][:10]
    assert sorted(mirror.entries) == stored
    assert all(p.endswith(image.index.sectors[n].checksum) for n, p in mirror.entries.items())
    reader.read(stored[0] * SECTOR + 300, 10)  # given already: not again
    assert mirror.given == len(stored)
    for offset in range(0, 3 * SECTOR, SECTOR // 4):  # a stream, which reads ahead of it
        reader.read(offset, SECTOR // 4)
    # ... through the page cache: the mirror reads those entries that way too
    ahead = [n for n in range(3, 7) if n in stored]
    assert ahead and all(n in mirror.buffered for n in ahead), (mirror.entries, mirror.buffered)
    # the entries it has read to their end are read with direct I/O again
    for offset in range(3 * SECTOR, 5 * SECTOR + SECTOR // 2, SECTOR // 4):
        assert reader.read(offset, SECTOR // 4) == image.data[offset : offset + SECTOR // 4]
    behind = [n for n in (3, 4) if n in stored]
    assert behind and all(n in mirror.entries for n in behind), mirror.entries
    assert not any(n in mirror.buffered for n in behind), mirror.buffered
    assert 5 in mirror.buffered or 5 not in stored  # read in part


def test_sectors_evicted_from_memory_are_read_from_their_entries_by_the_mirror(
    image: Image, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    reader = BlockReader(image.index, fetcher, memory_sectors=2, readahead_bytes=0)
    mirror = _EntryMirror()
    reader.mirror_memory(mirror)
    stored = [n for n in range(image.index.sector_count) if not image.index.sectors[n].is_zero]
    assert len(stored) >= 4
    for n in stored[:4]:
        reader.read(n * SECTOR, 10)  # fetched into memory; the first two pushed out
    # in memory: the last two; the two evicted are read from the entries this process wrote
    assert sorted(mirror.sectors) == stored[2:4]
    assert sorted(mirror.entries) == stored[:2]
    for n, path in mirror.entries.items():
        with open(path, "rb") as f:  # the entry of that sector, whole
            assert f.read(100) == image.data[n * SECTOR : n * SECTOR + 100]
    hits, given = fetcher.metrics.cache_hits.value, mirror.given
    # read here too (a READ the mirror handed over): from the entry, not given again
    assert reader.read(stored[0] * SECTOR + 50, 10) == image.data[stored[0] * SECTOR + 50 :][:10]
    assert fetcher.metrics.cache_hits.value == hits + 1 and mirror.given == given
    reader.drop_memory()  # the mirror forgets everything, and the reader that it gave it
    assert mirror.entries == {} and mirror.sectors == {}
    reader.read(stored[1] * SECTOR + 100, 10)  # from the cache: given again
    assert stored[1] in mirror.entries


def test_a_new_reader_gives_the_mirror_the_entries_the_node_cache_holds(
    image: Image, make_fetcher: MakeFetcher, tmp_path
) -> None:  # noqa: ANN001
    index = image.index
    stored = [n for n in range(index.sector_count) if not index.sectors[n].is_zero]
    first = make_fetcher()
    first.get(stored)  # the node cache holds every stored sector
    first.close()
    # another process: a cache of its own over the same directory, nothing checked yet
    fetcher = make_fetcher(cache=SectorCache(tmp_path / "cache", 64 << 20))
    reader = BlockReader(index, fetcher, memory_sectors=4, readahead_bytes=0)
    mirror = _EntryMirror()
    reader.mirror_memory(mirror)
    stop = threading.Event()
    stop.set()
    assert reader.mirror_cached(stop) == 0 and mirror.entries == {}
    given = reader.mirror_cached()
    assert given == len(mirror.entries) == reader.mirrored_entries
    assert sorted(mirror.entries) == stored
    # the image's prefetch order first, then the image's
    assert list(mirror.entries) == list(dict.fromkeys([*index.prefetch, *stored]))
    for n, path in mirror.entries.items():
        with open(path, "rb") as f:
            assert f.read(64) == image.data[n * SECTOR : n * SECTOR + 64]
    assert reader.mirror_cached() == 0  # given already


def test_giving_cached_entries_stops_at_the_mirrors_bound(
    image: Image, make_fetcher: MakeFetcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    fetcher = make_fetcher()
    stored = [n for n in range(image.index.sector_count) if not image.index.sectors[n].is_zero]
    fetcher.get(stored)
    monkeypatch.setattr(reader_module, "MIRRORED_ENTRIES", 3)
    reader = BlockReader(image.index, fetcher, memory_sectors=0)
    mirror = _EntryMirror()
    reader.mirror_memory(mirror)
    assert reader.mirror_cached() == 3 and len(mirror.entries) == 3


def test_giving_cached_entries_of_a_cold_image_stops_soon(
    image: Image, make_fetcher: MakeFetcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    fetcher = make_fetcher()
    monkeypatch.setattr(reader_module, "MIRROR_MISSES", 4)
    looked: list[int] = []
    real = fetcher.cached_entry

    def cached_entry(n: int, check: bool = False) -> object:
        looked.append(n)
        return real(n, check)

    monkeypatch.setattr(fetcher, "cached_entry", cached_entry)
    reader = BlockReader(image.index, fetcher, memory_sectors=0)
    reader.mirror_memory(_EntryMirror())
    assert reader.mirror_cached() == 0
    assert len(looked) == 4  # the cache holds none of them: not the whole image
    stored = [n for n in range(image.index.sector_count) if not image.index.sectors[n].is_zero]
    assert len(stored) > 4


def test_a_stream_answered_by_the_mirror_has_it_read_entries_buffered_then_direct(
    image: Image, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    stored = [n for n in range(3, 9) if not image.index.sectors[n].is_zero]
    fetcher.get(stored)  # in the node cache
    reader = BlockReader(image.index, fetcher, memory_sectors=8, readahead_bytes=4 * SECTOR,
                         stream_slack=SECTOR // 2)  # fmt: skip
    mirror = _EntryMirror()
    reader.mirror_memory(mirror)
    reader.mirror_cached()  # given, with direct I/O
    assert all(n in mirror.entries for n in stored) and not mirror.buffered
    chunk = SECTOR // 4
    # a stream's reads, answered by the mirror: its read-ahead window is read buffered
    reader.account_served([(o, chunk) for o in range(0, 3 * SECTOR, chunk)])
    reader.account_served([(o, chunk) for o in range(3 * SECTOR, 4 * SECTOR - chunk, chunk)])
    ahead = [n for n in stored if n < 7]
    assert ahead and all(n in mirror.buffered for n in ahead), mirror.buffered
    # the read that reaches sector 3's end: read with direct I/O again
    reader.account_served([(4 * SECTOR - chunk, chunk)])
    if 3 in stored:
        assert 3 in mirror.entries and 3 not in mirror.buffered
    assert all(n in mirror.buffered for n in ahead if n != 3)
