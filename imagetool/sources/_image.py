"""What every source shares: the ``Layer`` and ``SourceImage`` types, descriptors, platform
matching, and the walk from a manifest or index down to one image's config and layers.

A backend only knows how to find bytes: ``_read_blob`` (small documents: manifests,
configs) and ``_open_blob`` (a layer's stored bytes as a stream). Everything read is checked
against the digest that names it: manifests and configs here, layers by ``LayerStream``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from imagetool.errors import (
    DigestMismatchError,
    InvalidSourceError,
    NotFoundError,
    UnsupportedMediaTypeError,
)
from imagetool.platforms import Platform, default_platform
from imagetool.platforms import select_platform as _select
from imagetool.sources import _media
from imagetool.sources._stream import HASH_ALGORITHMS, LayerStream

log = logging.getLogger(__name__)

# Manifests and configs are small JSON documents; refuse absurd ones before reading them.
MAX_DOCUMENT_SIZE = 16 << 20
# Nested indexes are legal but rare; a bound keeps a hostile source from looping.
MAX_INDEX_DEPTH = 4

_DIGEST_RE = re.compile(r"^(sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128})$")


class MissingBlobError(InvalidSourceError, NotFoundError):
    """A blob the image refers to is not in the source (both a broken source and a miss)."""


def check_digest(digest: Any, what: str) -> str:
    """A valid ``sha256:``/``sha512:`` digest, or ``InvalidSourceError``."""
    if not isinstance(digest, str) or not _DIGEST_RE.match(digest):
        raise InvalidSourceError(f"{what}: invalid digest {digest!r}")
    return digest


def compute_digest(data: bytes, algorithm: str = "sha256") -> str:
    assert algorithm in HASH_ALGORITHMS
    return f"{algorithm}:{hashlib.new(algorithm, data).hexdigest()}"


def verify_bytes(data: bytes, digest: str, what: str, size: int | None = None) -> bytes:
    if size is not None and len(data) != size:
        raise DigestMismatchError(f"{what}: {len(data)} bytes, descriptor says {size}")
    got = compute_digest(data, digest.partition(":")[0])
    if got != digest:
        raise DigestMismatchError(f"{what}: content does not match digest {digest} (got {got})")
    return data


def parse_json(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidSourceError(f"{what}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise InvalidSourceError(f"{what}: not a JSON object")
    return doc


# --- descriptors and platforms ---------------------------------------------------------------


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: dict[str, Any] | None = None
    annotations: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, doc: Any, what: str) -> Descriptor:
        if not isinstance(doc, dict):
            raise InvalidSourceError(f"{what}: descriptor is not a JSON object")
        size = doc.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidSourceError(f"{what}: descriptor has invalid size {size!r}")
        media_type = doc.get("mediaType", "")
        plat = doc.get("platform")
        annotations = doc.get("annotations") or {}
        if not isinstance(media_type, str) or not isinstance(annotations, dict):
            raise InvalidSourceError(f"{what}: malformed descriptor")
        return cls(
            media_type=media_type,
            digest=check_digest(doc.get("digest"), what),
            size=size,
            platform=plat if isinstance(plat, dict) else None,
            annotations=annotations,
        )


def select_platform(manifests: list[Descriptor], want: Platform, what: str) -> Descriptor:
    """The index entry for ``want`` (``imagetool.platforms.select_platform``)."""
    return _select(manifests, lambda d: Platform.from_json(d.platform), want, what)


def _runnable(p: Platform | None) -> bool:
    """Not an index's attestation entry (buildx's ``unknown/unknown``)."""
    return p is not None and "unknown" not in (p.os, p.architecture)


def index_platforms(manifests: list[Descriptor]) -> tuple[str, ...]:
    """The platforms of an index's entries, in its order, each once."""
    seen: dict[str, None] = {}
    for d in manifests:
        if (p := Platform.from_json(d.platform)) is not None:
            seen.setdefault(str(p))
    return tuple(seen)


# --- layers and images -----------------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    """One layer of a source image, as its manifest and config describe it."""

    digest: str  # digest of the blob as stored (compressed)
    media_type: str
    size: int
    diff_id: str | None  # from config rootfs.diff_ids (digest of the uncompressed tar)


class SourceImage(ABC):
    """One platform image of a source: manifest digest, config, layers (bottom first)."""

    spec: str  # the source as given to open_source, for messages
    manifest_digest: str
    config: dict[str, Any]
    platform: str
    layers: list[Layer]
    # The platforms of the image index this image was picked from, in its order (empty when
    # the source is a single image).
    index_platforms: tuple[str, ...] = ()

    @contextmanager
    def open_layer(self, layer: Layer) -> Iterator[BinaryIO]:
        """The layer as an uncompressed tar byte stream (see ``LayerStream``).

        Compression is found from the magic bytes and must agree with the media type. The
        blob digest, its size and the diff_id are checked when the stream reaches its end,
        raising ``DigestMismatchError``; a consumer that leaves the block without reading to
        the end (a tar reader stops before the padding) has the rest drained and checked on
        a normal exit. Corrupt or truncated compressed data raises ``InvalidSourceError``.
        """
        what = self._layer_name(layer)
        compression = _media.layer_compression(layer.media_type, what)
        with self._open_blob(layer) as raw:
            stream = LayerStream(
                raw,
                digest=layer.digest,
                size=layer.size,
                diff_id=layer.diff_id,
                compression=compression,
                what=what,
            )
            try:
                yield stream  # type: ignore[misc]
                stream.drain()
            finally:
                stream.close()

    def _layer_name(self, layer: Layer) -> str:
        try:
            pos = f"{self.layers.index(layer) + 1}/{len(self.layers)} "
        except ValueError:
            pos = ""
        return f"layer {pos}{layer.digest} of {self.spec}"

    @abstractmethod
    def _open_blob(self, layer: Layer) -> Iterator[BinaryIO]:
        """A context manager yielding the stored bytes of ``layer`` (not verified);
        ``MissingBlobError`` if the source does not have it."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release files and connections."""

    def __enter__(self) -> SourceImage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec} {self.manifest_digest} {self.platform}>"


