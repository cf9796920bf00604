"""Prefetch: warming the sector cache in the background after a mount.

Why. A container's startup reads a predictable set of files — the interpreter, its shared
libraries, the application's modules, then perhaps gigabytes of weights. A lazy mount serves
each of them on demand, and every cold read pays a round trip to the store. Prefetching hides
those round trips by fetching ahead of the reads, in the order the reads will come.

What, in which order. ``plan(index, mode)`` is the whole policy, a pure function of the index:

1. the index's ``prefetch`` list: sector numbers hottest first, recorded from a startup
   profile at conversion (the writer also laid those files out first, so the list is mostly
   a few long runs that coalesce into few requests);
2. the metadata sectors (the mount normally fetched them already; listing them keeps a plan
   complete when it did not);
3. with ``PrefetchMode.FULL``, every other sector in image order: for images that will be
   read almost entirely (model weights), streaming the image sequentially at full bandwidth
   beats fetching it in scattered on-demand pieces.

All-zero sectors are never listed (they cost nothing to read).

How, without getting in the way. Prefetch must never slow down the reads it is meant to
speed up. The ``Prefetcher`` goes through the same ``SectorFetcher`` as on-demand reads, so a
reader that wants a sector being prefetched waits on that fetch instead of duplicating it
(and promotes it to on-demand priority). Its requests carry ``Priority.PREFETCH``: queued
behind every on-demand request, and holding at most ``FetchConfig.max_parallel_prefetch``
workers. It asks for a few sectors at a time (``batch_sectors``), so an on-demand read never
waits behind much. An optional token bucket caps the bytes it pulls per second, so that a
full prefetch does not saturate the node's link for its neighbours.

The cache is shared by every image on the node, and prefetched sectors compete with all the
others under its LRU. A full prefetch of an image larger than the cache would only evict its
own beginning (and everybody else's hot sectors), so the prefetcher stops once it has brought
in ``max_cache_fraction`` of the cache's capacity.

Prefetch is an optimisation: a failed batch is logged and counted and the next one tried;
after ``max_failures`` failed batches in a row (the store is probably down, and on-demand
reads will say so themselves) the prefetcher gives up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from imagetool.format import Index
from snapshotter.config import PrefetchConfig, PrefetchMode
from snapshotter.datapath.fetcher import Priority, SectorFetcher
from snapshotter.errors import ClosedError, FetchError

log = logging.getLogger(__name__)


def plan(index: Index, mode: PrefetchMode) -> list[int]:
    """Sector numbers to prefetch, in order; never a zero sector, never one twice."""
    if mode is PrefetchMode.NONE:
        return []
    order: dict[int, None] = dict.fromkeys(index.prefetch)
    order.update(dict.fromkeys(range(index.metadata_sectors)))
    if mode is PrefetchMode.FULL:
        order.update(dict.fromkeys(range(index.sector_count)))
    return [n for n in order if not index.sectors[n].is_zero]


class TokenBucket:
    """Bytes-per-second limiter. ``take(n)`` spends ``n`` tokens, going into debt if need be,
    and returns how long the caller must wait before spending them (0 within the burst)."""

    def __init__(
        self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._stamp = clock()
        self._lock = threading.Lock()

    def take(self, n: float) -> float:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            return max(0.0, -self._tokens / self.rate)


class Prefetcher:
    """Runs a prefetch plan on a background thread; ``stop()`` ends it early."""

    def __init__(
        self, fetcher: SectorFetcher, sectors: list[int], config: PrefetchConfig | None = None
    ) -> None:
        self.fetcher = fetcher
        self.sectors = list(sectors)
        self.config = config or PrefetchConfig()
        self.fetched = 0  # sectors this prefetcher brought into the cache
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lazyblock-prefetch", daemon=True)
        cfg = self.config
        self._bucket = (
            TokenBucket(cfg.bandwidth, cfg.burst_bytes) if cfg.bandwidth is not None else None
        )

    @classmethod
    def for_mount(cls, fetcher: SectorFetcher, config: PrefetchConfig) -> Prefetcher:
        return cls(fetcher, plan(fetcher.index, config.mode), config)

    def start(self) -> Prefetcher:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        """Ask the worker to stop after the batch in progress; wait up to ``timeout``."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the plan to finish; returns whether the worker has ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        cfg, fetcher, index = self.config, self.fetcher, self.fetcher.index
        budget = cfg.max_cache_fraction * fetcher.cache.max_bytes
        spent = 0
        failures = 0
        for i in range(0, len(self.sectors), cfg.batch_sectors):
            if self._stop.is_set():
                break
            batch = fetcher.missing(self.sectors[i : i + cfg.batch_sectors])
            if not batch:
                continue
            # The cache holds sectors decoded; the link carries them compressed.
            cost = sum(index.sector_span(n)[1] for n in batch)
            if spent + cost > budget:
                log.info("prefetch: stopping at %d bytes, the cache's share for it", spent)
                break
            wire = sum(index.sectors[n].length for n in batch)
            if self._bucket is not None and self._stop.wait(self._bucket.take(wire)):
                break
            try:
                fetcher.get(batch, time.monotonic() + cfg.batch_timeout, Priority.PREFETCH)
            except ClosedError:
                break
            except FetchError as e:
                failures += 1
                fetcher.metrics.prefetch_errors.inc()
                log.warning("prefetch: batch failed (%d in a row): %s", failures, e)
                if failures >= cfg.max_failures:
                    log.warning("prefetch: giving up after %d failed batches", failures)
                    break
                continue
            failures = 0
            spent += cost
            self.fetched += len(batch)
            fetcher.metrics.prefetched_sectors.inc(len(batch))
        log.debug("prefetch: done, %d sectors fetched", self.fetched)
