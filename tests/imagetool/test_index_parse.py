"""Parsing an index: a file map of any size round-trips, and parsing leaves the garbage
collector as it found it (it is paused while the index's objects are built)."""

from __future__ import annotations

import gc
import json

import pytest
import zstandard

from imagetool.errors import FormatError
from imagetool.format import (
    INDEX_JSON_MEDIA_TYPE,
    INDEX_MEDIA_TYPE,
    MIN_SECTOR_SIZE,
    Blob,
    FileExtent,
    Index,
    Sector,
    index_media_type,
    sector_checksum,
    sha256_digest,
)


def _index(files: int) -> Index:
    size = MIN_SECTOR_SIZE
    zero = sector_checksum(bytes(size))
    return Index(
        image_size=size, sector_size=size, sectors=(Sector(0, 0, zero),), metadata_sectors=1,
        blobs=(Blob("sha256:" + "0" * 64, 0),), version=1,
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
        assert len(Index.from_bytes(good).files) == 10
        assert gc.isenabled() is enabled
        index = Index.from_bytes(bad)  # the file map is checked when first used
        assert gc.isenabled() is enabled
        with pytest.raises(FormatError, match="non-negative"):
            list(index.files_in_range(0, 1))
        assert gc.isenabled() is enabled
        with pytest.raises(FormatError, match="not valid JSON"):
            Index.from_bytes(b"{")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_the_file_map_is_built_on_first_use_and_checked() -> None:
    index = _index(1_000)
    parsed = Index.from_bytes(index.to_bytes())
    assert len(parsed.files) == 1_000  # from the rows, nothing built yet
    assert parsed.files[7] == FileExtent("/d7/f7", 7 * 4096, 10)
    assert parsed.files == index.files and index.files == parsed.files
    assert parsed.to_bytes() == index.to_bytes()
    for bad_row, message in (
        (["/x", 0], "file map"),  # two fields
        ([7, 0, 10], "path string"),
        (["/x", 0, True], "non-negative"),
    ):
        doc = json.loads(index.to_bytes())
        doc["files"][0] = bad_row
        broken = Index.from_bytes(json.dumps(doc).encode())
        with pytest.raises(FormatError, match=message):
            list(broken.files)
    doc = json.loads(index.to_bytes())
    doc["files"] = {"not": "rows"}
    with pytest.raises(FormatError, match="not a list"):
        Index.from_bytes(json.dumps(doc).encode())


def test_the_large_files_are_found_without_building_the_rest() -> None:
    index = _index(1_000)
    doc = json.loads(index.to_bytes())
    doc["files"][5][2] = 1 << 20
    doc["files"][9][2] = 2 << 20
    parsed = Index.from_bytes(json.dumps(doc).encode())
    big = parsed.files.at_least(1 << 20)
    assert [f.path for f in big] == ["/d5/f5", "/d9/f9"]
    assert parsed.files._extents is None  # the other 998 were never built
    assert list(parsed.files)[9].length == 2 << 20
    assert parsed.files.at_least(2 << 20) == (FileExtent("/d9/f9", 9 * 4096, 2 << 20),)
    doc["files"][3] = ["/x", "0", "big"]
    with pytest.raises(FormatError, match="non-negative"):
        Index.from_bytes(json.dumps(doc).encode()).files.at_least(1)


def test_the_stored_index_is_one_zstd_frame_and_plain_json_still_parses() -> None:
    index = _index(20_000)
    blob = index.to_blob()
    assert blob[:4] == b"\x28\xb5\x2f\xfd" and len(blob) < len(index.to_bytes()) / 4
    assert index_media_type(blob) == INDEX_MEDIA_TYPE
    assert index_media_type(index.to_bytes()) == INDEX_JSON_MEDIA_TYPE
    assert Index.from_bytes(blob) == index == Index.from_bytes(index.to_bytes())
    assert index.digest == sha256_digest(blob)
    with pytest.raises(FormatError, match="zstd"):
        Index.from_bytes(blob[:-7])  # truncated frame
    with pytest.raises(FormatError, match="not valid JSON"):
        Index.from_bytes(zstandard.ZstdCompressor().compress(b"{not json"))
