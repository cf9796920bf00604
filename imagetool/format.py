"""The lazyblock block image format, version 1. This module is its only owner.

A block image is an EROFS filesystem image (uncompressed, 4096-byte blocks) cut into
fixed-size *sectors*. Each sector is compressed on its own with zstd; the *data blob* is the
concatenation of the compressed sectors. All-zero sectors are not stored. The *index* is a
canonical JSON document that describes the image:

    {
      "version": 1,
      "filesystem": {"type": "erofs", "block_size": 4096},
      "image_size": <bytes of the uncompressed filesystem image>,
      "sector_size": <power of two, default 4 MiB>,
      "compression": "zstd",
      "checksum": "xxh3-128",
      "sectors": [[blob_offset, compressed_length, xxh3_128_hex], ...],
      "metadata_sectors": <how many leading sectors hold all metadata>,
      "prefetch": [sector numbers, hottest first],
      "blob": {"digest": "sha256:...", "size": <bytes>},
      "source": {"manifest_digest": "sha256:...", "platform": "linux/amd64",
                 "config": {<OCI image config: Entrypoint, Cmd, Env, User, WorkingDir, ...>}},
      "files": [[path, image_offset, length], ...]   # regular files with data, layout order
    }

The index is stored as that document compressed into one zstd frame (media type
``INDEX_MEDIA_TYPE``; a 200,000-file image's 9.7 MB of JSON is 1.1 MB), and named by the sha256
of the stored bytes. Readers also accept it uncompressed (``INDEX_JSON_MEDIA_TYPE``, what
images written before compression carry).

A sector entry with ``compressed_length == 0`` is an all-zero sector (not in the blob). The
checksum is always over the *uncompressed* bytes of the sector; the last sector may be
shorter than ``sector_size``. Blobs are named by the sha256 of their bytes.

Readers never return bytes that ``Index.decode_sector`` has not verified.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import hashlib
import json
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import xxhash
import zstandard

from imagetool.errors import ChecksumError, FormatError

FORMAT_VERSION = 1
FS_TYPE = "erofs"
# EROFS block size; equal to the page size so the kernel maps blocks straight to pages.
FS_BLOCK_SIZE = 4096
# 4 MiB: big enough that a fetch amortises a round trip, small enough that a cold read of one
# small file does not drag in much that is unused (the figure production systems settled on).
DEFAULT_SECTOR_SIZE = 4 << 20
MIN_SECTOR_SIZE = 64 << 10
MAX_SECTOR_SIZE = 64 << 20
DEFAULT_ZSTD_LEVEL = 3
# The index's zstd level: its JSON compresses best at low levels (9.7 MB of paths: level 1
# 1.11 MB, 3 1.47 MB, 9 1.17 MB at ten times the time).
INDEX_ZSTD_LEVEL = 1
# An index larger than this, uncompressed, is refused (a 200,000-file image's is 9.7 MB).
MAX_INDEX_BYTES = 1 << 30
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
COMPRESSION = "zstd"
CHECKSUM = "xxh3-128"

# Media types of the index and data blob. Both sit under "application/vnd.oci.image.layer.":
# containerd 1.6/1.7 only treats such media types as layers (images.IsLayerType), and only
# layers get snapshotter labels and may be skipped by a remote snapshotter, not downloaded.
INDEX_MEDIA_TYPE = "application/vnd.oci.image.layer.lazyblock.index.v1+zstd"
INDEX_JSON_MEDIA_TYPE = "application/vnd.oci.image.layer.lazyblock.index.v1+json"
INDEX_MEDIA_TYPES = (INDEX_MEDIA_TYPE, INDEX_JSON_MEDIA_TYPE)
BLOB_MEDIA_TYPE = "application/vnd.oci.image.layer.lazyblock.sectors.v1"
# A layer annotation under containerd's inherited prefix ("containerd.io/snapshot/"): every
# containerd client passes it to the snapshotter as a Prepare label. Value: "index"/"blob".
ANNOTATION_SNAPSHOT_ROLE = "containerd.io/snapshot/lazyblock.role"
# Annotations put on the layers of a block image pushed to an OCI registry.
ANNOTATION_ROLE = "dev.lazyblock.role"  # "index" or "blob"
ANNOTATION_INDEX_DIGEST = "dev.lazyblock.index.digest"
ANNOTATION_BLOB_DIGEST = "dev.lazyblock.blob.digest"


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def sector_checksum(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def check_digest(digest: str) -> str:
    """Validate a ``sha256:<64 hex>`` digest and return it."""
    algo, sep, hexpart = digest.partition(":")
    if (
        algo != "sha256"
        or not sep
        or len(hexpart) != 64
        or any(c not in "0123456789abcdef" for c in hexpart)
    ):
        raise FormatError(f"invalid digest {digest!r}")
    return digest


def check_sector_size(size: int) -> int:
    if size < MIN_SECTOR_SIZE or size > MAX_SECTOR_SIZE or size & (size - 1):
        raise FormatError(
            f"sector size must be a power of two between {MIN_SECTOR_SIZE} and "
            f"{MAX_SECTOR_SIZE} bytes, got {size}"
        )
    return size


@dataclass(frozen=True, slots=True)
class Sector:
    """Where one sector lives in the data blob. ``length == 0`` means all zeros."""

    offset: int
    length: int
    checksum: str

    @property
    def is_zero(self) -> bool:
        return self.length == 0


@dataclass(frozen=True, slots=True)
class FileExtent:
    """A regular file's bytes in the filesystem image (contiguous by construction)."""

    path: str
    offset: int
    length: int


