"""Decoding a stored sector into the caller's memory checks exactly what decoding to new
bytes checks."""

from __future__ import annotations

import random

import pytest
import zstandard

from imagetool.errors import ChecksumError
from imagetool.format import decode_stored, decode_stored_into, sector_checksum

SECTOR = random.Random(3).randbytes(1 << 19) + b"lazyblock " * 50_000


def _stored() -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(SECTOR)


def test_decodes_into_the_memory_given_as_decode_stored_does() -> None:
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
def test_anything_but_exactly_the_named_bytes_is_a_checksum_error(stored: bytes, room: int) -> None:
    with pytest.raises(ChecksumError):
        decode_stored_into(stored, sector_checksum(SECTOR), memoryview(bytearray(room)))
