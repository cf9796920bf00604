"""LayerStream on its own: bounded reads, framing, verification."""

from __future__ import annotations

import gzip
import hashlib
import io
import tracemalloc

import pytest
import zstandard

from imagetool.errors import DigestMismatchError, InvalidSourceError
from imagetool.sources._stream import LayerStream, _ZstdFrames

BIG = 48 << 20  # very compressible: a few KB stored, so output must be bounded by read(n)


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def stream(blob: bytes, tar_digest: str | None, compression: str | None) -> LayerStream:
    return LayerStream(
        io.BytesIO(blob),
        digest=sha256(blob),
        size=len(blob),
        diff_id=tar_digest,
        compression=compression,
        what="layer test",
    )


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
def test_bounded_reads_of_a_bomb(compression: str) -> None:
    zeros = bytes(BIG)
    blob = (
        gzip.compress(zeros, mtime=0)
        if compression == "gzip"
        else zstandard.ZstdCompressor().compress(zeros)
    )
    assert len(blob) < BIG // 100
    s = stream(blob, sha256(zeros), compression)
    del zeros
    tracemalloc.start()
    total = 0
    while chunk := s.read(64 << 10):
        assert len(chunk) <= 64 << 10
        total += len(chunk)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert total == BIG
    assert s.verified
    assert peak < 4 << 20


def test_read_all_and_readinto() -> None:
    data = b"0123456789" * 1000
    s = stream(data, sha256(data), None)
    buf = bytearray(7)
    assert s.readinto(buf) == 7 and bytes(buf) == b"0123456"
    assert s.read() == data[7:]
    assert s.read(10) == b""


def test_uncompressed_digest_mismatch_at_eof() -> None:
    data = b"x" * 100
    s = LayerStream(
        io.BytesIO(data), digest=sha256(b"y" * 100), size=100, diff_id=None,
        compression=None, what="layer t",
    )  # fmt: skip
    assert s.read(60) == data[:60]
    with pytest.raises(DigestMismatchError, match="layer t: blob does not match"):
        s.read(60)
        s.read(60)


def test_short_blob_is_a_mismatch() -> None:
    data = b"x" * 100
    s = LayerStream(
        io.BytesIO(data), digest=sha256(data), size=101, diff_id=None,
        compression=None, what="layer t",
    )  # fmt: skip
    with pytest.raises(DigestMismatchError, match="100 bytes"):
        s.read()


def test_zstd_frames_walker() -> None:
    cctx = zstandard.ZstdCompressor(write_checksum=True, write_content_size=False)
    frames = cctx.compress(b"a" * 300_000) + cctx.compress(b"") + cctx.compress(b"xyz" * 9)
    for step in (1, 7, 4096, len(frames)):
        w = _ZstdFrames()
        for i in range(0, len(frames), step):
            w.feed(frames[i : i + step])
        assert w.complete and w.frames == 3
    w = _ZstdFrames()
    w.feed(frames[:-1])
    assert not w.complete
    with pytest.raises(ValueError):
        _ZstdFrames().feed(b"\x00\x01\x02\x03")


def test_empty_zstd_blob_is_rejected() -> None:
    s = stream(b"", None, None)
    assert s.read() == b""  # an empty plain layer is just empty
    with pytest.raises(InvalidSourceError, match="media type says zstd"):
        stream(b"", None, "zstd")
