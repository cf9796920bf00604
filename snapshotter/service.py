"""containerd's snapshots API over gRPC on a unix socket: the ``snapshotter serve`` daemon.

containerd reaches it as a ``[proxy_plugins]`` snapshotter. Each handler only translates: a
request becomes one call on ``SnapshotStore`` (or, for a Prepare whose labels name a
lazyblock layer, on ``RemoteLayers``), and errors become status codes:

    SnapshotNotFoundError   NOT_FOUND          SnapshotExistsError    ALREADY_EXISTS
    SnapshotStateError      FAILED_PRECONDITION SnapshotArgumentError INVALID_ARGUMENT
    any other error         UNKNOWN (its message, never credentials)

With ``[snapshotter] image_service_address`` set it also serves the CRI image service on that
socket, forwarded to containerd, recording the kubelet's pull credentials for the lazy mounts
(``snapshotter.crikeychain``).

Restarts: the snapshot metadata is in SQLite under the root, and each lazily mounted image is
served by its own mount server process (``snapshotter.mount``), not by this daemon. So
stopping the daemon (SIGTERM, upgrade, crash) leaves running containers' file systems
working; a new daemon finds the same snapshots and mounts. What does *not* survive is a
reboot or a killed mount server: the daemon remounts every remote snapshot whose mount is
gone when it starts, every ``remount_interval`` seconds, and before a Prepare, View or Mounts
hands out a chain that holds one (containers started before that point see EIO/ENOTCONN on
their lazy lower layer and must be restarted; new containers work).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import grpc

from snapshotter import systemd
from snapshotter.config import (
    DEFAULT_CONFIG_PATH,
    ConfigError,
    MountConfig,
    config_from_document,
    read_config_file,
)
from snapshotter.crikeychain import DEFAULT_CONTAINERD_ADDRESS
from snapshotter.proto import load as _load_stubs
from snapshotter.snapshots import (
    Info,
    Kind,
    Mount,
    SnapshotArgumentError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    SnapshotStateError,
    SnapshotStore,
)

log = logging.getLogger(__name__)

mount_pb2, pb, pb_grpc = _load_stubs()

DEFAULT_ADDRESS = Path("/run/lazyblock/snapshotter.sock")
# Persistent (not /run): the snapshots of unpacked ordinary layers live here.
DEFAULT_ROOT = Path("/var/lib/lazyblock/snapshotter")
DEFAULT_WORKERS = 16
# Seconds between checks for lost remote mounts: a mount server that died is replaced within
# this time even if no Prepare asks for its layer.
DEFAULT_REMOUNT_INTERVAL = 30.0
# Infos per List response message (containerd streams them).
LIST_BATCH = 100


@dataclass(frozen=True)
class ServiceConfig:
    """What ``snapshotter serve`` needs; the ``[snapshotter]`` section of the config file."""

    address: Path = DEFAULT_ADDRESS
    """The unix socket containerd's ``[proxy_plugins.lazyblock] address`` names."""
    root: Path = DEFAULT_ROOT
    """Snapshot metadata (``metadata.db``), layer directories and mount points."""
    insecure_registries: tuple[str, ...] = ()
    """``HOST:PORT`` of registries reached over plain HTTP (loopback tests only)."""
    workers: int = DEFAULT_WORKERS
    """gRPC handler threads (mounts of several layers can run at once)."""
    remount_interval: float = DEFAULT_REMOUNT_INTERVAL
    """Seconds between checks for remote snapshots whose mount is gone (a killed mount
    server), which are then remounted; 0: only at start and when a Prepare needs one."""
    image_service_address: Path | None = None
    """Unix socket for the CRI image service proxy (the kubelet's
    ``--image-service-endpoint``) that records pull credentials for lazy mounts
    (``snapshotter.crikeychain``); None: not served."""
    containerd_address: Path = DEFAULT_CONTAINERD_ADDRESS
    """containerd's gRPC socket, where the image service proxy forwards CRI calls."""
    mount: MountConfig = field(default_factory=MountConfig)


