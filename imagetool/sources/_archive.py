"""``docker-archive:PATH[:NAME:TAG]``: a ``docker save`` (or ``skopeo copy``) tarball.

manifest.json lists the images (Config, RepoTags, Layers). Two forms exist and both are read
in place, member by member, without extracting the archive:

- legacy (docker < 25, skopeo): layers at ``<id>/layer.tar`` or ``<diff-id>.tar``, config at
  ``<image-id>.json``. Layers are plain tars, so a layer's blob digest *is* its diff_id;
  a compressed member (rare) is hashed once when the image is opened.
- OCI (docker >= 25): an OCI layout inside the tar; Layers name ``blobs/sha256/<hex>``, and
  ``LayerSources`` may carry the layers' descriptors.

A docker archive holds no manifest of its own in the legacy form; the manifest digest is then
that of the Docker schema2 manifest describing the archive's config and layers exactly as
stored (what a registry would hold after ``docker push`` of uncompressed layers). In the OCI
form the layout's own manifest for the image is used when there is one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
import re
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, BinaryIO

from imagetool.errors import InvalidSourceError, NotFoundError
from imagetool.sources import _media
from imagetool.sources._image import (
    MAX_DOCUMENT_SIZE,
    Descriptor,
    Layer,
    MissingBlobError,
    SourceImage,
    compute_digest,
    config_diff_ids,
    config_platform,
    parse_json,
    verify_bytes,
)
from imagetool.sources._stream import CHUNK, detect_compression

log = logging.getLogger(__name__)

_BLOB_PATH = re.compile(r"^blobs/(sha256)/([0-9a-f]{64})$")
_HEX_NAME = re.compile(r"^([0-9a-f]{64})(\.json)?$")
# Symlink hops followed inside the archive before giving up.
MAX_LINK_HOPS = 8


def split_archive_spec(rest: str) -> tuple[Path, str | None]:
    """PATH[:NAME:TAG] -> (path, ref): the whole string if it is a file, else the longest
    prefix before a colon that is one."""
    if Path(rest).exists() or ":" not in rest:
        return Path(rest), None
    cuts = [i for i, c in enumerate(rest) if c == ":"]
    for i in reversed(cuts):
        if Path(rest[:i]).is_file():
            return Path(rest[:i]), rest[i + 1 :] or None
    return Path(rest), None


class DockerArchiveSource(SourceImage):
    def __init__(self, path: Path, ref: str | None, platform: str | None, spec: str) -> None:
        self.spec = spec
        self.path = Path(path)
        if not self.path.is_file():
            raise NotFoundError(f"{spec}: no such file {self.path}")
        try:
            self._tar = tarfile.open(self.path, "r:")
        except tarfile.ReadError:
            try:
                # `docker save | gzip` works too, at the price of slow seeks.
                self._tar = tarfile.open(self.path, "r:*")
                log.warning("%s: compressed archive; reading it is slow", spec)
            except (tarfile.TarError, OSError) as e:
                raise InvalidSourceError(f"{spec}: not a tar archive ({e})") from None
        try:
            try:
                members = self._tar.getmembers()
            except tarfile.TarError as e:
                raise InvalidSourceError(f"{spec}: corrupt tar archive ({e})") from None
            self._members = {self._norm(m.name): m for m in members}
            self._layer_members: dict[str, str] = {}
            self._load(ref, platform)
        except BaseException:
            self._tar.close()
            raise

    # --- reading members --------------------------------------------------------------------

    @staticmethod
    def _norm(name: str) -> str:
        return posixpath.normpath("/" + name).lstrip("/")

    def _member(self, name: str) -> tarfile.TarInfo:
        """The regular-file member called ``name``, following symlinks and hard links."""
        key = self._norm(name)
        for _ in range(MAX_LINK_HOPS):
            m = self._members.get(key)
            if m is None:
                raise MissingBlobError(f"{self.spec}: {name} is missing from the archive")
            if m.issym():
                key = self._norm(posixpath.join(posixpath.dirname(key), m.linkname))
            elif m.islnk():
                key = self._norm(m.linkname)
            elif m.isfile():
                return m
            else:
                raise InvalidSourceError(f"{self.spec}: {name} is not a file in the archive")
        raise InvalidSourceError(f"{self.spec}: {name}: too many levels of links")

    def _open_member(self, name: str) -> IO[bytes]:
        f = self._tar.extractfile(self._member(name))
        assert f is not None
        return f

    def _read_member(self, name: str) -> bytes:
        m = self._member(name)
        if m.size > MAX_DOCUMENT_SIZE:
            raise InvalidSourceError(f"{self.spec}: {name} is too large ({m.size} bytes)")
        with self._open_member(name) as f:
            return f.read()

    # --- the image --------------------------------------------------------------------------

    def _load(self, ref: str | None, platform: str | None) -> None:
        spec = self.spec
        doc = None
        if self._has("manifest.json"):
            try:
                doc = json.loads(self._read_member("manifest.json"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise InvalidSourceError(f"{spec}: manifest.json is not valid JSON ({e})") from None
        if not isinstance(doc, list) or not doc:
            raise InvalidSourceError(f"{spec}: no usable manifest.json (is this `docker save`?)")
        entry = self._pick_entry(doc, ref)
        config_name = entry.get("Config")
        layer_names = entry.get("Layers")
        if not isinstance(config_name, str) or not isinstance(layer_names, list):
            raise InvalidSourceError(f"{spec}: manifest.json entry lacks Config or Layers")
        config_bytes = self._read_member(config_name)
        config_digest = self._named_digest(config_name)
        if config_digest:
            verify_bytes(config_bytes, config_digest, f"{spec}: config {config_name}")
        else:
            config_digest = compute_digest(config_bytes)
        self.config = parse_json(config_bytes, f"{spec}: config {config_name}")
        self.platform = config_platform(self.config, platform, spec)
        diff_ids = config_diff_ids(self.config, len(layer_names), spec)
        sources = entry.get("LayerSources") or {}
        self.layers = [
            self._layer(name, diff_id, sources)
            for name, diff_id in zip(layer_names, diff_ids, strict=True)
        ]
        self.manifest_digest = self._layout_manifest(config_digest) or self._synthetic_manifest(
            config_digest, len(config_bytes)
        )
        log.info(
            "%s: manifest %s, %s, %d layers",
            spec,
            self.manifest_digest,
            self.platform,
            len(self.layers),
        )

    def _has(self, name: str) -> bool:
        return self._norm(name) in self._members

    def _pick_entry(self, doc: list[Any], ref: str | None) -> dict[str, Any]:
        entries = [e for e in doc if isinstance(e, dict)]
        tags = sorted({t for e in entries for t in e.get("RepoTags") or [] if isinstance(t, str)})
        if ref is None:
            if len(entries) != 1:
                raise InvalidSourceError(
                    f"{self.spec}: archive holds {len(entries)} images; name one with "
                    f"docker-archive:PATH:NAME:TAG (tags: {', '.join(tags) or 'none'})"
                )
            return entries[0]
        for e in entries:
            if ref in (e.get("RepoTags") or []):
                return e
        raise NotFoundError(
            f"{self.spec}: no image tagged {ref!r} in the archive "
            f"(tags: {', '.join(tags) or 'none'})"
        )

    @staticmethod
    def _named_digest(name: str) -> str | None:
        """The digest a member's name carries (``blobs/sha256/<hex>``, ``<hex>.json``)."""
        norm = posixpath.normpath(name)
        if m := _BLOB_PATH.match(norm):
            return f"{m[1]}:{m[2]}"
        if m := _HEX_NAME.match(norm):
            return f"sha256:{m[1]}"
        return None

    def _layer(self, name: Any, diff_id: str | None, sources: dict[str, Any]) -> Layer:
        if not isinstance(name, str):
            raise InvalidSourceError(f"{self.spec}: manifest.json has a bad Layers entry")
        member = self._member(name)
        with self._open_member(name) as f:
            head = f.read(4)
        compression = detect_compression(head)
        m = _BLOB_PATH.match(posixpath.normpath(name))
        digest = f"{m[1]}:{m[2]}" if m else None
        if digest is None and compression is None and diff_id is not None:
            digest = diff_id  # a plain tar: its blob is its uncompressed content
        if digest is None:
            log.debug("%s: hashing %s to learn its digest", self.spec, name)
            digest = self._hash_member(name)
        source = sources.get(digest)
        if isinstance(source, dict):
            media_type = Descriptor.from_json(source, f"{self.spec}: {name}").media_type
        else:
            media_type = {
                None: _media.DOCKER_LAYER,
                "gzip": _media.DOCKER_LAYER_GZIP,
                "zstd": _media.OCI_LAYER_ZSTD,
            }[compression]
        self._layer_members[digest] = name
        return Layer(digest=digest, media_type=media_type, size=member.size, diff_id=diff_id)

    def _hash_member(self, name: str) -> str:
        h = hashlib.sha256()
        with self._open_member(name) as f:
            while data := f.read(CHUNK):
                h.update(data)
        return "sha256:" + h.hexdigest()

    def _layout_manifest(self, config_digest: str) -> str | None:
        """The digest of the OCI-form archive's own manifest for this config, if any."""
        if not self._has("index.json"):
            return None
        try:
            index = parse_json(self._read_member("index.json"), f"{self.spec}: index.json")
            pending = list(index.get("manifests") or [])
            for _ in range(64):
                if not pending:
                    break
                desc = Descriptor.from_json(pending.pop(0), f"{self.spec}: index.json")
                algo, _, hexpart = desc.digest.partition(":")
                blob = f"blobs/{algo}/{hexpart}"
                if not self._has(blob):
                    continue
                body = verify_bytes(self._read_member(blob), desc.digest, blob, desc.size)
                doc = parse_json(body, f"{self.spec}: {blob}")
                if "manifests" in doc:
                    pending.extend(doc["manifests"])
                elif (doc.get("config") or {}).get("digest") == config_digest:
                    return desc.digest
        except InvalidSourceError as e:
            log.warning("%s: ignoring the archive's index.json: %s", self.spec, e)
        return None

    def _synthetic_manifest(self, config_digest: str, config_size: int) -> str:
        doc = {
            "schemaVersion": 2,
            "mediaType": _media.DOCKER_MANIFEST,
            "config": {
                "mediaType": _media.DOCKER_CONFIG,
                "size": config_size,
                "digest": config_digest,
            },
            "layers": [
                {"mediaType": layer.media_type, "size": layer.size, "digest": layer.digest}
                for layer in self.layers
            ],
        }
        return compute_digest(json.dumps(doc, indent=3).encode())

    @contextmanager
    def _open_blob(self, layer: Layer) -> Iterator[BinaryIO]:
        name = self._layer_members.get(layer.digest)
        if name is None:
            raise MissingBlobError(f"{self._layer_name(layer)} is not in the archive")
        with self._open_member(name) as f:
            yield f  # type: ignore[misc]

    def close(self) -> None:
        self._tar.close()
