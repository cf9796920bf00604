"""The OCI registry store: a block image as an ordinary OCI image manifest.

A published image is an OCI image manifest (``application/vnd.oci.image.manifest.v1+json``)
under the tag, whose

- config is a standard OCI image config: architecture/os from the index's platform, the
  source image's ``config`` (Entrypoint, Env, User, WorkingDir, ...), and ``rootfs.diff_ids``
  = [each data blob's digest, index digest];
- layers are [each data blob of the index, in its order (``format.BLOB_MEDIA_TYPE``), the
  index (``format.INDEX_MEDIA_TYPE``)], annotated with ``format.ANNOTATION_ROLE`` and, on
  the index layer and the manifest, ``ANNOTATION_INDEX_DIGEST``/``ANNOTATION_BLOB_DIGEST``;
  a version 2 image's data blob layers also say which region they hold and of which source
  layer (``ANNOTATION_BLOB_ROLE``, ``ANNOTATION_SOURCE_LAYER``).

A multi-platform block image is an OCI image index (``format.PLATFORM_INDEX_MEDIA_TYPE``,
``format.platform_index_bytes``) under the tag whose entries are the per-platform block
images' manifests, each pushed by digest (``put_image``) before the index: what containerd,
the kubelet and ``snapshotter pull`` resolve by platform, and what ``resolve_ref`` follows to
the running machine's platform (or the one asked for).

So any distribution-spec registry that honours ``Range`` can hold block images, and
``resolve`` finds the index from the manifest. Blobs are the repository's registry blobs:
a data blob that another image (or tag) already pushed is not uploaded again, and a registry
keeps it once, as it does an ordinary layer shared by two images.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from imagetool.errors import (
    AuthError,
    DigestMismatchError,
    FormatError,
    NotFoundError,
    StoreError,
    StoreTimeoutError,
)
from imagetool.format import (
    ANNOTATION_BLOB_DIGEST,
    ANNOTATION_BLOB_ROLE,
    ANNOTATION_INDEX_DIGEST,
    ANNOTATION_ROLE,
    ANNOTATION_SNAPSHOT_ROLE,
    ANNOTATION_SOURCE_LAYER,
    BLOB_MEDIA_TYPE,
    INDEX_MEDIA_TYPE,
    INDEX_MEDIA_TYPES,
    Index,
    PlatformEntry,
    check_digest,
    index_media_type,
    parse_platform_index,
    platform_index_bytes,
    sha256_digest,
)
from imagetool.platforms import Platform, default_platform, select_platform
from imagetool.registry.mirrors import HostChain
from imagetool.stores._common import check_range
from imagetool.stores.base import RangeBody, Store, StoreOptions, check_publishable
from imagetool.stores.refs import ImageRef, check_tag

log = logging.getLogger(__name__)

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
# What resolve() accepts, so that an ordinary image gives a clear error rather than a 404.
MANIFEST_ACCEPT = (OCI_MANIFEST, DOCKER_MANIFEST, OCI_INDEX, DOCKER_LIST)
# Used only when an index carries no platform (the converter always records one).
DEFAULT_PLATFORM = "linux/amd64"


class RegistryStore(Store):
    """One repository of an OCI registry."""

    def __init__(self, host: str, repository: str, options: StoreOptions | None = None) -> None:
        # Blobs from the registry's mirrors first (a hosts directory's), the rest from its
        # server (``client``).
        self.hosts = HostChain(host, repository, options or StoreOptions())
        self.client = self.hosts.server
        self.url = f"docker://{host}/{repository}"
        self.name = repository
        # Blob sizes named by the manifests resolve() read (a hint, never trusted alone).
        self._manifest_sizes: dict[str, int] = {}

    # --- blobs ----------------------------------------------------------------------------

    def blob_size(self, digest: str) -> int:
        return self.client.blob_size(digest)

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        check_range(f"{self.url}: blob {digest}", offset, length)
        return self.hosts.read_range(digest, offset, length)

    def open_range(self, digest: str, offset: int, length: int) -> RangeBody:
        check_range(f"{self.url}: blob {digest}", offset, length)
        return self.hosts.open_range(digest, offset, length)

    def source_stats(self) -> list[dict[str, Any]]:
        return self.hosts.stats()

    def read_blob(self, digest: str) -> bytes:
        """A whole (small) blob, verified against its digest. When a manifest this store
        resolved gave the blob's size, that is one ranged read, without asking the registry
        for the size first (a round trip less when mounting); should that size be wrong, the
        size is asked for. Bytes that do not match the digest are rejected (a mirror that
        served them backs off) and read again from the next host, once per host."""
        size = self._manifest_sizes.get(digest)
        if size is not None:
            try:
                data = self._read_verified(digest, size)
            except (NotFoundError, AuthError, StoreTimeoutError):
                raise
            except StoreError as e:
                log.debug("%s: blob %s by its manifest size: %s", self.url, digest, e)
            else:
                if data is not None:
                    return data
        size = self.blob_size(digest)
        for _ in range(max(1, len(self.hosts.sources))):
            data = self._read_verified(digest, size)
            if data is not None:
                return data
        raise DigestMismatchError(f"blob {digest} in {self.url} does not match its digest")

    def _read_verified(self, digest: str, size: int) -> bytes | None:
        """The blob read as ``size`` bytes, or None (and the bytes rejected) when they do not
        hash to ``digest``."""
        if not self.hosts.mirrors:
            data = self.read_range(digest, 0, size)
            return data if sha256_digest(data) == digest else None
        out = bytearray(size)
        with self.open_range(digest, 0, size) as body:
            body.readinto(memoryview(out))
            if sha256_digest(out) == digest:
                return bytes(out)
            body.reject(f"blob {digest} does not match its digest")
        return None

    def put_blob(self, digest: str, source: Path | bytes, media_type: str) -> None:
        del media_type  # registry blobs are untyped; the manifest gives the types
        self.client.upload_blob(digest, source)

    # --- tags -----------------------------------------------------------------------------

    def resolve(self, tag: str) -> str:
        """The index digest of the image under a tag (or a manifest digest); an image
        index is not followed (``resolve_ref`` does)."""
        return self._resolve(tag, None, follow=False)

    def resolve_ref(self, ref: ImageRef, platform: str | None = None) -> str:
        """For ``docker://`` references, ``@sha256:`` is the manifest's digest. An image
        index resolves to ``platform``'s image (default: the running machine's)."""
        return self._resolve(ref.digest or ref.tag or "latest", platform, follow=True)

    def resolve_target(self, ref: ImageRef) -> tuple[str, str]:
        """(digest, media type) of the manifest or image index a reference names."""
        reference = ref.digest or ref.tag or "latest"
        if not reference.startswith("sha256:"):
            check_tag(reference)
        _, media_type, digest = self.client.get_manifest(reference, MANIFEST_ACCEPT)
        return digest, media_type

    def _resolve(self, reference: str, platform: str | None, follow: bool) -> str:
        if not reference.startswith("sha256:"):
            check_tag(reference)
        where = f"{self.url}:{reference}"
        body, media_type, _ = self.client.get_manifest(reference, MANIFEST_ACCEPT)
        if follow and is_image_index(body, media_type):
            entries = parse_platform_index(body, where)
            want = Platform.parse(platform or default_platform())
            entry = select_platform(entries, lambda e: e.platform, want, where)
            where = f"{self.url}@{entry.digest} ({entry.platform} in {reference})"
            body, media_type, _ = self.client.get_manifest(entry.digest, MANIFEST_ACCEPT)
        digest = index_digest_from_manifest(body, media_type, where)
        self._manifest_sizes.update(layer_sizes(body))
        return digest

    def publish(self, tag: str, index_bytes: bytes) -> str:
        index_digest, manifest_digest, _ = self._push_image(tag, index_bytes)
        log.info(
            "published %s:%s -> index %s (manifest %s)", self.url, tag, index_digest,
            manifest_digest,
        )  # fmt: skip
        return index_digest

    def put_image(self, index_bytes: bytes) -> PlatformEntry:
        """The image's manifest, pushed by digest; the entry names the manifest."""
        index_digest, manifest_digest, manifest = self._push_image(None, index_bytes)
        index = Index.from_bytes(index_bytes)
        log.info("pushed %s@%s -> index %s", self.url, manifest_digest, index_digest)
        return PlatformEntry(
            OCI_MANIFEST, manifest_digest, len(manifest), Platform.parse(index.platform)
        )

    def _push_image(self, tag: str | None, index_bytes: bytes) -> tuple[str, str, bytes]:
        """Config, index and manifest (under ``tag``, or its digest); (index digest,
        manifest digest, manifest)."""
        index = check_publishable(self, tag, index_bytes)
        index_digest = sha256_digest(index_bytes)
        config = image_config(index, index_digest)
        config_digest = sha256_digest(config)
        manifest = image_manifest(index, index_digest, index_bytes, config_digest, config)
        self.client.upload_blob(config_digest, config)
        self.client.upload_blob(index_digest, index_bytes)
        manifest_digest = self.client.put_manifest(
            tag or sha256_digest(manifest), manifest, OCI_MANIFEST
        )
        return index_digest, manifest_digest, manifest

    def publish_index(self, tag: str, entries: list[PlatformEntry]) -> str:
        """The image index under the tag; returns its (manifest) digest."""
        check_tag(tag)
        data = platform_index_bytes(entries)
        digest = self.client.put_manifest(tag, data, OCI_INDEX)
        log.info("published %s:%s -> image index %s", self.url, tag, digest)
        return digest

    def list_tags(self) -> list[str]:
        try:
            return sorted(self.client.list_tags())
        except NotFoundError:
            return []

    def close(self) -> None:
        self.hosts.close()


