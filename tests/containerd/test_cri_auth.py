"""CRI pulls from a registry that wants credentials, the way a kubelet does them: through
the daemon's CRI image service proxy (``[snapshotter] image_service_address``, the kubelet's
``--image-service-endpoint``), with the pod's pull secret in PullImage's AuthConfig.

The node has no docker config.json (the daemon's ``DOCKER_CONFIG`` is an empty directory), so
the lazy mounts can only get in with what the proxy recorded from the pull. The registry is
Debian's docker-registry with token auth (tests/support.py's TokenServer, tokens that die
after a few seconds), run on each containerd flavour, and once more on containerd 2.x with
CRI pulling through its transfer service (the default of 2.1 when the config does not set
``disable_snapshot_annotations``).
"""

from __future__ import annotations

import base64
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import itool
import pytest
from harness import (
    BIG,
    CRI_NAMESPACE,
    Containerd,
    Flavour,
    alive_at,
    find_flavour,
    kill_mount_servers,
    mount_config,
    registry_data_bytes,
    registry_log_end,
    running_node,
    sample_image,
    wait_for,
    wait_no_snapshots,
)
from support import AuthRegistry, require, require_fuse, token_auth_registry

from snapshotter.containerd.proto import load_cri

pytestmark = [pytest.mark.root, pytest.mark.integration]

USER = "kubelet-puller"
PASSWORD = "pw-" + uuid.uuid4().hex  # unique: any trace of it in a log is a leak
WRONG = "wrong-" + uuid.uuid4().hex
LIFETIME = 3  # seconds a registry token lives
REPO = "secure/app"

cri = load_cri()


@pytest.fixture(scope="module")
def auth_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthRegistry]:
    root = tmp_path_factory.mktemp("authreg")
    with token_auth_registry(root, {USER: PASSWORD}, expires_in=LIFETIME) as reg:
        yield reg


@pytest.fixture(scope="module")
def secure_image(auth_registry: AuthRegistry, tmp_path_factory: pytest.TempPathFactory):
    """The sample image (48 MiB never read) converted into the registry; imagetool gets its
    credentials from a docker config of its own (not the node's)."""
    tmp = tmp_path_factory.mktemp("secureimg")
    layout = sample_image(tmp, big=BIG)
    ref = f"{auth_registry.host}/{REPO}:v1"
    docker = tmp / "docker"
    docker.mkdir()
    auth = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    (docker / "config.json").write_text(json.dumps({"auths": {auth_registry.host: {"auth": auth}}}))
    saved = os.environ.get("DOCKER_CONFIG")
    os.environ["DOCKER_CONFIG"] = str(docker)
    try:
        itool.imagetool("--plain-http", "convert", "-q", "--sector-size", "1MiB",
                        f"oci:{layout}:v1", f"docker://{ref}")  # fmt: skip
    finally:
        if saved is None:
            os.environ.pop("DOCKER_CONFIG")
        else:
            os.environ["DOCKER_CONFIG"] = saved
    token = httpx.get(
        auth_registry.tokens.realm,
        params={"service": auth_registry.tokens.service, "scope": f"repository:{REPO}:pull"},
        auth=(USER, PASSWORD),
    ).json()["token"]
    manifest = httpx.get(
        f"http://{auth_registry.host}/v2/{REPO}/manifests/v1",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json",
                 "Authorization": f"Bearer {token}"},
    ).json()  # fmt: skip
    return ref, manifest


@pytest.fixture(scope="module")
def auth_node(
    tmp_path_factory: pytest.TempPathFactory, auth_registry: AuthRegistry, flavour: Flavour
) -> Iterator[Containerd]:
    """A node whose daemon serves the CRI image service proxy, with no docker config."""
    yield from _auth_node(tmp_path_factory, auth_registry, flavour)


@pytest.fixture(scope="module")
def transfer_node(
    tmp_path_factory: pytest.TempPathFactory, auth_registry: AuthRegistry
) -> Iterator[Containerd]:
    """The same on containerd 2.x whose CRI plugin pulls through the transfer service."""
    require_fuse()
    found = find_flavour("2.x-transfer")
    require(isinstance(found, Flavour), f"containerd 2.x: {found}")
    assert isinstance(found, Flavour)
    yield from _auth_node(tmp_path_factory, auth_registry, found)


def _auth_node(
    tmp_path_factory: pytest.TempPathFactory,
    auth_registry: AuthRegistry,
    flavour: Flavour,
    name: str = "authnode",
    **extra: str,
) -> Iterator[Containerd]:
    root = tmp_path_factory.mktemp(f"{name}-{flavour.name}")
    empty = root / "no-docker-config"
    empty.mkdir()
    settings = {
        "image_service_address": str(root / "lazyblock" / "image.sock"),
        "containerd_address": str(root / "containerd" / "containerd.sock"),
        **extra,
    }
    with running_node(
        root, auth_registry.host, flavour, settings, env={"DOCKER_CONFIG": str(empty)}
    ) as node:
        assert node.snapshotter.proc is not None
        wait_for(Path(settings["image_service_address"]), node.snapshotter.proc, "image service")
        yield node


