"""Mounting a multi-platform block image: the mount resolves the reference (an index of
per-platform images, ``convert --platform all``) to the running machine's platform, through
real FUSE and the kernel's erofs, from the directory store and the real registry.

The source is a two-platform OCI image index of images built by umoci (``--architecture``),
whose trees differ; the oracle is umoci's unpacking of the node's platform's image."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest
from itool import fill_base, fill_update, imagetool, snapshot
from mounthelp import with_store_options
from ocibuild import build_with_umoci, index_of_tags, unpack_with_umoci
from support import require_root, require_tool

from imagetool.platforms import default_platform
from snapshotter.mount import api

pytestmark = [pytest.mark.root, pytest.mark.integration]

PLATFORMS = {"linux/amd64": "amd64", "linux/arm64": "arm64"}


@pytest.fixture(scope="module")
def multi_source(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Path]]:
    """(source spec of a two-platform index, platform -> the rootfs umoci unpacks)."""
    require_root()
    require_tool("umoci")
    here = default_platform()
    if here not in PLATFORMS:
        pytest.skip(f"this machine is {here}; the test image index has {', '.join(PLATFORMS)}")
    base = tmp_path_factory.mktemp("mtree")
    l1, l2 = base / "l1", base / "l2"
    fill_base(l1)
    subprocess.run(["cp", "-a", str(l1), str(l2)], check=True)
    fill_update(l2)
    layout = tmp_path_factory.mktemp("moci") / "image"
    # amd64: one layer; arm64: two (different trees, so a wrong pick shows)
    build_with_umoci(layout, "amd64", [l1], entrypoint=["/bin/sh"], architecture="amd64")
    build_with_umoci(layout, "arm64", [l1, l2], entrypoint=["/bin/sh"], architecture="arm64")
    index_of_tags(layout, {p: t for p, t in PLATFORMS.items()}, "v1")
    unpacked = tmp_path_factory.mktemp("munpacked")
    roots = {p: unpack_with_umoci(layout, t, unpacked / t) for p, t in PLATFORMS.items()}
    return f"oci:{layout}:v1", roots


@pytest.mark.parametrize("kind", ["dir", "registry"])
def test_mount_of_an_index_picks_the_node_platform(
    kind: str, multi_source, config, tmp_path: Path, request: pytest.FixtureRequest
) -> None:  # noqa: ANN001
    source, roots = multi_source
    if kind == "dir":
        ref = f"{tmp_path}/store/multi:v1"
    else:
        registry = request.getfixturevalue("registry")
        ref = f"docker://{registry.host}/lazyblock/multi-{uuid.uuid4().hex[:8]}:v1"
        config = with_store_options(config, plain_http=True)
    done = imagetool("--plain-http", "convert", "-q", "--platform", "all", source, ref)
    images = dict(line.split() for line in done.err.strip().splitlines())
    assert sorted(images) == sorted(PLATFORMS)
    here = default_platform()
    other = next(p for p in PLATFORMS if p != here)
    assert snapshot(roots[here]) != snapshot(roots[other])

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    info = api.mount(ref, mnt, config)
    assert info.index_digest == images[here]
    assert snapshot(mnt) == snapshot(roots[here])
    api.unmount(mnt, config)
