"""Read a published block image straight from its store, without mounting.

``BlockImage.read_at`` serves any byte range of the uncompressed filesystem image: it fetches
the sectors it needs with ranged reads (sectors adjacent in one blob in one request),
verifies each one with ``Index.decode_sector`` and keeps a few decoded sectors in memory.
This is what ``imagetool ls/cat/verify/raw`` use; the snapshotter has its own cached,
concurrent reader.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from imagetool.erofs.reader import ErofsReader
from imagetool.errors import FormatError
from imagetool.format import Index, blob_range, blob_runs, coalesce
from imagetool.stores import open_store, parse_ref
from imagetool.stores.base import Store, StoreOptions

log = logging.getLogger(__name__)

MEMORY_SECTORS = 16  # decoded sectors kept; 64 MiB at the default sector size
READ_AHEAD = 4  # sectors fetched together when a read misses


class BlockImage:
    def __init__(self, store: Store, index: Index) -> None:
        self.store = store
        self.index = index
        self._sectors: OrderedDict[int, bytes] = OrderedDict()

    @property
    def size(self) -> int:
        return self.index.image_size

    def read_at(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise ValueError("negative offset or length")
        length = max(0, min(length, self.size - offset))
        if length == 0:
            return b""
        numbers = self.index.sectors_for_range(offset, length)
        missing = [n for n in numbers if n not in self._sectors]
        if missing:
            extra = range(missing[-1] + 1, min(missing[-1] + READ_AHEAD, self.index.sector_count))
            for run in coalesce([*missing, *extra]):
                for n, data in self.fetch_run(run):
                    self._remember(n, data)
        out = bytearray()
        for n in numbers:
            data = self._sectors.get(n)
            if data is None:  # evicted while assembling a very large read
                data = dict(self.fetch_run(range(n, n + 1)))[n]
            else:
                self._sectors.move_to_end(n)
            start, _ = self.index.sector_span(n)
            lo = max(offset, start) - start
            hi = min(offset + length, start + len(data)) - start
            out += data[lo:hi]
        return bytes(out)

    def _remember(self, n: int, data: bytes) -> None:
        self._sectors[n] = data
        self._sectors.move_to_end(n)
        while len(self._sectors) > MEMORY_SECTORS:
            self._sectors.popitem(last=False)

    def fetch_run(self, run: range) -> Iterator[tuple[int, bytes]]:
        """Verified sectors of a run of consecutive sector numbers, in order: one ranged
        read for each part of it that is contiguous in one blob."""
        index = self.index
        fetched: dict[int, bytes] = {}
        for part in blob_runs(index, run):
            blob, offset, length = blob_range(index, part)
            stored = self.store.read_range(blob.digest, offset, length)
            for n in part:
                lo = index.sectors[n].offset - offset
                fetched[n] = index.decode_sector(n, stored[lo : lo + index.sectors[n].length])
        for n in run:
            yield n, fetched[n] if n in fetched else index.decode_sector(n, b"")

    def iter_all(self, run_bytes: int = 64 << 20) -> Iterator[tuple[int, bytes]]:
        """Every sector in order, verified, fetched in runs of about ``run_bytes``."""
        per_run = max(1, run_bytes // self.index.sector_size)
        for start in range(0, self.index.sector_count, per_run):
            yield from self.fetch_run(range(start, min(start + per_run, self.index.sector_count)))

    def filesystem(self) -> ErofsReader:
        return ErofsReader(self.read_at, self.size)


@dataclass
class OpenedImage:
    store: Store
    digest: str
    index: Index
    image: BlockImage

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> OpenedImage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_image(
    ref_text: str, options: StoreOptions = StoreOptions(), platform: str | None = None
) -> OpenedImage:
    """Resolve a reference, fetch and verify its index. A multi-platform image resolves to
    ``platform``'s image (default: the running machine's; ``Store.resolve_ref``)."""
    ref = parse_ref(ref_text)
    store = open_store(ref, options)
    try:
        digest = store.resolve_ref(ref, platform)
        index = Index.from_bytes(store.read_blob(digest))
        for blob in index.blobs:
            if store.blob_size(blob.digest) != blob.size:
                raise FormatError(f"data blob {blob.digest} has the wrong size")
    except BaseException:
        store.close()
        raise
    return OpenedImage(store, digest, index, BlockImage(store, index))