def image_socket(node: Containerd) -> Path:
    return node.snapshotter.root / "image.sock"


def pull_request(image: str, username: str = "", password: str = "", auth: str = "") -> bytes:
    request = cri.PullImageRequest(image=cri.ImageSpec(image=image))
    if username or auth:
        request.auth.CopyFrom(cri.AuthConfig(username=username, password=password, auth=auth))
    return request.SerializeToString()


def proxy_pull(node: Containerd, image: str, **auth: str) -> str:
    reply = node.cri_call("PullImage", pull_request(image, **auth), address=image_socket(node))
    return cri.PullImageResponse.FromString(reply).image_ref


def assert_no_secret(node: Containerd) -> None:
    logs = node.snapshotter.log_text() + node.log.read_text(errors="replace")
    for server_log in (node.snapshotter.root / "state").rglob("server.log"):
        logs += server_log.read_text(errors="replace")
    encoded = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    for secret in (PASSWORD, WRONG, encoded):
        assert secret not in logs, "a secret appears in a log"


def test_wrong_or_missing_credentials_fail_the_pull(auth_node: Containerd, secure_image) -> None:
    ref, _ = secure_image
    with pytest.raises(grpc.RpcError) as missing:
        proxy_pull(auth_node, ref)
    with pytest.raises(grpc.RpcError) as wrong:
        proxy_pull(auth_node, ref, username=USER, password=WRONG)
    for error in (missing.value, wrong.value):
        details = error.details().lower()
        assert "401" in details or "unauthorized" in details, details
        assert ref in error.details()
    with pytest.raises(grpc.RpcError) as malformed:
        proxy_pull(auth_node, ref, auth="not base64!")
    assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "AuthConfig.auth" in malformed.value.details()
    # Right credentials, but straight to containerd (no proxy): containerd gets in, the
    # lazy mount cannot (the problem the proxy solves), and the pull fails saying so.
    with pytest.raises(grpc.RpcError) as bypass:
        auth_node.cri_call("PullImage", pull_request(ref, username=USER, password=PASSWORD))
    assert "refused anonymous access" in bypass.value.details()
    # (what that pull left is garbage-collected before the next test pulls again)
    assert wait_no_snapshots(auth_node, CRI_NAMESPACE) == []
    images = auth_node.ctr("images", "ls", "-q", namespace=CRI_NAMESPACE).stdout
    assert ref not in images
    assert_no_secret(auth_node)


def test_pull_with_credentials_runs_lazily(
    auth_node: Containerd, auth_registry: AuthRegistry, secure_image
) -> None:
    ref, manifest = secure_image
    start = registry_log_end(auth_registry)
    image_ref = proxy_pull(auth_node, ref, username=USER, password=PASSWORD)
    assert image_ref.startswith("sha256:")
    # Everything else the kubelet calls goes through unchanged.
    status = auth_node.cri_call("ImageStatus", pull_request(ref), address=image_socket(auth_node))
    assert image_ref.encode() in status
    assert auth_node.cri_call("ListImages", b"", address=image_socket(auth_node)) == (
        auth_node.cri_call("ListImages", b"")
    )
    run = ["run", "--rm", "--snapshotter", "lazyblock", ref]
    out = auth_node.ctr(*run, "sec1", namespace=CRI_NAMESPACE).stdout
    assert out == "hello from lazyblock\n"
    read, size = registry_data_bytes(auth_registry, manifest, start)
    assert 0 < read < size // 4, (read, size)

    # The mount server renews its token with the recorded credentials: after the first
    # token died it still reads data it never read.
    time.sleep(LIFETIME + 1)
    out = auth_node.ctr(*run, "sec2", "/bin/sh", "-c", "head -c 3000000 /app/data.bin | wc -c",
                        namespace=CRI_NAMESPACE).stdout  # fmt: skip
    assert out.strip() == "3000000"

    # A wrong credential for the same repository fails and leaves the good one in place:
    # a mount server killed afterwards is remounted with it by the next Prepare.
    with pytest.raises(grpc.RpcError):
        proxy_pull(auth_node, ref, username=USER, password=WRONG)
    mountpoints = kill_mount_servers(auth_node)
    assert mountpoints and not alive_at(auth_node, mountpoints)
    out = auth_node.ctr(*run, "sec3", "/bin/sh", "-c", "wc -c < /app/data.bin",
                        namespace=CRI_NAMESPACE).stdout  # fmt: skip
    assert out.strip() == str(BIG)
    assert alive_at(auth_node, mountpoints)
    assert "credentials recorded for" in auth_node.snapshotter.log_text()
    # Nothing of them went to disk: the daemon's merged docker config stays empty.
    merged = auth_node.snapshotter.root / "data" / "auth" / "config.json"
    assert json.loads(merged.read_text()) == {"auths": {}}
    assert_no_secret(auth_node)