class FileMap(Sequence[FileExtent]):
    """An index's file map as parsed: the JSON rows, turned into checked ``FileExtent``s
    the first time anything looks at them.

    Mounting needs the sector table, not the file map (profiles and ``imagetool ls`` do), and
    for a 200,000-file image building the extents costs as much as parsing the JSON. Rows
    that are not ``[path, offset, length]`` raise ``FormatError`` on that first use. The
    bytes were checked against the index digest already, so only a writer bug gets there.
    """

    __slots__ = ("_rows", "_extents", "_lock")

    def __init__(self, rows: list[Any]) -> None:
        self._rows: list[Any] | None = rows
        self._extents: tuple[FileExtent, ...] | None = None
        self._lock = threading.Lock()

    def _built(self) -> tuple[FileExtent, ...]:
        extents = self._extents
        if extents is None:
            with self._lock, _collector_paused():
                if self._extents is None:
                    self._extents = _file_extents(self._rows or [])
                    self._rows = None
                extents = self._extents
        return extents

    def __len__(self) -> int:
        rows = self._rows
        return len(rows) if rows is not None else len(self._built())

    def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
        return self._built()[i]

    def __iter__(self) -> Iterator[FileExtent]:
        return iter(self._built())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FileMap):
            other = other._built()
        return isinstance(other, tuple) and self._built() == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"FileMap({len(self)} files)"


def _file_extents(rows: list[Any]) -> tuple[FileExtent, ...]:
    try:
        return tuple(FileExtent(_str(p), _int(o), _int(n)) for p, o, n in rows)
    except (TypeError, ValueError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"malformed index file map: {type(e).__name__}: {e}") from None


