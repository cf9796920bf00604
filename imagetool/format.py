"""The lazyblock block image format, versions 1 and 2. This module is its only owner.

A block image is an EROFS filesystem image (uncompressed, 4096-byte blocks) cut into
fixed-size *sectors*. Each sector is stored on its own: compressed with zstd (one frame) or,
in version 2, *raw* (its bytes as they are, when zstd would save too little). All-zero
sectors are not stored. Stored sectors are concatenated into *data blobs*; the *index* is a
canonical JSON document that describes the image and names the blobs.

Version 2 (what ``imagetool convert`` writes)::

    {
      "version": 2,
      "filesystem": {"type": "erofs", "block_size": 4096},
      "image_size": <bytes of the uncompressed filesystem image>,
      "sector_size": <power of two, default 4 MiB>,
      "compression": "zstd",
      "checksum": "xxh3-128",
      "blobs": [{"digest": "sha256:...", "size": <bytes>, "role": "metadata"|"hot"|"layer",
                 "layer": "<the source layer's descriptor digest>" or ""}, ...],
      "sectors": [[blob, blob_offset, stored_length, xxh3_128_hex, "zstd"|"raw"|"zero"], ...],
      "metadata_sectors": <how many leading sectors hold all metadata>,
      "prefetch": [sector numbers, hottest first],
      "source": {"manifest_digest": "sha256:...", "platform": "linux/amd64",
                 "config": {<OCI image config: Entrypoint, Cmd, Env, User, WorkingDir, ...>}},
      "files": [[path, image_offset, length], ...]   # regular files with data, by offset
    }

Each stored sector names its blob (a position in ``blobs``) and its byte range there. The
sectors of one blob, in sector order, are packed from its first byte to its last
(``blob_offset`` 0, then each one where the previous ended, ``size`` in all), so a run of
sectors that is contiguous in one blob is one ranged read. A ``"zero"`` sector has blob 0,
offset 0 and length 0 and is in no blob. A ``"raw"`` sector's stored bytes are its
uncompressed bytes (``stored_length`` is the sector's size): reading it costs a hash, not a
decompression. The last sector may be shorter than ``sector_size`` (the writer pads version 2
images to a whole number of sectors, see below).

Version 2's layout (``imagetool.erofs.writer.plan_erofs_regions``) puts the filesystem image
in *regions*, each starting on a sector boundary and each stored as one blob:

* ``metadata``: superblock, inodes, xattrs, directories and long symlinks (blocks from 0);
  image-specific and small.
* ``hot`` (only with a startup profile), one per source layer that holds profile files
  smaller than a sector: copies of those files, in that layer's tar order, packed (block
  aligned). The files' inodes point at these copies, so the files a start reads first are
  in few sectors; the layer regions keep their own bytes, so they stay shared. Tar order
  rather than first-access order, so two images whose profiles read the same files of a
  layer have the same hot region (and blob) for it.
* ``layer``, one per source layer with file data, in layer order: every regular file that
  layer's tar holds, in tar order, block aligned, a file of at least one sector starting on
  a sector boundary. A file that an upper layer replaces or deletes keeps its bytes in its
  layer's region, unreferenced (as the OCI layer itself keeps them).

A region's bytes depend on nothing but its source layer (and the conversion options), so an
unchanged layer gives the same sectors (the node cache, keyed by checksum, shares them) and,
zstd being deterministic for one level and version, the same blob digest (stores and
registries keep it once). A changed layer changes its own region and the metadata; the
regions of layers above it are untouched. A file of a sector or more starts a new sector,
so one that changes size leaves the sectors of the files before it alone. The image is
padded with zeros (not stored) to a whole number of sectors, so a region's last sector is
whole wherever the region sits.

Why one EROFS image with regions, not one EROFS image per layer (overlaid, or as erofs
extra devices): the kernel mount path stays one FUSE file and one erofs mount, the tree is
flattened once at conversion (whiteouts, opaque directories and hard links across layers
are resolved there, not by overlayfs at every lookup: an overlay of 6 layer images walked
a 27,500-file tree 1.24-1.29x slower and mounted 1.8x slower than the one image of the same
files, ``benchmarks/format/README.md``), and the sharing is the same: it comes from the
regions' bytes, not from how they are mounted. Why hot copies rather than profile order
inside the layer regions: a region laid out by one image's profile would differ between
images, and with it the blob; copies cost the hot files' bytes once more (per image and
layer, and the same blob for images whose profiles read the same files of a layer).

Version 1 (still read everywhere; ``imagetool convert --format-version 1`` writes it) has no
``blobs``: ``"blob": {"digest": ..., "size": ...}`` names the one data blob, sector rows are
``[blob_offset, compressed_length, xxh3_128_hex]`` (length 0: all zeros), every stored sector
is zstd, the image is laid out metadata first and then file data in layout order (profile
files first), and ``files`` is in layout order.

The index is stored as that document compressed into one zstd frame (media type
``INDEX_MEDIA_TYPE``, for both versions: the document says which; a 200,000-file image's 9.7
MB of JSON is 1.1 MB), and named by the sha256 of the stored bytes. Readers also accept it
uncompressed (``INDEX_JSON_MEDIA_TYPE``, what images written before compression carry).

Multi-platform block images (``imagetool convert --platform all`` or ``os/arch,os/arch``):
one block image per platform, as above, and a *platform index* naming them, an OCI image
index (``PLATFORM_INDEX_MEDIA_TYPE``, canonical JSON, written by ``platform_index_bytes``)::

    {"manifests": [{"digest": "sha256:...", "mediaType": "...", "size": <bytes>,
                    "platform": {"architecture": "amd64", "os": "linux"}}, ...],
     "mediaType": "application/vnd.oci.image.index.v1+json", "schemaVersion": 2}

with one entry per platform, in the order of the source's index. In an OCI registry it is
an ordinary image index whose entries are the block images' manifests
(``imagetool.stores.registry``), what containerd and the kubelet resolve by platform. In a
directory or S3 store its entries are the block images' indexes (``INDEX_MEDIA_TYPE``), it
is stored as a blob like them, and the tag's ref names it with its media type after the
digest (``sha256:<hex> application/vnd.oci.image.index.v1+json``; a block image's ref is the
digest alone): the per-platform images have no tag of their own, a platform index names
them by digest. The index is written last, once every platform's image is stored, so a
reader never sees a platform index naming an image that is not there. Readers resolve a
reference to a platform index to one block image, the running machine's platform unless
told another (``imagetool.platforms``, containerd's matching), in the one place that
resolves references, ``Store.resolve_ref``. Readers older than platform indexes report such
a tag as corrupt (directory, S3) or as a multi-platform index (registry).

The checksum is always over the *uncompressed* bytes of the sector. Blobs are named by the
sha256 of their bytes. Readers never return bytes that ``Index.decode_sector`` (or
``decode_sector_into``, ``verify_raw``) has not verified.
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
from imagetool.platforms import Platform

try:  # decoding and hashing in one pass, compiled (setup.py); optional
    from imagetool import _sectorcodec
except ImportError:  # not built here: python-zstandard and python-xxhash do the same work
    _sectorcodec = None  # type: ignore[assignment]

FORMAT_VERSION = 2  # what the converter writes
FORMAT_VERSIONS = (1, 2)  # what readers read
FS_TYPE = "erofs"
# EROFS block size; equal to the page size so the kernel maps blocks straight to pages.
FS_BLOCK_SIZE = 4096
# 4 MiB: big enough that a fetch amortises a round trip, small enough that a cold read of one
# small file does not drag in much that is unused (the figure production systems settled on).
DEFAULT_SECTOR_SIZE = 4 << 20
MIN_SECTOR_SIZE = 64 << 10
MAX_SECTOR_SIZE = 64 << 20
DEFAULT_ZSTD_LEVEL = 3
# A sector whose zstd form saves less than this share of its size is stored raw (version 2):
# then reading it costs a hash (xxh3: 0.02 CPU-s per GB) instead of a decompression (0.95
# CPU-s per GB for fp16 weights, which zstd -3 saves 8 % of), benchmarks/format/README.md.
DEFAULT_RAW_SAVING = 0.10
# The index's zstd level: its JSON compresses best at low levels (9.7 MB of paths: level 1
# 1.11 MB, 3 1.47 MB, 9 1.17 MB at ten times the time).
INDEX_ZSTD_LEVEL = 1
# An index larger than this, uncompressed, is refused (a 200,000-file image's is 9.7 MB).
MAX_INDEX_BYTES = 1 << 30
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
COMPRESSION = "zstd"
CHECKSUM = "xxh3-128"
# A version 2 sector's encoding.
ENCODINGS = (ENCODING_ZSTD, ENCODING_RAW, ENCODING_ZERO) = ("zstd", "raw", "zero")
# Blob roles: v1's one blob; v2's metadata, hot-copy and source-layer regions.
BLOB_ROLES = (ROLE_DATA, ROLE_METADATA, ROLE_HOT, ROLE_LAYER) = ("data", "metadata", "hot", "layer")

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
ANNOTATION_BLOB_DIGEST = "dev.lazyblock.blob.digest"  # the data blobs' digests, comma-separated
ANNOTATION_BLOB_ROLE = "dev.lazyblock.blob.role"  # a data blob's Blob.role
ANNOTATION_SOURCE_LAYER = "dev.lazyblock.source.layer"  # a data blob's Blob.layer
# A multi-platform block image's index of per-platform images: an OCI image index.
PLATFORM_INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
# A platform index larger than this is refused (an entry is about 200 bytes).
MAX_PLATFORM_INDEX_BYTES = 1 << 20


@dataclass(frozen=True)
class PlatformEntry:
    """One image of a platform index: the block image's index (directory, S3) or manifest
    (registry), and its platform."""

    media_type: str
    digest: str
    size: int
    platform: Platform


def platform_index_bytes(entries: Sequence[PlatformEntry]) -> bytes:
    """A platform index (deterministic bytes: canonical JSON, entries in the given order)."""
    if not entries:
        raise FormatError("a platform index needs at least one image")
    doc = {
        "schemaVersion": 2,
        "mediaType": PLATFORM_INDEX_MEDIA_TYPE,
        "manifests": [
            {"mediaType": e.media_type, "digest": check_digest(e.digest), "size": e.size,
             "platform": e.platform.to_json()}
            for e in entries
        ],
    }  # fmt: skip
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def parse_platform_index(data: bytes, where: str) -> list[PlatformEntry]:
    """The entries of a platform index (or of any OCI image index: entries without a
    platform or a sha256 digest are left out); ``FormatError`` if it is not an index."""
    if len(data) > MAX_PLATFORM_INDEX_BYTES:
        raise FormatError(f"{where}: image index of {len(data)} bytes is too large")
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise FormatError(f"{where}: image index is not valid JSON") from None
    manifests = doc.get("manifests") if isinstance(doc, dict) else None
    if not isinstance(manifests, list):
        raise FormatError(f"{where}: not an image index (no manifests list)")
    out = []
    for m in manifests:
        if not isinstance(m, dict):
            continue
        platform = Platform.from_json(m.get("platform"))
        digest, size = m.get("digest"), m.get("size")
        if platform is None or not isinstance(digest, str) or not isinstance(size, int):
            continue
        try:
            check_digest(digest)
        except FormatError:
            continue
        out.append(PlatformEntry(str(m.get("mediaType") or ""), digest, size, platform))
    return out


def is_platform_index(data: bytes) -> bool:
    """Whether a stored blob is a platform index rather than a block image's index (which
    is zstd or a JSON document with a ``version``)."""
    if data[:4] == _ZSTD_MAGIC or len(data) > MAX_PLATFORM_INDEX_BYTES:
        return False
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get("manifests"), list)


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def sector_checksum(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


# Bytes hashed both ways at a time by ``checksum_and_blocks``: well inside a core's L2.
FUSED_CHUNK = 256 << 10


def block_digests(data: bytes | memoryview, block: int) -> bytes:
    """The xxh3-64 of each ``block``-byte block of ``data`` (the last one short),
    concatenated (8 bytes each, as ``xxhash.xxh3_64_digest``)."""
    if block <= 0:
        raise ValueError(f"block size {block}")
    if _sectorcodec is not None:
        return _sectorcodec.hash_blocks(data, block, False)[1]
    return b"".join(_block_digests(memoryview(data), block))


def _block_digests(view: memoryview, block: int) -> list[bytes]:
    """python-xxhash's xxh3-64 of each ``block``-byte block of ``view``."""
    digest = xxhash.xxh3_64_digest
    return [digest(view[i : i + block]) for i in range(0, len(view), block)]


