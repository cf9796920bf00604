"""Fixtures for the mount tests: images in a directory store, a config with a private cache
and state directory, and cleanup of every mount a test leaves (also after failures)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import mountimages as images
import pytest
from itool import fill_base, fill_update
from ocibuild import build_with_umoci, unpack_with_umoci
from support import require_fuse, require_root, require_tool

from snapshotter.config import FetchConfig, MountConfig


@pytest.fixture
def config(tmp_path: Path) -> Iterator[MountConfig]:
    """A mount configuration with its own cache and state; unmounts whatever is left."""
    require_fuse()
    cfg = MountConfig(
        cache_dir=tmp_path / "cache",
        cache_size=4 << 30,
        state_dir=tmp_path / "state",
        prefetch=False,
        mount_timeout=60,
        fetch=FetchConfig(request_timeout=2.0, retries=1, backoff_base=0.05, deadline=5.0),
    )
    yield cfg
    from snapshotter.mount import api

    for info in api.list_mounts(cfg):
        try:
            api.unmount(info.mountpoint, cfg, lazy=True)
        except Exception as e:  # noqa: BLE001 - cleanup goes on
            print(f"cleanup of {info.mountpoint} failed: {e}", file=sys.stderr)


@pytest.fixture(scope="session")
def umoci_source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(OCI layout with tag v1 built by umoci, the rootfs umoci unpacks from it)."""
    require_root()
    require_tool("umoci", "skopeo")
    base = tmp_path_factory.mktemp("tree")
    l1, l2 = base / "l1", base / "l2"
    fill_base(l1)
    subprocess.run(["cp", "-a", str(l1), str(l2)], check=True)
    fill_update(l2)
    layout = tmp_path_factory.mktemp("oci") / "image"
    build_with_umoci(layout, "v1", [l1, l2], entrypoint=["/bin/sh"])
    rootfs = unpack_with_umoci(layout, "v1", tmp_path_factory.mktemp("unpacked") / "bundle")
    return layout, rootfs


@pytest.fixture(scope="session")
def umoci_dir_ref(umoci_source: tuple[Path, Path], tmp_path_factory) -> str:  # noqa: ANN001
    ref = str(tmp_path_factory.mktemp("store") / "app:v1")
    images.convert(umoci_source[0], "v1", ref, "--sector-size", "256KiB")
    return ref


@pytest.fixture(scope="session")
def many_files_ref(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An image with 20,000 small files."""
    root = tmp_path_factory.mktemp("many")
    layout = images.build_layout(root, [images.many_files_layer(20_000)])
    ref = str(root / "store" / "many:v1")
    images.convert(layout, "v1", ref)
    return ref


@pytest.fixture(scope="session")
def big_ref() -> Iterator[str]:
    """A 1 GiB image (compressible data, so the store holds little); built in tmpfs."""
    root = Path(tempfile.mkdtemp(prefix="lazyblock-big-", dir="/dev/shm"))
    try:
        layout = images.build_layout(root, [images.big_layer(1 << 30)])
        ref = str(root / "store" / "big:v1")
        images.convert(layout, "v1", ref, "--tmpdir", str(root))
        shutil.rmtree(layout)
        yield ref
    finally:
        shutil.rmtree(root, ignore_errors=True)
