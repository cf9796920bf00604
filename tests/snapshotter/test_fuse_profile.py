"""The FUSE adapter's startup profile: the files behind the byte ranges read, in
first-access order, mapped through the index's file map only when asked for."""

from __future__ import annotations

from collections.abc import Callable

from datapath_support import SECTOR, Image

from snapshotter.datapath.fetcher import SectorFetcher
from snapshotter.datapath.reader import BlockReader, scratch_memory
from snapshotter.mount.fuse import BLOCK, BlockFile


def _read(ops: BlockFile, offset: int, length: int) -> bytes:
    """What the FUSE file answers: the parts, joined."""
    return b"".join(bytes(p) for p in ops.read_parts(offset, length, scratch_memory(2 << 20)))


def test_profile_lists_files_in_first_access_order(
    image: Image, make_fetcher: Callable[..., SectorFetcher]
) -> None:
    ops = BlockFile(BlockReader(image.index, make_fetcher()))
    assert list(ops.touched_profile().paths) == []
    assert _read(ops, 30 * SECTOR, BLOCK) == image.data[30 * SECTOR : 30 * SECTOR + BLOCK]
    _read(ops, 3 * SECTOR + 150, 10)  # unaligned, inside /app/main.py only
    _read(ops, 0, 2 * BLOCK)  # /usr/bin/python3
    _read(ops, 9 * SECTOR, BLOCK)  # /app/weights.bin
    assert list(ops.touched_profile().paths) == [
        "/etc/hosts",
        "/app/main.py",
        "/usr/bin/python3",
        "/app/weights.bin",
    ]


def test_rereading_whole_blocks_adds_nothing_to_the_log(
    image: Image, make_fetcher: Callable[..., SectorFetcher]
) -> None:
    ops = BlockFile(BlockReader(image.index, make_fetcher()))
    for _ in range(3):
        _read(ops, 0, 16 * BLOCK)
        _read(ops, 4 * BLOCK, BLOCK)  # inside what was read
    assert len(ops._ranges) == 1
    _read(ops, 15 * BLOCK, 2 * BLOCK)  # one new block
    assert len(ops._ranges) == 2 and list(ops.touched_profile().paths) == ["/usr/bin/python3"]


def test_profile_gives_the_ranges_read_of_a_file_read_in_part(
    image: Image, make_fetcher: Callable[..., SectorFetcher]
) -> None:
    """A file read in part (a mapped library) keeps the ranges read, within the file; a
    small file read at all, and a file read to the end, are whole."""
    ops = BlockFile(BlockReader(image.index, make_fetcher()))
    weights = 8 * SECTOR  # /app/weights.bin: 10 sectors
    _read(ops, weights + 4 * SECTOR, 2 * BLOCK)
    _read(ops, 3 * SECTOR + 150, 10)  # /app/main.py, 200 bytes
    _read(ops, weights, BLOCK)
    _read(ops, 0, 3 * SECTOR + 100)  # all of /usr/bin/python3
    profile = ops.touched_profile()
    assert profile.paths == ("/app/weights.bin", "/app/main.py", "/usr/bin/python3")
    assert profile.entries[0].ranges == ((0, BLOCK), (4 * SECTOR, 4 * SECTOR + 2 * BLOCK))
    assert profile.entries[1].ranges is None and profile.entries[2].ranges is None
