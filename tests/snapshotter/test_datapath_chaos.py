"""The data path under everything at once: readers on 8 threads (random ranges and sequential
streams that start read-ahead) over a store that drops, corrupts, truncates and delays its
answers, a cache too small to hold the image whose entry files rot on disk meanwhile, and a
decoded-sector memory of four sectors.

Whatever happens, a read returns the image's own bytes or raises ``FetchError``, within its
deadline; nothing else. Once the store is healthy again every byte reads back, and the cache
is within its cap."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest
from datapath_support import (
    SECTOR,
    FaultyStore,
    Image,
    build_image,
    dir_store,
    standard_contents,
)

from imagetool.errors import StoreError
from imagetool.stores.base import Store
from snapshotter.cache.sectors import SectorCache
from snapshotter.config import FetchConfig
from snapshotter.datapath.fetcher import SectorFetcher
from snapshotter.datapath.reader import BlockReader
from snapshotter.errors import FetchError
from snapshotter.metrics import MountMetrics

CONFIG = FetchConfig(
    max_parallel=4,
    max_parallel_prefetch=2,
    request_timeout=0.3,
    retries=3,
    backoff_base=0.005,
    backoff_max=0.02,
    deadline=2.0,
)
THREADS = 8
ROUNDS_PER_THREAD = 20  # each a sequential stretch of 20 reads or one random read


class ChaosStore(FaultyStore):
    """A store whose every answer is, at random: refused, one byte flipped, cut short,
    late past the request timeout, or right; each after a short random delay. ``calm()``
    makes it answer right from then on."""

    def __init__(self, inner: Store, seed: int) -> None:
        super().__init__(inner)
        self._rng = random.Random(seed)
        self._calm = False
        self.injected = {"refused": 0, "flipped": 0, "short": 0, "late": 0}

    def calm(self) -> None:
        self._calm = True

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        data = super().read_range(digest, offset, length)
        with self._lock:
            if self._calm:
                return data
            roll, at, delay = self._rng.random(), self._rng.randrange(length), self._rng.random()
            fault = (
                "refused" if roll < 0.12
                else "flipped" if roll < 0.24
                else "short" if roll < 0.30
                else "late" if roll < 0.33
                else None
            )  # fmt: skip
            if fault:
                self.injected[fault] += 1
        time.sleep(CONFIG.request_timeout * 1.5 if fault == "late" else delay * 0.005)
        if fault == "refused":
            raise StoreError(f"{self.url}: connection reset (chaos)")
        if fault == "flipped":
            out = bytearray(data)
            out[at] ^= 0x5A
            return bytes(out)
        if fault == "short":
            return data[:at]
        return data


class BitRot(threading.Thread):
    """Flips one byte of a random cache entry file every few milliseconds until stopped
    (entry files only: not those being written, not the cache's usage counter)."""

    def __init__(self, root: Path, seed: int) -> None:
        super().__init__(name="bit-rot", daemon=True)
        self.root = root
        self.rng = random.Random(seed)
        self.flips = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.003):
            entries = [p for p in self.root.glob("*/??/*") if len(p.name) == 32]  # entry files
            if not entries:
                continue
            path = self.rng.choice(entries)
            try:
                with open(path, "r+b") as f:
                    size = os.fstat(f.fileno()).st_size
                    if not size:
                        continue
                    at = self.rng.randrange(size)
                    f.seek(at)
                    byte = f.read(1)
                    f.seek(at)
                    f.write(bytes([byte[0] ^ 0xA5]))
                self.flips += 1
            except OSError:  # evicted or replaced meanwhile
                pass


@pytest.fixture
def chaos_image() -> Image:
    return build_image(standard_contents(random.Random(99), count=60), metadata_sectors=2)


def test_a_read_is_right_or_an_error_within_its_deadline_whatever_fails(
    chaos_image: Image, tmp_path: Path
) -> None:
    image = chaos_image
    store = ChaosStore(dir_store(tmp_path / "store", image), seed=7)
    cache_root = tmp_path / "cache"
    cache = SectorCache(cache_root, 12 * SECTOR)  # a fifth of the image
    fetcher = SectorFetcher(
        store=store, index=image.index, cache=cache, config=CONFIG, metrics=MountMetrics()
    )
    reader = BlockReader(
        image.index, fetcher, memory_sectors=4, readahead_bytes=6 * SECTOR, stream_slack=SECTOR
    )
    size = image.index.image_size
    rot = BitRot(cache_root, seed=3)
    outcomes = {"right": 0, "failed": 0}
    wrong: list[tuple[int, int]] = []
    unexpected: list[BaseException] = []
    slowest = [0.0]
    lock = threading.Lock()

    def read_and_check(offset: int, length: int) -> None:
        start = time.monotonic()
        try:
            data = reader.read(offset, length)
        except FetchError:
            outcome = "failed"
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            with lock:
                unexpected.append(e)
            return
        else:
            outcome = "right"
            if data != image.data[offset : offset + length]:
                with lock:
                    wrong.append((offset, length))
        with lock:
            outcomes[outcome] += 1
            slowest[0] = max(slowest[0], time.monotonic() - start)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(ROUNDS_PER_THREAD):
            if rng.random() < 0.5:  # a sequential stretch, as a file copy reads
                offset = rng.randrange(size)
                for _ in range(20):
                    read_and_check(offset, 32 << 10)
                    offset = (offset + (32 << 10)) % size
            else:
                read_and_check(rng.randrange(size), rng.randrange(1, 3 * SECTOR))

    rot.start()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a reader hung"
        rot.done.set()
        rot.join(5)

        assert not unexpected, unexpected[:3]
        assert not wrong, f"{len(wrong)} reads returned other bytes than the image's: {wrong[:5]}"
        # Every kind of fault happened, and the readers got through most of them.
        assert all(store.injected.values()), store.injected
        assert rot.flips > 0
        assert fetcher.metrics.checksum_errors.value > 0  # the store's flipped bytes, caught
        assert cache.metrics.corrupt.value > 0  # rotten entries, caught and fetched again
        assert cache.metrics.evictions.value > 0
        assert fetcher.readahead_sectors.value > 0  # the sequential stretches were read ahead
        assert outcomes["right"] > outcomes["failed"], outcomes
        # No read waited much past the fetcher's deadline (generous: a shared, busy machine).
        assert slowest[0] < CONFIG.deadline + 5.0, slowest[0]

        # The store recovers: every byte reads back right, and the cache kept to its cap.
        store.calm()
        for offset in range(0, size, SECTOR):
            assert reader.read(offset, SECTOR) == image.data[offset : offset + SECTOR]
        assert cache.usage() <= cache.max_bytes
    finally:
        rot.done.set()
        store.calm()
        fetcher.close()
        store.release()
