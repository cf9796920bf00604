"""containerd's snapshots API and the CRI image messages the keychain reads: the ``.proto``
files and their generated stubs.

``load()`` returns the generated modules; when they are missing or older than the ``.proto``
files (a fresh checkout that skipped ``python -m snapshotter.containerd.proto.build``) it generates
them first, if grpcio-tools is installed.
"""

from __future__ import annotations

import importlib
from types import ModuleType


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
