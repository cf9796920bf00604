"""Fixtures for the containerd tests: the snapshotter daemon and a private containerd."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Containerd, SnapshotterDaemon, unmount_under
from support import Registry, require_fuse, require_tool


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, registry: Registry) -> Iterator[Containerd]:
    """containerd + the lazyblock daemon, sharing the session's registry (module-scoped:
    starting containerd takes a few seconds)."""
    require_fuse()
    require_tool("containerd", "ctr", "runc", "containerd-shim-runc-v2", "umoci", "skopeo")
    root = tmp_path_factory.mktemp("node")
    daemon = SnapshotterDaemon(root / "lazyblock", registry.host)
    containerd: Containerd | None = None
    try:
        daemon.start()
        (root / "containerd").mkdir()
        containerd = Containerd(root / "containerd", daemon, registry.host)
        yield containerd
    finally:
        try:
            if containerd is not None:
                containerd.stop()
        finally:
            daemon.stop()
            _unmount_lazyblock(daemon)
            unmount_under(root)


def _unmount_lazyblock(daemon: SnapshotterDaemon) -> None:
    """Stop mount servers the daemon left (a failed test may leave some)."""
    from snapshotter import mount as mount_mod
    from snapshotter.service import load_service_config

    config = load_service_config(daemon.config, {}).mount
    for info in mount_mod.list_mounts(config):
        try:
            mount_mod.unmount(Path(info.mountpoint), config)
        except Exception:  # noqa: BLE001 - best effort in teardown
            pass
