"""``snapshotter pull``: the lazy pull for ctr users, end to end with real containerd (Debian's
1.6, whose own ``ctr image pull`` cannot pull a block image lazily, and 2.x), runc, the
lazyblock daemon and the registry. After it, ``ctr run --snapshotter lazyblock`` runs the
image, and the registry's log shows that only part of the data blob was read.

Marked root + integration: CI runs them as root (``.ci/run``)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import harness
import httpx
import pytest
from harness import NAMESPACE, OCI_INDEX, OCI_MANIFEST, Containerd
from ocibuild import push_to_registry
from support import Registry

pytestmark = [pytest.mark.root, pytest.mark.integration]


def lazy_pull(node: Containerd, ref: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``snapshotter pull`` of ``ref`` into the node's containerd, as a user types it."""
    return subprocess.run(
        [sys.executable, "-m", "snapshotter", "pull", "--address", str(node.address),
         "--namespace", NAMESPACE, "--plain-http", *args, ref],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def images(node: Containerd) -> list[str]:
    return node.ctr("images", "ls", "-q").stdout.split()


def remove_all(node: Containerd) -> None:
    node.cleanup_namespace(NAMESPACE)
    names = images(node)
    if names:
        node.ctr("images", "rm", "--sync", *names)


def test_pull_then_ctr_run(node: Containerd, registry: Registry, lazy_image) -> None:
    from snapshotter.mount import api as mount_mod

    ref, manifest = lazy_image
    start = harness.registry_log_end(registry)
    try:
        pulled = lazy_pull(node, ref)
        assert pulled.returncode == 0, pulled.stderr
        assert f"pulled {ref} lazily" in pulled.stdout
        assert images(node) == [ref]
        out = node.ctr("run", "--rm", "--snapshotter", "lazyblock", ref, "pull1").stdout
        assert out == "hello from lazyblock\n"
        out = node.ctr("run", "--rm", "--snapshotter", "lazyblock", ref, "pull2", "/bin/sh",
                       "-c", "echo $GREETING; pwd; ls /app").stdout  # fmt: skip
        assert out == "hi\n/app\ndata.bin\nmsg\n"
        read, size = harness.registry_data_bytes(registry, manifest, start)
        assert 0 < read < size // 4, (read, size)

        # Every layer is a remote snapshot named by its chain ID; the image's config
        # holds the top one for containerd's garbage collector.
        snaps = node.ctr("snapshots", "--snapshotter", "lazyblock", "ls").stdout.splitlines()
        rows = [line.split() for line in snaps[1:]]  # KEY [PARENT] KIND
        layers = len(manifest["layers"])
        assert sorted(len(row) for row in rows) == [2] + [3] * (layers - 1)
        assert all(row[-1] == "Committed" for row in rows)
        parent_of = {row[0]: row[1] if len(row) == 3 else None for row in rows}
        (top,) = [row for row in rows if row[0] not in parent_of.values()]
        chain, at = [], top[0]
        while at is not None:  # one chain, top to bottom, through every layer
            chain.append(at)
            at = parent_of[at]
        assert len(chain) == layers
        for row in rows:
            info = json.loads(
                node.ctr("snapshots", "--snapshotter", "lazyblock", "info", row[0]).stdout
            )
            assert info["Labels"]["containerd.io/snapshot/remote"] == "remote"
        content = node.ctr("content", "ls").stdout
        assert f"containerd.io/gc.ref.snapshot.lazyblock={top[0]}" in content

        # Pulling again is harmless (the snapshots exist; the record is pointed again).
        again = lazy_pull(node, ref)
        assert again.returncode == 0, again.stderr
        assert images(node) == [ref]
    finally:
        remove_all(node)
    # Removing the image lets containerd collect its snapshots; the daemon unmounts.
    assert harness.wait_no_snapshots(node, NAMESPACE) == []
    config = harness.mount_config(node)
    deadline = time.monotonic() + 10
    while mount_mod.list_mounts(config) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert mount_mod.list_mounts(config) == []


def test_pull_through_an_image_index(
    node: Containerd, registry: Registry, lazy_image: tuple[str, dict[str, Any]]
) -> None:
    """A tag naming an OCI image index: the node's platform's manifest is pulled, another
    platform is refused with the ones there are."""
    ref, manifest = lazy_image
    body = httpx.get(f"http://{registry.host}/v2/lazy/app/manifests/v1",
                     headers={"Accept": OCI_MANIFEST}).content  # fmt: skip
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    entry = {"mediaType": OCI_MANIFEST, "digest": digest, "size": len(body)}
    index = {
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [
            {**entry, "platform": {"os": "linux", "architecture": "s390x"}},
            {**entry, "platform": {"os": "linux", "architecture": "amd64"}},
        ],
    }
    resp = httpx.put(f"http://{registry.host}/v2/lazy/app/manifests/multi",
                     content=json.dumps(index), headers={"Content-Type": OCI_INDEX})  # fmt: skip
    assert resp.status_code == 201, resp.text
    multi = ref.replace(":v1", ":multi")
    try:
        pulled = lazy_pull(node, multi)
        assert pulled.returncode == 0, pulled.stderr
        assert f"manifest {digest}" in pulled.stdout
        out = node.ctr("run", "--rm", "--snapshotter", "lazyblock", multi, "multi1").stdout
        assert out == "hello from lazyblock\n"
        listing = node.ctr("images", "ls").stdout
        assert OCI_INDEX in listing
        refused = lazy_pull(node, multi, "--platform", "linux/arm64")
        assert refused.returncode == 3
        assert "no image for platform linux/arm64" in refused.stderr
        assert "linux/amd64" in refused.stderr and "linux/s390x" in refused.stderr
    finally:
        remove_all(node)
    assert harness.wait_no_snapshots(node, NAMESPACE) == []


def test_pull_and_run_a_converted_two_platform_index(
    node: Containerd, registry: Registry, two_platform_image: tuple[str, str, dict[str, Any]]
) -> None:
    """``imagetool convert --platform all`` publishes an OCI image index of block images;
    pulled on amd64, containerd gets the amd64 block image (lazily) and runs it."""
    ref, amd64_digest, manifest = two_platform_image
    start = harness.registry_log_end(registry)
    try:
        pulled = lazy_pull(node, ref)
        assert pulled.returncode == 0, pulled.stderr
        assert f"manifest {amd64_digest}" in pulled.stdout
        assert OCI_INDEX in node.ctr("images", "ls").stdout
        out = node.ctr("run", "--rm", "--snapshotter", "lazyblock", ref, "multi-run").stdout
        assert out == "hello from lazyblock on amd64\n"
        read, size = harness.registry_data_bytes(registry, manifest, start)
        assert 0 < read < size // 4, (read, size)
        # The arm64 image is in the index too, and refused here only when asked for.
        refused = lazy_pull(node, ref, "--platform", "linux/s390x")
        assert refused.returncode == 3
        assert "available: linux/amd64, linux/arm64" in refused.stderr
    finally:
        remove_all(node)
    assert harness.wait_no_snapshots(node, NAMESPACE) == []


def test_refusals_leave_nothing_behind(
    node: Containerd, registry: Registry, lazy_image, tmp_path: Path
) -> None:
    """Every refusal is one line and exit 3, and leaves no image record or snapshot."""
    ref, _ = lazy_image
    push_to_registry(harness.sample_image(tmp_path), "v1", registry.host, "plain/pullme")
    ordinary = f"{registry.host}/plain/pullme:v1"
    cases = [
        (ordinary, (), "is an ordinary image, not a lazyblock block image"),
        (ref, ("--platform", "linux/arm64"), "is an image for linux/amd64, not linux/arm64"),
        (f"{registry.host}/lazy/app:nosuchtag", (), "NotFoundError"),
        # A snapshotter that unpacks the layer instead of mounting it: the pull undoes its
        # Prepare and says so.
        (ref, ("--snapshotter", "overlayfs"), "for an ordinary layer to unpack"),
    ]
    for image, args, message in cases:
        proc = lazy_pull(node, image, *args)
        assert proc.returncode == 3, (image, args, proc.stdout, proc.stderr)
        assert message in proc.stderr, (image, args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith("snapshotter: error: ")
        assert images(node) == []
    for sn in ("lazyblock", "overlayfs"):
        out = node.ctr("snapshots", "--snapshotter", sn, "ls").stdout.splitlines()[1:]
        assert not [line for line in out if "Active" in line], out
    unreachable = subprocess.run(
        [sys.executable, "-m", "snapshotter", "pull", "--address", str(tmp_path / "no.sock"),
         "--plain-http", ref],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert unreachable.returncode == 3
    assert "cannot reach containerd at" in unreachable.stderr
