"""Against a real registry on loopback: a demand read issued while a long prefetch queue is
pending is answered before that queue drains. Seen in the order of the registry's own
access log, not by a timing threshold: the prefetch reads one blob, the demand another."""

from __future__ import annotations

import dataclasses
import random
import re
import uuid
from pathlib import Path

from datapath_support import FAST, build_image, standard_contents

from imagetool.format import BLOB_MEDIA_TYPE
from imagetool.stores import StoreOptions
from imagetool.stores.registry import RegistryStore
from snapshotter.cache.sectors import SectorCache
from snapshotter.datapath.fetcher import SectorFetcher
from snapshotter.metrics import MountMetrics

# Sectors 0-1 metadata; a "layer" blob from 2 (what the prefetch reads), another from 30.
QUEUED_BLOB, DEMAND_BLOB = 1, 2


def blob_reads(log: Path, since: int, digests: dict[str, int]) -> list[int]:
    """The blobs (by number) of the registry's blob GETs logged after byte ``since``, in
    the order the registry answered them."""
    text = log.read_bytes()[since:].decode(errors="replace")
    found = re.findall(r'"GET /v2/[^ ]+/blobs/(sha256:[0-9a-f]{64})', text)
    return [digests[d] for d in found if d in digests]


def test_a_demand_read_overtakes_the_pending_prefetch_queue(registry, tmp_path: Path) -> None:
    image = build_image(standard_contents(random.Random(5)), metadata_sectors=2,
                        blob_starts=(2, 30))  # fmt: skip
    repo = f"lb/dp{uuid.uuid4().hex[:8]}"
    options = StoreOptions(plain_http=True, docker_config=tmp_path / "none.json")
    digests = {b.digest: i for i, b in enumerate(image.index.blobs)}
    # One worker for the prefetch, one left for demand: the queue stays long.
    config = dataclasses.replace(FAST, max_parallel=2, max_parallel_prefetch=1)
    with RegistryStore(registry.host, repo, options) as store:
        for digest, blob in image.blobs.items():
            store.put_blob(digest, blob, BLOB_MEDIA_TYPE)
        queued = [n for n in range(2, 30, 2) if not image.index.sectors[n].is_zero]
        demand = next(n for n in range(30, 40) if not image.index.sectors[n].is_zero)
        since = registry.log.stat().st_size
        cache = SectorCache(tmp_path / "cache", 64 << 20)
        with SectorFetcher(store, image.index, cache, config, MountMetrics()) as fetcher:
            batch = fetcher.prefetch(queued)  # every other sector: one job each
            assert batch.sectors == queued
            got = fetcher.get([demand])
            assert bytes(got[demand]) == image.sector(demand)
            assert batch.wait(30) and batch.error is None
    order = blob_reads(registry.log, since, digests)
    assert sorted(order) == [QUEUED_BLOB] * len(queued) + [DEMAND_BLOB], order
    # The demand's read came while most of the queue was still waiting.
    assert order.index(DEMAND_BLOB) < len(queued) // 2, order
