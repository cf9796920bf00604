"""Which layers of a Prepare are lazyblock layers: containerd's labels, read.

How containerd asks (client ``Pull`` with unpack: CRI, nerdctl, ctr >= 2.0's transfer
service): for each layer it calls ``Prepare(key="extract-<n> <chainID>", parent=<parent
chain's snapshot>)`` with the labels

    containerd.io/snapshot.ref                  the layer's chain ID (the target name)
    containerd.io/snapshot/cri.image-ref        e.g. registry.example:5000/team/app:v1  (CRI,
    containerd.io/snapshot/cri.manifest-digest  the image manifest's digest              with
    containerd.io/snapshot/cri.layer-digest     the layer's digest                       snapshot
    containerd.io/snapshot/cri.image-layers     the image's layer digests, comma-separated)
    containerd.io/snapshot/<anything>           the layer descriptor's annotations with this
                                                prefix (inherited by every client)

A block image in a registry has a layer per data blob (``imagetool.stores.registry``; one in
format v1, one per source layer and more in v2), then the index. Which layer is which comes
from the descriptor annotations (``containerd.io/snapshot/lazyblock.role`` when the image
carries them) or, failing that, from the image manifest fetched by digest (cached): the
layer's media type or ``dev.lazyblock.role`` annotation. ``LayerResolver.resolve`` turns the
labels into a ``RemoteLayer`` or None: anything else - no chain ID label, an ordinary layer, a
manifest we cannot read - is left to the normal unpack path.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from imagetool.format import ANNOTATION_ROLE, BLOB_MEDIA_TYPE, INDEX_MEDIA_TYPES
from imagetool.registry.client import RegistryClient
from imagetool.stores.base import StoreOptions
from imagetool.stores.refs import split_image_ref
from imagetool.stores.registry import MANIFEST_ACCEPT

log = logging.getLogger(__name__)

# containerd's label keys (containerd/snapshots and pkg/cri/labels).
LABEL_TARGET_REF = "containerd.io/snapshot.ref"
LABEL_REMOTE = "containerd.io/snapshot/remote"
LABEL_REMOTE_VALUE = "remote"
LABEL_CRI_IMAGE_REF = "containerd.io/snapshot/cri.image-ref"
LABEL_CRI_MANIFEST_DIGEST = "containerd.io/snapshot/cri.manifest-digest"
LABEL_CRI_LAYER_DIGEST = "containerd.io/snapshot/cri.layer-digest"
LABEL_CRI_IMAGE_LAYERS = "containerd.io/snapshot/cri.image-layers"
# Layer annotations with containerd's inherited prefix, so that every client passes them
# as Prepare labels (see the module docstring; imagetool puts them on pushed layers).
INHERITED_PREFIX = "containerd.io/snapshot/"
LABEL_ROLE = INHERITED_PREFIX + "lazyblock.role"
LABEL_INDEX_DIGEST = INHERITED_PREFIX + "lazyblock.index-digest"

ROLE_BLOB = "blob"
ROLE_INDEX = "index"
# Layer media types a lazyblock layer may carry: format.py's, and the same names under
# containerd's layer prefix (containerd only treats application/vnd.oci.image.layer.* as
# layers it may skip).
_ROLE_BY_MEDIA_TYPE = {
    BLOB_MEDIA_TYPE: ROLE_BLOB,
    **dict.fromkeys(INDEX_MEDIA_TYPES, ROLE_INDEX),
}
# Manifests kept in memory (one per image being pulled; small JSON documents).
MANIFEST_CACHE_SIZE = 64


class RemoteLayerError(Exception):
    """A lazyblock layer that cannot be mounted (the Prepare fails with its message)."""


@dataclass(frozen=True)
class RemoteLayer:
    """One lazyblock layer named by Prepare labels."""

    target: str  # the chain ID: the committed snapshot's name
    role: str  # ROLE_BLOB or ROLE_INDEX
    host: str  # registry host[:port]
    repository: str
    manifest_digest: str

    @property
    def ref(self) -> str:
        """The reference ``snapshotter.mount.api`` mounts: the manifest by digest."""
        return f"docker://{self.host}/{self.repository}@{self.manifest_digest}"


ManifestFetcher = Callable[[str, str, str], dict[str, Any]]


class LayerResolver:
    """Prepare labels -> ``RemoteLayer`` or None (not ours: unpack it normally)."""

    def __init__(self, fetch_manifest: ManifestFetcher) -> None:
        self.fetch_manifest = fetch_manifest  # (host, repository, digest) -> manifest JSON
        self._manifests: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def resolve(self, labels: dict[str, str]) -> RemoteLayer | None:
        target = labels.get(LABEL_TARGET_REF)
        image_ref = labels.get(LABEL_CRI_IMAGE_REF)
        manifest_digest = labels.get(LABEL_CRI_MANIFEST_DIGEST)
        layer_digest = labels.get(LABEL_CRI_LAYER_DIGEST)
        if not target:
            return None
        role = labels.get(LABEL_ROLE)
        if role is None and not (image_ref and manifest_digest and layer_digest):
            return None  # no way to tell, and nothing to fetch it from: an ordinary layer
        if not (image_ref and manifest_digest):
            raise RemoteLayerError(
                f"lazyblock layer {target} came without the image reference and manifest "
                "digest labels; pull with 'snapshotter pull', through CRI with "
                "disable_snapshot_annotations = false, nerdctl, or containerd 2.x's transfer "
                "service with the proxy plugin's exports "
                'enable_remote_snapshot_annotations = "true"'
            )
        host, repository = split_image_ref(image_ref)
        if role is None:
            role = self._role_from_manifest(host, repository, manifest_digest, layer_digest or "")
            if role is None:
                return None
        if role not in (ROLE_BLOB, ROLE_INDEX):
            raise RemoteLayerError(f"layer {target}: unknown lazyblock role {role!r}")
        return RemoteLayer(target, role, host, repository, manifest_digest)

    def _role_from_manifest(
        self, host: str, repository: str, manifest_digest: str, layer_digest: str
    ) -> str | None:
        with self._lock:
            manifest = self._manifests.get(manifest_digest)
        if manifest is None:
            try:
                manifest = self.fetch_manifest(host, repository, manifest_digest)
            except Exception as e:  # an ordinary image must still unpack normally
                log.warning(
                    "cannot read manifest %s of %s/%s to check for lazyblock layers (%s: %s); "
                    "unpacking normally", manifest_digest, host, repository,
                    type(e).__name__, e,
                )  # fmt: skip
                return None
            with self._lock:
                if len(self._manifests) >= MANIFEST_CACHE_SIZE:
                    self._manifests.pop(next(iter(self._manifests)))
                self._manifests[manifest_digest] = manifest
        for layer in manifest.get("layers") or []:
            if isinstance(layer, dict) and layer.get("digest") == layer_digest:
                return layer_role(layer)
        return None


def layer_role(layer: dict[str, Any]) -> str | None:
    """The lazyblock role of a manifest's layer descriptor (``ROLE_BLOB``, ``ROLE_INDEX``, or
    whatever other role it claims), from its annotations or media type; None for an
    ordinary layer."""
    annotations = layer.get("annotations") or {}
    if not isinstance(annotations, dict):
        annotations = {}
    role = annotations.get(ANNOTATION_ROLE) or annotations.get(LABEL_ROLE)
    return role or _ROLE_BY_MEDIA_TYPE.get(str(layer.get("mediaType")))


def registry_manifests(options_for: Callable[[str], StoreOptions]) -> ManifestFetcher:
    """A ``ManifestFetcher`` that reads manifests from their registry, with the store
    options ``options_for(ref)`` gives for ``docker://host/repository``."""

    def fetch(host: str, repository: str, digest: str) -> dict[str, Any]:
        options = options_for(f"docker://{host}/{repository}")
        with RegistryClient(host, repository, options) as client:
            body, _, _ = client.get_manifest(digest, MANIFEST_ACCEPT)
        doc = json.loads(body)
        if not isinstance(doc, dict):
            raise ValueError("manifest is not a JSON object")
        return doc

    return fetch
