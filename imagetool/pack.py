"""Cut a filesystem image into sectors, compress and checksum them, write the data blob.

Sectors are assembled one at a time from the plan (metadata bytes, file extents read from the
content spool, zeros), compressed on a thread pool (zstd releases the GIL) and written in
order, so memory stays at a few sectors per worker whatever the image size, and the output is
byte-for-byte the same for the same plan and options.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO

import zstandard

from imagetool.erofs.writer import ErofsPlan
from imagetool.format import Sector, sector_checksum


@dataclass(frozen=True)
class PackResult:
    sectors: tuple[Sector, ...]
    blob_digest: str
    blob_size: int


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


def _compress(data: bytes, level: int) -> tuple[bytes | None, str]:
    checksum = sector_checksum(data)
    if data.count(0) == len(data):
        return None, checksum
    comp = getattr(_local, "zstd", None)
    if comp is None or _local.level != level:
        comp = _local.zstd = zstandard.ZstdCompressor(level=level, write_checksum=False)
        _local.level = level
    return comp.compress(data), checksum


def pack(
    sectors: Iterator[bytes],
    out: BinaryIO,
    *,
    level: int,
    workers: int | None = None,
    progress: Callable[[int], object] | None = None,
) -> PackResult:
    """Compress ``sectors`` in parallel and write the data blob to ``out`` in order."""
    workers = workers or os.cpu_count() or 1
    table: list[Sector] = []
    digest = hashlib.sha256()
    offset = 0
    pending: deque[tuple[Future[tuple[bytes | None, str]], int]] = deque()

    def drain_one() -> None:
        nonlocal offset
        fut, raw_len = pending.popleft()
        stored, checksum = fut.result()
        if stored is None:
            table.append(Sector(0, 0, checksum))
        else:
            out.write(stored)
            digest.update(stored)
            table.append(Sector(offset, len(stored), checksum))
            offset += len(stored)
        if progress is not None:
            progress(raw_len)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pack") as pool:
        for data in sectors:
            pending.append((pool.submit(_compress, data, level), len(data)))
            if len(pending) >= 2 * workers:
                drain_one()
        while pending:
            drain_one()
    return PackResult(tuple(table), "sha256:" + digest.hexdigest(), offset)