def manifest_kind(media_type: str, doc: dict[str, Any], what: str) -> str:
    """ "manifest" or "index", from the announced media type, else the document itself."""
    declared = doc.get("mediaType")
    if media_type in ("", "application/json", "application/octet-stream"):
        media_type = declared if isinstance(declared, str) else ""
    elif isinstance(declared, str) and declared and declared != media_type:
        raise InvalidSourceError(
            f"{what}: document says media type {declared!r} but was served as {media_type!r}"
        )
    if media_type in _media.MANIFEST_TYPES:
        return "manifest"
    if media_type in _media.INDEX_TYPES:
        return "index"
    if not media_type and doc.get("schemaVersion") == 2:
        if "manifests" in doc:
            return "index"
        if "config" in doc and "layers" in doc:
            return "manifest"
    raise UnsupportedMediaTypeError(
        f"{what}: unsupported manifest media type {media_type or declared!r}"
    )


# (body, media type) of the manifest or index a descriptor names, already verified.
FetchManifest = Callable[[Descriptor], tuple[bytes, str]]


# ``open_source(platform=ANY_PLATFORM)``: whichever image an index lists first (to learn the
# index's platforms, ``SourceImage.index_platforms``), with no check of the image's config.
ANY_PLATFORM = "*"


def resolve_manifest(
    top: Descriptor, fetch: FetchManifest, platform: str | None, what: str
) -> tuple[Descriptor, dict[str, Any], tuple[str, ...]]:
    """Follow ``top`` through image indexes to one image manifest; returns its descriptor,
    its document and the platforms of the index it was picked from (empty for a single
    manifest). With an index, ``platform`` (default: the running machine) picks the entry;
    a single manifest's platform is checked later against its config."""
    want = None if platform == ANY_PLATFORM else Platform.parse(platform or default_platform())
    desc = top
    platforms: tuple[str, ...] = ()
    for _ in range(MAX_INDEX_DEPTH):
        body, media_type = fetch(desc)
        name = f"{what}: manifest {desc.digest}"
        doc = parse_json(body, name)
        kind = manifest_kind(media_type or desc.media_type, doc, name)
        if kind == "manifest":
            return desc, doc, platforms
        entries = doc.get("manifests")
        if not isinstance(entries, list):
            raise InvalidSourceError(f"{name}: index has no manifests list")
        manifests = [Descriptor.from_json(m, name) for m in entries]
        platforms = index_platforms(manifests)
        if want is None:
            if not manifests:
                raise NotFoundError(f"{what}: image index lists no images")
            known = [d for d in manifests if _runnable(Platform.from_json(d.platform))]
            desc = (known or manifests)[0]
        else:
            desc = select_platform(manifests, want, what)
        log.debug("%s: platform %s -> %s", what, want, desc.digest)
    raise InvalidSourceError(f"{what}: image indexes nested more than {MAX_INDEX_DEPTH} deep")


def image_from_manifest(
    manifest: dict[str, Any],
    read_config: Callable[[Descriptor], bytes],
    platform: str | None,
    what: str,
) -> tuple[dict[str, Any], str, list[Layer]]:
    """(config, platform string, layers) of an image manifest. ``read_config`` returns the
    config blob's verified bytes."""
    config_desc = Descriptor.from_json(manifest.get("config"), f"{what}: config")
    _media.check_config_type(config_desc.media_type, what)
    config = parse_json(read_config(config_desc), f"{what}: config {config_desc.digest}")
    entries = manifest.get("layers")
    if not isinstance(entries, list):
        raise InvalidSourceError(f"{what}: manifest has no layers list")
    descs = [Descriptor.from_json(e, f"{what}: layer {i + 1}") for i, e in enumerate(entries)]
    for i, d in enumerate(descs):
        _media.layer_compression(d.media_type, f"{what}: layer {i + 1} {d.digest}")
    diff_ids = config_diff_ids(config, len(descs), what)
    layers = [
        Layer(digest=d.digest, media_type=d.media_type, size=d.size, diff_id=diff_ids[i])
        for i, d in enumerate(descs)
    ]
    return config, config_platform(config, platform, what), layers


def config_diff_ids(config: dict[str, Any], count: int, what: str) -> list[str | None]:
    rootfs = config.get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if diff_ids is None:
        log.warning("%s: config has no rootfs.diff_ids; layers checked by blob digest only", what)
        return [None] * count
    if not isinstance(diff_ids, list) or len(diff_ids) != count:
        raise InvalidSourceError(
            f"{what}: config lists {len(diff_ids) if isinstance(diff_ids, list) else 'no'} "
            f"diff_ids for {count} layers"
        )
    return [check_digest(d, f"{what}: diff_id") for d in diff_ids]


def config_platform(config: dict[str, Any], wanted: str | None, what: str) -> str:
    """The image's platform from its config; an explicitly wanted one must match it."""
    got = Platform.of(config.get("os"), config.get("architecture"), config.get("variant"))
    if not got.os or not got.architecture:
        raise InvalidSourceError(f"{what}: config does not name os and architecture")
    if wanted == ANY_PLATFORM:
        return str(got)
    want = Platform.parse(wanted or default_platform())
    if not want.matches(got):
        if wanted:
            raise NotFoundError(f"{what}: image is for platform {got}, not {want}")
        log.warning("%s: image is for platform %s, this machine is %s", what, got, want)
    return str(got)