def _canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def image_config(index: Index, index_digest: str) -> bytes:
    """The OCI image config pushed with a block image (deterministic bytes)."""
    platform = index.platform or DEFAULT_PLATFORM
    if not index.platform:
        log.warning("index %s records no platform; labelling it %s", index_digest, platform)
    os_, _, rest = platform.partition("/")
    arch, _, variant = rest.partition("/")
    doc: dict[str, Any] = {
        "architecture": arch or "amd64",
        "os": os_ or "linux",
        "config": index.config,
        "rootfs": {
            "type": "layers",
            "diff_ids": [*(b.digest for b in index.blobs), index_digest],
        },
    }
    if variant:
        doc["variant"] = variant
    return _canonical(doc)


def image_manifest(
    index: Index, index_digest: str, index_blob: bytes, config_digest: str, config: bytes
) -> bytes:
    """The OCI image manifest of a block image (deterministic bytes)."""
    digests = {
        ANNOTATION_INDEX_DIGEST: index_digest,
        ANNOTATION_BLOB_DIGEST: ",".join(b.digest for b in index.blobs),
    }
    blobs = []
    for b in index.blobs:
        annotations = {ANNOTATION_ROLE: "blob", ANNOTATION_SNAPSHOT_ROLE: "blob"}
        if index.version > 1:
            annotations[ANNOTATION_BLOB_ROLE] = b.role
            if b.layer:
                annotations[ANNOTATION_SOURCE_LAYER] = b.layer
        blobs.append(
            {"mediaType": BLOB_MEDIA_TYPE, "digest": b.digest, "size": b.size,
             "annotations": annotations}
        )  # fmt: skip
    doc = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(config)},
        "layers": [
            *blobs,
            {
                "mediaType": index_media_type(index_blob),
                "digest": index_digest,
                "size": len(index_blob),
                "annotations": {
                    ANNOTATION_ROLE: "index",
                    ANNOTATION_SNAPSHOT_ROLE: "index",
                    **digests,
                },
            },
        ],
        "annotations": digests,
    }
    return _canonical(doc)


