"""containerd's snapshots API, the CRI image messages the keychain reads, the parts of
containerd's images, content and leases APIs that ``snapshotter pull`` calls, and its version
and introspection services that ``snapshotter check`` asks: the ``.proto`` files and their
generated stubs.

``load()`` returns the generated modules; when they are missing or older than the ``.proto``
files (a fresh checkout that skipped ``python -m snapshotter.containerd.proto.build``) it generates
them first, if grpcio-tools is installed.
"""

from __future__ import annotations

import importlib
from types import ModuleType, SimpleNamespace


def load() -> tuple[ModuleType, ModuleType, ModuleType]:
    """(mount_pb2, snapshots_pb2, snapshots_pb2_grpc)."""
    from snapshotter.containerd.proto import build as _build

    if not _build.up_to_date():
        _build.build()
        importlib.invalidate_caches()
    return (
        importlib.import_module("snapshotter.containerd.proto.mount_pb2"),
        importlib.import_module("snapshotter.containerd.proto.snapshots_pb2"),
        importlib.import_module("snapshotter.containerd.proto.snapshots_pb2_grpc"),
    )


def load_cri() -> ModuleType:
    """cri_pb2: the CRI image service messages (``runtime.v1``) the keychain reads."""
    load()
    return importlib.import_module("snapshotter.containerd.proto.cri_pb2")


CLIENT_SERVICES = ("images", "content", "leases", "snapshots")


def load_client(services: tuple[str, ...] = CLIENT_SERVICES) -> SimpleNamespace:
    """The stubs a client of containerd needs: for each of ``services`` (default: what
    ``snapshotter pull`` calls; ``snapshotter check`` asks for ``version``, ``introspection``
    and ``snapshots``) the ``_pb2`` module, its gRPC module as ``<name>_grpc``; and
    ``descriptor``."""
    load()
    modules = {}
    for name in services:
        modules[name] = importlib.import_module(f"snapshotter.containerd.proto.{name}_pb2")
        modules[f"{name}_grpc"] = importlib.import_module(
            f"snapshotter.containerd.proto.{name}_pb2_grpc"
        )
    modules["descriptor"] = importlib.import_module("snapshotter.containerd.proto.descriptor_pb2")
    return SimpleNamespace(**modules)
