"""Byte-range reads over a block image's uncompressed filesystem image.

``BlockReader.read(offset, length)`` is what the FUSE file's read callback calls. It maps the
range to sectors, takes decoded sectors from a small in-memory LRU (the kernel reads a file
in 128 KiB pieces, so one 4 MiB sector serves ~32 reads: it is decoded once, not 32 times),
asks the fetcher for the rest in one call (so adjacent misses are coalesced), and slices.

It also keeps an access log: the sectors touched, in first-access order. Right after a
container starts, that log is its startup profile; ``touched_files()`` maps it to file paths
through the index's file map, which is what ``imagetool convert --profile`` lays out first.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from imagetool.format import Index
from snapshotter.errors import InvalidReadError
from snapshotter.fetcher import SectorFetcher

# Decoded sectors kept in memory per reader: 8 x 4 MiB = 32 MiB, enough for a few readers
# streaming different files at once without thrashing.
DEFAULT_MEMORY_SECTORS = 8


class BlockReader:
    """Reads of one mounted image, through ``fetcher``."""

    def __init__(
        self,
        index: Index,
        fetcher: SectorFetcher,
        memory_sectors: int = DEFAULT_MEMORY_SECTORS,
        timeout: float | None = None,
    ) -> None:
        """``timeout``: seconds one read may take (default: the fetcher's deadline)."""
        if memory_sectors < 0:
            raise ValueError("memory_sectors must not be negative")
        self.index = index
        self.fetcher = fetcher
        self.memory_sectors = memory_sectors
        self.timeout = timeout
        self.metrics = fetcher.metrics
        self._lock = threading.Lock()
        self._memory: OrderedDict[int, bytes] = OrderedDict()  # LRU first
        self._touched: dict[int, None] = {}  # insertion-ordered set

    @property
    def size(self) -> int:
        return self.index.image_size

    def read(self, offset: int, length: int) -> bytes:
        """Image bytes ``[offset, offset+length)``, short at the end of the image.

        Raises ``FetchError`` when sectors cannot be fetched in time (EIO).
        """
        if offset < 0 or length < 0:
            raise InvalidReadError(f"invalid read: offset {offset}, length {length}")
        numbers = self.index.sectors_for_range(offset, length)
        self.metrics.reads.inc()
        if not numbers:
            return b""
        sectors: dict[int, bytes] = {}
        with self._lock:
            for n in numbers:
                self._touched.setdefault(n)
                data = self._memory.get(n)
                if data is not None:
                    self._memory.move_to_end(n)
                    sectors[n] = data
        self.metrics.memory_hits.inc(len(sectors))
        wanted = [n for n in numbers if n not in sectors]
        if wanted:
            deadline = None if self.timeout is None else time.monotonic() + self.timeout
            fetched = self.fetcher.get(wanted, deadline)
            sectors.update(fetched)
            self._remember(fetched)
        end = min(offset + length, self.index.image_size)
        pieces = []
        for n in numbers:
            start, size = self.index.sector_span(n)
            lo, hi = max(offset, start) - start, min(end, start + size) - start
            pieces.append(memoryview(sectors[n])[lo:hi])
        out = b"".join(pieces)
        self.metrics.read_bytes.inc(len(out))
        return out

    def touched_sectors(self) -> list[int]:
        """Sectors read so far, in first-access order."""
        with self._lock:
            return list(self._touched)

    def touched_files(self) -> list[str]:
        """Paths of files in the sectors read so far, in first-access order (by image
        offset within one sector)."""
        seen: dict[str, None] = {}
        for n in self.touched_sectors():
            start, size = self.index.sector_span(n)
            for f in self.index.files_in_range(start, size):
                seen.setdefault(f.path)
        return list(seen)

    def drop_memory(self) -> None:
        """Forget the decoded sectors held in memory."""
        with self._lock:
            self._memory.clear()

    def _remember(self, fetched: dict[int, bytes]) -> None:
        if not self.memory_sectors:
            return
        with self._lock:
            for n, data in fetched.items():
                self._memory[n] = data
                self._memory.move_to_end(n)
            while len(self._memory) > self.memory_sectors:
                self._memory.popitem(last=False)
