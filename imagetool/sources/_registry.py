"""``docker://HOST[:PORT]/REPO[:TAG|@DIGEST]``: an image in a registry.

The manifest (or index, then the platform's manifest) is fetched with ``RegistryClient``
and checked against its digest; the config is read whole and checked; layers stream from
``open_blob`` through ``LayerStream``, which checks them. Auth, retries and timeouts are the
client's business (``imagetool.registry``); ``StoreOptions`` are passed on untouched.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import BinaryIO

from imagetool.errors import InvalidReferenceError, InvalidSourceError, NotFoundError
from imagetool.registry.client import RegistryClient
from imagetool.sources import _media
from imagetool.sources._image import (
    MAX_DOCUMENT_SIZE,
    Descriptor,
    Layer,
    MissingBlobError,
    SourceImage,
    image_from_manifest,
    resolve_manifest,
    verify_bytes,
)
from imagetool.stores.base import StoreOptions

log = logging.getLogger(__name__)

# The distribution spec's grammar for repository names, tags and host[:port].
_REPO = re.compile(
    r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$"
)
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_HOST = re.compile(r"^(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
DEFAULT_TAG = "latest"


def parse_registry_spec(rest: str, spec: str) -> tuple[str, str, str]:
    """``HOST[:PORT]/REPO[:TAG|@DIGEST]`` -> (host, repository, tag or digest)."""
    host, sep, path = rest.partition("/")
    if not sep or not _HOST.match(host) or not path:
        raise InvalidReferenceError(
            f"invalid registry source {spec!r}: expected HOST[:PORT]/REPO[:TAG]"
        )
    if "@" in path:
        path, _, reference = path.partition("@")
        if not _DIGEST.match(reference):
            raise InvalidReferenceError(
                f"invalid registry source {spec!r}: bad digest {reference!r}"
            )
        repo = path.rpartition(":")[0] if ":" in path.rpartition("/")[2] else path
    else:
        last = path.rpartition("/")[2]
        if ":" in last:
            repo, _, reference = path.rpartition(":")
            if not _TAG.match(reference):
                raise InvalidReferenceError(
                    f"invalid registry source {spec!r}: bad tag {reference!r}"
                )
        else:
            repo, reference = path, DEFAULT_TAG
    if not _REPO.match(repo):
        raise InvalidReferenceError(
            f"invalid registry source {spec!r}: bad repository name {repo!r}"
        )
    return host, repo, reference


class RegistrySource(SourceImage):
    def __init__(
        self,
        host: str,
        repository: str,
        reference: str,
        platform: str | None,
        options: StoreOptions,
        spec: str,
    ) -> None:
        self.spec = spec
        self._client = RegistryClient(host, repository, options)
        try:
            body, media_type, digest = self._client.get_manifest(reference, _media.ACCEPT_MANIFESTS)
            if reference.startswith("sha256:"):
                verify_bytes(body, reference, f"{spec}: manifest")
            top = Descriptor(media_type=media_type, digest=digest, size=len(body))
            fetched = {digest: (body, media_type)}

            def fetch(desc: Descriptor) -> tuple[bytes, str]:
                if desc.digest not in fetched:
                    data, mt, _ = self._client.get_manifest(desc.digest, _media.ACCEPT_MANIFESTS)
                    verify_bytes(data, desc.digest, f"{spec}: manifest {desc.digest}", desc.size)
                    fetched[desc.digest] = (data, mt)
                return fetched[desc.digest]

            desc, manifest, self.index_platforms = resolve_manifest(top, fetch, platform, spec)
            self.manifest_digest = desc.digest
            self.config, self.platform, self.layers = image_from_manifest(
                manifest, self._read_document, platform, spec
            )
        except BaseException:
            self._client.close()
            raise
        log.info(
            "%s: manifest %s, %s, %d layers",
            spec,
            self.manifest_digest,
            self.platform,
            len(self.layers),
        )

    def _read_document(self, desc: Descriptor) -> bytes:
        what = f"{self.spec}: blob {desc.digest}"
        if desc.size > MAX_DOCUMENT_SIZE:
            raise InvalidSourceError(f"{what}: {desc.size} bytes is too large for a document")
        try:
            with self._client.open_blob(desc.digest) as f:
                data = f.read(desc.size + 1)
        except NotFoundError:
            raise MissingBlobError(f"{what} is missing from the registry") from None
        return verify_bytes(data, desc.digest, what, desc.size)

    @contextmanager
    def _open_blob(self, layer: Layer) -> Iterator[BinaryIO]:
        stack = ExitStack()
        try:
            f = stack.enter_context(self._client.open_blob(layer.digest))
        except NotFoundError:
            raise MissingBlobError(
                f"{self._layer_name(layer)} is missing from the registry"
            ) from None
        with stack:
            yield f

    def close(self) -> None:
        self._client.close()
