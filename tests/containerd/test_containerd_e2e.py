"""End to end with real containerd, runc and the registry: ordinary images through the
lazyblock snapshotter, converted images mounted lazily, daemon restarts, removal. Every test
runs on each containerd flavour (1.6 and 2.x: the ``node`` fixture's parameter).

Marked root + integration: CI runs them as root (``.ci/run``)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import (
    BIG,
    CRI_NAMESPACE,
    NAMESPACE,
    OCI_INDEX,
    OCI_MANIFEST,
    Containerd,
    Flavour,
    alive_at,
    find_flavour,
    kill_mount_servers,
    mount_config,
    registry_blob_bytes,
    registry_data_bytes,
    registry_log_end,
    running_node,
    sample_image,
    wait_no_snapshots,
)
from ocibuild import push_to_registry
from support import Registry, require, require_fuse, require_tool

pytestmark = [pytest.mark.root, pytest.mark.integration]


def test_ordinary_image_pull_and_run(node: Containerd, registry: Registry, tmp_path: Path) -> None:
    layout = sample_image(tmp_path)
    push_to_registry(layout, "v1", registry.host, "plain/app")
    ref = f"{registry.host}/plain/app:v1"
    node.ctr("image", "pull", "--plain-http", "--snapshotter", "lazyblock", ref)
    out = node.ctr("run", "--rm", "--snapshotter", "lazyblock", ref, "plain1").stdout
    assert out == "hello from lazyblock\n"
    out = node.ctr(
        "run", "--rm", "--snapshotter", "lazyblock", ref, "plain2", "/bin/sh", "-c",
        "echo $GREETING; pwd; echo changed > /app/msg; cat /app/msg",
    ).stdout  # fmt: skip
    assert out == "hi\n/app\nchanged\n"
    # The write went to the container's upper layer, not the image.
    assert node.ctr("run", "--rm", "--snapshotter", "lazyblock", ref, "plain3").stdout == (
        "hello from lazyblock\n"
    )
    snaps = node.ctr("snapshots", "--snapshotter", "lazyblock", "ls").stdout
    assert snaps.count("Committed") == 2
    # Also via CRI (the kubelet's path), into the k8s.io namespace.
    node.cri_pull(ref)
    out = node.ctr("run", "--rm", "--snapshotter", "lazyblock", ref, "plain4",
                   namespace=CRI_NAMESPACE).stdout  # fmt: skip
    assert out == "hello from lazyblock\n"
    for ns in (NAMESPACE, CRI_NAMESPACE):
        remove_images(node, ns)
    for ns in (NAMESPACE, CRI_NAMESPACE):
        assert wait_no_snapshots(node, ns) == []


def remove_images(node: Containerd, namespace: str) -> None:
    """Remove every image of ``namespace`` (CRI also names each image by its digests)."""
    names = node.ctr("images", "ls", "-q", namespace=namespace).stdout.split()
    if names:
        node.ctr("images", "rm", "--sync", *names, namespace=namespace)


def test_converted_image_runs_lazily(node: Containerd, registry: Registry, lazy_image) -> None:
    ref, manifest = lazy_image
    start = registry_log_end(registry)
    node.cri_pull(ref)
    run = ["run", "--rm", "--snapshotter", "lazyblock", ref]
    out = node.ctr(*run, "lazy1", namespace=CRI_NAMESPACE).stdout
    assert out == "hello from lazyblock\n"
    out = node.ctr(*run, "lazy2", "/bin/sh", "-c", "echo $GREETING; pwd; id -u; ls /app",
                   namespace=CRI_NAMESPACE).stdout  # fmt: skip
    assert out == "hi\n/app\n0\ndata.bin\nmsg\n"
    read, size = registry_data_bytes(registry, manifest, start)
    assert 0 < read < size // 4, (read, size)
    logging.getLogger(__name__).info("read %d of %d blob bytes", read, size)
    snaps = node.ctr("snapshots", "--snapshotter", "lazyblock", "ls",
                     namespace=CRI_NAMESPACE).stdout  # fmt: skip
    assert snaps.count("Committed") == len(manifest["layers"])


def test_ctr_pull_of_a_converted_image(node: Containerd, registry: Registry, lazy_image) -> None:
    """``ctr image pull --snapshotter lazyblock``: on 2.x its transfer service passes the
    layer labels (``enable_remote_snapshot_annotations`` in the proxy plugin's exports), so
    the image is mounted lazily; 1.6's ctr fetches every blob first and passes no labels
    (``snapshotter pull`` is the lazy pull there: test_pull.py)."""
    ref, manifest = lazy_image
    start = registry_log_end(registry)
    pull = node.ctr("image", "pull", "--plain-http", "--snapshotter", "lazyblock", ref,
                    check=node.flavour.config_version >= 3)  # fmt: skip
    read, size = registry_data_bytes(registry, manifest, start)
    try:
        if node.flavour.config_version < 3:  # the limit deploy/README.md documents
            assert pull.returncode != 0
            # What docs/troubleshooting.md quotes (it sends users to snapshotter pull).
            assert (
                "failed to get stream processor for "
                "application/vnd.oci.image.layer.lazyblock.sectors.v1" in pull.stderr
            ), pull.stderr
            assert "no processor for media-type" in pull.stderr
            assert read == size
            return
        assert read < size // 4, (read, size)
        out = node.ctr("run", "--rm", "--snapshotter", "lazyblock", ref, "tpull1").stdout
        assert out == "hello from lazyblock\n"
        snaps = node.ctr("snapshots", "--snapshotter", "lazyblock", "ls").stdout
        assert snaps.count("Committed") == len(manifest["layers"])
        chain = snaps.splitlines()[1].split()[0]
        info = json.loads(node.ctr("snapshots", "--snapshotter", "lazyblock", "info", chain).stdout)
        assert info["Labels"]["containerd.io/snapshot/remote"] == "remote"
    finally:
        remove_images(node, NAMESPACE)
        assert wait_no_snapshots(node, NAMESPACE) == []


def test_daemon_restart_keeps_running_container(node: Containerd, lazy_image) -> None:
    ref, manifest = lazy_image
    node.cri_pull(ref)
    node.ctr("run", "-d", "--snapshotter", "lazyblock", ref, "longrun", "/bin/sleep", "600",
             namespace=CRI_NAMESPACE)  # fmt: skip
    try:
        node.snapshotter.restart()
        node.wait_snapshotter()
        # Data never read before the restart: served by the mount server that outlived it.
        out = node.ctr("task", "exec", "--exec-id", "e1", "longrun", "/bin/sh", "-c",
                       "head -c 3000000 /app/data.bin | wc -c; cat /app/msg",
                       namespace=CRI_NAMESPACE).stdout  # fmt: skip
        assert out.split() == ["3000000", "hello", "from", "lazyblock"]
        # The restarted daemon knows every snapshot, and new containers start.
        snaps = node.ctr("snapshots", "--snapshotter", "lazyblock", "ls",
                         namespace=CRI_NAMESPACE).stdout  # fmt: skip
        assert snaps.count("Committed") == len(manifest["layers"]) and snaps.count("Active") == 1
        out = node.ctr("run", "--rm", "--snapshotter", "lazyblock", ref, "after",
                       namespace=CRI_NAMESPACE).stdout  # fmt: skip
        assert out == "hello from lazyblock\n"
    finally:
        node.cleanup_namespace(CRI_NAMESPACE)


def test_removing_the_image_frees_mounts(node: Containerd, lazy_image) -> None:
    from snapshotter.mount import api as mount_mod

    ref, _ = lazy_image
    node.cri_pull(ref)
    config = mount_config(node)
    assert [m for m in mount_mod.list_mounts(config) if m.alive]
    node.cleanup_namespace(CRI_NAMESPACE)
    remove_images(node, CRI_NAMESPACE)
    assert wait_no_snapshots(node, CRI_NAMESPACE) == []
    deadline = time.monotonic() + 10
    while mount_mod.list_mounts(config) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert mount_mod.list_mounts(config) == []
    assert list((node.snapshotter.root / "data" / "mounts").iterdir()) == []


def test_remount_after_the_mount_server_dies(node: Containerd, lazy_image) -> None:
    from snapshotter.mount import api as mount_mod

    ref, _ = lazy_image
    node.cri_pull(ref)
    run = ["run", "--rm", "--snapshotter", "lazyblock", ref]
    node.ctr("run", "-d", "--snapshotter", "lazyblock", ref, "victim", "/bin/sleep", "600",
             namespace=CRI_NAMESPACE)  # fmt: skip
    try:
        mountpoints = kill_mount_servers(node)
        assert mountpoints
        # A container running on a dead mount gets errors (EIO/ENOTCONN) for what is not
        # in the page cache: it must be restarted (deploy/README.md).
        res = node.ctr("task", "exec", "--exec-id", "e1", "victim", "/bin/sh", "-c",
                       "cat /app/data.bin > /dev/null", namespace=CRI_NAMESPACE,
                       check=False)  # fmt: skip
        assert res.returncode != 0
        node.cleanup_namespace(CRI_NAMESPACE)

        # As after a reboot: nothing mounted, the dead servers' leftovers gone.
        config = mount_config(node)
        for mountpoint in mountpoints:
            mount_mod.unmount(mountpoint, config)
        assert not [m for m in mount_mod.list_mounts(config)]
        node.snapshotter.restart()
        node.wait_snapshotter()
        assert alive_at(node, mountpoints)  # remounted when the daemon started
        assert node.ctr(*run, "after-restart", namespace=CRI_NAMESPACE).stdout == (
            "hello from lazyblock\n"
        )
        out = node.ctr(*run, "size", "/bin/sh", "-c", "wc -c < /app/data.bin",
                       namespace=CRI_NAMESPACE).stdout  # fmt: skip
        assert out.strip() == str(BIG)

        # Killed again, with the daemon up: the Prepare of the next container remounts it
        # (before the periodic check comes round).
        mountpoints = kill_mount_servers(node)
        assert mountpoints and not alive_at(node, mountpoints)
        assert node.ctr(*run, "after-kill", namespace=CRI_NAMESPACE).stdout == (
            "hello from lazyblock\n"
        )
        assert alive_at(node, mountpoints)
        assert "mount gone, remounting" in node.snapshotter.log_text()
    finally:
        node.cleanup_namespace(CRI_NAMESPACE)


HANDOVERS = 20  # of each kind


def test_container_reads_on_while_its_mount_server_is_killed_and_replaced(
    node: Containerd, lazy_image
) -> None:
    """A container reads its image's 48 MiB file in a loop (md5sum of the whole file, the
    page cache dropped under it all the time so that the reads reach the mount server) while
    the mount server is SIGKILLed 20 times (its holder starts a successor), then 20 times the
    daemon is restarted and the mount server replaced (``api.replace``, what ``snapshotter
    upgrade-mounts`` does after an upgrade): every pass of the loop must succeed with the
    same digest."""
    import os
    import signal
    import subprocess
    import threading

    from snapshotter.mount import api as mount_mod
    from snapshotter.mount import state

    ref, _ = lazy_image
    node.cri_pull(ref)
    node.ctr("run", "-d", "--snapshotter", "lazyblock", ref, "reader", "/bin/sleep", "600",
             namespace=CRI_NAMESPACE)  # fmt: skip
    config = mount_config(node)
    (mount,) = [m for m in mount_mod.list_mounts(config)
                if (m.mountpoint / "app/data.bin").exists()]  # fmt: skip
    assert mount.alive and mount.held
    stop_dropping = threading.Event()

    def drop_page_cache() -> None:  # the container's reads go down to FUSE
        fd = os.open(mount.mountpoint / "app/data.bin", os.O_RDONLY)
        try:
            while not stop_dropping.wait(0.02):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    loop = ("while [ ! -e /tmp/stop ]; do s=$(busybox md5sum /app/data.bin 2>&1) "
            "&& echo \"ok ${s%% *}\" || echo \"FAIL $s\"; done")  # fmt: skip
    cmd = [node.flavour.binary("ctr"), "--address", str(node.address), "-n", CRI_NAMESPACE,
           "task", "exec", "--exec-id", "loop", "reader", "/bin/sh", "-c", loop]  # fmt: skip
    reader = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=node.flavour.env())  # fmt: skip
    lines: list[tuple[float, str]] = []
    collector = threading.Thread(
        target=lambda: lines.extend((time.monotonic(), line.strip()) for line in reader.stdout),
        daemon=True,
    )
    collector.start()
    dropper = threading.Thread(target=drop_page_cache, daemon=True)
    dropper.start()
    try:

        def passes_after(n: int, timeout: float = 60) -> None:
            want, deadline = len(lines) + n, time.monotonic() + timeout
            while len(lines) < want:
                assert time.monotonic() < deadline and reader.poll() is None, lines[-3:]
                time.sleep(0.02)

        passes_after(3)
        directory = mount.state_dir
        for _ in range(HANDOVERS):
            pid = state.MountRecord.load(directory).pid
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while not ((r := state.MountRecord.load(directory)) and r.pid != pid and r.alive):
                assert time.monotonic() < deadline, "no successor"
                time.sleep(0.01)
            passes_after(1)
        # An upgrade, 20 times over: the daemon restarted as systemd does it
        # (KillMode=process: the daemon alone, its mount servers live on), then the mount
        # server replaced by a process of the installed (new) code, as `snapshotter
        # upgrade-mounts` does after the package upgrade.
        for _ in range(HANDOVERS):
            before = node.snapshotter.proc
            node.snapshotter.restart()
            assert node.snapshotter.proc is not before
            node.wait_snapshotter()
            passes_after(1)
            old = state.MountRecord.load(directory).pid
            info = mount_mod.replace(mount.mountpoint, config)
            assert info.pid != old
            passes_after(1)
        passes_after(2)
    finally:
        stop_dropping.set()
        node.ctr("task", "exec", "--exec-id", "stop", "reader", "/bin/sh", "-c",
                 "echo > /tmp/stop", namespace=CRI_NAMESPACE, check=False)  # fmt: skip
        try:
            reader.wait(60)
        finally:
            collector.join(10)
            node.cleanup_namespace(CRI_NAMESPACE)
    digests = {line for _, line in lines}
    failed = [line for _, line in lines if not line.startswith("ok ")]
    gaps = [b - a for (a, _), (b, _) in zip(lines, lines[1:], strict=False)]
    typical = sorted(gaps)[len(gaps) // 2]
    print(f"\ncontainer ({node.flavour.name}): {HANDOVERS} SIGKILLs, {HANDOVERS} daemon "
          f"restarts each followed by a replacement, "
          f"{len(lines)} passes over the file, {len(failed)} failed, {len(digests)} digest(s); "
          f"pass took median {typical:.3f}s, longest {max(gaps):.3f}s")  # fmt: skip
    assert failed == [] and len(digests) == 1
    stats = mount_mod.stats(mount.mountpoint, config)
    assert stats["handover"]["servers"] == 2 * HANDOVERS + 1
    # The passes reached FUSE: the last server alone (2 passes at least) answered this much.
    print(f"last server: {stats['fetch']['read_bytes']} bytes read through FUSE")
    assert stats["fetch"]["read_bytes"] >= BIG // 2


def cri_pull_two_platform_index(
    node: Containerd, registry: Registry, two_platform_image: tuple[str, str, dict[str, Any]]
) -> None:
    """CRI PullImage of the converted two-platform index (containerd picks the node's
    platform), then a run in k8s.io: the amd64 image's output, its data read lazily."""
    ref, _, manifest = two_platform_image
    # From an empty k8s.io (the module's other tests leave their image there), so that the
    # snapshots counted below are this image's.
    node.cleanup_namespace(CRI_NAMESPACE)
    remove_images(node, CRI_NAMESPACE)
    assert wait_no_snapshots(node, CRI_NAMESPACE) == []
    start = registry_log_end(registry)
    try:
        node.cri_pull(ref)
        out = node.ctr("run", "--rm", "--snapshotter", "lazyblock", ref, "multi-cri",
                       namespace=CRI_NAMESPACE).stdout  # fmt: skip
        assert out == "hello from lazyblock on amd64\n"
        read, size = registry_data_bytes(registry, manifest, start)
        assert 0 < read < size // 4, (read, size)
        logging.getLogger(__name__).info("read %d of %d blob bytes", read, size)
        # Nothing of the arm64 image's own blobs was read.
        others = other_platform_blobs(registry, ref, manifest)
        assert others
        assert not any(registry_blob_bytes(registry, d, start) for d in others)
        # Every layer of the amd64 image is a remote snapshot (no layer was unpacked).
        snaps = node.ctr("snapshots", "--snapshotter", "lazyblock", "ls",
                         namespace=CRI_NAMESPACE).stdout  # fmt: skip
        rows = [line.split() for line in snaps.splitlines()[1:]]
        assert len(rows) == len(manifest["layers"]) and all(r[-1] == "Committed" for r in rows)
        for row in rows:
            info = json.loads(node.ctr("snapshots", "--snapshotter", "lazyblock", "info",
                                       row[0], namespace=CRI_NAMESPACE).stdout)  # fmt: skip
            assert info["Labels"]["containerd.io/snapshot/remote"] == "remote"
        # The image record is the index itself.
        listing = node.ctr("images", "ls", namespace=CRI_NAMESPACE).stdout
        assert OCI_INDEX in listing
    finally:
        node.cleanup_namespace(CRI_NAMESPACE)
        remove_images(node, CRI_NAMESPACE)
    assert wait_no_snapshots(node, CRI_NAMESPACE) == []


