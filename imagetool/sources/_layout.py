"""``oci:PATH[:TAG]``: an OCI image layout directory.

index.json lists the layout's images; TAG picks the entry whose
``org.opencontainers.image.ref.name`` annotation equals it. Without TAG the layout must hold
exactly one entry (which may itself be a multi-platform index). Blobs live at
``blobs/<algorithm>/<hex>``; a digest is validated before it becomes a path.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from imagetool.errors import InvalidSourceError, NotFoundError
from imagetool.sources._image import (
    MAX_DOCUMENT_SIZE,
    Descriptor,
    Layer,
    MissingBlobError,
    SourceImage,
    check_digest,
    image_from_manifest,
    parse_json,
    resolve_manifest,
    verify_bytes,
)

log = logging.getLogger(__name__)

REF_NAME = "org.opencontainers.image.ref.name"


def split_layout_spec(rest: str) -> tuple[Path, str | None]:
    """PATH[:TAG] -> (path, tag). A path may itself hold colons: the whole string wins if it
    is a directory, then the longest prefix before a colon that is one."""
    if Path(rest).is_dir() or ":" not in rest:
        return Path(rest), None
    cuts = [i for i, c in enumerate(rest) if c == ":"]
    for i in reversed(cuts):
        if Path(rest[:i]).is_dir():
            return Path(rest[:i]), rest[i + 1 :] or None
    head, _, tag = rest.partition(":")
    return Path(head), tag or None


class OciLayoutSource(SourceImage):
    def __init__(self, path: Path, tag: str | None, platform: str | None, spec: str) -> None:
        self.spec = spec
        self.path = Path(path)
        if not self.path.is_dir():
            raise NotFoundError(f"{spec}: no such directory {self.path}")
        layout_file = self.path / "oci-layout"
        if not layout_file.is_file():
            raise InvalidSourceError(f"{spec}: not an OCI image layout (no oci-layout file)")
        version = parse_json(layout_file.read_bytes(), f"{spec}: oci-layout").get(
            "imageLayoutVersion"
        )
        if version != "1.0.0":
            log.warning("%s: unknown imageLayoutVersion %r", spec, version)
        top = self._pick_entry(tag)
        desc, manifest, self.index_platforms = resolve_manifest(
            top, self._fetch_manifest, platform, spec
        )
        self.manifest_digest = desc.digest
        self.config, self.platform, self.layers = image_from_manifest(
            manifest, self._read_document, platform, spec
        )
        log.info(
            "%s: manifest %s, %s, %d layers",
            spec,
            self.manifest_digest,
            self.platform,
            len(self.layers),
        )

    def _pick_entry(self, tag: str | None) -> Descriptor:
        index_path = self.path / "index.json"
        try:
            data = index_path.read_bytes()
        except FileNotFoundError:
            raise InvalidSourceError(f"{self.spec}: layout has no index.json") from None
        index = parse_json(data, f"{self.spec}: index.json")
        entries: Any = index.get("manifests")
        if not isinstance(entries, list):
            raise InvalidSourceError(f"{self.spec}: index.json has no manifests list")
        descs = [Descriptor.from_json(e, f"{self.spec}: index.json") for e in entries]
        tags = sorted({d.annotations[REF_NAME] for d in descs if REF_NAME in d.annotations})
        if tag is None:
            if len(descs) != 1:
                raise InvalidSourceError(
                    f"{self.spec}: layout holds {len(descs)} images; name one with "
                    f"oci:PATH:TAG (tags: {', '.join(tags) or 'none'})"
                )
            return descs[0]
        found = [d for d in descs if d.annotations.get(REF_NAME) == tag]
        if not found:
            raise NotFoundError(
                f"{self.spec}: no image tagged {tag!r} in {self.path} "
                f"(tags: {', '.join(tags) or 'none'})"
            )
        if len({d.digest for d in found}) > 1:
            raise InvalidSourceError(f"{self.spec}: tag {tag!r} names several images")
        return found[0]

    def _blob_path(self, digest: str) -> Path:
        algo, _, hexpart = check_digest(digest, self.spec).partition(":")
        return self.path / "blobs" / algo / hexpart

    def _read_document(self, desc: Descriptor) -> bytes:
        what = f"{self.spec}: blob {desc.digest}"
        if desc.size > MAX_DOCUMENT_SIZE:
            raise InvalidSourceError(f"{what}: {desc.size} bytes is too large for a document")
        try:
            data = self._blob_path(desc.digest).read_bytes()
        except FileNotFoundError:
            raise MissingBlobError(f"{what} is missing from the layout") from None
        return verify_bytes(data, desc.digest, what, desc.size)

    def _fetch_manifest(self, desc: Descriptor) -> tuple[bytes, str]:
        return self._read_document(desc), desc.media_type

    @contextmanager
    def _open_blob(self, layer: Layer) -> Iterator[BinaryIO]:
        try:
            f = open(self._blob_path(layer.digest), "rb")  # noqa: SIM115
        except FileNotFoundError:
            raise MissingBlobError(
                f"{self._layer_name(layer)} is missing from the layout"
            ) from None
        with f:
            yield f
