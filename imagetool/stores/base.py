"""The store interface: where block images live.

A store holds content-addressed blobs (the index and the data blob of each image, named by
sha256) and tags (``name:tag`` -> index digest). Every backend supports ranged reads, which is
all the snapshotter needs at run time. A ``Store`` object is bound to one image *name* (for a
registry, one repository); blobs may be shared between names where the backend allows it.

Publishing is ordered so that a reader never sees a half-written image: blobs first (each
written under a temporary name and moved into place, or verified by the server), the tag last.
Backend errors are mapped to ``imagetool.errors`` inside each backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from imagetool.registry.hosts import HostsConfig
    from imagetool.stores.refs import ImageRef


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
        from imagetool.errors import StoreError

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
        from imagetool.errors import NotFoundError

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
        from imagetool.errors import DigestMismatchError
        from imagetool.format import sha256_digest

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

    def resolve_ref(self, ref: ImageRef) -> str:
        """The index digest a reference names: its digest (checked to be present) or its tag.

        Backends whose references carry another kind of digest (a registry's manifest
        digest) override this."""
        from imagetool.errors import NotFoundError

        if ref.digest is None:
            return self.resolve(ref.tag or "latest")
        if not self.has_blob(ref.digest):
            raise NotFoundError(f"index {ref.digest} not found in {self.url}")
        return ref.digest

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
