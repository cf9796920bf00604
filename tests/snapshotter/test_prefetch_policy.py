"""Prefetch: the pure plan, the token bucket, and the background worker for real."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import pytest
from datapath_support import FAST, SECTOR, Image, build_image, wait_until

from snapshotter.cache.sectors import SectorCache
from snapshotter.datapath.fetcher import SectorFetcher
from snapshotter.datapath.prefetch import (
    PrefetchConfig,
    Prefetcher,
    PrefetchMode,
    TokenBucket,
    Window,
    large_file_share,
    plan,
)
from snapshotter.datapath.reader import BlockReader

MakeFetcher = Callable[..., SectorFetcher]


def stored(image: Image) -> list[int]:
    return [n for n, s in enumerate(image.index.sectors) if not s.is_zero]


def test_plan_orders_profile_then_metadata_then_everything(image: Image) -> None:
    assert plan(image.index, PrefetchMode.NONE) == []
    assert plan(image.index, PrefetchMode.PROFILE) == [8, 9, 10, 0, 1]
    full = plan(image.index, PrefetchMode.FULL)
    assert full[:5] == [8, 9, 10, 0, 1]
    assert sorted(full) == stored(image)  # every stored sector once, no zero sector
    assert full[5:] == sorted(full[5:])


def test_plan_skips_zero_sectors_and_duplicates() -> None:
    sector = 64 << 10
    contents = [b"\1" * sector, bytes(sector), b"\2" * sector, bytes(sector)]
    img = build_image(contents, metadata_sectors=2, prefetch=(3, 2, 2, 1, 0))
    assert plan(img.index, PrefetchMode.PROFILE) == [2, 0]
    assert plan(img.index, PrefetchMode.FULL) == [2, 0]


def test_token_bucket_allows_a_burst_then_paces() -> None:
    now = [0.0]
    bucket = TokenBucket(rate=1000, burst=500, clock=lambda: now[0])
    assert bucket.take(400) == 0
    assert bucket.take(300) == pytest.approx(0.2)  # 200 bytes in debt at 1000/s
    now[0] += 0.2
    assert bucket.take(100) == pytest.approx(0.1)
    now[0] += 10  # idle: refills only up to the burst
    assert bucket.take(500) == 0
    assert bucket.take(1) > 0


class Link:
    """A fake link for ``Window``: a batch of ``BATCH`` bytes completes every
    ``BATCH / rate(size)`` seconds of the fake clock."""

    BATCH = 1_000_000

    def __init__(self, rate: Callable[[int], float]) -> None:
        self.now = 0.0
        self.rate = rate
        self.window = Window(2, 6, clock=lambda: self.now)

    def run(self, seconds: float) -> list[int]:
        """The window's size after each completion for ``seconds`` of fake time."""
        sizes = []
        end = self.now + seconds
        while self.now < end:
            self.now += self.BATCH / self.rate(self.window.size)
            self.window.completed(self.BATCH)
            sizes.append(self.window.size)
        return sizes


def test_the_window_grows_while_more_in_flight_delivers_more() -> None:
    # A long fat link: each batch more in flight adds 20 MB/s, up to the window's cap.
    link = Link(lambda size: 20e6 * size)
    sizes = link.run(10)
    assert sizes[0] == 2 and max(sizes) == 6  # from low to high, never beyond
    assert sizes == sorted(sizes)  # it only grew
    assert sizes[-1] == 6


def test_the_window_steps_back_when_more_in_flight_does_not_pay() -> None:
    # The link is full at 3 batches: a fourth buys nothing; the window settles at 3 and
    # probes 4 again now and then (links change), never going above 4 or below 3 once there.
    link = Link(lambda size: 20e6 * min(size, 3))
    link.run(2)
    later = link.run(20)
    assert set(later) <= {3, 4}
    assert later.count(3) > 3 * later.count(4)  # mostly at the size that pays
    assert 4 in later  # probed again


def test_the_window_follows_a_link_that_gets_faster() -> None:
    rate = {"cap": 2}
    link = Link(lambda size: 20e6 * min(size, rate["cap"]))
    assert set(link.run(10)) <= {2, 3}
    rate["cap"] = 6  # e.g. another mount's transfer ended
    assert link.run(20)[-1] >= 5


