"""Fixtures for the containerd tests: the snapshotter daemon and a private containerd, once
per containerd flavour (Debian's 1.6 and 2.x from ``scripts/fetch-containerd2``)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import itool
import pytest
from harness import (
    BIG,
    FLAVOURS,
    OCI_INDEX,
    OCI_MANIFEST,
    Containerd,
    Flavour,
    busybox_tree,
    find_flavour,
    running_node,
    sample_image,
)
from ocibuild import build_with_umoci, index_of_tags
from support import Registry, require, require_fuse, require_tool


@pytest.fixture(scope="module", params=FLAVOURS)
def flavour(request: pytest.FixtureRequest) -> Flavour:
    """Which containerd the module's node runs: every test using ``node`` runs on each."""
    require_fuse()
    require_tool("runc", "umoci", "skopeo")
    if request.param == "1.6":
        require_tool("containerd", "ctr", "containerd-shim-runc-v2")
    found = find_flavour(request.param)
    require(isinstance(found, Flavour), f"containerd {request.param}: {found}")
    assert isinstance(found, Flavour)
    return found


@pytest.fixture(scope="module")
def node(
    tmp_path_factory: pytest.TempPathFactory, registry: Registry, flavour: Flavour
) -> Iterator[Containerd]:
    """containerd + the lazyblock daemon, sharing the session's registry (module-scoped:
    starting containerd takes a few seconds)."""
    root = tmp_path_factory.mktemp(f"node-{flavour.name}")
    with running_node(root, registry.host, flavour) as containerd:
        yield containerd


@pytest.fixture(scope="module")
def lazy_image(
    registry: Registry, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, dict[str, Any]]:
    """A 2-layer image (busybox + app with 48 MiB of data) converted into the registry (once
    for both containerd flavours): its reference and its manifest."""
    tmp = tmp_path_factory.mktemp("lazyimg")
    layout = sample_image(tmp, big=BIG)
    ref = f"{registry.host}/lazy/app:v1"
    itool.imagetool("--plain-http", "convert", "-q", "--sector-size", "1MiB",
                    f"oci:{layout}:v1", f"docker://{ref}")  # fmt: skip
    manifest = json.loads(
        httpx.get(f"http://{registry.host}/v2/lazy/app/manifests/v1",
                  headers={"Accept": OCI_MANIFEST}).content
    )  # fmt: skip
    return ref, manifest


@pytest.fixture(scope="module")
def two_platform_image(
    registry: Registry, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, str, dict[str, Any]]:
    """A two-platform image index built with umoci (linux/amd64: busybox + app with 48 MiB
    of data never read; linux/arm64: the same without the data and with another message;
    busybox is this machine's, the arm64 image is never run), converted with ``imagetool
    convert --platform all`` into the registry: its reference, the digest of its amd64
    block image and that image's manifest."""
    from imagetool.platforms import default_platform

    if default_platform() != "linux/amd64":
        pytest.skip(f"this machine is {default_platform()}; the test runs the amd64 image")
    tmp = tmp_path_factory.mktemp("multi")
    base = busybox_tree(tmp / "t1")
    layout = tmp / "oci"
    for arch in ("amd64", "arm64"):
        app = tmp / f"t2-{arch}"
        shutil.copytree(base, app, symlinks=True)
        (app / "app").mkdir()
        (app / "app/msg").write_text(f"hello from lazyblock on {arch}\n")
        if arch == "amd64":
            (app / "app/data.bin").write_bytes(os.urandom(BIG))
        build_with_umoci(layout, arch, [base, app], cmd=["/bin/cat", "/app/msg"],
                         workdir="/app", architecture=arch)  # fmt: skip
    index_of_tags(layout, {"linux/amd64": "amd64", "linux/arm64": "arm64"}, "v1")
    ref = f"{registry.host}/lazy/multi:v1"
    itool.imagetool("--plain-http", "convert", "-q", "--sector-size", "1MiB", "--platform",
                    "all", f"oci:{layout}:v1", f"docker://{ref}")  # fmt: skip
    index = httpx.get(f"http://{registry.host}/v2/lazy/multi/manifests/v1",
                      headers={"Accept": OCI_INDEX}).json()  # fmt: skip
    amd64 = next(m for m in index["manifests"] if m["platform"]["architecture"] == "amd64")
    manifest = httpx.get(f"http://{registry.host}/v2/lazy/multi/manifests/{amd64['digest']}",
                         headers={"Accept": OCI_MANIFEST}).json()  # fmt: skip
    return ref, amd64["digest"], manifest
