"""The remote-snapshot handshake that makes containerd skip a lazyblock layer's download.

For a Prepare whose labels name a lazyblock layer (``layers.LayerResolver``) we commit a
snapshot named by the chain ID ourselves - labelled ``containerd.io/snapshot.ref`` = chain
ID and ``containerd.io/snapshot/remote`` = ``remote`` - and answer ALREADY_EXISTS. containerd
then finds it (a List with ``labels."containerd.io/snapshot.ref"==<chainID>,parent==
<parent>``), records it as the layer's snapshot and never fetches the layer blob.

Each data blob layer becomes an empty committed snapshot; the index layer's snapshot is the
mounted block image (``mounter.MountBackend``: FUSE + erofs, metadata first), so the image's
root file system is the index layer's snapshot and a container is an overlay with it as the
lower layer. ``restore`` and ``ensure_mounted`` remount the images whose mount is gone (a
reboot, a killed mount server).

Known limits: ``ctr image pull`` of containerd 1.6/1.7 fetches every blob before unpacking and
passes no labels, so it downloads the whole data blob and then fails to apply it; pull with
``snapshotter pull`` (``pull``: containerd's client steps with the labels), through CRI
(``crictl pull``, kubelet), nerdctl or containerd 2.x's transfer service (``ctr`` >= 2.0,
with ``enable_remote_snapshot_annotations`` in the proxy plugin's exports) instead.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from snapshotter.config import Config
from snapshotter.containerd.keychain.cri import Keychain
from snapshotter.containerd.keychain.dockerconfig import Credentials, node_sources
from snapshotter.containerd.layers import (
    INHERITED_PREFIX,
    LABEL_REMOTE,
    LABEL_REMOTE_VALUE,
    LABEL_TARGET_REF,
    ROLE_BLOB,
    ROLE_INDEX,
    LayerResolver,
    registry_manifests,
)
from snapshotter.containerd.mounter import MountBackend
from snapshotter.containerd.snapshots import (
    RemoteInfo,
    RemoteMounter,
    SnapshotExistsError,
    SnapshotNotFoundError,
    SnapshotStore,
)
from snapshotter.metrics import REMOUNT_FAILURES_FILE, CountsFile
from snapshotter.mount.api import MountError

log = logging.getLogger(__name__)


class RemountAuthError(MountError):
    """A remount the registry refused: no credentials, or ones it does not take (logged and
    counted as such, retried every ``remount_interval``)."""


class RemoteLayers:
    """The remote-snapshot handshake on a ``SnapshotStore``."""

    def __init__(
        self, resolver: LayerResolver, mounter: RemoteMounter, keychain: Keychain | None = None
    ) -> None:
        self.resolver = resolver
        self.mounter = mounter
        # Where the CRI image service proxy records pull credentials for the mounts.
        self.keychain = keychain if keychain is not None else Keychain()
        self.store: SnapshotStore | None = None
        # Remounts that failed, for the metrics exporter; in memory until ``create`` (the
        # daemon) gives it a file under the mount state directory.
        self.failures = CountsFile()
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    @classmethod
    def create(cls, config: Config) -> RemoteLayers:
        """From the daemon's configuration: registry manifests and mounts with its
        options, credentials merged under its root."""
        credentials = Credentials(
            sources=node_sources(config.mount.store.docker_config),
            out=config.service.root / "auth" / "config.json",
        )
        mounter = MountBackend(config.mount, config.service.insecure_registries, credentials)
        resolver = LayerResolver(registry_manifests(lambda ref: mounter.config_for(ref).store))
        layers = cls(resolver, mounter, mounter.keychain)
        layers.failures = CountsFile(config.mount.state_dir / REMOUNT_FAILURES_FILE)
        return layers

    def recover_credentials(self) -> int:
        """A starting daemon's: take in the CRI credentials the live mount servers hold
        (``MountBackend.recover_credentials``), before anything is remounted."""
        recover = getattr(self.mounter, "recover_credentials", None)
        return recover() if recover is not None else 0

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
            except RemountAuthError:
                pass  # logged as such; the next check (or a Prepare that needs it) retries
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
            try:
                self.mounter.mount(remote.ref, mountpoint)
            except MountError as e:
                if e.cause == "AuthError":
                    self.failures.add("auth")
                    log.error(
                        "remote snapshot %s: remount of %s cannot authenticate (%s); retried "
                        "every remount_interval and before a Prepare that needs it: a CRI "
                        "pull of the image, or the node's docker config, gives credentials",
                        name, remote.ref, e,
                    )  # fmt: skip
                    raise RemountAuthError(str(e)) from None
                self.failures.add("other")
                raise
            except Exception:
                self.failures.add("other")
                raise
        log.info("remote snapshot %s: remounted at %s", name, mountpoint)
        return True