def load_service_config(path: Path | None, overrides: dict[str, Any]) -> ServiceConfig:
    """The ``[snapshotter]`` section of the config file (default path if None; a missing
    default file means defaults) with flag ``overrides`` on top; the other sections go to
    ``snapshotter.config`` for the mount configuration."""
    doc = read_config_file(path)
    config = config_from_document(doc, where=path or DEFAULT_CONFIG_PATH)  # checks sections
    own = dict(doc.get("snapshotter", {}))
    own.update({k: v for k, v in overrides.items() if v not in (None, ())})
    unknown = set(own) - {
        "address", "root", "insecure_registries", "workers", "remount_interval",
        "image_service_address", "containerd_address",
    }  # fmt: skip
    if unknown:
        raise ConfigError(f"unknown [snapshotter] keys: {', '.join(sorted(unknown))}")
    insecure = own.get("insecure_registries", ())
    if isinstance(insecure, str):
        insecure = (insecure,)
    return ServiceConfig(
        # Absolute: containerd and the kubelet reach these from their own directories.
        address=Path(os.path.abspath(own.get("address", DEFAULT_ADDRESS))),
        root=Path(os.path.abspath(own.get("root", DEFAULT_ROOT))),
        insecure_registries=tuple(str(h) for h in insecure),
        workers=int(own.get("workers", DEFAULT_WORKERS)),
        remount_interval=float(own.get("remount_interval", DEFAULT_REMOUNT_INTERVAL)),
        image_service_address=Path(os.path.abspath(own["image_service_address"]))
        if own.get("image_service_address")
        else None,
        containerd_address=Path(own.get("containerd_address") or DEFAULT_CONTAINERD_ADDRESS),
        mount=config.mount,
    )


# --- translation -----------------------------------------------------------------------------