@dataclass(frozen=True)
class Index:
    image_size: int
    sector_size: int
    sectors: tuple[Sector, ...]
    metadata_sectors: int
    blob_digest: str
    blob_size: int
    prefetch: tuple[int, ...] = ()
    manifest_digest: str = ""
    platform: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    files: Sequence[FileExtent] = ()  # a tuple, or the parser's FileMap
    block_size: int = FS_BLOCK_SIZE

    def __post_init__(self) -> None:
        check_sector_size(self.sector_size)
        if self.block_size != FS_BLOCK_SIZE:
            raise FormatError(f"unsupported filesystem block size {self.block_size}")
        expected = -(-self.image_size // self.sector_size)
        if len(self.sectors) != expected:
            raise FormatError(f"index has {len(self.sectors)} sectors, image size needs {expected}")
        if not 0 <= self.metadata_sectors <= len(self.sectors):
            raise FormatError("metadata_sectors out of range")
        check_digest(self.blob_digest)
        end = 0
        for s in self.sectors:
            if s.is_zero:
                continue
            if s.offset != end or s.length < 0:
                raise FormatError("sector table is not a packed sequence of blob ranges")
            end += s.length
        if end != self.blob_size:
            raise FormatError(f"sectors cover {end} blob bytes, blob has {self.blob_size}")
        for p in self.prefetch:
            if not 0 <= p < len(self.sectors):
                raise FormatError(f"prefetch names sector {p}, which does not exist")

    # --- geometry -------------------------------------------------------------------------

    @property
    def sector_count(self) -> int:
        return len(self.sectors)

    def sector_span(self, number: int) -> tuple[int, int]:
        """(image offset, uncompressed length) of sector ``number``."""
        start = number * self.sector_size
        return start, min(self.sector_size, self.image_size - start)

    def sectors_for_range(self, offset: int, length: int) -> range:
        """Sector numbers that hold image bytes [offset, offset+length)."""
        if length <= 0 or offset >= self.image_size:
            return range(0)
        end = min(self.image_size, offset + length)
        return range(offset // self.sector_size, (end - 1) // self.sector_size + 1)

    # --- sector decoding ------------------------------------------------------------------

    def decode_sector(self, number: int, stored: bytes) -> bytes:
        """Decompress and verify sector ``number`` from its stored bytes.

        Raises ``ChecksumError`` for anything that does not decode to exactly the bytes the
        index names; this is the one place sector bytes are checked.
        """
        entry = self.sectors[number]
        _, size = self.sector_span(number)
        if entry.is_zero:
            data = bytes(size)
            if sector_checksum(data) != entry.checksum:
                raise ChecksumError(f"sector {number}: checksum mismatch")
            return data
        if len(stored) != entry.length:
            raise ChecksumError(
                f"sector {number}: got {len(stored)} stored bytes, expected {entry.length}"
            )
        try:
            return decode_stored(stored, entry.checksum, size)
        except ChecksumError as e:
            raise ChecksumError(f"sector {number}: {e}") from None

    def decode_sector_into(self, number: int, stored: bytes | memoryview, out: memoryview) -> None:
        """``decode_sector`` into ``out`` (exactly the sector's size, not all zeros): the
        caller's memory instead of new bytes. Raises ``ChecksumError`` as ``decode_sector``
        does, and then what ``out`` holds is not the sector: it must not be used."""
        entry = self.sectors[number]
        _, size = self.sector_span(number)
        if entry.is_zero or len(out) != size:
            raise ValueError(f"sector {number}: {len(out)} bytes of room, not {size} stored")
        if len(stored) != entry.length:
            raise ChecksumError(
                f"sector {number}: got {len(stored)} stored bytes, expected {entry.length}"
            )
        try:
            decode_stored_into(stored, entry.checksum, out)
        except ChecksumError as e:
            raise ChecksumError(f"sector {number}: {e}") from None

    # --- files ----------------------------------------------------------------------------

    def files_in_range(self, offset: int, length: int) -> Iterator[FileExtent]:
        """Files whose bytes overlap image range [offset, offset+length), by image offset."""
        ordered, starts = self._files_by_offset()
        i = max(0, bisect.bisect_right(starts, offset) - 1)
        end = offset + length
        while i < len(ordered) and ordered[i].offset < end:
            f = ordered[i]
            if f.offset + f.length > offset:
                yield f
            i += 1

    def _files_by_offset(self) -> tuple[list[FileExtent], list[int]]:
        cached = self.__dict__.get("_by_offset")
        if cached is None:
            ordered = sorted(self.files, key=lambda f: f.offset)
            cached = (ordered, [f.offset for f in ordered])
            object.__setattr__(self, "_by_offset", cached)
        return cached

    # --- serialisation --------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION,
            "filesystem": {"type": FS_TYPE, "block_size": self.block_size},
            "image_size": self.image_size,
            "sector_size": self.sector_size,
            "compression": COMPRESSION,
            "checksum": CHECKSUM,
            "sectors": [[s.offset, s.length, s.checksum] for s in self.sectors],
            "metadata_sectors": self.metadata_sectors,
            "prefetch": list(self.prefetch),
            "blob": {"digest": self.blob_digest, "size": self.blob_size},
            "source": {
                "manifest_digest": self.manifest_digest,
                "platform": self.platform,
                "config": self.config,
            },
            "files": [[f.path, f.offset, f.length] for f in self.files],
        }

    def to_bytes(self) -> bytes:
        """Canonical JSON: the same index always has the same bytes, hence the same digest."""
        return json.dumps(
            self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        ).encode()

    def to_blob(self) -> bytes:
        """The index as stored: ``to_bytes()`` in one zstd frame (``INDEX_MEDIA_TYPE``)."""
        return zstandard.ZstdCompressor(level=INDEX_ZSTD_LEVEL).compress(self.to_bytes())

    @property
    def digest(self) -> str:
        """The digest of the index as stored (``to_blob()``)."""
        return sha256_digest(self.to_blob())

    @classmethod
    def from_bytes(cls, data: bytes) -> Index:
        """Parse an index blob: ``to_blob()``'s zstd frame, or the JSON itself."""
        if data[:4] == _ZSTD_MAGIC:
            try:
                data = zstandard.ZstdDecompressor().decompress(
                    data, max_output_size=MAX_INDEX_BYTES
                )
            except zstandard.ZstdError as e:
                raise FormatError(f"index is not a valid zstd frame: {e}") from None
        with _collector_paused():
            try:
                doc = orjson.loads(data)  # the same JSON as json.loads, 2-4x faster
            except orjson.JSONDecodeError as e:
                raise FormatError(f"index is not valid JSON: {e}") from None
            if not isinstance(doc, dict):
                raise FormatError("index is not a JSON object")
            return cls.from_dict(doc)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Index:
        version = doc.get("version")
        if version != FORMAT_VERSION:
            raise FormatError(f"unsupported block image format version {version!r}")
        try:
            fs = doc["filesystem"]
            if fs["type"] != FS_TYPE:
                raise FormatError(f"unsupported filesystem type {fs['type']!r}")
            if doc["compression"] != COMPRESSION or doc["checksum"] != CHECKSUM:
                raise FormatError("unsupported compression or checksum algorithm")
            source = doc.get("source", {})
            return cls(
                image_size=_int(doc["image_size"]),
                sector_size=_int(doc["sector_size"]),
                sectors=tuple(Sector(_int(o), _int(n), _hex(c)) for o, n, c in doc["sectors"]),
                metadata_sectors=_int(doc["metadata_sectors"]),
                prefetch=tuple(_int(p) for p in doc.get("prefetch", [])),
                blob_digest=str(doc["blob"]["digest"]),
                blob_size=_int(doc["blob"]["size"]),
                manifest_digest=str(source.get("manifest_digest", "")),
                platform=str(source.get("platform", "")),
                config=dict(source.get("config", {})),
                files=_file_map(doc["files"]),
                block_size=_int(fs["block_size"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, FormatError):
                raise
            raise FormatError(f"malformed index: {type(e).__name__}: {e}") from None


def index_media_type(blob: bytes) -> str:
    """The media type of an index blob: compressed (``to_blob()``) or plain JSON."""
    return INDEX_MEDIA_TYPE if blob[:4] == _ZSTD_MAGIC else INDEX_JSON_MEDIA_TYPE


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Without the cyclic garbage collector: parsing an index makes a few objects per file
    (a 200,000-file image: over a million), and every few hundred of them would set it off
    over everything alive, which took half the parse time (every mount parses its index).
    None of them form cycles; collection resumes as before afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _file_map(rows: Any) -> FileMap:
    if not isinstance(rows, list):
        raise FormatError(f"malformed index: files is {type(rows).__name__}, not a list")
    return FileMap(rows)


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise FormatError(f"expected a path string, got {v!r}")
    return v


def _int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise FormatError(f"expected a non-negative integer, got {v!r}")
    return v


def _hex(v: Any) -> str:
    if not isinstance(v, str) or len(v) != 32:
        raise FormatError(f"expected a 128-bit hex checksum, got {v!r}")
    return v


def decode_stored(stored: bytes, checksum: str, size: int | None = None) -> bytes:
    """Decompress one stored sector and check it against its checksum (and size, if given).

    Needs no index, so a cache can check an entry against its own name. Raises
    ``ChecksumError`` for anything that does not decode to exactly the named bytes.
    """
    try:
        data = zstandard.ZstdDecompressor().decompress(
            stored, max_output_size=size if size is not None else MAX_SECTOR_SIZE
        )
    except zstandard.ZstdError as e:
        raise ChecksumError(f"undecodable ({e})") from None
    if (size is not None and len(data) != size) or sector_checksum(data) != checksum:
        raise ChecksumError("checksum mismatch")
    return data


def decode_stored_into(stored: bytes | memoryview, checksum: str, out: memoryview) -> None:
    """``decode_stored`` into ``out``, whose length is the sector's size: its stored bytes
    must decode to exactly that many bytes, which hash to ``checksum``. On
    ``ChecksumError``, ``out`` holds no sector."""
    done = 0
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(stored, read_across_frames=False)
        while done < len(out) and (got := reader.readinto(out[done:])):
            done += got
        longer = bool(reader.read(1))
    except zstandard.ZstdError as e:
        raise ChecksumError(f"undecodable ({e})") from None
    if done != len(out) or longer or sector_checksum(out) != checksum:
        raise ChecksumError("checksum mismatch")


def coalesce(numbers: Iterable[int]) -> list[range]:
    """Group sector numbers into runs of consecutive numbers (for coalesced ranged reads)."""
    runs: list[range] = []
    for n in sorted(set(numbers)):
        if runs and runs[-1].stop == n:
            runs[-1] = range(runs[-1].start, n + 1)
        else:
            runs.append(range(n, n + 1))
    return runs


def blob_range(index: Index, run: range) -> tuple[int, int]:
    """(offset, length) in the data blob covering the stored sectors of a run."""
    stored = [index.sectors[n] for n in run if not index.sectors[n].is_zero]
    if not stored:
        return 0, 0
    return stored[0].offset, stored[-1].offset + stored[-1].length - stored[0].offset
