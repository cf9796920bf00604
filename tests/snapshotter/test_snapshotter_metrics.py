"""Metrics: counters, the latency histogram's quantiles, JSON snapshots."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import pytest
from datapath_support import Image

from snapshotter.datapath.fetcher import SectorFetcher
from snapshotter.metrics import Counter, Histogram, MountMetrics


def test_counter_is_thread_safe() -> None:
    c = Counter()
    threads = [threading.Thread(target=lambda: [c.inc() for _ in range(10_000)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.value == 80_000


def test_histogram_quantiles() -> None:
    h = Histogram(buckets=(1.0, 2.0, 4.0, 8.0))
    assert h.quantile(0.5) is None
    for v in [0.5] * 50 + [1.5] * 40 + [3.0] * 9 + [100.0]:
        h.observe(v)
    assert h.count == 100
    assert h.quantile(0.5) == pytest.approx(1.0)  # 50th of 100 is the top of bucket one
    assert 1.0 < h.quantile(0.9) <= 2.0
    assert 2.0 < h.quantile(0.99) <= 4.0
    assert h.quantile(1.0) == 8.0  # beyond the last bound reports the last bound
    snap = h.snapshot()
    assert snap["buckets"][-1] == ["+Inf", 100]
    with pytest.raises(ValueError):
        h.quantile(1.5)
    with pytest.raises(ValueError):
        Histogram(buckets=(2.0, 1.0))


def test_mount_snapshot_is_json(image: Image, make_fetcher: Callable[..., SectorFetcher]) -> None:
    fetcher = make_fetcher()
    fetcher.get([1, 2, 5])
    fetcher.get([1])
    snap = json.loads(json.dumps(fetcher.metrics.snapshot()))
    assert snap["sectors_fetched"] == 2
    assert snap["cache_hits"] == 1 and snap["cache_misses"] == 2 and snap["zero_sectors"] == 1
    assert snap["inflight"] == 0 and snap["queued"] == 0
    assert snap["fetch_latency"]["count"] == 1 and snap["fetch_latency"]["p50"] is not None
    assert set(MountMetrics().snapshot()) == set(snap)
    assert json.dumps(fetcher.cache.metrics.snapshot())
