"""Real containerd and the lazyblock snapshotter daemon for end-to-end tests (import as
``harness``).

Each test module gets its own containerd (own root, state, socket and config: nothing of a
system containerd is touched), with the daemon as ``[proxy_plugins.lazyblock]`` and the CRI
plugin set up the way a node is (``snapshotter = "lazyblock"``,
``disable_snapshot_annotations = false``, plain HTTP to the loopback test registry). Two
flavours: Debian's containerd 1.6 (config version 2) and containerd 2.x (config version 3,
from ``scripts/fetch-containerd2``'s private cache), written as ``deploy/containerd/`` has
them.
Teardown kills tasks, removes containers, stops containerd and its shims (found by our
socket path, never by name), the daemon, and unmounts whatever is left under the test root.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from ocibuild import build_with_umoci
from support import Registry

# Shared with the cold-start benchmark: the hand-encoded CRI PullImage request, and the
# cleanup of shims left by our own containerd.
from benchmarks.coldstart.node import kill_processes_naming, pull_request, string_field

log = logging.getLogger(__name__)

NAMESPACE = "lbtest"
CRI_NAMESPACE = "k8s.io"
REPO = Path(__file__).resolve().parents[2]
FLAVOURS = ("1.6", "2.x")
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


@dataclass(frozen=True)
class Flavour:
    """Which containerd: where its binaries are and which config version it reads."""

    name: str  # "1.6" (Debian 12's) or "2.x"
    bin_dir: Path | None  # None: the system's, on PATH
    config_version: int  # 2 for 1.6/1.7, 3 for 2.x
    # 2.x only: drop disable_snapshot_annotations, so that CRI pulls go through the transfer
    # service (containerd >= 2.1's default) instead of falling back to local pulls.
    cri_transfer: bool = False

    def binary(self, name: str) -> str:
        return str(self.bin_dir / name) if self.bin_dir else name

    def env(self) -> dict[str, str]:
        """containerd finds ``containerd-shim-runc-v2`` on PATH: its own first."""
        env = dict(os.environ)
        if self.bin_dir:
            env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env


def find_flavour(name: str) -> Flavour | str:
    """The flavour called ``name`` ("1.6", "2.x", "2.x-transfer"), or why it is not
    available (a skip reason)."""
    if name == "1.6":
        return Flavour(name, None, 2)
    proc = subprocess.run([sys.executable, str(REPO / "scripts/fetch-containerd2"), "--cached"],
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        return proc.stderr.strip() or "no containerd 2.x"
    return Flavour(name, Path(proc.stdout.strip()), 3, cri_transfer=name.endswith("-transfer"))


def wait_for(path: Path, proc: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not create {path}")


class SnapshotterDaemon:
    """``python -m snapshotter serve``."""

    def __init__(
        self,
        root: Path,
        insecure: str,
        settings: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """``settings``: more ``[snapshotter]`` keys (strings); ``env``: environment changes."""
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.address = root / "snapshotter.sock"
        self.config = root / "config.toml"
        extra = "".join(f'{k} = "{v}"\n' for k, v in (settings or {}).items())
        self.config.write_text(
            f'[snapshotter]\nroot = "{root / "data"}"\n{extra}'
            f'[cache]\ndir = "{root / "cache"}"\n'
            f'[state]\ndir = "{root / "state"}"\n'
        )
        self.env = {**os.environ, **(env or {})}
        self.insecure = insecure
        self.log = root / "daemon.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.address.unlink(missing_ok=True)
        logf = open(self.log, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "snapshotter", "serve", "--config", str(self.config),
             "--address", str(self.address), "--insecure-registry", self.insecure, "-v"],
            stdout=logf, stderr=logf, start_new_session=True, env=self.env,
        )  # fmt: skip
        logf.close()
        wait_for(self.address, self.proc, "snapshotter daemon")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class Containerd:
    def __init__(
        self,
        root: Path,
        snapshotter: SnapshotterDaemon,
        registry_host: str,
        flavour: Flavour,
        edit: Callable[[str], str] | None = None,
    ) -> None:
        """``edit``: changes the config text before containerd starts (a broken node)."""
        self.root = root
        self.address = root / "containerd.sock"
        self.config = root / "config.toml"
        self.snapshotter = snapshotter
        self.flavour = flavour
        (root / "cni").mkdir(exist_ok=True)
        if flavour.config_version >= 3:
            text = config_v3(
                root, self.address, snapshotter.address, registry_host, flavour.cri_transfer
            )
        else:
            text = config_v2(root, self.address, snapshotter.address, registry_host)
        self.config.write_text(edit(text) if edit else text)
        self.log = root / "containerd.log"
        logf = open(self.log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [flavour.binary("containerd"), "--config", str(self.config)],
            stdout=logf, stderr=logf, start_new_session=True, env=flavour.env(),
        )  # fmt: skip
        logf.close()
        try:
            wait_for(self.address, self.proc, "containerd")
            self.ctr("version")
        except BaseException:  # interrupted too: no containerd left running
            self.proc.kill()
            self.proc.wait()
            raise

    def ctr(
        self, *args: str, namespace: str = NAMESPACE, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [self.flavour.binary("ctr"), "--address", str(self.address), "--namespace",
             namespace, *args],
            capture_output=True, text=True, timeout=timeout, env=self.flavour.env(),
        )  # fmt: skip
        if check and proc.returncode != 0:
            raise AssertionError(
                f"ctr {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}\n"
                f"--- containerd log tail:\n{self.log.read_text(errors='replace')[-3000:]}\n"
                f"--- snapshotter log tail:\n{self.snapshotter.log_text()[-3000:]}"
            )
        return proc

    def wait_snapshotter(self, timeout: float = 30) -> None:
        """Wait until containerd reaches the proxy snapshotter again: after the daemon
        restarts, containerd redials it with backoff, and a call made before it has
        fails with "connection closed: unavailable"."""
        deadline = time.monotonic() + timeout
        while True:
            proc = self.ctr("snapshots", "--snapshotter", "lazyblock", "ls",
                            namespace=CRI_NAMESPACE, check=time.monotonic() > deadline)  # fmt: skip
            if proc.returncode == 0:
                return
            time.sleep(0.2)

    def cri_pull(self, image: str, timeout: float = 120) -> str:
        """Pull through the CRI plugin (runtime.v1.ImageService/PullImage), as kubelet does:
        the path that passes the image's labels to the snapshotter."""
        with grpc.insecure_channel(f"unix://{self.address}") as channel:
            call = channel.unary_unary("/runtime.v1.ImageService/PullImage")
            reply = call(pull_request(image), timeout=timeout)
        return string_field(reply, 1)

    def cri_call(
        self, method: str, request: bytes, address: Path | None = None, timeout: float = 120
    ) -> bytes:
        """One raw ``runtime.v1.ImageService`` call on ``address`` (default: containerd's
        own socket); raises ``grpc.RpcError`` with containerd's status."""
        with grpc.insecure_channel(f"unix://{address or self.address}") as channel:
            return channel.unary_unary(f"/runtime.v1.ImageService/{method}")(
                request, timeout=timeout
            )

    def cleanup_namespace(self, namespace: str) -> None:
        """Kill every task and remove every container of ``namespace``."""
        out = self.ctr("containers", "ls", "-q", namespace=namespace, check=False).stdout
        for cid in out.split():
            self.ctr("task", "delete", "--force", cid, namespace=namespace, check=False)
            self.ctr("containers", "rm", cid, namespace=namespace, check=False)

    def stop(self) -> None:
        for ns in self.ctr("namespaces", "ls", "-q", check=False).stdout.split():
            self.cleanup_namespace(ns)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        kill_processes_naming(str(self.address))


