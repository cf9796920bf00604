"""The store interface: where block images live.

A store holds content-addressed blobs (the index and the data blob of each image, named by
sha256) and tags (``name:tag`` -> index digest). Every backend supports ranged reads, which is
all the snapshotter needs at run time. A ``Store`` object is bound to one image *name* (for a
registry, one repository); blobs may be shared between names where the backend allows it.

Publishing is ordered so that a reader never sees a half-written image: blobs first (each
written under a temporary name and moved into place, or verified by the server), the tag last.
A multi-platform image is each platform's image stored untagged (``put_image``), then a
platform index naming them under the tag (``publish_index``, ``imagetool.format``);
``resolve_ref`` resolves a reference to one to the image for a platform, the running
machine's by default: the one place readers (``imagetool.image``, the snapshotter's mounts)
pick a platform.
Backend errors are mapped to ``imagetool.errors`` inside each backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from imagetool.errors import DigestMismatchError, FormatError, NotFoundError, StoreError
from imagetool.format import (
    INDEX_MEDIA_TYPES,
    MAX_PLATFORM_INDEX_BYTES,
    PLATFORM_INDEX_MEDIA_TYPE,
    Index,
    PlatformEntry,
    index_media_type,
    is_platform_index,
    parse_platform_index,
    platform_index_bytes,
    sha256_digest,
)
from imagetool.platforms import Platform, default_platform, select_platform
from imagetool.stores.refs import ImageRef, check_tag

if TYPE_CHECKING:
    from imagetool.registry.hosts import HostsConfig


@dataclass(frozen=True)
class StoreOptions:
    """Connection options shared by all backends (parsed once at the CLI edge)."""

    plain_http: bool = False  # registry over http://; only meant for loopback tests
    timeout: float = 30.0  # seconds per request
    retries: int = 3  # attempts after the first for idempotent reads
    docker_config: Path | None = None  # default: $DOCKER_CONFIG/config.json or ~/.docker/...
    # (username, secret) for the registry host, given at run time (e.g. by a CRI pull):
    # used instead of docker_config; held in memory, never written or shown in a repr.
    credentials: tuple[str, str] | None = field(default=None, repr=False)
    # containerd's registry hosts directory, read (``imagetool.registry.hosts``): the
    # mirrors to read blobs from and each registry's server; None: the registries alone.
    registry_hosts: HostsConfig | None = None
    mirror_timeout: float = 5.0  # seconds a mirror may take to connect or send more bytes
    mirror_backoff: float = 30.0  # seconds a failed mirror is skipped (doubling, capped)


class RangeBody(ABC):
    """The bytes of one ranged read of a blob (``Store.open_range``), consumed in order with
    ``readinto``; a context manager that releases the connection or file behind it."""

    def __init__(self, where: str, length: int) -> None:
        self.where = where  # for messages: the store and the blob
        self.length = length
        self.position = 0  # bytes of the range consumed so far

    def readinto(self, out: memoryview) -> None:
        """Fill ``out`` with the next ``len(out)`` bytes of the range; ``StoreError`` if the
        body ends first (store errors as ``read_range`` raises them)."""

        want = len(out)
        if self.position + want > self.length:
            raise ValueError(f"read past the range: {self.position}+{want} of {self.length}")
        end = self.position + want
        while self.position < end:
            n = self._read_some(out[want - (end - self.position) :])
            if n <= 0:
                raise StoreError(
                    f"{self.where}: the range ended after {self.position} of {self.length} bytes"
                )
            self.position += n

    def read_some(self, out: memoryview) -> int:
        """Up to ``len(out)`` (> 0) of the next bytes of the range into ``out``; how many
        (0 at its end). Errors as ``readinto``."""
        if self.position >= self.length or not out:
            return 0
        n = self._read_some(out[: self.length - self.position])
        self.position += n
        return n

    @abstractmethod
    def _read_some(self, out: memoryview) -> int:
        """Up to ``len(out)`` (> 0) bytes from ``position`` on into ``out``; how many, 0
        at the end."""

    def reject(self, reason: str) -> None:  # noqa: B027 - optional hook
        """The caller found the bytes it read last (``readinto``) to be corrupt: a store
        that has other sources for them (registry mirrors) stops using this one for a
        while. The caller asks for them again; nothing is returned here."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the connection or file."""

    def __enter__(self) -> RangeBody:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BytesBody(RangeBody):
    """A range already read whole."""

    def __init__(self, where: str, data: bytes) -> None:
        super().__init__(where, len(data))
        self._data = memoryview(data)

    def _read_some(self, out: memoryview) -> int:
        n = min(len(out), len(self._data) - self.position)
        out[:n] = self._data[self.position : self.position + n]
        return n