def checksum_and_blocks(data: bytes | memoryview, block: int) -> tuple[str, bytes]:
    """``sector_checksum(data)``, and the xxh3-64 of each ``block``-byte block of ``data``
    (the last one short), concatenated: what a reader that checks blocks of a sector on
    their own needs (the node cache's entries). In one pass over memory: each chunk is
    hashed both ways while it is in the CPU's cache, where hashing a 4 MiB sector twice
    reads it twice from memory (a third less CPU for the two hashes, measured here)."""
    if block <= 0:
        raise ValueError(f"block size {block}")
    if _sectorcodec is not None:
        checksum, blocks = _sectorcodec.hash_blocks(data, block)
        return checksum.hex(), blocks
    view = memoryview(data)
    whole = xxhash.xxh3_128()
    step = max(block, FUSED_CHUNK // block * block)
    parts: list[bytes] = []
    for start in range(0, len(view), step):
        chunk = view[start : start + step]
        whole.update(chunk)
        parts += _block_digests(chunk, block)
    return whole.hexdigest(), b"".join(parts)


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


def check_layer_digest(digest: str) -> str:
    """Validate a source layer's digest (``sha256:`` or ``sha512:``, as OCI allows) and
    return it."""
    algo, _, hexpart = digest.partition(":")
    if algo == "sha512" and len(hexpart) == 128 and all(c in "0123456789abcdef" for c in hexpart):
        return digest
    return check_digest(digest)


def check_sector_size(size: int) -> int:
    if size < MIN_SECTOR_SIZE or size > MAX_SECTOR_SIZE or size & (size - 1):
        raise FormatError(
            f"sector size must be a power of two between {MIN_SECTOR_SIZE} and "
            f"{MAX_SECTOR_SIZE} bytes, got {size}"
        )
    return size


@dataclass(frozen=True, slots=True)
class Sector:
    """Where one sector lives: ``length`` bytes at ``offset`` of blob number ``blob``,
    zstd-compressed or (``raw``) as they are. ``length == 0`` means all zeros."""

    offset: int
    length: int
    checksum: str
    blob: int = 0
    raw: bool = False

    @property
    def is_zero(self) -> bool:
        return self.length == 0

    @property
    def encoding(self) -> str:
        if self.length == 0:
            return ENCODING_ZERO
        return ENCODING_RAW if self.raw else ENCODING_ZSTD


@dataclass(frozen=True, slots=True)
class Blob:
    """One data blob of an image: its digest and size, which region of the image it holds
    (``role``) and, for a region of a source layer, that layer's digest."""

    digest: str
    size: int
    role: str = ROLE_DATA
    layer: str = ""


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

    def at_least(self, length: int) -> tuple[FileExtent, ...]:
        """The files of ``length`` bytes or more, without building the others' extents (a
        tenth of the cost for a 200,000-file image, at the mount)."""
        rows = self._rows
        if rows is None:
            return tuple(f for f in self._built() if f.length >= length)
        try:
            big = [r for r in rows if r[2] >= length]
        except (TypeError, IndexError):
            big = list(rows)  # malformed: the full check below says how
        return tuple(f for f in _file_extents(big) if f.length >= length)

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
    blobs: tuple[Blob, ...]
    prefetch: tuple[int, ...] = ()
    manifest_digest: str = ""
    platform: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    files: Sequence[FileExtent] = ()  # a tuple, or the parser's FileMap
    block_size: int = FS_BLOCK_SIZE
    version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        check_sector_size(self.sector_size)
        if self.version not in FORMAT_VERSIONS:
            raise FormatError(f"unsupported block image format version {self.version!r}")
        if self.block_size != FS_BLOCK_SIZE:
            raise FormatError(f"unsupported filesystem block size {self.block_size}")
        expected = -(-self.image_size // self.sector_size)
        if len(self.sectors) != expected:
            raise FormatError(f"index has {len(self.sectors)} sectors, image size needs {expected}")
        if not 0 <= self.metadata_sectors <= len(self.sectors):
            raise FormatError("metadata_sectors out of range")
        if self.version == 1 and (len(self.blobs) != 1 or self.blobs[0].role != ROLE_DATA):
            raise FormatError("a version 1 index names exactly one data blob")
        for blob in self.blobs:
            check_digest(blob.digest)
            if blob.role not in BLOB_ROLES:
                raise FormatError(f"blob {blob.digest}: unknown role {blob.role!r}")
            if blob.layer:
                check_layer_digest(blob.layer)
        self._check_sectors()
        for p in self.prefetch:
            if not 0 <= p < len(self.sectors):
                raise FormatError(f"prefetch names sector {p}, which does not exist")

    def _check_sectors(self) -> None:
        """Each blob's sectors, in sector order, are a packed sequence of its ranges that
        ends at its size; a raw sector's stored length is its size."""
        ends = [0] * len(self.blobs)
        for n, s in enumerate(self.sectors):
            if s.is_zero:
                if self.version > 1 and (s.blob or s.offset or s.raw):
                    raise FormatError(f"sector {n}: an all-zero sector names a blob range")
                continue
            if not 0 <= s.blob < len(self.blobs):
                raise FormatError(f"sector {n} names blob {s.blob}, which does not exist")
            if s.raw and (self.version == 1 or s.length != self.sector_span(n)[1]):
                raise FormatError(f"sector {n}: raw, but {s.length} bytes stored")
            if s.offset != ends[s.blob] or s.length < 0:
                raise FormatError("sector table is not a packed sequence of blob ranges")
            ends[s.blob] += s.length
        for blob, end in zip(self.blobs, ends, strict=True):
            if end != blob.size:
                raise FormatError(
                    f"sectors cover {end} bytes of blob {blob.digest}, which has {blob.size}"
                )

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

    def blob_of(self, number: int) -> Blob:
        """The blob that holds sector ``number`` (not an all-zero one)."""
        return self.blobs[self.sectors[number].blob]

    # --- sector decoding ------------------------------------------------------------------

    def decode_sector(self, number: int, stored: bytes) -> bytes:
        """Decode and verify sector ``number`` from its stored bytes.

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
        self._check_stored_length(number, stored)
        if entry.raw:
            self.verify_raw(number, stored)
            return bytes(stored)
        try:
            return decode_stored(stored, entry.checksum, size)
        except ChecksumError as e:
            raise ChecksumError(f"sector {number}: {e}") from None

    def decode_sector_into(
        self, number: int, stored: bytes | memoryview, out: memoryview, block: int = 0
    ) -> bytes:
        """``decode_sector`` into ``out`` (exactly the sector's size, not all zeros): the
        caller's memory instead of new bytes. Raises ``ChecksumError`` as ``decode_sector``
        does, and then what ``out`` holds is not the sector: it must not be used. A raw
        sector received straight into its memory needs no copy: ``verify_raw``. With
        ``block``, returns the digest of each ``block``-byte block of the sector, hashed
        with its checksum (``checksum_and_blocks``); else b""."""
        entry = self.sectors[number]
        _, size = self.sector_span(number)
        if entry.is_zero or len(out) != size:
            raise ValueError(f"sector {number}: {len(out)} bytes of room, not {size} stored")
        self._check_stored_length(number, stored)
        if entry.raw:
            out[:] = stored
            return self.verify_raw(number, out, block)
        try:
            return decode_stored_into(stored, entry.checksum, out, block)
        except ChecksumError as e:
            raise ChecksumError(f"sector {number}: {e}") from None

    def verify_raw(self, number: int, data: bytes | memoryview, block: int = 0) -> bytes:
        """Check that ``data``, the stored bytes of raw sector ``number``, are that sector:
        its size and checksum. Raises ``ChecksumError`` (or ``ValueError`` for a sector
        that is not raw). ``block``: as ``decode_sector_into``."""
        entry = self.sectors[number]
        if not entry.raw:
            raise ValueError(f"sector {number} is not stored raw")
        if len(data) != entry.length:
            raise ChecksumError(f"sector {number}: checksum mismatch")
        checksum, blocks = _checksum_of(data, block)
        if checksum != entry.checksum:
            raise ChecksumError(f"sector {number}: checksum mismatch")
        return blocks

    def _check_stored_length(self, number: int, stored: bytes | memoryview) -> None:
        if len(stored) != self.sectors[number].length:
            raise ChecksumError(
                f"sector {number}: got {len(stored)} stored bytes, "
                f"expected {self.sectors[number].length}"
            )

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
        doc: dict[str, Any] = {
            "version": self.version,
            "filesystem": {"type": FS_TYPE, "block_size": self.block_size},
            "image_size": self.image_size,
            "sector_size": self.sector_size,
            "compression": COMPRESSION,
            "checksum": CHECKSUM,
            "metadata_sectors": self.metadata_sectors,
            "prefetch": list(self.prefetch),
            "source": {
                "manifest_digest": self.manifest_digest,
                "platform": self.platform,
                "config": self.config,
            },
            "files": [[f.path, f.offset, f.length] for f in self.files],
        }
        if self.version == 1:
            doc["sectors"] = [[s.offset, s.length, s.checksum] for s in self.sectors]
            doc["blob"] = {"digest": self.blobs[0].digest, "size": self.blobs[0].size}
        else:
            doc["sectors"] = [
                [s.blob, s.offset, s.length, s.checksum, s.encoding] for s in self.sectors
            ]
            doc["blobs"] = [
                {"digest": b.digest, "size": b.size, "role": b.role, "layer": b.layer}
                for b in self.blobs
            ]
        return doc

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
        if version not in FORMAT_VERSIONS:
            raise FormatError(f"unsupported block image format version {version!r}")
        try:
            fs = doc["filesystem"]
            if fs["type"] != FS_TYPE:
                raise FormatError(f"unsupported filesystem type {fs['type']!r}")
            if doc["compression"] != COMPRESSION or doc["checksum"] != CHECKSUM:
                raise FormatError("unsupported compression or checksum algorithm")
            source = doc.get("source", {})
            if version == 1:
                sectors = tuple(Sector(_int(o), _int(n), _hex(c)) for o, n, c in doc["sectors"])
                blob = doc["blob"]
                blobs: tuple[Blob, ...] = (Blob(str(blob["digest"]), _int(blob["size"])),)
            else:
                sectors = tuple(_sector_v2(row) for row in doc["sectors"])
                blobs = tuple(
                    Blob(str(b["digest"]), _int(b["size"]), str(b["role"]), str(b["layer"]))
                    for b in doc["blobs"]
                )
            return cls(
                image_size=_int(doc["image_size"]),
                sector_size=_int(doc["sector_size"]),
                sectors=sectors,
                metadata_sectors=_int(doc["metadata_sectors"]),
                prefetch=tuple(_int(p) for p in doc.get("prefetch", [])),
                blobs=blobs,
                manifest_digest=str(source.get("manifest_digest", "")),
                platform=str(source.get("platform", "")),
                config=dict(source.get("config", {})),
                files=_file_map(doc["files"]),
                block_size=_int(fs["block_size"]),
                version=version,
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, FormatError):
                raise
            raise FormatError(f"malformed index: {type(e).__name__}: {e}") from None


def _sector_v2(row: Any) -> Sector:
    blob, offset, length, checksum, encoding = row
    if encoding not in ENCODINGS or ((encoding == ENCODING_ZERO) != (length == 0)):
        raise FormatError(f"sector encoding {encoding!r} with {length!r} bytes stored")
    return Sector(_int(offset), _int(length), _hex(checksum), _int(blob), encoding == ENCODING_RAW)


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


def decode_stored_into(
    stored: bytes | memoryview, checksum: str, out: memoryview, block: int = 0
) -> bytes:
    """``decode_stored`` into ``out``, whose length is the sector's size: its stored bytes
    must decode to exactly that many bytes, which hash to ``checksum``. On
    ``ChecksumError``, ``out`` holds no sector. ``block``: as
    ``Index.decode_sector_into``."""
    if _sectorcodec is not None:
        # Decoded and hashed a slice at a time (imagetool/_sectorcodec.c).
        try:
            produced, raw_checksum, blocks = _sectorcodec.decode_into(stored, out, block)
        except ValueError as e:
            raise ChecksumError(f"undecodable ({e})") from None
        if produced != len(out) or raw_checksum.hex() != checksum:
            raise ChecksumError("checksum mismatch")
        return blocks
    done = 0
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(stored, read_across_frames=False)
        while done < len(out) and (got := reader.readinto(out[done:])):
            done += got
        longer = bool(reader.read(1))
    except zstandard.ZstdError as e:
        raise ChecksumError(f"undecodable ({e})") from None
    if done != len(out) or longer:
        raise ChecksumError("checksum mismatch")
    got_checksum, blocks = _checksum_of(out, block)
    if got_checksum != checksum:
        raise ChecksumError("checksum mismatch")
    return blocks


def _checksum_of(data: bytes | memoryview, block: int) -> tuple[str, bytes]:
    """(checksum, block digests) of ``data``: ``checksum_and_blocks`` with ``block``, the
    checksum alone and b"" without."""
    return checksum_and_blocks(data, block) if block else (sector_checksum(data), b"")


def coalesce(numbers: Iterable[int]) -> list[range]:
    """Group sector numbers into runs of consecutive numbers (for coalesced ranged reads)."""
    runs: list[range] = []
    for n in sorted(set(numbers)):
        if runs and runs[-1].stop == n:
            runs[-1] = range(runs[-1].start, n + 1)
        else:
            runs.append(range(n, n + 1))
    return runs


def blob_runs(index: Index, numbers: Iterable[int]) -> list[list[int]]:
    """The stored sectors among ``numbers`` grouped into runs that are contiguous in one blob
    (each sector begins where the one before it in the run ended: only all-zero sectors, or
    other blobs' sectors, lie between them), each run one ranged read; by first sector."""
    sectors = index.sectors
    runs: list[list[int]] = []
    latest: dict[int, list[int]] = {}  # blob -> its run so far
    for n in sorted(set(numbers)):
        s = sectors[n]
        if s.is_zero:
            continue
        run = latest.get(s.blob)
        if run is not None:
            p = sectors[run[-1]]
            if p.offset + p.length == s.offset:
                run.append(n)
                continue
        latest[s.blob] = [n]
        runs.append(latest[s.blob])
    return runs


def blob_range(index: Index, run: Sequence[int]) -> tuple[Blob, int, int]:
    """(blob, offset, length) covering the stored sectors of ``run`` (stored sectors
    contiguous in one blob, as ``blob_runs`` makes them; all-zero ones are skipped)."""
    stored = [index.sectors[n] for n in run if not index.sectors[n].is_zero]
    if not stored:
        raise ValueError("a run of all-zero sectors is in no blob")
    first, last = stored[0], stored[-1]
    return index.blobs[first.blob], first.offset, last.offset + last.length - first.offset