def test_pull_through_the_transfer_service(
    transfer_node: Containerd, auth_registry: AuthRegistry, secure_image
) -> None:
    """containerd 2.1's CRI in transfer-service mode: the layer labels come from the proxy
    plugin's ``enable_remote_snapshot_annotations`` export, the credentials from the
    keychain, and the image still mounts lazily."""
    ref, manifest = secure_image
    start = registry_log_end(auth_registry)
    proxy_pull(transfer_node, ref, username=USER, password=PASSWORD)
    assert "Falling back to local image pull mode" not in transfer_node.log.read_text()
    out = transfer_node.ctr("run", "--rm", "--snapshotter", "lazyblock", ref, "tr1",
                            namespace=CRI_NAMESPACE).stdout  # fmt: skip
    assert out == "hello from lazyblock\n"
    read, size = registry_data_bytes(auth_registry, manifest, start)
    assert 0 < read < size // 4, (read, size)
    assert "credentials recorded for" in transfer_node.snapshotter.log_text()
    assert_no_secret(transfer_node)


@pytest.fixture(scope="module")
def restart_node(
    tmp_path_factory: pytest.TempPathFactory, auth_registry: AuthRegistry, flavour: Flavour
) -> Iterator[Containerd]:
    """As ``auth_node``, with the periodic remount check every 2 s."""
    yield from _auth_node(
        tmp_path_factory, auth_registry, flavour, "restartnode", remount_interval="2"
    )


def assert_not_on_disk(node: Containerd) -> None:
    """No file under the daemon's directories (root, state, cache, config, logs) holds the
    password or user:password in base64; mounted images are not walked into."""
    encoded = base64.b64encode(f"{USER}:{PASSWORD}".encode())
    checked = 0
    for dirpath, dirs, files in os.walk(node.snapshotter.root):
        dirs[:] = [d for d in dirs if not os.path.ismount(os.path.join(dirpath, d))]
        for name in files:
            path = Path(dirpath, name)
            if not path.is_file() or path.is_symlink():
                continue
            data = path.read_bytes()
            checked += 1
            assert PASSWORD.encode() not in data and encoded not in data, path
    assert checked > 10


def test_credentials_for_remounts_survive_a_daemon_restart(
    restart_node: Containerd, auth_registry: AuthRegistry, secure_image
) -> None:
    """The kubelet's credentials, recorded from its pull, outlive a daemon restart in the
    mount servers' memory: the new daemon takes them back from them, and a mount server
    killed after the restart is remounted with them. With every mount server gone too,
    the remount cannot authenticate: logged and counted, retried, and done once a pull
    gives credentials again. Nothing of them is written to disk."""
    from snapshotter.metrics import REMOUNT_FAILURES_FILE, read_counts
    from snapshotter.prometheus import exposition

    node = restart_node
    ref, _ = secure_image
    proxy_pull(node, ref, username=USER, password=PASSWORD)
    run = ["run", "--rm", "--snapshotter", "lazyblock", ref]
    out = node.ctr(*run, "rs1", "/bin/sh", "-c", "wc -c < /app/data.bin",
                   namespace=CRI_NAMESPACE).stdout  # fmt: skip
    assert out.strip() == str(BIG)

    # 1. Restart: the daemon asks the live mount servers; then one dies and is remounted.
    node.snapshotter.restart()
    node.wait_snapshotter()
    mountpoints = kill_mount_servers(node)
    assert mountpoints
    out = node.ctr(*run, "rs2", "/bin/sh", "-c", "wc -c < /app/data.bin",
                   namespace=CRI_NAMESPACE).stdout  # fmt: skip
    assert out.strip() == str(BIG)
    assert alive_at(node, mountpoints)
    assert "recovered from the mount server of" in node.snapshotter.log_text()

    # 2. Restart with no mount server left to ask: the remount cannot authenticate.
    node.snapshotter.stop()
    kill_mount_servers(node)
    node.snapshotter.start()
    node.wait_snapshotter()
    failures = mount_config(node).state_dir / REMOUNT_FAILURES_FILE
    deadline = time.monotonic() + 30
    while read_counts(failures).get("auth", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)  # the start's check and at least one periodic retry
    assert read_counts(failures).get("auth", 0) >= 2
    assert "cannot authenticate" in node.snapshotter.log_text()
    assert not alive_at(node, mountpoints)
    text = exposition(mount_config(node)).decode()
    assert 'lazyblock_remount_failures_total{reason="auth"}' in text
    # The kubelet pulls again (a pod starting): the next periodic check remounts.
    proxy_pull(node, ref, username=USER, password=PASSWORD)
    deadline = time.monotonic() + 30
    while not alive_at(node, mountpoints) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive_at(node, mountpoints)
    out = node.ctr(*run, "rs3", "/bin/sh", "-c", "wc -c < /app/data.bin",
                   namespace=CRI_NAMESPACE).stdout  # fmt: skip
    assert out.strip() == str(BIG)
    assert_not_on_disk(node)
    assert_no_secret(node)