class Store(ABC):
    """One image name in one store."""

    url: str  # the store's own reference, e.g. "/srv/images", "s3://b/p", "docker://h/r"
    name: str

    # --- blobs ----------------------------------------------------------------------------

    def has_blob(self, digest: str) -> bool:

        try:
            self.blob_size(digest)
        except NotFoundError:
            return False
        return True

    @abstractmethod
    def blob_size(self, digest: str) -> int:
        """Size in bytes; ``NotFoundError`` if absent."""

    @abstractmethod
    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``offset`` of a blob (``StoreError`` if short)."""

    def open_range(self, digest: str, offset: int, length: int) -> RangeBody:
        """The bytes ``read_range`` returns, to be read in order as they arrive: a reader of
        a long range can use its first bytes before the last are in, and reads them into
        its own buffers. Backends that can stream override this; by default the whole range
        is read first."""
        return BytesBody(f"{self.url}: blob {digest}", self.read_range(digest, offset, length))

    def read_blob(self, digest: str) -> bytes:
        """A whole (small) blob, verified against its digest."""

        memo = self.__dict__.pop("_read_memo", None)
        if memo is not None and memo[0] == digest:
            return memo[1]  # read (and verified) by resolve_ref a moment ago
        data = self.read_range(digest, 0, self.blob_size(digest))
        if sha256_digest(data) != digest:
            raise DigestMismatchError(f"blob {digest} in {self.url} does not match its digest")
        return data

    def source_stats(self) -> list[dict[str, Any]]:
        """What each host this store reads blobs from did (a registry's mirrors and server,
        ``imagetool.registry.mirrors``): one dict per host; empty for a store of one
        source."""
        return []

    @abstractmethod
    def put_blob(self, digest: str, source: Path | bytes, media_type: str) -> None:
        """Store a blob whose digest the caller computed; a no-op if it is already there."""

    # --- tags -----------------------------------------------------------------------------

    @abstractmethod
    def resolve(self, tag: str) -> str:
        """The index digest that ``name:tag`` points to; ``NotFoundError`` if none."""

    @abstractmethod
    def publish(self, tag: str, index_bytes: bytes) -> str:
        """Point ``name:tag`` at an index whose blobs are already stored; returns the index
        digest. This is the commit point of a conversion."""

    @abstractmethod
    def list_tags(self) -> list[str]: ...

    def resolve_ref(self, ref: ImageRef, platform: str | None = None) -> str:
        """The index digest of the block image a reference names: its digest (checked to be
        present) or its tag's. A reference to a multi-platform image (a platform index)
        resolves to the image for ``platform`` (``os/arch[/variant]``; default: the running
        machine's), or ``NotFoundError`` listing the platforms it has.

        Backends whose references carry another kind of digest (a registry's manifest
        digest) override this."""

        digest, media_type = self.resolve_target(ref)
        if media_type != PLATFORM_INDEX_MEDIA_TYPE:
            return digest
        return self._platform_image(digest, platform, str(ref))

    def resolve_target(self, ref: ImageRef) -> tuple[str, str]:
        """(digest, media type) of what a reference names, a platform index not followed:
        a block image's index (media type "") or a platform index
        (``format.PLATFORM_INDEX_MEDIA_TYPE``)."""

        if ref.digest is None:
            return self.resolve_tag(ref.tag or "latest")
        try:
            size = self.blob_size(ref.digest)
        except NotFoundError:
            raise NotFoundError(f"index {ref.digest} not found in {self.url}") from None
        if size <= MAX_PLATFORM_INDEX_BYTES:  # a digest may name either: look (and keep it)
            data = self.read_blob(ref.digest)
            self.__dict__["_read_memo"] = (ref.digest, data)
            if is_platform_index(data):
                return ref.digest, PLATFORM_INDEX_MEDIA_TYPE
        return ref.digest, ""

    def resolve_tag(self, tag: str) -> tuple[str, str]:
        """(digest, media type) of what ``name:tag`` points to (see ``resolve_target``).
        Backends that store platform indexes override this."""
        return self.resolve(tag), ""

    def _platform_image(self, digest: str, platform: str | None, where: str) -> str:
        """The index digest of ``platform``'s image in the platform index ``digest``."""

        entries = parse_platform_index(self.read_blob(digest), where)
        want = Platform.parse(platform or default_platform())
        entry = select_platform(entries, lambda e: e.platform, want, where)
        if entry.media_type not in INDEX_MEDIA_TYPES:
            raise FormatError(
                f"{where}: the image for {entry.platform} is a {entry.media_type!r}, not a "
                "lazyblock index"
            )
        return entry.digest

    def put_image(self, index_bytes: bytes) -> PlatformEntry:
        """Store a block image untagged (its data blobs already stored), for a platform
        index to name (``publish_index``); returns its entry there (the platform from the
        index). Here the entry is the image's index; a registry's is its manifest."""

        index = check_publishable(self, None, index_bytes)
        digest = sha256_digest(index_bytes)
        media_type = index_media_type(index_bytes)
        self.put_blob(digest, index_bytes, media_type)
        return PlatformEntry(media_type, digest, len(index_bytes), Platform.parse(index.platform))

    def publish_index(self, tag: str, entries: list[PlatformEntry]) -> str:
        """Point ``name:tag`` at a platform index of images already stored (``put_image``);
        returns its digest. The commit point of a multi-platform conversion."""

        check_tag(tag)
        data = platform_index_bytes(entries)
        for e in entries:
            self.blob_size(e.digest)  # NotFoundError: put_image first
        digest = sha256_digest(data)
        self.put_blob(digest, data, PLATFORM_INDEX_MEDIA_TYPE)
        self._write_ref(tag, digest, PLATFORM_INDEX_MEDIA_TYPE)
        return digest

    def _write_ref(self, tag: str, digest: str, media_type: str) -> None:
        """Point the tag at ``digest`` (a platform index when ``media_type`` says so)."""

        raise StoreError(f"{self.url}: this store cannot hold multi-platform images")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_publishable(store: Store, tag: str | None, index_bytes: bytes) -> Index:
    """Validate a publish: a good tag (None: an untagged image, ``Store.put_image``), a
    well-formed index, its data blobs present in full."""
    if tag is not None:
        check_tag(tag)
    index = Index.from_bytes(index_bytes)
    what = f"{store.name}:{tag}" if tag is not None else f"the {index.platform} image"
    for blob in index.blobs:
        try:
            size = store.blob_size(blob.digest)
        except NotFoundError:
            raise NotFoundError(
                f"{store.url}: cannot publish {what}: data blob {blob.digest} "
                "is not in the store (put it first)"
            ) from None
        if size != blob.size:
            raise StoreError(
                f"{store.url}: cannot publish {what}: data blob {blob.digest} "
                f"has {size} bytes, the index says {blob.size}"
            )
    return index
