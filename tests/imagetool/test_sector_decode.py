"""Decoding a stored sector into the caller's memory checks exactly what decoding to new
bytes checks."""

from __future__ import annotations

import random

import pytest
import xxhash
import zstandard
from support import in_threads

from imagetool.errors import ChecksumError
from imagetool.format import (
    checksum_and_blocks,
    decode_stored,
    decode_stored_into,
    sector_checksum,
)

SECTOR = random.Random(3).randbytes(1 << 19) + b"lazyblock " * 50_000


def _stored() -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(SECTOR)


def test_decodes_into_the_memory_given_as_decode_stored_does(codec: str) -> None:
    stored = _stored()
    out = memoryview(bytearray(len(SECTOR)))
    decode_stored_into(memoryview(stored), sector_checksum(SECTOR), out)
    assert out == SECTOR == decode_stored(stored, sector_checksum(SECTOR), len(SECTOR))


@pytest.mark.parametrize(
    ("stored", "room"),
    [
        (_stored()[:-7], len(SECTOR)),  # cut short
        (_stored(), len(SECTOR) - 1),  # decodes to more than the sector's size
        (_stored(), len(SECTOR) + 1),  # to less
        (_stored() + _stored(), len(SECTOR)),  # a second frame after the sector's
        (b"not zstd at all", len(SECTOR)),
        (zstandard.ZstdCompressor().compress(SECTOR[:-1] + b"?"), len(SECTOR)),  # other bytes
    ],
    ids=["truncated", "longer", "shorter", "two-frames", "garbage", "wrong-bytes"],
)
def test_anything_but_exactly_the_named_bytes_is_a_checksum_error(
    stored: bytes, room: int, codec: str
) -> None:
    with pytest.raises(ChecksumError):
        decode_stored_into(stored, sector_checksum(SECTOR), memoryview(bytearray(room)))
    with pytest.raises(ChecksumError):  # and with the block digests asked for
        decode_stored_into(stored, sector_checksum(SECTOR), memoryview(bytearray(room)), 4096)


@pytest.mark.parametrize("block", [4096, 16384, 100_000])
def test_the_block_digests_are_of_the_bytes_decoded(block: int, codec: str) -> None:
    out = memoryview(bytearray(len(SECTOR)))
    blocks = decode_stored_into(_stored()[:], sector_checksum(SECTOR), out, block)
    assert out == SECTOR
    assert blocks == b"".join(
        xxhash.xxh3_64_digest(SECTOR[i : i + block]) for i in range(0, len(SECTOR), block)
    )


def test_a_sector_of_any_size_decodes_and_hashes_alike(codec: str) -> None:
    rng = random.Random(9)
    for size in (0, 1, 4095, 4096, 131_073, 1 << 20):
        data = rng.randbytes(size // 2) + b"x" * (size - size // 2)
        for stored in (zstandard.ZstdCompressor(level=1).compress(data),
                       zstandard.ZstdCompressor(level=19).compress(data)):  # fmt: skip
            out = memoryview(bytearray(size))
            blocks = decode_stored_into(stored, sector_checksum(data), out, 16384)
            assert out == data and blocks == checksum_and_blocks(data, 16384)[1]


def test_a_corrupt_stored_sector_never_decodes_to_other_bytes(codec: str) -> None:
    """Bytes flipped anywhere in the stored sector (the frame's header, its blocks, its
    end), a byte at a time: each decode either refuses (ChecksumError) or gives exactly the
    sector, and it never reads or writes past the buffers (the compiled decoder included)."""
    stored = _stored()
    rng = random.Random(5)
    positions = list(range(24)) + rng.sample(range(24, len(stored)), 300) + [len(stored) - 1]
    for at in positions:
        bad = bytearray(stored)
        bad[at] ^= 1 << rng.randrange(8)
        out = memoryview(bytearray(len(SECTOR)))
        try:
            decode_stored_into(bytes(bad), sector_checksum(SECTOR), out, 16384)
        except ChecksumError:
            continue
        assert out == SECTOR


def test_decodes_on_many_threads_at_once_each_get_their_own_bytes(codec: str) -> None:
    """The compiled decoder keeps its zstd contexts for reuse across threads and calls,
    after a failed decode too: each thread's sectors still decode to exactly their bytes."""
    rng = random.Random(11)
    sectors = [rng.randbytes(1 << 16) + bytes([i]) * (1 << 16) for i in range(8)]
    stored = [zstandard.ZstdCompressor(level=3).compress(s) for s in sectors]

    def work(i: int) -> None:
        for k in range(40):
            out = memoryview(bytearray(len(sectors[i])))
            if k % 5 == 4:  # a corrupt one now and then
                with pytest.raises(ChecksumError):
                    decode_stored_into(stored[i][:-9], sector_checksum(sectors[i]), out)
                continue
            blocks = decode_stored_into(stored[i], sector_checksum(sectors[i]), out, 16384)
            assert out == sectors[i]
            assert blocks == checksum_and_blocks(sectors[i], 16384)[1]

    in_threads(work, 8)
