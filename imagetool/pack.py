"""Cut a filesystem image into sectors, compress and checksum them, write the data blobs.

Sectors are assembled one at a time from the plan (metadata bytes, file extents read from the
content spool, zeros), compressed on a thread pool (zstd releases the GIL) and written in
order, each region's stored sectors to a blob file of its own, so memory stays at a few
sectors per worker whatever the image size, and the output is byte-for-byte the same for the
same plan and options. A sector whose zstd form saves less than ``raw_saving`` of its size
is stored raw (``imagetool.format``).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import zstandard

from imagetool.erofs.writer import ErofsPlan, Region
from imagetool.format import Sector, sector_checksum


@dataclass(frozen=True)
class PackedBlob:
    """A region's stored sectors, written to ``path``."""

    region: Region
    path: Path
    digest: str
    size: int


@dataclass(frozen=True)
class PackResult:
    sectors: tuple[Sector, ...]
    blobs: tuple[PackedBlob, ...]  # regions with stored sectors, in image order


def iter_sectors(plan: ErofsPlan, spool_fd: int | None, sector_size: int) -> Iterator[bytes]:
    """The uncompressed image, sector by sector."""
    extents = plan.extents
    meta = plan.metadata
    e = 0
    for start in range(0, plan.size, sector_size):
        end = min(plan.size, start + sector_size)
        buf = bytearray(end - start)
        if start < len(meta):
            piece = meta[start : min(end, len(meta))]
            buf[: len(piece)] = piece
        while e < len(extents) and extents[e].image_offset + extents[e].length <= start:
            e += 1
        i = e
        while i < len(extents) and extents[i].image_offset < end:
            ext = extents[i]
            lo = max(start, ext.image_offset)
            hi = min(end, ext.image_offset + ext.length)
            assert spool_fd is not None
            data = os.pread(spool_fd, hi - lo, ext.spool_offset + (lo - ext.image_offset))
            if len(data) != hi - lo:
                raise OSError("content spool is shorter than expected")
            buf[lo - start : hi - start] = data
            i += 1
        yield bytes(buf)


_local = threading.local()


def _compress(data: bytes, level: int, raw_saving: float) -> tuple[bytes | None, str, bool]:
    """(stored bytes or None for all zeros, checksum, whether stored raw)."""
    checksum = sector_checksum(data)
    if data.count(0) == len(data):
        return None, checksum, False
    comp = getattr(_local, "zstd", None)
    if comp is None or _local.level != level:
        comp = _local.zstd = zstandard.ZstdCompressor(level=level, write_checksum=False)
        _local.level = level
    stored = comp.compress(data)
    if raw_saving and len(stored) > len(data) * (1 - raw_saving):
        return data, checksum, True
    return stored, checksum, False


def pack(
    sectors: Iterator[bytes],
    regions: Sequence[Region],
    sector_size: int,
    out_dir: Path,
    *,
    level: int,
    raw_saving: float = 0.0,
    workers: int | None = None,
    progress: Callable[[int], object] | None = None,
) -> PackResult:
    """Compress ``sectors`` in parallel; each region's stored sectors go, in order, to a blob
    file of its own in ``out_dir`` (a region with none gets none). Regions start on sector
    boundaries and cover the image."""
    workers = workers or os.cpu_count() or 1
    table: list[Sector] = []
    blobs: list[PackedBlob] = []
    pending: deque[tuple[Future[tuple[bytes | None, str, bool]], int]] = deque()
    current: _BlobFile | None = None
    region = 0

    def drain_one() -> None:
        nonlocal current, region
        fut, raw_len = pending.popleft()
        stored, checksum, raw = fut.result()
        start = len(table) * sector_size
        while start >= regions[region].end:
            region += 1
        if current is not None and current.region is not regions[region]:
            blobs.append(current.close())
            current = None
        if stored is None:
            table.append(Sector(0, 0, checksum))
        else:
            if current is None:
                current = _BlobFile(regions[region], out_dir / f"blob-{len(blobs)}")
            table.append(Sector(current.size, len(stored), checksum, len(blobs), raw))
            current.write(stored)
        if progress is not None:
            progress(raw_len)

    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pack") as pool:
            for data in sectors:
                pending.append((pool.submit(_compress, data, level, raw_saving), len(data)))
                if len(pending) >= 2 * workers:
                    drain_one()
            while pending:
                drain_one()
        if current is not None:
            blobs.append(current.close())
            current = None
    finally:
        if current is not None:
            current.file.close()
    return PackResult(tuple(table), tuple(blobs))


class _BlobFile:
    """A blob being written: its file and running digest."""

    def __init__(self, region: Region, path: Path) -> None:
        self.region = region
        self.path = path
        self.file: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, stored: bytes) -> None:
        self.file.write(stored)
        self.digest.update(stored)
        self.size += len(stored)

    def close(self) -> PackedBlob:
        with self.file:
            self.file.flush()
            os.fsync(self.file.fileno())
        return PackedBlob(self.region, self.path, "sha256:" + self.digest.hexdigest(), self.size)
