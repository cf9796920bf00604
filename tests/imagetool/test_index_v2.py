"""The version 2 index: several data blobs, raw sectors; what a reader accepts and refuses,
and version 1 indexes still read (and written) as they were."""

from __future__ import annotations

import json
import random

import pytest
import xxhash
import zstandard

from imagetool.errors import ChecksumError, FormatError
from imagetool.format import (
    MIN_SECTOR_SIZE,
    ROLE_HOT,
    ROLE_LAYER,
    ROLE_METADATA,
    Blob,
    Index,
    Sector,
    blob_range,
    blob_runs,
    block_digests,
    checksum_and_blocks,
    sector_checksum,
    sha256_digest,
)

SIZE = MIN_SECTOR_SIZE
LAYER = sha256_digest(b"a source layer")


def _v2() -> tuple[Index, list[bytes], dict[str, bytes]]:
    """Six sectors: metadata (blob 0), a zero sector, a raw and a zstd sector of a layer
    (blob 1), a hot sector (blob 2), and the layer's short last sector (blob 1)."""
    rng = random.Random(5)
    data = [
        b"meta" * (SIZE // 4),
        bytes(SIZE),
        rng.randbytes(SIZE),
        b"text " * (SIZE // 5) + b"t",
        b"hot!" * (SIZE // 4),
        rng.randbytes(1000),
    ]
    placement = [(0, False), None, (1, False), (1, True), (2, False), (1, False)]
    stored: list[bytearray] = [bytearray(), bytearray(), bytearray()]
    sectors = []
    for chunk, where in zip(data, placement, strict=True):
        if where is None:
            sectors.append(Sector(0, 0, sector_checksum(chunk)))
            continue
        blob, raw = where
        body = chunk if raw else zstandard.ZstdCompressor(level=3).compress(chunk)
        sectors.append(Sector(len(stored[blob]), len(body), sector_checksum(chunk), blob, raw))
        stored[blob] += body
    roles = [(ROLE_METADATA, ""), (ROLE_LAYER, LAYER), (ROLE_HOT, LAYER)]
    blobs = tuple(
        Blob(sha256_digest(bytes(b)), len(b), role, layer)
        for b, (role, layer) in zip(stored, roles, strict=True)
    )
    index = Index(
        image_size=5 * SIZE + 1000, sector_size=SIZE, sectors=tuple(sectors),
        metadata_sectors=1, blobs=blobs, prefetch=(4, 2),
    )  # fmt: skip
    return index, data, {b.digest: bytes(s) for b, s in zip(blobs, stored, strict=True)}


def _stored(index: Index, blobs: dict[str, bytes], n: int) -> bytes:
    s = index.sectors[n]
    return blobs[index.blobs[s.blob].digest][s.offset : s.offset + s.length]


def test_a_v2_index_round_trips_and_decodes_every_sector() -> None:
    index, data, blobs = _v2()
    doc = json.loads(index.to_bytes())
    assert doc["version"] == 2 and "blob" not in doc
    assert doc["blobs"][1] == {"digest": index.blobs[1].digest, "size": index.blobs[1].size,
                               "role": "layer", "layer": LAYER}  # fmt: skip
    assert [row[4] for row in doc["sectors"]] == ["zstd", "zero", "zstd", "raw", "zstd", "zstd"]
    again = Index.from_bytes(index.to_blob())
    assert again == index and again.to_bytes() == index.to_bytes()
    for n in range(6):
        assert again.decode_sector(n, _stored(index, blobs, n)) == data[n]
        if n != 1:
            out = memoryview(bytearray(len(data[n])))
            again.decode_sector_into(n, _stored(index, blobs, n), out)
            assert out == data[n]
    assert again.blob_of(3) == index.blobs[1] and again.sectors[3].raw


def test_a_raw_sector_is_checked_by_size_and_checksum(codec: str) -> None:
    index, data, blobs = _v2()
    good = _stored(index, blobs, 3)
    assert good == data[3]
    index.verify_raw(3, memoryview(good))
    assert index.verify_raw(3, good, 4096) == checksum_and_blocks(data[3], 4096)[1]
    for bad in (good[:-1], good[:-1] + b"?", good + b"x"):
        with pytest.raises(ChecksumError):
            index.verify_raw(3, bad)
        with pytest.raises(ChecksumError):
            index.decode_sector(3, bad)
    with pytest.raises(ValueError, match="not stored raw"):
        index.verify_raw(2, _stored(index, blobs, 2))


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 300_000, (1 << 20) + 5])
@pytest.mark.parametrize("block", [4096, 16384, 1 << 20])
def test_the_checksum_and_block_digests_hashed_together_are_those_hashed_apart(
    size: int, block: int, codec: str
) -> None:
    data = random.Random(size).randbytes(size)
    checksum, blocks = checksum_and_blocks(memoryview(data), block)
    apart = [xxhash.xxh3_64_digest(data[i : i + block]) for i in range(0, size, block)]
    assert checksum == sector_checksum(data) and blocks == b"".join(apart)
    assert block_digests(data, block) == blocks
    for bad in (checksum_and_blocks, block_digests):
        with pytest.raises(ValueError):
            bad(data, 0)


def test_decoding_into_memory_returns_the_block_digests_of_what_it_checked(codec: str) -> None:
    index, data, blobs = _v2()
    for n in (0, 2, 3, 4, 5):  # zstd and raw
        out = memoryview(bytearray(len(data[n])))
        blocks = index.decode_sector_into(n, _stored(index, blobs, n), out, 4096)
        assert out == data[n] and blocks == checksum_and_blocks(data[n], 4096)[1]
        assert index.decode_sector_into(n, _stored(index, blobs, n), out) == b""
    bad = bytearray(_stored(index, blobs, 2))
    bad[-1] ^= 1
    with pytest.raises(ChecksumError):
        index.decode_sector_into(2, bytes(bad), memoryview(bytearray(len(data[2]))), 4096)


def test_runs_are_contiguous_in_one_blob() -> None:
    index, _, _ = _v2()
    # 0 (blob 0) | 2, 3 (blob 1; 1 is all zeros) | 4 (blob 2) | 5 (blob 1, after 3: only
    # another blob's sector between them, so 2-5 of blob 1 would be one range)
    assert blob_runs(index, range(6)) == [[0], [2, 3, 5], [4]]
    assert blob_runs(index, [5, 2]) == [[2], [5]]  # 3 missing: not contiguous
    blob, offset, length = blob_range(index, [2, 3, 5])
    assert blob == index.blobs[1] and (offset, length) == (0, index.blobs[1].size)
    with pytest.raises(ValueError):
        blob_range(index, [1])


def _broken(change) -> bytes:  # noqa: ANN001
    index, _, _ = _v2()
    doc = json.loads(index.to_bytes())
    change(doc)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["sectors"][2].__setitem__(0, 7), "blob 7, which does not exist"),
        (lambda d: d["blobs"][1].__setitem__("size", d["blobs"][1]["size"] - 1), "which has"),
        (lambda d: d["blobs"][1].__setitem__("size", d["blobs"][1]["size"] + 1), "which has"),
        (lambda d: d["sectors"][3].__setitem__(1, 5), "packed"),
        (lambda d: d["sectors"][2].__setitem__(4, "raw"), "raw, but"),
        (lambda d: d["sectors"][2].__setitem__(4, "lz4"), "encoding"),
        (lambda d: d["sectors"][1].__setitem__(4, "zstd"), "encoding"),
        (lambda d: d["blobs"][0].__setitem__("digest", "sha256:nothex"), "invalid digest"),
        (lambda d: d["blobs"][2].__setitem__("role", "extra"), "unknown role"),
        (lambda d: d.__setitem__("version", 3), "version 3"),
        (lambda d: d.pop("blobs"), "malformed"),
    ],
    ids=[
        "no-such-blob",
        "blob-shorter",
        "blob-longer",
        "not-packed",
        "raw-length",
        "encoding",
        "zero-encoding",
        "digest",
        "role",
        "version",
        "no-blobs",
    ],  # fmt: skip
)
def test_a_bad_v2_index_is_refused_with_what_is_wrong(change, message: str) -> None:  # noqa: ANN001
    with pytest.raises(FormatError, match=message):
        Index.from_bytes(_broken(change))


def test_version_1_reads_and_writes_as_before() -> None:
    v1 = {
        "version": 1, "filesystem": {"type": "erofs", "block_size": 4096},
        "image_size": SIZE, "sector_size": SIZE, "compression": "zstd", "checksum": "xxh3-128",
        "sectors": [[0, 5, "0" * 32]], "metadata_sectors": 1, "prefetch": [],
        "blob": {"digest": "sha256:" + "a" * 64, "size": 5},
        "source": {"manifest_digest": "", "platform": "", "config": {}}, "files": [],
    }  # fmt: skip
    text = json.dumps(v1, sort_keys=True, separators=(",", ":")).encode()
    index = Index.from_bytes(text)
    assert index.version == 1 and index.blobs == (Blob("sha256:" + "a" * 64, 5),)
    assert index.to_bytes() == text  # same bytes, so the same digest
    with pytest.raises(FormatError, match="exactly one data blob"):
        Index(image_size=SIZE, sector_size=SIZE, sectors=index.sectors, metadata_sectors=1,
              blobs=(*index.blobs, index.blobs[0]), version=1)  # fmt: skip
