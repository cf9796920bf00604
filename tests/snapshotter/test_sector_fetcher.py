"""SectorFetcher against a real block image in a store double: cache first, single flight,
coalescing, verification, deadlines that hold when the store fails or hangs, priorities."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import pytest
from datapath_support import FAST, FaultyStore, Image, entry_path, wait_until
from support import in_threads

from imagetool.format import Index, blob_range
from imagetool.stores.dir import DirStore
from snapshotter.cache.sectors import SectorCache
from snapshotter.config import FetchConfig
from snapshotter.datapath import fetcher as fetcher_mod
from snapshotter.datapath.fetcher import Priority, SectorFetcher
from snapshotter.errors import ClosedError, FetchError, FetchTimeoutError, InvalidReadError

MakeFetcher = Callable[..., SectorFetcher]


def stored_sectors(image: Image) -> list[int]:
    return [n for n, s in enumerate(image.index.sectors) if not s.is_zero]


def test_the_image_round_trips_through_a_dir_store(image: Image, store) -> None:
    assert Index.from_bytes(store.read_blob(store.resolve("v1"))) == image.index


def test_get_returns_verified_sector_bytes(image: Image, make_fetcher: MakeFetcher) -> None:
    fetcher = make_fetcher()
    everything = range(image.index.sector_count)
    got = fetcher.get(everything)
    assert set(got) == set(everything)
    for n in everything:
        assert got[n] == image.sector(n), n
    assert len(got[image.index.sector_count - 1]) == 10_000  # the short last sector
    m = fetcher.metrics
    assert m.zero_sectors.value == 5
    # 11 and 12 repeat sector 3: fetched once, as 3
    assert m.sectors_fetched.value == len(stored_sectors(image)) - 2
    repeats = image.index.sectors[11].length + image.index.sectors[12].length
    assert m.bytes_fetched.value == image.index.blobs[0].size - repeats


def test_fetched_sectors_cannot_be_changed_by_their_readers(
    image: Image, make_fetcher: MakeFetcher
) -> None:
    # Decoded into memory the fetcher allocated and shared with the cache write, the
    # memory of read-ahead and every waiting reader: handed out read-only.
    fetcher = make_fetcher()
    got = fetcher.get([1, 2])
    for n in (1, 2):
        with pytest.raises(TypeError):
            memoryview(got[n])[:1] = b"x"
        assert got[n] == image.sector(n)


def test_second_get_is_served_from_the_cache(
    image: Image, store, cache: SectorCache, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    fetcher.get([1, 2, 3])
    before = len(store.requests)
    assert fetcher.get([1, 2, 3]) == {n: image.sector(n) for n in (1, 2, 3)}
    assert len(store.requests) == before
    assert fetcher.metrics.cache_hits.value == 3
    # sectors 11 and 12 repeat sector 3: same content, same cache entry, no request
    assert fetcher.get([11, 12]) == {11: image.sector(3), 12: image.sector(3)}
    assert len(store.requests) == before
    # the cache is shared: a second fetcher (another mount) hits it too
    other = make_fetcher()
    other.get([1, 2])
    assert len(store.requests) == before


def test_zero_sectors_cost_no_request(image: Image, store, make_fetcher: MakeFetcher) -> None:
    fetcher = make_fetcher()
    assert fetcher.get([5, 6, 20]) == {n: bytes(64 << 10) for n in (5, 6, 20)}
    assert store.requests == []


def test_adjacent_misses_are_coalesced(image: Image, store, make_fetcher: MakeFetcher) -> None:
    fetcher = make_fetcher()
    fetcher.get([1, 2, 3, 4, 9])
    # 1..4 are one run; 9 stands alone
    assert sorted(store.requests) == [
        blob_range(image.index, range(1, 5))[1:],
        blob_range(image.index, range(9, 10))[1:],
    ]
    store.requests.clear()
    # 4, 7: only all-zero sectors (5, 6) between them, so they are contiguous in the blob
    fetcher.cache.clear()
    fetcher.get([4, 7])
    assert store.requests == [blob_range(image.index, range(4, 8))[1:]]


def test_coalesced_requests_respect_max_request_bytes(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    limit = 3 * (64 << 10) + 100  # room for about three random sectors
    fetcher = make_fetcher(dataclasses.replace(FAST, max_request_bytes=limit))
    fetcher.get(range(23, 40))
    assert len(store.requests) > 1
    assert all(length <= limit for _, length in store.requests)
    assert store.fetch_counts(image) == {n: 1 for n in range(23, 40)}


def test_a_run_over_the_limit_is_cut_into_even_requests(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    run = range(23, 27)  # four stored sectors of about 64 KiB, contiguous in the blob
    assert not any(image.index.sectors[n].is_zero for n in run)
    limit = blob_range(image.index, range(23, 26))[2] + 100  # room for three
    fetcher = make_fetcher(dataclasses.replace(FAST, max_request_bytes=limit))
    fetcher.get(run)
    # two and two (both in flight at once, both about as long), not three and one
    assert sorted(store.requests) == [
        blob_range(image.index, range(23, 25))[1:],
        blob_range(image.index, range(25, 27))[1:],
    ]


def test_the_sectors_of_a_long_read_are_served_as_their_bytes_arrive(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher(dataclasses.replace(FAST, request_timeout=5.0))
    store.stall_after = blob_range(image.index, range(23, 25))[2]  # two sectors, then nothing
    fetcher.readahead(range(23, 30))  # one request
    assert fetcher.get([23, 24], time.monotonic() + 2) == {n: image.sector(n) for n in (23, 24)}
    assert store.requests == [blob_range(image.index, range(23, 30))[1:]]
    store.release()
    assert fetcher.get(range(23, 30)) == {n: image.sector(n) for n in range(23, 30)}
    assert len(store.requests) == 1


def test_a_read_that_stalls_is_abandoned_and_only_the_rest_is_fetched_again(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher(dataclasses.replace(FAST, request_timeout=0.3))
    store.stall_after = blob_range(image.index, range(23, 25))[2]
    start = time.monotonic()
    assert fetcher.get(range(23, 30)) == {n: image.sector(n) for n in range(23, 30)}
    assert time.monotonic() - start < 3
    # the first read delivered 23 and 24 and stalled; the retry asked for 25..29 only
    assert store.requests == [
        blob_range(image.index, range(23, 30))[1:],
        blob_range(image.index, range(25, 30))[1:],
    ]
    assert fetcher.metrics.sectors_fetched.value == 7
    assert fetcher.metrics.retries.value == 1


def test_transfer_buffers_are_reused_and_released(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher(dataclasses.replace(FAST, max_parallel=2))
    fetcher.get([23])
    fetcher.get([30])  # the same buffer again: one kept
    largest = max(s.length for s in image.index.sectors)
    assert fetcher.release_buffers() == largest
    assert fetcher.release_buffers() == 0
    assert fetcher.get([31]) == {31: image.sector(31)}


def test_sixteen_threads_on_overlapping_ranges_fetch_each_sector_once(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher(dataclasses.replace(FAST, max_parallel=4))
    start = threading.Barrier(16)
    store.before_read = lambda *_: time.sleep(0.02)  # widen the race window
    results: dict[int, dict[int, bytes]] = {}

    def reader(i: int) -> None:
        start.wait()
        lo = (i * 3) % 30
        results[i] = fetcher.get(range(lo, lo + 12))

    in_threads(reader, 16, timeout=30)
    for i, got in results.items():
        lo = (i * 3) % 30
        assert got == {n: image.sector(n) for n in range(lo, lo + 12)}
    counts = store.fetch_counts(image)
    assert counts and all(c == 1 for c in counts.values()), counts
    # sector 3's content is shared with 11 and 12; whichever got fetched, once each
    assert set(counts) <= set(stored_sectors(image))


def test_store_down_fails_within_the_deadline_then_recovers(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher(dataclasses.replace(FAST, retries=100))
    fetcher.get([1])  # cached before the outage
    store.mode = "down"
    t0 = time.monotonic()
    with pytest.raises(FetchError) as info:
        fetcher.get([2, 3], deadline=time.monotonic() + 1.0)
    assert time.monotonic() - t0 < 1.0 + 2.0
    assert info.value.sectors
    assert fetcher.get([1]) == {1: image.sector(1)}  # cached data is still served
    assert fetcher.metrics.store_errors.value > 1  # it did retry
    assert fetcher.metrics.fetch_errors.value == 1
    store.mode = "ok"
    assert fetcher.get([2, 3]) == {2: image.sector(2), 3: image.sector(3)}


def test_retries_run_out_before_the_deadline(store, make_fetcher: MakeFetcher) -> None:
    fetcher = make_fetcher(dataclasses.replace(FAST, retries=2))
    store.mode = "down"
    with pytest.raises(FetchError, match="connection refused"):
        fetcher.get([2], deadline=time.monotonic() + 30)
    assert len(store.requests) == 3


def test_hanging_store_fails_within_the_deadline_then_recovers(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher(dataclasses.replace(FAST, request_timeout=0.3, retries=100))
    fetcher.get([1])
    store.hang()
    t0 = time.monotonic()
    with pytest.raises(FetchTimeoutError):
        fetcher.get([2], deadline=time.monotonic() + 1.0)
    assert time.monotonic() - t0 < 1.0 + 2.0
    # on-demand reads that hit the cache are unaffected
    assert fetcher.get([1], deadline=time.monotonic() + 0.5) == {1: image.sector(1)}
    # the default deadline holds too
    short = make_fetcher(dataclasses.replace(FAST, deadline=0.5, request_timeout=5.0))
    t0 = time.monotonic()
    with pytest.raises(FetchTimeoutError):
        short.get([4])
    assert time.monotonic() - t0 < 0.5 + 2.0
    store.release()
    wait_until(lambda: store.hanging == 0)
    assert fetcher.get([2]) == {2: image.sector(2)}
    assert short.get([4]) == {4: image.sector(4)}


def test_many_hung_requests_do_not_pile_up_threads(store, make_fetcher: MakeFetcher) -> None:
    config = dataclasses.replace(FAST, request_timeout=0.05, retries=1000, max_stuck_requests=3)
    fetcher = make_fetcher(config)
    store.hang()
    with pytest.raises(FetchError):
        fetcher.get([2], deadline=time.monotonic() + 1.0)
    assert store.hanging <= config.max_stuck_requests + 1
    store.release()


def test_corrupt_bytes_are_refetched_never_served(
    image: Image, store, cache: SectorCache, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    at = image.index.sectors[2].offset + 10
    store.corrupt[at] = 1  # the first read of sector 2 comes back damaged
    assert fetcher.get([1, 2, 3]) == {n: image.sector(n) for n in (1, 2, 3)}
    assert fetcher.metrics.checksum_errors.value == 1
    counts = store.fetch_counts(image)
    assert counts[2] == 2 and counts[1] == 1 and counts[3] == 1  # only 2 is refetched
    assert cache.get(image.index.sectors[2].checksum) == image.sector(2)


def test_persistently_corrupt_sector_fails_and_is_not_cached(
    image: Image, store, cache: SectorCache, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    store.corrupt[image.index.sectors[4].offset] = 1000
    with pytest.raises(FetchError, match="checksum|undecodable"):
        fetcher.get([4])
    assert len(store.requests) == FAST.retries + 1
    assert image.index.sectors[4].checksum not in cache
    store.corrupt.clear()
    assert fetcher.get([4]) == {4: image.sector(4)}


def test_corrupt_cache_entry_is_refetched(
    image: Image, store, cache: SectorCache, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    fetcher.get([7])
    key = image.index.sectors[7].checksum
    path = entry_path(cache.root, key)
    path.write_bytes(b"\0" * path.stat().st_size)
    store.requests.clear()
    assert fetcher.get([7]) == {7: image.sector(7)}
    assert len(store.requests) == 1
    assert cache.get(key) is not None  # and cached again, good this time


def test_missing_blob_fails_without_retrying(image: Image, cache: SectorCache, tmp_path) -> None:
    empty = DirStore(tmp_path / "empty", "test")
    with SectorFetcher(empty, image.index, cache, FAST) as fetcher:
        t0 = time.monotonic()
        with pytest.raises(FetchError, match="not found"):
            fetcher.get([1])
        assert time.monotonic() - t0 < 1.0
        assert fetcher.metrics.retries.value == 0


def test_works_with_a_cache_that_cannot_hold_anything(image: Image, store, tmp_path) -> None:
    tiny = SectorCache(tmp_path / "tiny", 10)
    with SectorFetcher(store, image.index, tiny, FAST) as fetcher:
        assert fetcher.get([1, 2]) == {1: image.sector(1), 2: image.sector(2)}
        assert fetcher.get([1]) == {1: image.sector(1)}
    assert len(tiny) == 0


def test_on_demand_goes_before_prefetch(image: Image, store, make_fetcher: MakeFetcher) -> None:
    fetcher = make_fetcher(dataclasses.replace(FAST, max_parallel=1, max_parallel_prefetch=1))
    store.hang()
    blocker = threading.Thread(target=lambda: fetcher.get([1]))
    blocker.start()
    wait_until(lambda: store.hanging == 1)  # the only worker is busy
    prefetch = threading.Thread(
        target=lambda: fetcher.get([9], time.monotonic() + 10, Priority.PREFETCH)
    )
    prefetch.start()
    wait_until(lambda: fetcher.metrics.queued.value == 1)
    demand = threading.Thread(target=lambda: fetcher.get([30]))
    demand.start()
    wait_until(lambda: fetcher.metrics.queued.value == 2)
    store.release()
    for t in (blocker, prefetch, demand):
        t.join(10)
    offsets = [offset for offset, _ in store.requests]
    assert offsets[1:] == [image.index.sectors[30].offset, image.index.sectors[9].offset]


def test_a_prefetch_that_waited_long_enough_goes_before_new_demand(
    image: Image, store, make_fetcher: MakeFetcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Demand first, but not for ever: a reader that never stops would starve the profile.
    monkeypatch.setattr(fetcher_mod, "PREFETCH_MAX_WAIT", 0.3)
    fetcher = make_fetcher(dataclasses.replace(FAST, max_parallel=1, max_parallel_prefetch=1))
    store.hang()
    blocker = threading.Thread(target=lambda: fetcher.get([1]))
    blocker.start()
    wait_until(lambda: store.hanging == 1)
    batch = fetcher.prefetch([9], time.monotonic() + 10)
    assert batch.sectors == [9]
    time.sleep(0.4)  # it has waited its time behind the busy worker
    demand = threading.Thread(target=lambda: fetcher.get([30]))
    demand.start()
    wait_until(lambda: fetcher.metrics.queued.value == 2)
    store.release()
    assert batch.wait(10) and batch.error is None
    for t in (blocker, demand):
        t.join(10)
    offsets = [offset for offset, _ in store.requests]
    assert offsets[1:] == [image.index.sectors[9].offset, image.index.sectors[30].offset]


def test_on_demand_reader_promotes_a_queued_prefetch(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher(dataclasses.replace(FAST, max_parallel=1, max_parallel_prefetch=1))
    store.hang()
    threads = [threading.Thread(target=lambda: fetcher.get([1]))]
    threads[0].start()
    wait_until(lambda: store.hanging == 1)
    for n in (9, 13):
        threads.append(
            threading.Thread(
                target=lambda n=n: fetcher.get([n], time.monotonic() + 10, Priority.PREFETCH)
            )
        )
        threads[-1].start()
        wait_until(lambda n=n: fetcher.metrics.queued.value == (1 if n == 9 else 2))
    threads.append(threading.Thread(target=lambda: fetcher.get([13])))
    threads[-1].start()
    wait_until(lambda: fetcher.metrics.cache_misses.value == 4)  # 1, 9, 13 and the joiner
    store.release()
    for t in threads:
        t.join(10)
    assert len(store.requests) == 3
    assert [o for o, _ in store.requests[1:]] == [
        image.index.sectors[13].offset,
        image.index.sectors[9].offset,
    ]


def test_missing_lists_what_a_prefetch_would_fetch(image: Image, make_fetcher: MakeFetcher) -> None:
    fetcher = make_fetcher()
    fetcher.get([1, 3])
    # 5 is all zeros, 1 and 3 are cached, 12 repeats 3's content
    assert fetcher.missing([1, 2, 3, 4, 5, 12]) == [2, 4]


def test_bad_sector_numbers_and_close(make_fetcher: MakeFetcher) -> None:
    fetcher = make_fetcher()
    with pytest.raises(InvalidReadError):
        fetcher.get([10_000])
    fetcher.close()
    with pytest.raises(ClosedError):
        fetcher.get([2])


def test_close_fails_waiting_readers(store, make_fetcher: MakeFetcher) -> None:
    fetcher = make_fetcher()
    store.hang()
    errors: list[BaseException] = []

    def read() -> None:
        try:
            fetcher.get([2], deadline=time.monotonic() + 30)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=read)
    t.start()
    wait_until(lambda: store.hanging == 1)
    fetcher.close()
    t.join(5)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], ClosedError)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        FetchConfig(max_parallel=0)
    with pytest.raises(ValueError):
        FetchConfig(max_parallel=2, max_parallel_prefetch=3)
    with pytest.raises(ValueError):
        FetchConfig(deadline=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        FetchConfig().retries = 9  # type: ignore[misc]


def test_sectors_with_the_same_content_are_fetched_once(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    # 11 and 12 hold sector 3's bytes: one flight for the content, not three
    assert fetcher.get([3, 11, 12]) == {n: image.sector(3) for n in (3, 11, 12)}
    assert store.requests == [blob_range(image.index, range(3, 4))[1:]]


def test_stalls_are_counted_by_why_the_sector_was_not_there(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    """Seconds readers wait on the network: for a sector nobody had asked for (missing),
    and for one read ahead or prefetched that had not arrived yet (late). Prefetch's own
    waits are no reader's stall."""
    fetcher = make_fetcher()
    m = fetcher.metrics
    store.before_read = lambda offset, length: time.sleep(0.2)
    fetcher.get([1])
    assert 0.15 < m.stall_missing_seconds.value < 5 and m.stall_late_seconds.value == 0
    missing = m.stall_missing_seconds.value
    assert fetcher.readahead([2]) == 1
    fetcher.get([2])  # joins the read-ahead that is on its way
    assert 0.05 < m.stall_late_seconds.value < 5
    assert m.stall_missing_seconds.value == missing
    late = m.stall_late_seconds.value
    fetcher.get([4], priority=Priority.PREFETCH)
    assert (m.stall_missing_seconds.value, m.stall_late_seconds.value) == (missing, late)
    assert fetcher.metrics.snapshot()["stall_late_seconds"] == late


def test_a_flight_watch_sees_each_fetch_start_and_end(
    image: Image, store: FaultyStore, make_fetcher: Callable[..., SectorFetcher]
) -> None:
    events: list[tuple[str, int]] = []

    class Watch:
        def pending(self, n: int) -> None:
            events.append(("pending", n))

        def settled(self, n: int) -> None:
            events.append(("settled", n))

    fetcher = make_fetcher()
    fetcher.watch_flights(Watch())
    stored = [n for n, s in enumerate(image.index.sectors) if not s.is_zero]
    fetcher.get([stored[0]])
    assert events == [("pending", stored[0]), ("settled", stored[0])]
    events.clear()
    store.mode = "down"
    with pytest.raises(FetchError):
        fetcher.get([stored[1]], deadline=time.monotonic() + 0.5)
    assert events[0] == ("pending", stored[1]) and events[-1] == ("settled", stored[1])