def config_v2(root: Path, address: Path, proxy: Path, registry_host: str) -> str:
    """containerd 1.6/1.7 (deploy/containerd/config-1.6-1.7.toml, plus private paths)."""
    return f"""version = 2
root = "{root / "root"}"
state = "{root / "state"}"
[grpc]
  address = "{address}"
[ttrpc]
  address = "{address}.ttrpc"
[proxy_plugins]
  [proxy_plugins.lazyblock]
    type = "snapshot"
    address = "{proxy}"
[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "lazyblock"
    disable_snapshot_annotations = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{root / "cni"}"
    conf_dir = "{root / "cni"}"
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."{registry_host}"]
    endpoint = ["http://{registry_host}"]
"""


DEPLOY_CONFIG_V3 = REPO / "deploy/containerd/config-2.x.toml"


def config_v3(
    root: Path, address: Path, proxy: Path, registry_host: str, cri_transfer: bool = False
) -> str:
    """containerd 2.x: deploy/containerd/config-2.x.toml itself (so that file is what is
    tested), with this node's socket and hosts directory put in and private paths added;
    the loopback registry over plain HTTP through a hosts.toml under ``config_path``.
    ``cri_transfer``: without its ``disable_snapshot_annotations`` line (see Flavour)."""
    certs = root / "certs.d"
    (certs / registry_host).mkdir(parents=True, exist_ok=True)
    (certs / registry_host / "hosts.toml").write_text(
        f'server = "http://{registry_host}"\n'
        f'[host."http://{registry_host}"]\n  capabilities = ["pull", "resolve"]\n'
    )
    deploy = DEPLOY_CONFIG_V3.read_text()
    for default, ours in (("/run/lazyblock/snapshotter.sock", proxy),
                          ("/etc/containerd/certs.d", certs)):  # fmt: skip
        assert default in deploy, f"{DEPLOY_CONFIG_V3} no longer names {default}"
        deploy = deploy.replace(f'"{default}"', f'"{ours}"')
    if cri_transfer:
        line = "  disable_snapshot_annotations = false\n"
        assert line in deploy, f"{DEPLOY_CONFIG_V3} no longer sets disable_snapshot_annotations"
        deploy = deploy.replace(line, "")
    top = f'root = "{root / "root"}"\nstate = "{root / "state"}"\n'
    private = f"""
[grpc]
  address = "{address}"
[ttrpc]
  address = "{address}.ttrpc"
[plugins."io.containerd.cri.v1.runtime".cni]
  bin_dirs = ["{root / "cni"}"]
  conf_dir = "{root / "cni"}"
[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
"""
    version, rest = deploy.split("version = 3\n", 1)
    return f"{version}version = 3\n{top}{rest}{private}"