def other_platform_blobs(registry: Registry, ref: str, manifest: dict[str, Any]) -> list[str]:
    """The layer digests of the arm64 image of ``ref``'s index that the amd64 one
    (``manifest``) does not share."""
    repo, tag = ref.split("/", 1)[1].rsplit(":", 1)
    base = f"http://{registry.host}/v2/{repo}/manifests"
    index = httpx.get(f"{base}/{tag}", headers={"Accept": OCI_INDEX}).json()
    (arm64,) = [m for m in index["manifests"] if m["platform"]["architecture"] == "arm64"]
    other = httpx.get(f"{base}/{arm64['digest']}", headers={"Accept": OCI_MANIFEST}).json()
    ours = {d["digest"] for d in manifest["layers"]}
    return [d["digest"] for d in other["layers"] if d["digest"] not in ours]


def test_cri_pull_of_a_converted_two_platform_index(
    node: Containerd, registry: Registry, two_platform_image: tuple[str, str, dict[str, Any]]
) -> None:
    """The kubelet's path for ``imagetool convert --platform all``'s index (1.6, 2.x)."""
    cri_pull_two_platform_index(node, registry, two_platform_image)


def test_cri_pull_of_a_converted_two_platform_index_through_the_transfer_service(
    registry: Registry,
    two_platform_image: tuple[str, str, dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The same on containerd 2.x whose CRI pulls through the transfer service (2.1's
    default when ``disable_snapshot_annotations`` is not set)."""
    require_fuse()
    require_tool("runc", "umoci", "skopeo")
    found = find_flavour("2.x-transfer")
    require(isinstance(found, Flavour), f"containerd 2.x: {found}")
    assert isinstance(found, Flavour)
    root = tmp_path_factory.mktemp("node-2.x-transfer")
    with running_node(root, registry.host, found) as node:
        cri_pull_two_platform_index(node, registry, two_platform_image)
        assert "Falling back to local image pull mode" not in node.log.read_text()
