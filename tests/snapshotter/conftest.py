"""Fixtures for the snapshotter's data path (the helpers live in ``datapath_support``)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from datapath_support import (
    FAST,
    FILES,
    FaultyStore,
    Image,
    build_image,
    dir_store,
    standard_contents,
)

from snapshotter.cache.sectors import SectorCache
from snapshotter.config import FetchConfig
from snapshotter.datapath.fetcher import SectorFetcher
from snapshotter.metrics import MountMetrics


@pytest.fixture
def image() -> Image:
    return build_image(
        standard_contents(random.Random(1234)), metadata_sectors=2, prefetch=(8, 9, 10), files=FILES
    )


@pytest.fixture
def store(image: Image, tmp_path: Path) -> FaultyStore:
    return FaultyStore(dir_store(tmp_path / "store", image))


@pytest.fixture
def cache(tmp_path: Path) -> SectorCache:
    return SectorCache(tmp_path / "cache", 64 << 20)


@pytest.fixture
def make_fetcher(
    image: Image, store: FaultyStore, cache: SectorCache
) -> Iterator[Callable[..., SectorFetcher]]:
    made: list[SectorFetcher] = []

    def make(config: FetchConfig = FAST, **overrides: object) -> SectorFetcher:
        kwargs = {"store": store, "index": image.index, "cache": cache, "config": config}
        kwargs.update(overrides)
        f = SectorFetcher(metrics=MountMetrics(), **kwargs)  # type: ignore[arg-type]
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()
    store.release()  # let hung store threads finish
