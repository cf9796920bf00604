"""SectorCache.read_view: the FUSE read path's reads into the FUSE thread's scratch memory,
checked where they land and answered from there."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from datapath_support import entry_path, set_mtime

from imagetool.format import sector_checksum
from snapshotter.cache.sectors import SectorCache, view_room
from snapshotter.datapath.reader import scratch_memory


def read_view(cache: SectorCache, key: str, offset: int, length: int, **kw: object) -> bytes | None:
    """``read_view`` into fresh scratch of the size the FUSE thread would give it: the bytes,
    or None."""
    got = cache.read_view(key, offset, length, scratch_memory(view_room(length)), **kw)
    return None if got is None else bytes(got[0])


@pytest.mark.parametrize("fresh", [False, True], ids=["verified", "first-use"])
def test_reads_into_a_buffer_match_the_entry(tmp_path: Path, fresh: bool) -> None:
    data = random.Random(2).randbytes(300_000)
    key = sector_checksum(data)
    cache = SectorCache(tmp_path, 1 << 20)
    cache.put(key, data)
    if fresh:  # another process: nothing checked yet, the first read checks the trailer
        cache = SectorCache(tmp_path, 1 << 20)
    rng = random.Random(3)
    for _ in range(100):
        offset = rng.randrange(len(data) - 1)
        length = rng.randrange(1, min(100_000, len(data) - offset) + 1)
        sequential = rng.random() < 0.5
        got = read_view(cache, key, offset, length, size=len(data), sequential=sequential)
        assert got == data[offset : offset + length], (offset, length)
    assert read_view(cache, key, len(data) - 50, 100) is None  # past the end: not whole
    assert read_view(cache, key, 0, 100, size=len(data) + 1) is None  # not the sector asked for
    assert read_view(cache, sector_checksum(b"absent"), 0, 100) is None
    small = scratch_memory(4096)  # too little scratch for the blocks: a miss, not a wrong read
    assert cache.read_view(key, 1000, 20_000, small, sequential=True) is None
    assert cache.read_view(key, 1000, 40_000, small) is None
    # ... except for a small random read, which needs none: its read-around window holds it
    got = cache.read_view(key, 1000, 20_000, small)
    assert got is not None and got[1] == 0 and got[0] == data[1000:21_000]
    assert cache.metrics.corrupt.value == 0


def test_damage_after_the_check_is_caught_where_the_blocks_land(
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
    # blocks that are intact still serve
    assert read_view(cache, key, 1000, 5000) == data[1000:6000]
    # the damaged block is only partly in the range asked for: still caught
    assert read_view(cache, key, 199_000, 1001) is None
    assert "corrupt" in caplog.text and not path.exists() and key not in cache
    assert cache.metrics.corrupt.value == 1
    # and it stays a miss until the sector is put again
    assert read_view(cache, key, 1000, 5000) is None
    cache.put(key, data)
    assert read_view(cache, key, 199_000, 1001) == data[199_000:200_001]


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
    assert read_view(cache, key, 1000, 5000) == data[1000:6000]
    assert cache.read(key, 150_000, 10) == data[150_000:150_010]
    assert cache.metrics.corrupt.value == 0 and cache.metrics.misses.value == 0
