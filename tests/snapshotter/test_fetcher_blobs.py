"""SectorFetcher on a version 2 image: its sectors in several data blobs (one ranged read
never spans two; adjacent sectors of one blob are still one read), raw sectors received
into their memory and only hashed, and a blob the store lacks or holds short: an error,
nothing cached, nothing served."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from datapath_support import FaultyStore, Image, build_image, standard_contents

import imagetool.format
from imagetool.format import ROLE_LAYER, ROLE_METADATA
from snapshotter.cache.sectors import SectorCache
from snapshotter.datapath.fetcher import SectorFetcher
from snapshotter.errors import FetchError

# Sectors 0-1 metadata, then layer blobs from 2, 10 and 24 (5, 6, 20-22 are all zeros; 11
# and 12 repeat 3). Raw: random sectors, the last (short) one too.
STARTS = (2, 10, 24)
RAW = frozenset({4, 9, 13, 25, 40})


@pytest.fixture
def image() -> Image:
    contents = standard_contents(random.Random(99))
    return build_image(contents, metadata_sectors=2, blob_starts=STARTS, raw=RAW)


@pytest.fixture
def fetcher(make_fetcher: Callable[..., SectorFetcher]) -> SectorFetcher:
    return make_fetcher()


def _blob_number(image: Image, digest: str) -> int:
    return [b.digest for b in image.index.blobs].index(digest)


def test_the_image_has_the_blobs_and_raw_sectors_it_was_built_with(image: Image) -> None:
    index = image.index
    assert index.version == 2
    assert [b.role for b in index.blobs] == [ROLE_METADATA] + [ROLE_LAYER] * 3
    assert {n for n, s in enumerate(index.sectors) if s.raw} == RAW
    assert all(index.sectors[n].length == index.sector_span(n)[1] for n in RAW)
    assert index.sectors[13].blob == 2 and index.sectors[25].blob == 3


def test_one_read_never_spans_two_blobs(image: Image, store: FaultyStore, fetcher) -> None:
    got = fetcher.get(range(image.index.sector_count))
    assert all(got[n] == image.sector(n) for n in got)
    # One read per blob (each blob's sectors are contiguous), but blob 2's sectors 11 and 12
    # repeat sector 3, fetched once as 3: that blob is read in two pieces around them.
    assert len(store.requests) == 5
    assert store.digests.count(image.index.blobs[2].digest) == 2
    for digest, (offset, length) in zip(store.digests, store.requests, strict=True):
        number = _blob_number(image, digest)
        inside = image.sectors_in(offset, length, number)
        assert inside and offset == image.index.sectors[inside[0]].offset
        assert {image.index.sectors[n].blob for n in inside} == {number}
        assert length == sum(image.index.sectors[n].length for n in inside)


def test_adjacent_sectors_of_one_blob_are_one_read_and_of_two_blobs_two(
    image: Image, store: FaultyStore, fetcher
) -> None:
    fetcher.get([4, 7])  # blob 1, only all-zero sectors between them
    assert len(store.requests) == 1
    store.requests.clear()
    store.digests.clear()
    fetcher.get([8, 9, 10])  # 8, 9 end blob 1; 10 starts blob 2
    index = image.index
    assert sorted(zip(store.digests, store.requests, strict=True)) == sorted(
        [
            (
                index.blobs[1].digest,
                (index.sectors[8].offset, index.blobs[1].size - index.sectors[8].offset),
            ),
            (index.blobs[2].digest, (0, index.sectors[10].length)),
        ]
    )


def test_raw_sectors_are_hashed_not_decompressed(
    image: Image, fetcher, cache: SectorCache, monkeypatch
) -> None:
    def no_decompression(*args: object) -> None:
        raise AssertionError("a raw sector was decompressed")

    monkeypatch.setattr(imagetool.format, "decode_stored_into", no_decompression)
    raw = sorted(RAW)
    got = fetcher.get(raw)
    assert {n: bytes(got[n]) for n in raw} == {n: image.sector(n) for n in raw}
    assert fetcher.metrics.bytes_fetched.value == sum(image.index.sectors[n].length for n in raw)
    assert fetcher.metrics.bytes_fetched.value == sum(len(image.sector(n)) for n in raw)
    assert all(cache.get(image.index.sectors[n].checksum) == image.sector(n) for n in raw)


def test_a_corrupt_raw_sector_is_refetched_and_never_cached_or_served(
    image: Image, store: FaultyStore, fetcher, cache: SectorCache
) -> None:
    index = image.index
    once = (index.blobs[2].digest, index.sectors[13].offset + 100)
    store.corrupt[once] = 1
    assert bytes(fetcher.get([13])[13]) == image.sector(13)
    assert fetcher.metrics.checksum_errors.value == 1
    always = (index.blobs[3].digest, index.sectors[25].offset + 7)
    store.corrupt[always] = 1000
    with pytest.raises(FetchError, match="checksum"):
        fetcher.get([25])
    assert index.sectors[25].checksum not in cache


def test_a_blob_missing_from_the_store_fails_its_sectors_only(
    image: Image, store: FaultyStore, fetcher, cache: SectorCache, tmp_path: Path
) -> None:
    missing = image.index.blobs[2].digest
    os.unlink(tmp_path / "store" / "blobs" / "sha256" / missing.removeprefix("sha256:"))
    with pytest.raises(FetchError, match="not found"):
        fetcher.get([13])
    assert image.index.sectors[13].checksum not in cache
    assert store.digests == [missing]  # not retried: a missing blob stays missing
    assert bytes(fetcher.get([26])[26]) == image.sector(26)  # blob 3 is there


def test_a_blob_shorter_than_the_index_says_fails_the_sectors_past_its_end(
    image: Image, fetcher, cache: SectorCache, tmp_path: Path
) -> None:
    blob = image.index.blobs[3]
    path = tmp_path / "store" / "blobs" / "sha256" / blob.digest.removeprefix("sha256:")
    os.chmod(path, 0o644)
    last = max(n for n, s in enumerate(image.index.sectors) if s.blob == 3 and not s.is_zero)
    os.truncate(path, blob.size - 10)  # the last sector's range now crosses the blob's end
    with pytest.raises(FetchError, match="past the end"):
        fetcher.get([last])
    assert image.index.sectors[last].checksum not in cache
