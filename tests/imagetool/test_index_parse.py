"""Parsing an index: a file map of any size round-trips, and parsing leaves the garbage
collector as it found it (it is paused while the index's objects are built)."""

from __future__ import annotations

import gc
import json

import pytest

from imagetool.errors import FormatError
from imagetool.format import MIN_SECTOR_SIZE, FileExtent, Index, Sector, sector_checksum


def _index(files: int) -> Index:
    size = MIN_SECTOR_SIZE
    zero = sector_checksum(bytes(size))
    return Index(
        image_size=size, sector_size=size, sectors=(Sector(0, 0, zero),), metadata_sectors=1,
        blob_digest="sha256:" + "0" * 64, blob_size=0,
        files=tuple(FileExtent(f"/d{i % 100}/f{i}", i * 4096, 10) for i in range(files)),
    )  # fmt: skip


def test_a_large_file_map_round_trips() -> None:
    index = _index(50_000)
    again = Index.from_bytes(index.to_bytes())
    assert again == index and again.to_bytes() == index.to_bytes()
    assert [f.path for f in again.files_in_range(4096 * 123, 1)] == ["/d23/f123"]


@pytest.mark.parametrize("enabled", [True, False])
def test_parsing_leaves_the_collector_as_it_was(enabled: bool) -> None:
    good = _index(10).to_bytes()
    doc = json.loads(good)
    doc["files"][3][1] = -1
    bad = json.dumps(doc).encode()
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        Index.from_bytes(good)
        assert gc.isenabled() is enabled
        with pytest.raises(FormatError, match="non-negative"):
            Index.from_bytes(bad)
        assert gc.isenabled() is enabled
        with pytest.raises(FormatError, match="not valid JSON"):
            Index.from_bytes(b"{")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