_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (SnapshotNotFoundError, grpc.StatusCode.NOT_FOUND),
    (SnapshotExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (SnapshotStateError, grpc.StatusCode.FAILED_PRECONDITION),
    (SnapshotArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
)


def status_code(error: BaseException) -> grpc.StatusCode:
    for kind, code in _CODES:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.UNKNOWN


def _ts(ns: int) -> Any:
    from google.protobuf.timestamp_pb2 import Timestamp

    return Timestamp(seconds=ns // 1_000_000_000, nanos=ns % 1_000_000_000)


def info_to_pb(info: Info) -> Any:
    return pb.Info(
        name=info.name,
        parent=info.parent,
        kind=int(info.kind),
        created_at=_ts(info.created_ns),
        updated_at=_ts(info.updated_ns),
        labels=info.labels,
    )


def mounts_to_pb(mounts: list[Mount]) -> list[Any]:
    return [mount_pb2.Mount(type=m.type, source=m.source, options=list(m.options)) for m in mounts]


class _Translate:
    """Run a handler body; a raised error becomes the status code of the reply."""

    def __init__(self, context: grpc.ServicerContext, what: str) -> None:
        self.context = context
        self.what = what

    def __enter__(self) -> _Translate:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: Any
    ) -> bool:
        if error is None or not isinstance(error, Exception):
            return False
        code = status_code(error)
        level = logging.WARNING if code == grpc.StatusCode.UNKNOWN else logging.DEBUG
        log.log(level, "%s: %s: %s", self.what, type(error).__name__, error)
        self.context.abort(code, f"{type(error).__name__}: {error}")
        return False  # abort raises


class SnapshotsServicer(pb_grpc.SnapshotsServicer):
    """containerd.services.snapshots.v1.Snapshots on a ``SnapshotStore``."""

    def __init__(self, store: SnapshotStore, remote: Any | None = None) -> None:
        self.store = store
        self.remote = remote  # snapshotter.remote.RemoteLayers, or None (no lazy layers)

    def Prepare(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        labels = dict(request.labels)
        with _Translate(context, f"prepare {request.key!r}"):
            if self.remote is not None:
                self.remote.prepare(request.key, request.parent, labels)
                self.remote.ensure_mounted(request.parent)
            mounts = self.store.prepare(request.key, request.parent, labels)
            return pb.PrepareSnapshotResponse(mounts=mounts_to_pb(mounts))

    def View(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        with _Translate(context, f"view {request.key!r}"):
            if self.remote is not None:
                self.remote.ensure_mounted(request.parent)
            mounts = self.store.view(request.key, request.parent, dict(request.labels))
            return pb.ViewSnapshotResponse(mounts=mounts_to_pb(mounts))

    def Mounts(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        with _Translate(context, f"mounts {request.key!r}"):
            if self.remote is not None:
                self.remote.ensure_mounted(request.key)
            return pb.MountsResponse(mounts=mounts_to_pb(self.store.mounts(request.key)))

    def Commit(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        from google.protobuf.empty_pb2 import Empty

        with _Translate(context, f"commit {request.key!r}"):
            self.store.commit(request.name, request.key, dict(request.labels))
            return Empty()

    def Remove(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        from google.protobuf.empty_pb2 import Empty

        with _Translate(context, f"remove {request.key!r}"):
            self.store.remove(request.key)
            return Empty()

    def Stat(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        with _Translate(context, f"stat {request.key!r}"):
            return pb.StatSnapshotResponse(info=info_to_pb(self.store.stat(request.key)))

    def Update(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        info = request.info
        with _Translate(context, f"update {info.name!r}"):
            new = self.store.update(
                Info(info.name, info.parent, Kind(info.kind), 0, 0, dict(info.labels)),
                list(request.update_mask.paths),
            )
            return pb.UpdateSnapshotResponse(info=info_to_pb(new))

    def List(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:  # noqa: N802
        with _Translate(context, "list"):
            infos = self.store.list(list(request.filters))
        for i in range(0, len(infos), LIST_BATCH):
            yield pb.ListSnapshotsResponse(info=[info_to_pb(x) for x in infos[i : i + LIST_BATCH]])

    def Usage(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        with _Translate(context, f"usage {request.key!r}"):
            usage = self.store.usage(request.key)
            return pb.UsageResponse(size=usage.size, inodes=usage.inodes)

    def Cleanup(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        from google.protobuf.empty_pb2 import Empty

        with _Translate(context, "cleanup"):
            self.store.cleanup()
            return Empty()


# --- the daemon ------------------------------------------------------------------------------


def start_server(
    address: Path, store: SnapshotStore, remote: Any | None = None, workers: int = DEFAULT_WORKERS
) -> grpc.Server:
    """A started gRPC server on unix socket ``address`` (a stale socket file is replaced)."""
    address.parent.mkdir(parents=True, exist_ok=True)
    if address.is_socket() or address.exists():
        address.unlink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    pb_grpc.add_SnapshotsServicer_to_server(SnapshotsServicer(store, remote), server)
    if server.add_insecure_port(f"unix://{address}") == 0:
        raise OSError(f"cannot listen on {address}")
    server.start()
    os.chmod(address, 0o600)
    return server


def serve(config: ServiceConfig) -> None:
    """Run the daemon until SIGTERM/SIGINT. Stopping it leaves mounts alive (see module)."""
    from snapshotter.remote import RemoteLayers

    remote = RemoteLayers.create(config)
    store = SnapshotStore(config.root, mounter=remote.mounter)
    remote.attach(store)
    _warm_fork_server()
    remote.restore()
    store.cleanup()
    server = start_server(config.address, store, remote, config.workers)
    log.info("serving containerd snapshots on %s (root %s)", config.address, config.root)
    image_service = None
    if config.image_service_address is not None:
        from snapshotter.crikeychain import start_image_service

        image_service = start_image_service(
            config.image_service_address, remote.keychain, config.containerd_address,
            config.workers,
        )  # fmt: skip
        log.info(
            "serving the CRI image service on %s (forwarded to %s)",
            config.image_service_address, config.containerd_address,
        )  # fmt: skip
    systemd.notify("READY=1")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if config.remount_interval > 0:
        threading.Thread(
            target=_remount_periodically, args=(remote, config.remount_interval, stop),
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


def _warm_fork_server() -> None:
    """Have a fork server (imports done) ready, so that the node's first lazy mount also
    takes a fraction of a second; it idles out on its own, so the periodic check renews it."""
    from snapshotter import forkserver

    try:
        forkserver.ensure_running()
    except forkserver.ForkServerError as e:
        log.warning("no fork server; mounts start new processes: %s", e)


def _remount_periodically(remote: Any, interval: float, stop: threading.Event) -> None:
    while not stop.wait(interval):
        _warm_fork_server()
        try:
            remote.restore()
        except Exception:  # keep checking; restore logs per snapshot
            log.exception("periodic remount check failed")


# --- command line ----------------------------------------------------------------------------


@click.command("serve", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help=f"Configuration file (default {DEFAULT_CONFIG_PATH}, if present).",
)
@click.option(
    "--address",
    type=click.Path(path_type=Path),
    help=f"Unix socket to serve on (default {DEFAULT_ADDRESS}).",
)
@click.option(
    "--root",
    type=click.Path(file_okay=False, path_type=Path),
    help=f"Snapshot metadata and layers (default {DEFAULT_ROOT}).",
)
@click.option(
    "--insecure-registry",
    "insecure",
    multiple=True,
    metavar="HOST:PORT",
    help="A registry reached over plain HTTP (repeatable; loopback tests only).",
)
@click.option("-v", "--verbose", count=True, help="More logging (-vv for debug).")
def serve_command(
    config_path: Path | None,
    address: Path | None,
    root: Path | None,
    insecure: tuple[str, ...],
    verbose: int,
) -> None:
    """Serve containerd's snapshots API (a [proxy_plugins] snapshotter)."""
    logging.basicConfig(
        level=[logging.INFO, logging.DEBUG][min(verbose, 1)],
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    overrides = {"address": address, "root": root, "insecure_registries": insecure}
    try:
        config = load_service_config(config_path, overrides)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    serve(config)  # fmt: skip


if __name__ == "__main__":
    serve_command()
