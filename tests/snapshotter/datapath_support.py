"""Test helpers for the snapshotter's data path: a real block image built with
imagetool.format, an in-memory store holding it, and failure-injecting store doubles."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

from imagetool.errors import StoreError
from imagetool.format import (
    BLOB_MEDIA_TYPE,
    Blob,
    FileExtent,
    Index,
    Sector,
    sector_checksum,
    sha256_digest,
)
from imagetool.stores.base import BytesBody, RangeBody, Store
from imagetool.stores.dir import DirStore
from snapshotter.cache.sectors import LAYOUT_VERSION
from snapshotter.config import FetchConfig

SECTOR = 64 << 10


def entry_path(root: Path, checksum: str) -> Path:
    """Where a ``SectorCache`` at ``root`` keeps the entry ``checksum``."""
    return root / LAYOUT_VERSION / checksum[:2] / checksum


@dataclass
class Image:
    index: Index
    blob: bytes  # the first data blob (a version 1 image's only one)
    data: bytes  # the uncompressed filesystem image
    blobs: dict[str, bytes] = field(default_factory=dict)  # every data blob by digest

    def sector(self, n: int) -> bytes:
        start, size = self.index.sector_span(n)
        return self.data[start : start + size]

    def sectors_in(self, offset: int, length: int, blob: int = 0) -> list[int]:
        """Sectors whose stored bytes lie in range [offset, offset+length) of blob ``blob``."""
        return [
            n
            for n, s in enumerate(self.index.sectors)
            if not s.is_zero
            and s.blob == blob
            and offset <= s.offset
            and s.offset + s.length <= offset + length
        ]


def build_image(
    contents: list[bytes],
    sector_size: int = SECTOR,
    metadata_sectors: int = 1,
    prefetch: tuple[int, ...] = (),
    files: tuple[FileExtent, ...] = (),
    blob_starts: tuple[int, ...] = (),
    raw: frozenset[int] = frozenset(),
) -> Image:
    """A block image whose sectors hold ``contents`` (all but the last exactly one sector).

    Without ``blob_starts`` or ``raw``, a version 1 image (one data blob). Otherwise version
    2: a new blob begins at each sector number in ``blob_starts`` (the first at 0: metadata,
    then one "layer" blob each), and the sectors in ``raw`` are stored raw."""
    version = 2 if blob_starts or raw else 1
    starts = sorted({0, *blob_starts}) if version == 2 else [0]
    stored_blobs: list[bytearray] = [bytearray() for _ in starts]
    sectors = []
    compressor = zstandard.ZstdCompressor(level=3)
    for n, data in enumerate(contents):
        if not any(data):
            sectors.append(Sector(0, 0, sector_checksum(data)))
            continue
        number = max(i for i, start in enumerate(starts) if start <= n)
        blob = stored_blobs[number]
        stored = data if n in raw else compressor.compress(data)
        sectors.append(Sector(len(blob), len(stored), sector_checksum(data), number, n in raw))
        blob += stored
    image = b"".join(contents)
    if version == 1:
        blobs = (Blob(sha256_digest(bytes(stored_blobs[0])), len(stored_blobs[0])),)
    else:
        blobs = tuple(
            Blob(
                sha256_digest(bytes(b)),
                len(b),
                "metadata" if i == 0 else "layer",
                "" if i == 0 else sha256_digest(b"source layer %d" % i),
            )
            for i, b in enumerate(stored_blobs)
        )
    index = Index(
        image_size=len(image),
        sector_size=sector_size,
        sectors=tuple(sectors),
        metadata_sectors=metadata_sectors,
        blobs=blobs,
        prefetch=prefetch,
        files=files,
        version=version,
    )
    by_digest = {b.digest: bytes(data) for b, data in zip(blobs, stored_blobs, strict=True)}
    return Image(index, bytes(stored_blobs[0]), image, by_digest)


def standard_contents(rng: random.Random, count: int = 40) -> list[bytes]:
    """Random, compressible, all-zero and repeated sectors, with a short last sector."""
    contents = []
    for n in range(count):
        if n in (5, 6, 20, 21, 22):
            contents.append(bytes(SECTOR))
        elif n in (11, 12):
            contents.append(contents[3])  # repeats: same checksum as sector 3
        elif n % 3 == 0:
            contents.append((f"sector {n} ".encode() * SECTOR)[:SECTOR])
        else:
            contents.append(rng.randbytes(SECTOR))
    contents.append(rng.randbytes(10_000))
    return contents


FILES = (
    FileExtent("/usr/bin/python3", 0, 3 * SECTOR + 100),
    FileExtent("/app/main.py", 3 * SECTOR + 100, 200),
    FileExtent("/app/weights.bin", 8 * SECTOR, 10 * SECTOR),
    FileExtent("/etc/hosts", 30 * SECTOR + 5, 50),
)


def dir_store(root: Path, image: Image) -> DirStore:
    """A real directory store holding ``image`` as ``test:v1``."""
    store = DirStore(root, "test")
    for digest, blob in image.blobs.items():
        store.put_blob(digest, blob, BLOB_MEDIA_TYPE)
    store.publish("v1", image.index.to_bytes())
    return store


class FaultyStore(Store):
    """Wraps a real store; records every ranged read and injects failures on demand.

    ``mode``: "ok", "down" (raise StoreError) or "hang" (block until ``release()``).
    ``corrupt``: blob offset (of any blob, or ``(digest, offset)`` of one) -> how many more
    reads covering it return that byte flipped.
    ``before_read``: called with (offset, length) before each read (after recording it).
    ``stall_after``: the next ``open_range`` body stops after that many bytes, until
    ``release()`` (a read that stalls mid-way); other bodies stream the bytes of
    ``read_range`` as they are.
    """

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.url = "faulty+" + inner.url
        self.name = inner.name
        self.mode = "ok"
        self.corrupt: dict[int | tuple[str, int], int] = {}
        self.requests: list[tuple[int, int]] = []
        self.digests: list[str] = []  # the blob of each of ``requests``
        self.before_read: Callable[[int, int], None] | None = None
        self.stall_after: int | None = None
        self._gate = threading.Event()
        self._lock = threading.Lock()
        self.hanging = 0

    def release(self) -> None:
        self.mode = "ok"
        self._gate.set()

    def hang(self) -> None:
        self._gate.clear()
        self.mode = "hang"

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        with self._lock:
            self.requests.append((offset, length))
            self.digests.append(digest)
        if self.before_read is not None:
            self.before_read(offset, length)
        if self.mode == "down":
            raise StoreError(f"{self.url}: connection refused")
        if self.mode == "hang":
            with self._lock:
                self.hanging += 1
            self._gate.wait(60)
            with self._lock:
                self.hanging -= 1
        data = bytearray(self.inner.read_range(digest, offset, length))
        with self._lock:
            for key, times in list(self.corrupt.items()):
                blob, at = key if isinstance(key, tuple) else (digest, key)
                if times > 0 and blob == digest and offset <= at < offset + length:
                    data[at - offset] ^= 0xFF
                    self.corrupt[key] = times - 1
        return bytes(data)

    def open_range(self, digest: str, offset: int, length: int) -> RangeBody:
        data = self.read_range(digest, offset, length)
        with self._lock:
            stall, self.stall_after = self.stall_after, None
        if stall is None:
            return BytesBody(self.url, data)
        self._gate.clear()
        return _StallingBody(self.url, data, stall, self._gate)

    def requested_sectors(self, image: Image) -> list[int]:
        """The stored sectors read from the store, in the order of the requests (a sector
        once per request that read it)."""
        with self._lock:
            requests = list(self.requests)
        return [n for offset, length in requests for n in image.sectors_in(offset, length)]

    def fetch_counts(self, image: Image) -> dict[int, int]:
        """How many times each stored sector was read from the store."""
        counts: dict[int, int] = {}
        for n in self.requested_sectors(image):
            counts[n] = counts.get(n, 0) + 1
        return counts

    def has_blob(self, digest: str) -> bool:
        return self.inner.has_blob(digest)

    def blob_size(self, digest: str) -> int:
        return self.inner.blob_size(digest)

    def put_blob(self, digest: str, source: Path | bytes, media_type: str) -> None:
        self.inner.put_blob(digest, source, media_type)

    def resolve(self, tag: str) -> str:
        return self.inner.resolve(tag)

    def publish(self, tag: str, index_bytes: bytes) -> str:
        return self.inner.publish(tag, index_bytes)

    def list_tags(self) -> list[str]:
        return self.inner.list_tags()


class _StallingBody(BytesBody):
    """A body that stops after ``stall`` bytes until ``gate`` is set."""

    def __init__(self, where: str, data: bytes, stall: int, gate: threading.Event) -> None:
        super().__init__(where, data)
        self._stall = stall
        self._gate = gate

    def _read_some(self, out: memoryview) -> int:
        if self.position >= self._stall:
            self._gate.wait(60)
        elif self.position + len(out) > self._stall:
            out = out[: self._stall - self.position]
        return super()._read_some(out)


# Quick to fail: tests that provoke timeouts should not wait for production defaults.
FAST = FetchConfig(
    max_parallel=4,
    request_timeout=0.5,
    retries=2,
    backoff_base=0.01,
    backoff_max=0.05,
    deadline=5.0,
)


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def set_mtime(path: Path, t: float) -> None:
    os.utime(path, (t, t))
