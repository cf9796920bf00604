"""SectorCache.read_into: the FUSE read path's reads straight into a caller's buffer, checked
where they land."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from datapath_support import entry_path, set_mtime

from imagetool.format import sector_checksum
from snapshotter.cache.sectors import SectorCache


@pytest.mark.parametrize("fresh", [False, True], ids=["verified", "first-use"])
def test_reads_into_a_buffer_match_the_entry(tmp_path: Path, fresh: bool) -> None:
    data = random.Random(2).randbytes(300_000)
    key = sector_checksum(data)
    cache = SectorCache(tmp_path, 1 << 20)
    cache.put(key, data)
    if fresh:  # another process: nothing checked yet, the first read checks the trailer
        cache = SectorCache(tmp_path, 1 << 20)
    rng = random.Random(3)
    buf = bytearray(100_000)
    for _ in range(100):
        offset = rng.randrange(len(data))
        length = rng.randrange(min(len(buf), len(data) - offset) + 1)
        view = memoryview(buf)[:length]
        assert cache.read_into(key, offset, view, size=len(data))
        assert bytes(view) == data[offset : offset + length], (offset, length)
    view = memoryview(buf)[:100]
    assert not cache.read_into(key, len(data) - 50, view)  # past the end: not whole
    assert not cache.read_into(key, 0, view, size=len(data) + 1)  # not the sector asked for
    assert not cache.read_into(sector_checksum(b"absent"), 0, view)
    assert cache.metrics.corrupt.value == 0


def test_damage_after_the_check_is_caught_by_the_read_into_the_buffer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = random.Random(4).randbytes(300_000)
    key = sector_checksum(data)
    cache = SectorCache(tmp_path, 1 << 20)
    cache.put(key, data)
    path = entry_path(tmp_path, key)
    st = path.stat()
    with open(path, "r+b") as f:  # damaged in place: same size, same mtime
        f.seek(200_000)
        f.write(b"\xff" * 3)
    set_mtime(path, st.st_mtime)
    buf = bytearray(5000)
    assert cache.read_into(key, 1000, memoryview(buf))  # blocks that are intact still serve
    assert bytes(buf) == data[1000:6000]
    # the damaged block is only partly in the range asked for: still caught
    assert not cache.read_into(key, 199_000, memoryview(buf)[:1001])
    assert "corrupt" in caplog.text and not path.exists() and key not in cache
    assert cache.metrics.corrupt.value == 1
    # and it stays a miss until the sector is put again
    assert not cache.read_into(key, 1000, memoryview(buf))
    cache.put(key, data)
    assert cache.read_into(key, 199_000, memoryview(buf)[:1001])
    assert bytes(buf[:1001]) == data[199_000:200_001]


def test_a_file_system_that_refuses_direct_reads_is_read_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fcntl
    import os

    data = random.Random(5).randbytes(200_000)
    key = sector_checksum(data)
    SectorCache(tmp_path, 1 << 20).put(key, data)
    real_preadv = os.preadv

    def preadv(fd: int, buffers: list, offset: int, *flags: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(22, "Invalid argument")  # as a file system without direct I/O
        return real_preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", preadv)
    cache = SectorCache(tmp_path, 1 << 20)
    buf = bytearray(5000)
    assert cache.read_into(key, 1000, memoryview(buf))
    assert bytes(buf) == data[1000:6000]
    assert cache.read(key, 150_000, 10) == data[150_000:150_010]
    assert cache.metrics.corrupt.value == 0 and cache.metrics.misses.value == 0
