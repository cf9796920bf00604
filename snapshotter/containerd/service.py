"""containerd's snapshots API over gRPC on a unix socket: requests in, status codes out.

containerd reaches it as a ``[proxy_plugins]`` snapshotter. Each handler only translates: a
request becomes one call on ``SnapshotStore`` (or, for a Prepare whose labels name a
lazyblock layer, on ``RemoteLayers``: ``snapshotter.containerd.handshake``), and errors
become status codes:

    SnapshotNotFoundError   NOT_FOUND          SnapshotExistsError    ALREADY_EXISTS
    SnapshotStateError      FAILED_PRECONDITION SnapshotArgumentError INVALID_ARGUMENT
    any other error         UNKNOWN (its message, never credentials)

The daemon around it (its start, restarts, the CRI image service beside it) is
``snapshotter.containerd.daemon``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from snapshotter.config import DEFAULT_WORKERS
from snapshotter.containerd.handshake import RemoteLayers
from snapshotter.containerd.proto import load as _load_stubs
from snapshotter.containerd.snapshots import (
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

# Infos per List response message (containerd streams them).
LIST_BATCH = 100


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

    def __init__(self, store: SnapshotStore, remote: RemoteLayers | None = None) -> None:
        self.store = store
        self.remote = remote  # None: no lazy layers

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


def start_server(
    address: Path,
    store: SnapshotStore,
    remote: RemoteLayers | None = None,
    workers: int = DEFAULT_WORKERS,
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
