"""Plain, thread-safe metric objects for the snapshotter's data path.

``MountMetrics`` holds one mount's counters (the fetcher, reader and prefetcher of that mount
write to it); ``CacheMetrics`` holds the node-wide sector cache's. ``snapshot()`` turns either
into a JSON-able dict for ``snapshotter status --json``. The objects are deliberately plain —
counters, gauges and a bucketed histogram with the same shape Prometheus uses — so that an
exposition can be layered on later without touching the code that records.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Fetch latency buckets (seconds, upper bounds): 1 ms .. ~33 s, doubling. A local directory
# store answers in well under a millisecond, an S3 GET of 4 MiB in tens to hundreds.
LATENCY_BUCKETS: tuple[float, ...] = tuple(0.001 * 2**i for i in range(16))


class Counter:
    """A monotonically increasing integer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    def inc(self, n: int = 1) -> None:
        with self._lock:
            self._value += n

    @property
    def value(self) -> int:
        return self._value


class Seconds:
    """A monotonically increasing number of seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0.0

    def add(self, seconds: float) -> None:
        with self._lock:
            self._value += seconds

    @property
    def value(self) -> float:
        return self._value


class Gauge:
    """An integer that goes up and down (e.g. requests in flight)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    def inc(self, n: int = 1) -> None:
        with self._lock:
            self._value += n

    def dec(self, n: int = 1) -> None:
        with self._lock:
            self._value -= n

    def set(self, v: int) -> None:
        with self._lock:
            self._value = v

    @property
    def value(self) -> int:
        return self._value


class Histogram:
    """Observations counted into fixed buckets (upper bounds), plus sum and count.

    Quantiles are estimated from the buckets by linear interpolation within the bucket that
    holds the rank, as Prometheus' ``histogram_quantile`` does; observations above the last
    bound report that bound.
    """

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        if not buckets or list(buckets) != sorted(buckets):
            raise ValueError("histogram buckets must be a non-empty ascending sequence")
        self._lock = threading.Lock()
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(self.buckets) + 1)  # last: above the highest bound
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        with self._lock:
            self._counts[i] += 1
            self._sum += value
            self._count += 1

    @property
    def count(self) -> int:
        return self._count

    @property
    def sum(self) -> float:
        return self._sum

    def quantile(self, q: float) -> float | None:
        """Estimated ``q``-quantile (0 <= q <= 1), or None before any observation."""
        if not 0.0 <= q <= 1.0:
            raise ValueError("quantile must be within [0, 1]")
        with self._lock:
            counts = list(self._counts)
            total = self._count
        if total == 0:
            return None
        rank = q * total
        seen = 0
        for i, c in enumerate(counts):
            if c and seen + c >= rank:
                if i == len(self.buckets):
                    return self.buckets[-1]
                lower = self.buckets[i - 1] if i else 0.0
                upper = self.buckets[i]
                return lower + (upper - lower) * max(0.0, rank - seen) / c
            seen += c
        return self.buckets[-1]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            counts = list(self._counts)
        cumulative, running = [], 0
        for bound, c in zip((*self.buckets, float("inf")), counts, strict=True):
            running += c
            cumulative.append(["+Inf" if bound == float("inf") else bound, running])
        return {
            "count": self._count,
            "sum": self._sum,
            "p50": self.quantile(0.5),
            "p90": self.quantile(0.9),
            "p99": self.quantile(0.99),
            "buckets": cumulative,
        }


class MountMetrics:
    """Per-mount statistics of the data path."""

    def __init__(self) -> None:
        # fetcher
        self.sectors_fetched = Counter()  # sectors read from the store and verified
        self.bytes_fetched = Counter()  # stored (compressed) bytes read from the store
        self.store_requests = Counter()  # ranged reads issued (attempts, retries included)
        self.cache_hits = Counter()  # sectors served from the local cache
        self.cache_misses = Counter()  # sectors that had to come from the store
        self.zero_sectors = Counter()  # all-zero sectors served without any I/O
        self.retries = Counter()  # attempts after the first, over all requests
        self.checksum_errors = Counter()  # sectors from the store that failed verification
        self.store_errors = Counter()  # failed or timed-out store requests
        self.fetch_errors = Counter()  # get() calls that raised FetchError
        self.inflight = Gauge()  # store requests running now
        self.queued = Gauge()  # coalesced requests waiting for a worker
        self.fetch_latency = Histogram()  # seconds per store request (successful ones)
        # Stalls: seconds readers spent waiting on the network, by why the sector was not
        # there yet. Late: it was being read ahead or prefetched (asked for too late);
        # missing: nobody had asked for it before a reader did (no prefetch, or a wrong one).
        self.stall_late_seconds = Seconds()
        self.stall_missing_seconds = Seconds()
        # reader
        self.reads = Counter()  # read() calls
        self.read_bytes = Counter()  # bytes returned by read()
        self.memory_hits = Counter()  # sectors served from the reader's decoded LRU
        # stored bytes of the sectors read so far (each once): what the workload needed
        self.touched_stored_bytes = Counter()
        # prefetcher
        self.prefetched_sectors = Counter()  # sectors the prefetcher brought into the cache
        self.prefetch_errors = Counter()  # prefetch batches that failed

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, m in vars(self).items():
            if isinstance(m, Histogram):
                out[name] = m.snapshot()
            elif isinstance(m, Counter | Gauge | Seconds):
                out[name] = m.value
        return out


class CacheMetrics:
    """Statistics of the node-wide sector cache (shared by every mount)."""

    def __init__(self) -> None:
        self.hits = Counter()
        self.misses = Counter()
        self.puts = Counter()  # entries written
        self.put_failures = Counter()  # puts dropped (disk full, I/O error)
        # Sectors not cached for want of room that could be made (what is left is pinned by
        # reads in progress): served from memory, verified, to the read that fetched them.
        self.uncached = Counter()
        self.evictions = Counter()  # entries removed to stay under the size cap
        self.corrupt = Counter()  # entries that failed verification and were deleted
        # Small random reads answered from a read-around window already in memory.
        self.read_around_hits = Counter()

    def snapshot(self) -> dict[str, Any]:
        return {name: m.value for name, m in vars(self).items() if isinstance(m, Counter)}


# The daemon's remount failures, under the mount state directory, for the metrics exporter
# (``lazyblock_remount_failures_total{reason}``): a separate process, like the mount servers.
REMOUNT_FAILURES_FILE = "remount-failures.json"


class CountsFile:
    """Events counted by reason, across restarts, in ``path`` (a JSON object of counts;
    nothing else is written there), for the metrics exporter, a separate process; in memory
    only without one. The daemon's remount failures (``auth``: the registry refused the
    credentials the daemon had, or wanted some it had none of; ``other``) and the mounts that
    could not go through the node launcher are counted so."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._counts = read_counts(path) if path is not None else {}

    def add(self, reason: str) -> None:
        """Count one more event of ``reason`` (and write the counts, if kept in a file)."""
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1
            counts = dict(self._counts)
        if self.path is None:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(counts))
            os.replace(tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def read_counts(path: Path) -> dict[str, int]:
    """The counts a daemon recorded in ``path`` (empty if none, or unreadable)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict):
        return {}
    return {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, int)}
