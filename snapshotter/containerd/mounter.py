"""Mounting the images of remote snapshots, with the credentials of their pulls.

``MountBackend`` is what ``SnapshotStore`` and the handshake call to mount, unmount and
check a remote snapshot's image (``snapshots.RemoteMounter``). Each mount goes through
``snapshotter.mount.api`` and is served by its own mount server process, so the daemon can
restart under running containers. The mount's store options are the daemon's, with plain
HTTP for the registries configured as insecure, and credentials: those a CRI pull of the
repository recorded (``keychain.cri``) first, else the node's docker config merged from its
sources (``keychain.dockerconfig``).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

from snapshotter.config import MountConfig
from snapshotter.containerd.keychain.cri import Keychain
from snapshotter.containerd.keychain.dockerconfig import Credentials
from snapshotter.mount import api, state


class MountBackend:
    """``RemoteMounter`` on ``snapshotter.mount.api``: one mount server process per image."""

    def __init__(
        self,
        config: MountConfig,
        insecure_registries: tuple[str, ...] = (),
        credentials: Credentials | None = None,
        keychain: Keychain | None = None,
    ) -> None:
        self.config = config
        self.insecure = set(insecure_registries)
        self.credentials = credentials
        # Credentials from CRI pulls (``keychain.cri``): they come first.
        self.keychain = keychain if keychain is not None else Keychain()
        self._locks: dict[Path, threading.RLock] = {}
        self._locks_lock = threading.Lock()

    def lock(self, mountpoint: Path) -> threading.RLock:
        """The lock that mounting and unmounting ``mountpoint`` hold."""
        with self._locks_lock:
            return self._locks.setdefault(Path(os.path.abspath(mountpoint)), threading.RLock())

    def config_for(self, ref: str) -> MountConfig:
        """The mount config for ``ref``: plain HTTP for insecure hosts, the credentials of
        a CRI pull of its repository if there was one, else the merged docker config."""
        host, _, path = ref.removeprefix("docker://").partition("/")
        store = self.config.store
        changes: dict[str, object] = {}
        if host in self.insecure:
            changes["plain_http"] = True
        if self.credentials is not None:
            changes["docker_config"] = self.credentials.refresh()
        secret = self.keychain.lookup(host, path.split("@", 1)[0].split(":", 1)[0])
        if secret is not None:
            changes["credentials"] = secret
        if changes:
            return dataclasses.replace(
                self.config,
                store=dataclasses.replace(store, **changes),  # type: ignore[arg-type]
            )
        return self.config

    def mount(self, ref: str, mountpoint: Path) -> None:
        with self.lock(mountpoint):
            mountpoint.mkdir(parents=True, exist_ok=True)
            api.mount(ref, mountpoint, self.config_for(ref))

    def unmount(self, mountpoint: Path) -> None:
        with self.lock(mountpoint):
            api.unmount(mountpoint, self.config)

    def is_mounted(self, mountpoint: Path) -> bool:
        """Mounted, with a live server (a dead one leaves the kernel mount but gives EIO)."""
        if not os.path.ismount(mountpoint):
            return False
        record = state.MountRecord.load(state.mount_dir(self.config.state_dir, mountpoint))
        return record is not None and record.alive
