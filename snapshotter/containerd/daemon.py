"""The ``snapshotter serve`` daemon: containerd's proxy snapshotter, from start to stop.

It opens the snapshot store under its root, has a fork server ready for mounts, remounts the
remote snapshots whose mount is gone, serves containerd's snapshots API
(``snapshotter.containerd.service``) and, with ``[snapshotter] image_service_address`` set,
the CRI image service that records the kubelet's pull credentials for the lazy mounts
(``snapshotter.containerd.keychain.cri``), then tells systemd it is ready.

Restarts: the snapshot metadata is in SQLite under the root, and each lazily mounted image is
served by its own mount server process (``snapshotter.mount``), not by this daemon. So
stopping the daemon (SIGTERM, upgrade, crash) leaves running containers' file systems
working; a new daemon finds the same snapshots and mounts. Run in a pod, whose deletion kills
every process in it, the daemon has its mount servers started by the node launcher outside
the pod (``snapshotter.mount.launcher``, ``[mount] launcher``); while one of its code answers,
the daemon starts no fork server of its own. What does *not* survive is a
reboot or a killed mount server: the daemon remounts every remote snapshot whose mount is
gone when it starts, every ``remount_interval`` seconds, and before a Prepare, View or Mounts
hands out a chain that holds one (containers started before that point see EIO/ENOTCONN on
their lazy lower layer and must be restarted; new containers work).
"""

from __future__ import annotations

import logging
import signal
import threading

from snapshotter import systemd
from snapshotter.config import Config
from snapshotter.containerd.handshake import RemoteLayers
from snapshotter.containerd.keychain.cri import start_image_service
from snapshotter.containerd.service import start_server
from snapshotter.containerd.snapshots import SnapshotStore
from snapshotter.mount import forkserver, launcher

log = logging.getLogger(__name__)


def serve(config: Config) -> None:
    """Run the daemon until SIGTERM/SIGINT. Stopping it leaves mounts alive (see module)."""
    service = config.service
    remote = RemoteLayers.create(config)
    store = SnapshotStore(service.root, mounter=remote.mounter)
    remote.attach(store)
    _warm_fork_server(config)
    # The CRI credentials of the images mounted before this start, from their mount
    # servers (memory only), so that what must be remounted authenticates as before.
    recovered = remote.recover_credentials()
    if recovered:
        log.info("registry credentials of %d repositories recovered from mount servers",
                 recovered)  # fmt: skip
    remote.restore()
    store.cleanup()
    server = start_server(service.address, store, remote, service.workers)
    log.info("serving containerd snapshots on %s (root %s)", service.address, service.root)
    image_service = None
    if service.image_service_address is not None:
        image_service = start_image_service(
            service.image_service_address, remote.keychain, service.containerd_address,
            service.workers,
        )  # fmt: skip
        log.info(
            "serving the CRI image service on %s (forwarded to %s)",
            service.image_service_address, service.containerd_address,
        )  # fmt: skip
    systemd.notify("READY=1")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if service.remount_interval > 0:
        threading.Thread(
            target=_remount_periodically,
            args=(remote, service.remount_interval, stop, config),
            name="lazyblock-remount", daemon=True,
        ).start()  # fmt: skip
    stop.wait()
    systemd.notify("STOPPING=1")
    log.info("stopping; lazily mounted images stay mounted for running containers")
    if image_service is not None:
        image_service[0].stop(grace=5).wait()
        image_service[1].close()
    server.stop(grace=5).wait()
    store.close()


_launcher_seen: list[str] = [""]  # what the last check logged about the node launcher


def _warm_fork_server(config: Config) -> None:
    """Have a fork server (imports done) ready, so that the node's first lazy mount also
    takes a fraction of a second; it idles out on its own, so the periodic check renews it.
    With a node launcher (``[mount] launcher``) mounts go there and this daemon needs none,
    unless the launcher is gone: then mount servers start in the daemon's context, which a
    pod's deletion kills (warned once per change; mounts count it)."""
    mount = config.mount
    path = launcher.resolve(mount.launcher, mount.state_dir)
    if path is not None:
        try:
            info = launcher.hello(path)
        except launcher.LauncherError as e:
            seen = f"gone: {e}"
            if _launcher_seen[0] != seen:
                log.warning("node launcher %s: %s; mount servers start in this daemon's "
                            "context and will not outlive it", path, e)  # fmt: skip
            _launcher_seen[0] = seen
        else:
            seen = f"{info.get('pid')} {info.get('code')}"
            if _launcher_seen[0] != seen:
                ours = launcher.code_version()
                if info.get("code") == ours:
                    log.info("mount servers are started by the node launcher %s (pid %s, "
                             "lazyblock %s, code %s)", path, info.get("pid"),
                             info.get("version"), ours)  # fmt: skip
                else:
                    log.warning("node launcher %s runs other code (%s, ours %s): mount "
                                "servers start in this daemon's context until it is "
                                "replaced", path, info.get("code"), ours)  # fmt: skip
            _launcher_seen[0] = seen
            if info.get("code") == launcher.code_version():
                return
    try:
        forkserver.ensure_running()
    except forkserver.ForkServerError as e:
        log.warning("no fork server; mounts start new processes: %s", e)


def _remount_periodically(
    remote: RemoteLayers, interval: float, stop: threading.Event, config: Config
) -> None:
    while not stop.wait(interval):
        _warm_fork_server(config)
        try:
            remote.restore()
        except Exception:  # keep checking; restore logs per snapshot
            log.exception("periodic remount check failed")