# --- test images and the registry's view -----------------------------------------------------

BIG = 48 << 20  # never read by the container: the bytes a lazy pull must not fetch


def busybox_tree(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    shutil.copy("/bin/busybox", root / "bin/busybox")
    for applet in ("sh", "cat", "echo", "ls", "sleep", "id", "pwd", "env", "head", "wc"):
        (root / "bin" / applet).symlink_to("busybox")
    (root / "etc").mkdir()
    (root / "etc/passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/app:/bin/sh\n"
    )
    (root / "etc/group").write_text("root:x:0:\napp:x:1000:\n")
    (root / "tmp").mkdir(mode=0o1777)
    (root / "tmp").chmod(0o1777)
    return root


def sample_image(tmp: Path, big: int = 0) -> Path:
    """A 2-layer image: busybox, then an app (with ``big`` bytes of data never read)."""
    base = busybox_tree(tmp / "t1")
    app = tmp / "t2"
    shutil.copytree(base, app, symlinks=True)
    (app / "app").mkdir()
    (app / "app/msg").write_text("hello from lazyblock\n")
    if big:
        (app / "app/data.bin").write_bytes(os.urandom(big))
    layout = tmp / "oci"
    build_with_umoci(layout, "v1", [base, app], cmd=["/bin/cat", "/app/msg"], workdir="/app",
                     env=["GREETING=hi"])  # fmt: skip
    return layout


def registry_log_end(registry: Registry) -> int:
    """Where the registry's access log ends now (to count what a test reads after it)."""
    return registry.log.stat().st_size


def registry_blob_bytes(registry: Registry, digest: str, since: int = 0) -> int:
    """Bytes the registry sent for blob ``digest`` (from its access log, after ``since``)."""
    total = 0
    with open(registry.log, "rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    for line in text.splitlines():
        m = re.search(r'"GET [^"]*/blobs/' + re.escape(digest) + r' HTTP/[0-9.]+" \d+ (\d+)', line)
        if m:
            total += int(m.group(1))
    return total


def registry_data_bytes(registry: Registry, manifest: dict, since: int = 0) -> tuple[int, int]:
    """(bytes the registry sent of a block image's data blobs after ``since``, their size):
    every layer but the index (one in format v1; metadata, layers and hot copies in v2)."""
    data = [d for d in manifest["layers"] if d["annotations"].get("dev.lazyblock.role") == "blob"]
    read = sum(registry_blob_bytes(registry, d["digest"], since) for d in data)
    return read, sum(d["size"] for d in data)


def wait_no_snapshots(node: Containerd, namespace: str, timeout: float = 20) -> list[str]:
    """Snapshots left in ``namespace`` once containerd's garbage collection settles."""
    deadline = time.monotonic() + timeout
    while True:
        out = node.ctr("snapshots", "--snapshotter", "lazyblock", "ls", namespace=namespace)
        left = out.stdout.splitlines()[1:]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def mount_config(node: Containerd):  # noqa: ANN201
    """The MountConfig of the node's snapshotter daemon."""
    from snapshotter.config import load_config

    return load_config(node.snapshotter.config).mount


def kill_mount_servers(node: Containerd) -> list[Path]:
    """SIGKILL every live mount server of the daemon and its holder (the holder first, or
    it starts a successor; as deleting the DaemonSet's pod does); returns their mount
    points."""
    from snapshotter.mount import api as mount_mod

    config = mount_config(node)
    live = [m for m in mount_mod.list_mounts(config) if m.alive]
    for m in live:
        if m.held:
            os.kill(m.holder_pid, signal.SIGKILL)
        os.kill(m.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(m.alive for m in mount_mod.list_mounts(config)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [m.mountpoint for m in live]


def alive_at(node: Containerd, mountpoints: list[Path]) -> bool:
    """Whether a live mount server serves each of ``mountpoints``."""
    from snapshotter.mount import api as mount_mod

    alive = {m.mountpoint for m in mount_mod.list_mounts(mount_config(node)) if m.alive}
    return set(mountpoints) <= alive


@contextmanager
def running_node(
    root: Path,
    registry_host: str,
    flavour: Flavour,
    settings: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[Containerd]:
    """The lazyblock daemon (``settings``/``env``: see ``SnapshotterDaemon``) and a
    containerd of ``flavour`` using it, under ``root``; everything stopped and unmounted
    on the way out."""
    daemon = SnapshotterDaemon(root / "lazyblock", registry_host, settings, env)
    containerd: Containerd | None = None
    try:
        daemon.start()
        (root / "containerd").mkdir()
        containerd = Containerd(root / "containerd", daemon, registry_host, flavour)
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
    from snapshotter.config import load_config
    from snapshotter.mount import api as mount_mod

    config = load_config(daemon.config).mount
    for info in mount_mod.list_mounts(config):
        try:
            mount_mod.unmount(Path(info.mountpoint), config)
        except Exception:  # noqa: BLE001 - best effort in teardown
            pass


def unmount_under(root: Path) -> None:
    """Lazily unmount every mount point below ``root``, deepest first."""
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            target = line.split()[4].encode().decode("unicode_escape")
            if target == str(root) or target.startswith(str(root) + "/"):
                mounts.append(target)
    for target in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True)
