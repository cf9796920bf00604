"""Remote snapshots: recognising lazyblock layers in containerd's Prepare labels, and the
handshake that makes containerd skip their download.

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

If the layer is a lazyblock layer we commit a snapshot named by the chain ID ourselves -
labelled ``containerd.io/snapshot.ref`` = chain ID and ``containerd.io/snapshot/remote`` =
``remote`` - and answer ALREADY_EXISTS. containerd then finds it (a List with
``labels."containerd.io/snapshot.ref"==<chainID>,parent==<parent>``), records it as the
layer's snapshot and never fetches the layer blob.

A block image in a registry has two layers (``imagetool.stores.registry``): the data blob,
then the index. The blob layer becomes an empty committed snapshot; the index layer's
snapshot is the mounted block image (``snapshotter.mount``: FUSE + erofs, metadata first),
so the image's root file system is the index layer's snapshot and a container is an overlay
with it as the lower layer. Which layer is which comes from the descriptor annotations
(``containerd.io/snapshot/lazyblock.role`` when the image carries them) or, failing that,
from the image manifest fetched by digest (cached): the layer's media type or
``dev.lazyblock.role`` annotation. Anything else - no chain ID label, an ordinary layer, a
manifest we cannot read - is left to the normal unpack path.

Known limits: ``ctr image pull`` of containerd 1.6/1.7 fetches every blob before unpacking and
passes no labels, so it downloads the whole data blob and then fails to apply it; pull
through CRI (``crictl pull``, kubelet), nerdctl or containerd 2.x's transfer service (``ctr``
>= 2.0, with ``enable_remote_snapshot_annotations`` in the proxy plugin's exports) instead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imagetool.format import ANNOTATION_ROLE, BLOB_MEDIA_TYPE, INDEX_MEDIA_TYPES
from imagetool.stores.base import StoreOptions
from snapshotter.credentials import Credentials
from snapshotter.crikeychain import Keychain
from snapshotter.snapshots import (
    RemoteInfo,
    SnapshotExistsError,
    SnapshotNotFoundError,
    SnapshotStore,
)

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
DOCKER_HUB = "docker.io"
DOCKER_HUB_REGISTRY = "registry-1.docker.io"
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
        """The reference ``snapshotter.mount`` mounts: the manifest by digest."""
        return f"docker://{self.host}/{self.repository}@{self.manifest_digest}"


def split_image_ref(ref: str) -> tuple[str, str]:
    """``host[:port]/repo[:tag][@digest]`` (normalised or not) -> (registry host, repo)."""
    name = ref.split("@", 1)[0]
    first, sep, rest = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        host, path = first, rest
    else:
        host, path = DOCKER_HUB, name
    last = path.rsplit("/", 1)
    if ":" in last[-1]:
        path = path[: len(path) - len(last[-1])] + last[-1].split(":", 1)[0]
    if host == DOCKER_HUB:
        host = DOCKER_HUB_REGISTRY
        if "/" not in path:
            path = "library/" + path
    return host, path


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
                "digest labels; pull through CRI with disable_snapshot_annotations = false, "
                "nerdctl, or containerd 2.x's transfer service with the proxy plugin's "
                'exports enable_remote_snapshot_annotations = "true"'
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
            if not isinstance(layer, dict) or layer.get("digest") != layer_digest:
                continue
            annotations = layer.get("annotations") or {}
            role = annotations.get(ANNOTATION_ROLE) or annotations.get(LABEL_ROLE)
            return role or _ROLE_BY_MEDIA_TYPE.get(str(layer.get("mediaType")))
        return None


class MountBackend:
    """``RemoteMounter`` on ``snapshotter.mount``: one mount server process per image."""

    def __init__(
        self,
        config: Any,  # snapshotter.config.MountConfig
        insecure_registries: tuple[str, ...] = (),
        credentials: Credentials | None = None,
        keychain: Keychain | None = None,
    ) -> None:
        self.config = config
        self.insecure = set(insecure_registries)
        self.credentials = credentials
        # Credentials from CRI pulls (``snapshotter.crikeychain``): they come first.
        self.keychain = keychain if keychain is not None else Keychain()
        self._locks: dict[Path, threading.RLock] = {}
        self._locks_lock = threading.Lock()

    def lock(self, mountpoint: Path) -> threading.RLock:
        """The lock that mounting and unmounting ``mountpoint`` hold."""
        with self._locks_lock:
            return self._locks.setdefault(Path(os.path.abspath(mountpoint)), threading.RLock())

    def config_for(self, ref: str) -> Any:
        """The mount config for ``ref``: plain HTTP for insecure hosts, the credentials of
        a CRI pull of its repository if there was one, else the merged docker config."""
        host, _, path = ref.removeprefix("docker://").partition("/")
        store: StoreOptions = self.config.store
        changes: dict[str, Any] = {}
        if host in self.insecure:
            changes["plain_http"] = True
        if self.credentials is not None:
            changes["docker_config"] = self.credentials.refresh()
        secret = self.keychain.lookup(host, path.split("@", 1)[0].split(":", 1)[0])
        if secret is not None:
            changes["credentials"] = secret
        if changes:
            return dataclasses.replace(self.config, store=dataclasses.replace(store, **changes))
        return self.config

    def mount(self, ref: str, mountpoint: Path) -> None:
        from snapshotter import mount as mount_mod

        with self.lock(mountpoint):
            mountpoint.mkdir(parents=True, exist_ok=True)
            mount_mod.mount(ref, mountpoint, self.config_for(ref))

    def unmount(self, mountpoint: Path) -> None:
        from snapshotter import mount as mount_mod

        with self.lock(mountpoint):
            mount_mod.unmount(mountpoint, self.config)

    def is_mounted(self, mountpoint: Path) -> bool:
        """Mounted, with a live server (a dead one leaves the kernel mount but gives EIO)."""
        from snapshotter import state

        if not os.path.ismount(mountpoint):
            return False
        record = state.MountRecord.load(state.mount_dir(self.config.state_dir, mountpoint))
        return record is not None and record.alive


class RemoteLayers:
    """The remote-snapshot handshake on a ``SnapshotStore``."""

    def __init__(self, resolver: LayerResolver, mounter: Any) -> None:
        self.resolver = resolver
        self.mounter = mounter
        self.store: SnapshotStore | None = None
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    @classmethod
    def create(cls, config: Any) -> RemoteLayers:
        """From a ``ServiceConfig``: registry manifests and mounts with its options."""
        credentials = Credentials(
            sources=_credential_sources(config.mount.store.docker_config),
            out=config.root / "auth" / "config.json",
        )
        mounter = MountBackend(config.mount, config.insecure_registries, credentials)
        return cls(LayerResolver(_registry_fetcher(mounter)), mounter)

    @property
    def keychain(self) -> Keychain:
        """Where the CRI image service proxy records pull credentials for the mounts."""
        return self.mounter.keychain

    def attach(self, store: SnapshotStore) -> None:
        self.store = store

    def _lock_for(self, target: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(target, threading.Lock())

    def prepare(self, key: str, parent: str, labels: dict[str, str]) -> None:
        """Handle a Prepare if it names a lazyblock layer: mount and commit it, then raise
        ``SnapshotExistsError`` (ALREADY_EXISTS). Returns for anything else."""
        assert self.store is not None, "attach() a store first"
        log.debug("prepare %r (parent %r), label keys %s", key, parent, sorted(labels))
        layer = self.resolver.resolve(labels)
        if layer is None:
            return
        committed = {k: v for k, v in labels.items() if k.startswith(INHERITED_PREFIX)}
        committed[LABEL_TARGET_REF] = layer.target
        committed[LABEL_REMOTE] = LABEL_REMOTE_VALUE
        with self._lock_for(layer.target):
            if layer.role == ROLE_BLOB:
                self.store.commit_remote(
                    layer.target, parent, committed, RemoteInfo(layer.ref, "", ROLE_BLOB)
                )
            else:
                mountpoint = self.store.mountpoint_for(layer.target)
                self.store.commit_remote(
                    layer.target,
                    parent,
                    committed,
                    RemoteInfo(layer.ref, str(mountpoint), ROLE_INDEX),
                    mount=lambda: self.mounter.mount(layer.ref, mountpoint),
                )
        log.info("prepare %r: remote snapshot %s (%s layer)", key, layer.target, layer.role)
        raise SnapshotExistsError(f"remote snapshot {layer.target} is ready")

    def restore(self) -> int:
        """Remount remote snapshots whose mount is gone (after a reboot or a killed mount
        server); mounts that survived a daemon restart are left as they are. Returns how
        many were remounted. Run when the daemon starts and then periodically."""
        assert self.store is not None
        remounted = 0
        for info in self.store.remote_snapshots():
            try:
                remounted += self._remount_if_gone(info.name)
            except Exception as e:  # the next check (or a Prepare that needs it) retries
                log.error("remote snapshot %s: remount failed: %s", info.name, e)
        return remounted

    def ensure_mounted(self, name: str) -> None:
        """Remount the remote layers in the chain from snapshot ``name`` up whose mount is
        gone, so that the mounts a Prepare, View or Mounts hands containerd work (a mount
        server killed since the last periodic check). Raises if a remount fails."""
        assert self.store is not None
        while name:
            try:
                info = self.store.stat(name)
            except SnapshotNotFoundError:
                return  # the store's own call says so
            if info.remote is not None and info.remote.mountpoint:
                self._remount_if_gone(name)
            name = info.parent

    def _remount_if_gone(self, name: str) -> bool:
        assert self.store is not None
        info = self.store.stat(name)
        if info.remote is None or not info.remote.mountpoint:
            return False
        mountpoint = Path(info.remote.mountpoint)
        if self.mounter.is_mounted(mountpoint):
            return False
        # Under the mount point's lock, and only if the snapshot still exists: a Remove
        # deletes the row first and then unmounts under the same lock.
        with self.mounter.lock(mountpoint):
            try:
                info = self.store.stat(name)
            except SnapshotNotFoundError:
                return False
            remote = info.remote
            if remote is None or self.mounter.is_mounted(mountpoint):
                return False
            log.warning("remote snapshot %s: mount gone, remounting %s", name, remote.ref)
            # mount() also clears what a dead server left at the mount point.
            self.mounter.mount(remote.ref, mountpoint)
        log.info("remote snapshot %s: remounted at %s", name, mountpoint)
        return True


def _credential_sources(configured: Path | None) -> list[Path]:
    sources = [configured] if configured else []
    sources.append(Path(os.environ.get("DOCKER_CONFIG", "/root/.docker")))
    return sources


def _registry_fetcher(mounter: MountBackend) -> ManifestFetcher:
    from imagetool.registry.client import RegistryClient
    from imagetool.stores.registry import MANIFEST_ACCEPT

    def fetch(host: str, repository: str, digest: str) -> dict[str, Any]:
        options = mounter.config_for(f"docker://{host}/{repository}").store
        with RegistryClient(host, repository, options) as client:
            body, _, _ = client.get_manifest(digest, MANIFEST_ACCEPT)
        doc = json.loads(body)
        if not isinstance(doc, dict):
            raise ValueError("manifest is not a JSON object")
        return doc

    return fetch
