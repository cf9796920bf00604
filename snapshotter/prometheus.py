"""Prometheus metrics of every mount on the node, aggregated at scrape time.

Each mount has its own server process, so there is no single process that holds all the
counters. Instead one exporter (``snapshotter metrics``, the ``lazyblock-metrics`` systemd
unit) answers each scrape by asking every live mount server for its ``stats`` over its
control socket and rendering them with a ``mountpoint`` and ``image`` label. Mount servers
stay free of HTTP listeners and ports, and the exporter holds no state: restarting it loses
nothing (the counters live in the servers; they restart from zero with a new mount, which
Prometheus' ``rate`` handles as a counter reset).

Metrics (all prefixed ``lazyblock_``): ``mounts``, ``sectors_fetched_total``,
``fetched_bytes_total``, ``store_requests_total``, ``cache_hits_total``,
``cache_misses_total``, ``cache_uncached_total``, ``cache_read_around_hits_total``,
``cache_hit_ratio``,
``fetch_latency_seconds`` (histogram),
``errors_total{kind=fetch|store|checksum|read|prefetch}``, ``inflight_fetches``,
``queued_fetches``, ``read_bytes_total``, ``prefetched_sectors_total``,
``stall_seconds_total{why=late|missing}`` (seconds readers waited on the network, for
sectors read ahead or prefetched too late / for sectors nobody had asked for), ``cache_bytes``,
``cache_entries``, ``cache_capacity_bytes``, ``remount_failures_total{reason=auth|other}``
(the daemon's, from the file it keeps under the state directory),
``launcher_fallbacks_total{reason=unreachable|refused}`` (mount servers started in the
caller's context because the node launcher could not be used). Where a hosts directory
gives a registry mirrors, per host (labels ``source``, its API root, and ``role``, mirror or
server):
``source_requests_total{outcome=ok|error|timeout|not_found|rejected}``,
``source_bytes_total``, ``source_skipped_total`` (reads that passed over it while it backed
off), ``source_backoff_seconds``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from snapshotter.cache.sectors import cache_usage, local_copies
from snapshotter.config import MountConfig
from snapshotter.errors import SnapshotterError
from snapshotter.metrics import REMOUNT_FAILURES_FILE, read_counts

# launcher.FALLBACKS_FILE (not imported: the exporter needs nothing of the mount code)
LAUNCHER_FALLBACKS_FILE = "launcher-fallbacks.json"

log = logging.getLogger(__name__)

LABELS = ["mountpoint", "image"]


class MountsCollector(Collector):
    """Collects from every live mount recorded under ``config.state_dir``."""

    def __init__(self, config: MountConfig) -> None:
        self.config = config

    def collect(self) -> Iterator[Metric]:
        from snapshotter.mount import api

        all_stats: list[dict[str, Any]] = []
        for info in api.list_mounts(self.config):
            if not (info.alive and info.phase == "ready"):
                continue
            try:
                all_stats.append(api.stats(info.mountpoint, self.config, timeout=5.0))
            except SnapshotterError as e:
                log.warning("no stats from %s: %s", info.mountpoint, e)
        yield from render(all_stats, self.config)


def render(all_stats: list[dict[str, Any]], config: MountConfig) -> Iterator[Metric]:
    p = "lazyblock_"
    mounts = GaugeMetricFamily(p + "mounts", "Live lazyblock mounts on this node.")
    mounts.add_metric([], len(all_stats))
    yield mounts

    def counter(name: str, doc: str, key: str) -> CounterMetricFamily:
        fam = CounterMetricFamily(p + name, doc, labels=LABELS)
        for s in all_stats:
            fam.add_metric([s["mountpoint"], s["ref"]], s["fetch"][key])
        return fam

    yield counter("sectors_fetched", "Sectors fetched from the store and verified.",
                  "sectors_fetched")  # fmt: skip
    yield counter("fetched_bytes", "Stored bytes read from the store.", "bytes_fetched")
    yield counter("store_requests", "Ranged reads sent to the store.", "store_requests")
    yield counter("cache_hits", "Sectors served from the local cache.", "cache_hits")
    yield counter("cache_misses", "Sectors that had to come from the store.", "cache_misses")
    yield counter("read_bytes", "Bytes served to the kernel through FUSE.", "read_bytes")
    yield counter("prefetched_sectors", "Sectors brought in by the prefetcher.",
                  "prefetched_sectors")  # fmt: skip

    def cache_counter(name: str, doc: str, key: str) -> CounterMetricFamily:
        # 0 where a server's cache statistics lack the key (an older version's)
        fam = CounterMetricFamily(p + name, doc, labels=LABELS)
        for s in all_stats:
            fam.add_metric([s["mountpoint"], s["ref"]], s.get("cache", {}).get(key, 0))
        return fam

    yield cache_counter(
        "cache_uncached",
        "Sectors served from memory without being cached: no room could be made (what the "
        "cache holds is pinned by reads in progress).",
        "uncached",
    )
    yield cache_counter(
        "cache_read_around_hits",
        "Small random reads of the node cache answered from the 128 KiB window a read "
        "before them took into memory (no disk read).",
        "read_around_hits",
    )

    ratio = GaugeMetricFamily(
        p + "cache_hit_ratio", "Cache hits / (hits + misses) since mount.", labels=LABELS
    )
    inflight = GaugeMetricFamily(p + "inflight_fetches", "Store requests running now.",
                                 labels=LABELS)  # fmt: skip
    queued = GaugeMetricFamily(p + "queued_fetches", "Fetches waiting for a worker.",
                               labels=LABELS)  # fmt: skip
    errors = CounterMetricFamily(p + "errors", "Errors by kind.", labels=[*LABELS, "kind"])
    stalls = CounterMetricFamily(
        p + "stall_seconds",
        "Seconds readers waited on the network: for sectors asked for too late (late) or "
        "not asked for before they were needed (missing).",
        labels=[*LABELS, "why"],
    )
    latency = HistogramMetricFamily(
        p + "fetch_latency_seconds", "Seconds per successful store request.", labels=LABELS
    )
    for s in all_stats:
        labels = [s["mountpoint"], s["ref"]]
        f = s["fetch"]
        total = f["cache_hits"] + f["cache_misses"]
        ratio.add_metric(labels, f["cache_hits"] / total if total else 0.0)
        inflight.add_metric(labels, f["inflight"])
        queued.add_metric(labels, f["queued"])
        for kind, value in (
            ("fetch", f["fetch_errors"]),
            ("store", f["store_errors"]),
            ("checksum", f["checksum_errors"]),
            ("prefetch", f["prefetch_errors"]),
            ("read", s["reads"]["errors"]),
        ):
            errors.add_metric([*labels, kind], value)
        stalls.add_metric([*labels, "late"], f["stall_late_seconds"])
        stalls.add_metric([*labels, "missing"], f["stall_missing_seconds"])
        h = f["fetch_latency"]
        buckets = [(_bound(b), c) for b, c in h["buckets"]]
        latency.add_metric(labels, buckets, sum_value=h["sum"])
    yield from (ratio, inflight, queued, errors, stalls, latency)
    yield from _sources(all_stats)

    entries, used = cache_usage(config.cache_dir)
    _, copies = local_copies(config.cache_dir)
    for name, doc, value in (
        ("cache_bytes", "Bytes held by the node's sector cache.", used),
        ("cache_entries", "Sectors held by the node's sector cache.", entries),
        (
            "cache_local_copy_bytes",
            "Bytes of whole images copied out of the sector cache "
            "for loop devices to read (mount.local_copy), within its cap.",
            copies,
        ),
        ("cache_capacity_bytes", "The sector cache's size cap.", config.cache_size),
    ):
        g = GaugeMetricFamily(p + name, doc)
        g.add_metric([], value)
        yield g
    yield _by_reason(
        p + "remount_failures",
        "Remounts of remote snapshots the daemon could not do, by reason: auth (the "
        "registry wanted credentials the daemon lacks, or refused them), other. Retried.",
        config.state_dir / REMOUNT_FAILURES_FILE,
        ("auth", "other"),
    )
    yield _by_reason(
        p + "launcher_fallbacks",
        "Mount servers started in the caller's context because the node launcher "
        "([mount] launcher) was unreachable or refused (other code, other directories): "
        "they die with the daemon's pod.",
        config.state_dir / LAUNCHER_FALLBACKS_FILE,
        ("unreachable", "refused"),
    )


def _by_reason(name: str, doc: str, path: Path, reasons: tuple[str, ...]) -> Metric:
    """A counter by reason from a counts file (``CountsFile``), every known reason
    present (0 until counted)."""
    family = CounterMetricFamily(name, doc, labels=["reason"])
    counts = read_counts(path)
    for reason in sorted({*reasons, *counts}):
        family.add_metric([reason], counts.get(reason, 0))
    return family


def _sources(all_stats: list[dict[str, Any]]) -> Iterator[Metric]:
    """Per host a mount reads blobs from, where a hosts directory gives mirrors."""
    p = "lazyblock_source_"
    labels = [*LABELS, "source", "role"]
    requests = CounterMetricFamily(
        p + "requests", "Ranged reads by host and outcome: ok, error, timeout, not_found "
        "(the mirror lacks the blob), rejected (bytes that failed verification).",
        labels=[*labels, "outcome"],
    )  # fmt: skip
    fetched = CounterMetricFamily(p + "bytes", "Stored bytes read from the host.", labels=labels)
    skipped = CounterMetricFamily(
        p + "skipped", "Reads that passed over the host while it backed off.", labels=labels
    )
    backoff = GaugeMetricFamily(
        p + "backoff_seconds", "Seconds the host is still skipped after failing.", labels=labels
    )
    for s in all_stats:
        for src in s.get("sources", []):
            at = [s["mountpoint"], s["ref"], src["url"], src["role"]]
            failed = sum(src[k] for k in ("errors", "timeouts", "not_found", "rejected"))
            for outcome, value in (
                ("ok", max(0, src["requests"] - failed)),
                ("error", src["errors"]),
                ("timeout", src["timeouts"]),
                ("not_found", src["not_found"]),
                ("rejected", src["rejected"]),
            ):
                requests.add_metric([*at, outcome], value)
            fetched.add_metric(at, src["bytes"])
            skipped.add_metric(at, src["skipped"])
            backoff.add_metric(at, src["backoff_seconds"])
    yield from (requests, fetched, skipped, backoff)


def _bound(b: object) -> str:
    return "+Inf" if b == "+Inf" else repr(float(b))  # type: ignore[arg-type]


def registry(config: MountConfig) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(MountsCollector(config))
    return reg


def exposition(config: MountConfig) -> bytes:
    """The text a scrape would get now."""
    from prometheus_client import generate_latest

    return generate_latest(registry(config))


def serve_forever(listen: str, config: MountConfig) -> None:
    """Serve ``/metrics`` on ``listen`` (host:port) until interrupted."""
    import threading

    from prometheus_client import start_http_server

    host, _, port = listen.rpartition(":")
    server, thread = start_http_server(int(port), addr=host or "0.0.0.0", registry=registry(config))
    log.info("serving Prometheus metrics on http://%s/metrics", listen)
    try:
        threading.Event().wait()
    finally:
        server.shutdown()
