"""Mounting the images of remote snapshots, with the credentials of their pulls.

``MountBackend`` is what ``SnapshotStore`` and the handshake call to mount, unmount and
check a remote snapshot's image (``snapshots.RemoteMounter``). Each mount goes through
``snapshotter.mount.api`` and is served by its own mount server process, so the daemon can
restart under running containers. The mount's store options are the daemon's, with plain
HTTP for the registries configured as insecure, and credentials: those a CRI pull of the
repository recorded (``keychain.cri``) first, else the node's docker config merged from its
sources (``keychain.dockerconfig``). The registry hosts directory (``RegistryHostsWatch``)
is read again when a file under it changes; a malformed change keeps the previous one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from pathlib import Path

from imagetool.registry.hosts import HostsConfig, hosts_dir_stamp
from imagetool.stores.refs import registry_host
from snapshotter.config import ConfigError, MountConfig, read_registry_hosts
from snapshotter.containerd.keychain.cri import Keychain, Secret
from snapshotter.containerd.keychain.dockerconfig import Credentials
from snapshotter.errors import SnapshotterError
from snapshotter.mount import api, state

log = logging.getLogger(__name__)


def repository_of(ref: str) -> tuple[str, str]:
    """(registry host, repository) of a mount's registry reference, as the keychain keys
    credentials: any tag or digest of the repository."""
    host, _, path = ref.removeprefix("docker://").partition("/")
    return host, path.split("@", 1)[0].split(":", 1)[0]


class RegistryHostsWatch:
    """The daemon's registry hosts directory (``MountConfig.registry_config_path``), as
    containerd reads it: changes apply to the next mounts without a restart. Read again
    when a file under it changes; a change that does not parse is logged (the file and the
    problem) and the configuration read before stays in force."""

    def __init__(self, path: Path | None, initial: HostsConfig | None) -> None:
        self.path = path
        self.current = initial
        self._stamp = hosts_dir_stamp(path) if path is not None else ()
        self._lock = threading.Lock()

    def get(self) -> HostsConfig | None:
        if self.path is None:
            return self.current
        stamp = hosts_dir_stamp(self.path)
        with self._lock:
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self.current = read_registry_hosts(self.path)
                    log.info("registry hosts directory %s read again", self.path)
                except ConfigError as e:
                    log.error("%s; keeping the previous registry hosts configuration", e)
            return self.current


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
        self.hosts = RegistryHostsWatch(config.registry_config_path, config.store.registry_hosts)

    def lock(self, mountpoint: Path) -> threading.RLock:
        """The lock that mounting and unmounting ``mountpoint`` hold."""
        with self._locks_lock:
            return self._locks.setdefault(Path(os.path.abspath(mountpoint)), threading.RLock())

    def config_for(self, ref: str) -> MountConfig:
        """The mount config for ``ref``: plain HTTP for insecure hosts, the credentials of
        a CRI pull of its repository if there was one, else the merged docker config, and
        the registry hosts directory as it is now."""
        host, repository = repository_of(ref)
        store = self.config.store
        changes: dict[str, object] = {}
        if host in self.insecure:
            changes["plain_http"] = True
        if self.credentials is not None:
            changes["docker_config"] = self.credentials.refresh()
        secret = self.keychain.lookup(host, repository)
        if secret is not None:
            changes["credentials"] = secret
        hosts = self.hosts.get()
        if hosts != store.registry_hosts:
            changes["registry_hosts"] = hosts
        if changes:
            return dataclasses.replace(
                self.config,
                store=dataclasses.replace(store, **changes),  # type: ignore[arg-type]
            )
        return self.config

    def recover_credentials(self) -> int:
        """Ask every live mount server for the CRI credentials it was started with and keep
        them in the keychain (``Keychain.adopt``): what a restarted daemon remounts with.
        Returns how many repositories' credentials were taken in."""
        taken = 0
        for info in api.list_mounts(self.config):
            if not info.alive:
                continue
            try:
                secret = api.credentials(info.mountpoint, self.config)
            except SnapshotterError as e:
                log.warning("mount server of %s: no credentials from it: %s", info.ref, e)
                continue
            if secret is None:
                continue
            host, repository = repository_of(info.ref)
            if self.keychain.adopt(host, repository, Secret(*secret)):
                taken += 1
                log.info("registry credentials for %s/%s recovered from the mount server "
                         "of %s", registry_host(host), repository, info.ref)  # fmt: skip
        return taken

    def mount(self, ref: str, mountpoint: Path) -> None:
        with self.lock(mountpoint):
            mountpoint.mkdir(parents=True, exist_ok=True)
            api.mount(ref, mountpoint, self.config_for(ref))

    def unmount(self, mountpoint: Path) -> None:
        with self.lock(mountpoint):
            api.unmount(mountpoint, self.config)

    def is_mounted(self, mountpoint: Path) -> bool:
        """Mounted, with a live server or a live holder (which is starting a successor of a
        dead server: readers wait, none fails). A dead server without a holder leaves the
        kernel mount but gives EIO."""
        if not os.path.ismount(mountpoint):
            return False
        record = state.MountRecord.load(state.mount_dir(self.config.state_dir, mountpoint))
        return record is not None and (record.alive or record.held)
