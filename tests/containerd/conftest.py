"""Fixtures for the containerd tests: the snapshotter daemon and a private containerd, once
per containerd flavour (Debian's 1.6 and 2.x from ``scripts/fetch-containerd2``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import itool
import pytest
from harness import BIG, FLAVOURS, Containerd, Flavour, find_flavour, running_node, sample_image
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
                  headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}).content
    )  # fmt: skip
    return ref, manifest