def test_the_window_stays_within_its_bounds() -> None:
    w = Window(0, 0, clock=lambda: 0.0)
    assert (w.low, w.high, w.size) == (1, 1, 1)  # at least one batch in flight
    now = [0.0]
    w = Window(3, 2, clock=lambda: now[0])
    assert w.size == 3 and w.high == 3  # a cap below the floor is raised to it
    for _ in range(50):
        now[0] += 1
        w.completed(1)
    assert w.size == 3


def test_prefetcher_warms_the_cache(
    image: Image, store, cache: SectorCache, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    p = Prefetcher.for_mount(fetcher, PrefetchConfig(mode=PrefetchMode.FULL)).start()
    assert p.wait(10)
    # 11 and 12 repeat 3's content: once 3 is cached, they are too
    assert p.fetched == len(stored(image)) - 2
    assert fetcher.missing(range(image.index.sector_count)) == []
    assert fetcher.metrics.prefetched_sectors.value == p.fetched
    # repeated sectors (11, 12 = 3) share an entry, so nothing was fetched twice
    assert all(c == 1 for c in store.fetch_counts(image).values())
    # a second prefetch of the same plan finds nothing to do
    again = Prefetcher.for_mount(fetcher, PrefetchConfig(mode=PrefetchMode.FULL)).start()
    assert again.wait(10) and again.fetched == 0


def test_auto_streams_the_image_once_the_start_has_read_its_share(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    index = image.index
    total = sum(s.length for s in index.sectors)
    cfg = PrefetchConfig(mode=PrefetchMode.AUTO, stream_fraction=0.25, stream_watch=30)
    p = Prefetcher.for_mount(fetcher, cfg).start()
    wait_until(lambda: fetcher.missing(plan(index, PrefetchMode.PROFILE)) == [])
    assert p.running and not p.streaming  # the profile's sectors alone are not a quarter
    # Fetched but not read (read-ahead, another mount's prefetch): not the start's share.
    ahead = [n for n in reversed(stored(image)) if n not in set(index.prefetch)]
    for n in ahead:
        if fetcher.metrics.bytes_fetched.value >= total / 2:
            break
        fetcher.get([n])
    time.sleep(0.5)  # five of the prefetcher's looks
    assert p.running and not p.streaming
    reader = BlockReader(index, fetcher, readahead_bytes=0)
    for n in stored(image):  # a reader reads on until it has read a quarter of the bytes
        if fetcher.metrics.touched_stored_bytes.value >= total / 4:
            break
        start, size = index.sector_span(n)
        reader.read(start, size)
    assert p.wait(10) and p.streaming
    assert fetcher.missing(range(index.sector_count)) == []


def test_auto_trusts_a_profile_that_names_the_share_until_the_start_reads_outside_it(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    """A profile naming ``stream_fraction`` of the image is the start's reads: it is fetched
    first and the rest waits (even where large files would have the image streamed from the
    mount); a start that reads outside it (a stale profile) has the rest streamed."""
    fetcher = make_fetcher()
    index = image.index
    total = sum(s.length for s in index.sectors)
    profile = set(index.prefetch)
    profiled = sum(index.sectors[n].length for n in profile)
    cfg = PrefetchConfig(mode=PrefetchMode.AUTO, stream_fraction=profiled / total,
                         stream_large_share=0.01, large_file_bytes=SECTOR,
                         stream_large_files=False, stream_watch=30)  # fmt: skip
    p = Prefetcher.for_mount(fetcher, cfg).start()
    wait_until(lambda: fetcher.missing(plan(index, PrefetchMode.PROFILE)) == [])
    time.sleep(0.5)  # five of the prefetcher's looks
    assert p.running and not p.streaming
    outside = [n for n in stored(image) if n not in profile and n >= index.metadata_sectors]
    assert len(fetcher.missing(outside)) == len(outside)  # nothing but the profile came
    # Reads within the profile are what it said: still no more.
    reader = BlockReader(index, fetcher, readahead_bytes=0)
    for n in sorted(profile):
        start, size = index.sector_span(n)
        reader.read(start, size)
    time.sleep(0.3)
    assert p.running and not p.streaming
    # The start leaves the profile: once it has read 5 % of the profile's bytes outside it,
    # the rest follows.
    read = 0
    for n in outside:
        start, size = index.sector_span(n)
        reader.read(start, size)
        read += index.sectors[n].length
        if read >= 0.05 * profiled:
            break
    assert p.wait(10) and p.streaming
    assert fetcher.missing(range(index.sector_count)) == []


def test_a_trusted_profile_naming_part_of_a_large_file_does_not_stream_the_rest(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    """The test image's profile names the first 3 of /app/weights.bin's 10 sectors, as a
    profile with byte ranges names what a start reads of a large library. A start reading
    those has the profile's word for it: the rest of the file does not follow. A read of
    the file outside the profile does stream it."""
    fetcher = make_fetcher()
    index = image.index
    total = sum(s.length for s in index.sectors)
    profiled = sum(index.sectors[n].length for n in set(index.prefetch))
    weights = range(8, 18)
    assert set(index.prefetch) < set(weights)
    cfg = PrefetchConfig(mode=PrefetchMode.AUTO, stream_fraction=profiled / total,
                         stream_large_share=2, large_file_bytes=SECTOR,
                         stream_large_files=True, stream_watch=30)  # fmt: skip
    p = Prefetcher.for_mount(fetcher, cfg).start()
    fetcher.get([9])  # on demand, inside the profile
    wait_until(lambda: fetcher.missing(plan(index, PrefetchMode.PROFILE)) == [])
    time.sleep(0.5)
    assert p.running and p.files_streamed == 0
    rest = [n for n in weights if n not in index.prefetch]
    assert fetcher.missing(rest) == rest
    fetcher.get([14])  # outside it: the profile did not know this start
    wait_until(lambda: p.files_streamed == 1 and fetcher.missing(weights) == [])
    p.stop()


def test_a_trusted_profile_keeps_read_ahead_inside_it_until_the_prefetcher_ends(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    """A sequential reader's read-ahead past what a trusted profile names is a guess the
    profile contradicts: it is dropped while the start stays inside the profile, and read
    ahead again once the prefetcher is done with the start."""
    fetcher = make_fetcher()
    index = image.index
    total = sum(s.length for s in index.sectors)
    profiled = sum(index.sectors[n].length for n in set(index.prefetch))
    cfg = PrefetchConfig(mode=PrefetchMode.AUTO, stream_fraction=profiled / total,
                         stream_large_share=2, stream_watch=30)  # fmt: skip
    p = Prefetcher.for_mount(fetcher, cfg).start()
    wait_until(lambda: fetcher.missing(plan(index, PrefetchMode.PROFILE)) == [])
    beyond = [13, 14, 15]  # /app/weights.bin, after the profile's first three sectors
    assert p.running and fetcher.readahead(beyond) == 0
    time.sleep(0.2)
    assert fetcher.missing(beyond) == beyond
    p.stop()
    assert fetcher.readahead(beyond) == 3
    wait_until(lambda: fetcher.missing(beyond) == [])


def test_auto_fetches_only_what_is_read_when_a_start_reads_little(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    cfg = PrefetchConfig(mode=PrefetchMode.AUTO, stream_fraction=0.9, stream_watch=0.5)
    p = Prefetcher.for_mount(fetcher, cfg).start()
    fetcher.get([30])
    assert p.wait(10) and not p.streaming  # it watched for its time, then ended
    profile = set(plan(image.index, PrefetchMode.PROFILE))
    cached = set(stored(image)) - set(fetcher.missing(stored(image)))
    assert cached <= profile | {30, 11, 12, 3}  # 11, 12 repeat 3
    assert len(cached) < len(stored(image)) // 2


def test_prefetcher_follows_the_plan_order(image: Image, store, make_fetcher: MakeFetcher) -> None:
    # One batch at a time: exactly the plan's order.
    fetcher = make_fetcher(dataclasses.replace(FAST, max_parallel_prefetch=1))
    p = Prefetcher(fetcher, [30, 8, 2], PrefetchConfig(batch_sectors=1, min_window=1)).start()
    assert p.wait(10)
    sectors = image.index.sectors
    assert [o for o, _ in store.requests] == [sectors[n].offset for n in (30, 8, 2)]


def test_a_window_of_batches_keeps_the_plan_order_within_the_window(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()  # 2 prefetch workers
    sectors = image.index.sectors
    firsts = {}  # one sector per content: repeats are fetched once
    for n in range(39, 1, -3):
        if not sectors[n].is_zero:
            firsts.setdefault(sectors[n].checksum, n)
    order = list(firsts.values())
    p = Prefetcher(fetcher, order, PrefetchConfig(batch_sectors=1)).start()
    assert p.wait(10)
    by_offset = {image.index.sectors[n].offset: n for n in order}
    asked = [by_offset[o] for o, _ in store.requests]
    assert sorted(asked) == sorted(order)
    # Batches in flight at once may reach the store in either order, no further apart.
    width = p.window.size if p.window else 1
    assert all(abs(order.index(n) - k) < max(2, width) for k, n in enumerate(asked)), asked


def test_prefetcher_stops_on_request(image: Image, store, make_fetcher: MakeFetcher) -> None:
    fetcher = make_fetcher()
    started = threading.Event()

    def slow(*_: object) -> None:
        started.set()
        time.sleep(0.05)

    store.before_read = slow
    p = Prefetcher.for_mount(fetcher, PrefetchConfig(mode=PrefetchMode.FULL, batch_sectors=1))
    p.start()
    assert started.wait(5)
    p.stop(timeout=5)
    assert not p.running
    assert p.fetched < len(stored(image))


def test_prefetcher_respects_the_bandwidth_cap(image: Image, make_fetcher: MakeFetcher) -> None:
    fetcher = make_fetcher()
    rate = image.index.blobs[0].size  # the whole blob per second, burst of a tenth of it
    config = PrefetchConfig(mode=PrefetchMode.FULL, bandwidth=rate, burst_bytes=rate // 10)
    t0 = time.monotonic()
    p = Prefetcher.for_mount(fetcher, config).start()
    assert p.wait(10)
    assert time.monotonic() - t0 >= 0.5  # ~0.9 s of debt to pay off; lenient lower bound


def test_prefetcher_gives_up_when_the_store_is_down(store, make_fetcher: MakeFetcher) -> None:
    fetcher = make_fetcher(dataclasses.replace(FAST, retries=0))
    store.mode = "down"
    p = Prefetcher.for_mount(
        fetcher, PrefetchConfig(mode=PrefetchMode.FULL, batch_sectors=1, max_failures=2)
    ).start()
    assert p.wait(10)
    assert p.fetched == 0
    assert fetcher.metrics.prefetch_errors.value == 2


def test_prefetcher_leaves_room_in_a_small_cache(image: Image, store, tmp_path) -> None:
    small = SectorCache(tmp_path / "small", image.index.blobs[0].size // 2)
    with SectorFetcher(store, image.index, small, FAST) as fetcher:
        config = PrefetchConfig(mode=PrefetchMode.FULL, max_cache_fraction=0.5)
        p = Prefetcher.for_mount(fetcher, config).start()
        assert p.wait(10)
        assert 0 < p.fetched < len(stored(image))
        assert small.usage() <= small.max_bytes // 2


def test_on_demand_reads_are_served_during_a_prefetch(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher(dataclasses.replace(FAST, max_parallel=2, max_parallel_prefetch=1))
    store.before_read = lambda *_: time.sleep(0.02)
    p = Prefetcher.for_mount(fetcher, PrefetchConfig(mode=PrefetchMode.FULL, batch_sectors=1))
    p.start()
    wait_until(lambda: len(store.requests) >= 1)
    got = fetcher.get([39], deadline=time.monotonic() + 5)
    assert got == {39: image.sector(39)}
    assert p.running  # the demand read did not wait for the prefetch to finish
    p.stop()


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        PrefetchConfig(batch_sectors=0)
    with pytest.raises(ValueError):
        PrefetchConfig(bandwidth=0)
    with pytest.raises(ValueError):
        PrefetchConfig(max_cache_fraction=0)


def test_large_file_share_counts_the_stored_bytes_of_large_files(image: Image) -> None:
    index = image.index
    total = sum(s.length for s in index.sectors)
    weights = index.sectors_for_range(8 * SECTOR, 10 * SECTOR)  # /app/weights.bin
    expected = sum(index.sectors[n].length for n in weights) / total
    assert large_file_share(index, 10 * SECTOR) == pytest.approx(expected)
    assert 0 < expected < 1
    # python3 (3 sectors and a bit) joins at that size; nothing is that large
    assert large_file_share(index, 3 * SECTOR) > expected
    assert large_file_share(index, 11 * SECTOR) == 0


def test_auto_streams_from_the_mount_an_image_of_large_files(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    """Nothing is read: the index alone says the start will read most of the image."""
    fetcher = make_fetcher()
    share = large_file_share(image.index, 10 * SECTOR)
    cfg = PrefetchConfig(mode=PrefetchMode.AUTO, stream_large_share=share,
                         large_file_bytes=10 * SECTOR, stream_watch=0.5)  # fmt: skip
    p = Prefetcher.for_mount(fetcher, cfg).start()
    assert p.wait(10) and p.streaming
    assert fetcher.metrics.touched_stored_bytes.value == 0
    assert fetcher.missing(range(image.index.sector_count)) == []
    # The profile still goes first: its sectors head the plan.
    assert p.sectors[: len(image.index.prefetch)] == list(image.index.prefetch)


def test_auto_waits_for_reads_when_large_files_hold_less_than_the_share(
    image: Image, store, make_fetcher: MakeFetcher
) -> None:
    fetcher = make_fetcher()
    share = large_file_share(image.index, 10 * SECTOR)
    cfg = PrefetchConfig(mode=PrefetchMode.AUTO, stream_large_share=share + 0.01,
                         large_file_bytes=10 * SECTOR, stream_fraction=0.9,
                         stream_watch=0.5)  # fmt: skip
    p = Prefetcher.for_mount(fetcher, cfg).start()
    assert p.wait(10) and not p.streaming
    assert len(fetcher.missing(stored(image))) > len(stored(image)) // 2


@pytest.mark.parametrize("enabled", [True, False])
def test_auto_streams_a_large_file_once_the_start_reads_it(
    image: Image, store, make_fetcher: MakeFetcher, enabled: bool
) -> None:
    """A start that reads a large file (weights) reads it whole: the rest of the file is
    fetched next, from the sector read on, then its beginning; nothing else is."""
    fetcher = make_fetcher(dataclasses.replace(FAST, max_parallel_prefetch=1))
    cfg = PrefetchConfig(mode=PrefetchMode.AUTO, stream_large_files=enabled, batch_sectors=1,
                         min_window=1, large_file_bytes=10 * SECTOR, stream_fraction=0.9,
                         stream_watch=30)  # fmt: skip
    p = Prefetcher.for_mount(fetcher, cfg).start()
    index = image.index
    wait_until(lambda: fetcher.missing(plan(index, PrefetchMode.PROFILE)) == [])
    before = len(store.requested_sectors(image))
    BlockReader(index, fetcher, readahead_bytes=0).read(*index.sector_span(14))
    weights = list(range(8, 18))
    if not enabled:
        time.sleep(0.5)
        assert p.files_streamed == 0
        assert fetcher.missing(weights) == [11, 12, 13, 15, 16, 17]
        p.stop()
        return
    cached = [index.sectors[n].checksum for n in weights]  # not only asked for: in the cache
    wait_until(lambda: all(c in fetcher.cache for c in cached))
    assert p.files_streamed == 1 and not p.streaming and p.running
    after = store.requested_sectors(image)[before:]
    # The demand read races the prefetch of the sectors after it to the store.
    assert after.count(14) == 1
    # (The profile's last sectors may still be on their way: only the file's count.)
    assert [n for n in after if 8 <= n < 18 and n != 14] == [15, 16, 17, 11, 13]  # 12 = 11
    assert len(fetcher.missing(stored(image))) > len(stored(image)) // 2
    # A second read of the file streams nothing again.
    BlockReader(index, fetcher, readahead_bytes=0).read(*index.sector_span(13))
    time.sleep(0.3)
    assert p.files_streamed == 1
    p.stop()
