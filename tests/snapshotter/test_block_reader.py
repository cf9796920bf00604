"""BlockReader: byte ranges over the uncompressed image, the decoded-sector LRU, the access
log that becomes a startup profile."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pytest
from datapath_support import SECTOR, Image

from snapshotter.errors import FetchError, InvalidReadError
from snapshotter.fetcher import SectorFetcher
from snapshotter.reader import BlockReader

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
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(30):
                offset = rng.randrange(image.index.image_size)
                length = rng.randrange(1, 2 * SECTOR)
                assert reader.read(offset, length) == image.data[offset : offset + length]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
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