def layer_sizes(body: bytes) -> dict[str, int]:
    """``digest -> size`` of the layers a (valid JSON) manifest lists, as it states them."""
    sizes: dict[str, int] = {}
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        for layer in json.loads(body).get("layers") or []:
            digest, size = layer.get("digest"), layer.get("size")
            if isinstance(digest, str) and isinstance(size, int) and size >= 0:
                sizes[digest] = size
    return sizes


def is_image_index(body: bytes, media_type: str) -> bool:
    """Whether a manifest the registry served is an image index (OCI or Docker list)."""
    if media_type in (OCI_INDEX, DOCKER_LIST):
        return True
    with contextlib.suppress(ValueError, TypeError):
        doc = json.loads(body)
        return isinstance(doc, dict) and "manifests" in doc
    return False


def index_digest_from_manifest(body: bytes, media_type: str, where: str) -> str:
    """The lazyblock index digest named by a manifest; ``FormatError`` if it is not one."""
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise FormatError(f"{where}: manifest is not valid JSON") from None
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: manifest is not a JSON object")
    kind = media_type or str(doc.get("mediaType", ""))
    if kind in (OCI_INDEX, DOCKER_LIST) or "manifests" in doc:
        raise FormatError(
            f"{where} is a multi-platform image index, not a lazyblock block image; "
            "convert it with imagetool first"
        )
    layers = doc.get("layers")
    if isinstance(layers, list):
        for layer in layers:
            if not isinstance(layer, dict):
                continue
            annotations = layer.get("annotations") or {}
            role = annotations.get(ANNOTATION_ROLE) if isinstance(annotations, dict) else None
            if role == "index" or layer.get("mediaType") in INDEX_MEDIA_TYPES:
                return check_digest(str(layer.get("digest")))
    raise FormatError(
        f"{where} is an ordinary container image, not a lazyblock block image (no layer of "
        f"type {INDEX_MEDIA_TYPE}); convert it with imagetool first"
    )
