"""The fetcher over a registry with a mirror in front (hosts.toml): the bytes a mirror
corrupts fail verification, the mirror is told (``RangeBody.reject``) and backs off, and the
sectors come verified from the registry instead."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from datapath_support import FAST, Image
from support import MirrorServer

from imagetool.format import BLOB_MEDIA_TYPE
from imagetool.registry import mirrors
from imagetool.registry.hosts import load_hosts_dir
from imagetool.stores import StoreOptions
from imagetool.stores.registry import RegistryStore
from snapshotter.cache.sectors import SectorCache
from snapshotter.datapath.fetcher import SectorFetcher
from snapshotter.metrics import MountMetrics


@pytest.fixture
def mirror(registry) -> Iterator[MirrorServer]:
    m = MirrorServer(registry.host)
    yield m
    m.stop()


def test_corrupt_mirror_is_refused_and_skipped(
    registry, mirror: MirrorServer, image: Image, tmp_path: Path
) -> None:
    mirrors._health.clear()
    repo = f"lb/fm{uuid.uuid4().hex[:8]}"
    plain = StoreOptions(plain_http=True, docker_config=tmp_path / "none.json")
    with RegistryStore(registry.host, repo, plain) as store:
        for digest, blob in image.blobs.items():
            store.put_blob(digest, blob, BLOB_MEDIA_TYPE)
    (tmp_path / "certs.d" / registry.host).mkdir(parents=True)
    (tmp_path / "certs.d" / registry.host / "hosts.toml").write_text(
        f'server = "http://{registry.host}"\n[host."http://{mirror.host}"]\n'
    )
    options = StoreOptions(
        docker_config=tmp_path / "none.json", mirror_backoff=60,
        registry_hosts=load_hosts_dir(tmp_path / "certs.d"),
    )  # fmt: skip
    mirror.mode = "corrupt"  # one byte flipped in the middle of every answer
    metrics = MountMetrics()
    with (
        RegistryStore(registry.host, repo, options) as store,
        SectorFetcher(
            store, image.index, SectorCache(tmp_path / "c", 64 << 20), FAST, metrics
        ) as f,
    ):
        wanted = [n for n in range(7, 11) if not image.index.sectors[n].is_zero]
        got = f.get(wanted)
        assert all(bytes(got[n]) == image.sector(n) for n in wanted)
        asked = mirror.blob_reads()
        later = [n for n in range(12, 30) if not image.index.sectors[n].is_zero]
        got = f.get(later)
        assert all(bytes(got[n]) == image.sector(n) for n in later)
        mirror_stats, server_stats = store.source_stats()
    # Each answer of the mirror (requests in parallel before the first was found out) had
    # a corrupt sector: refused, reported, and asked for again at the registry.
    assert metrics.checksum_errors.value == mirror_stats["rejected"] >= 1
    assert mirror_stats["backoff_seconds"] > 50
    assert server_stats["requests"] >= mirror_stats["rejected"] and server_stats["bytes"] > 0
    # Backing off: not asked for the later sectors.
    assert mirror.blob_reads() == asked == mirror_stats["requests"] <= FAST.max_parallel
    assert mirror_stats["skipped"] >= 1
