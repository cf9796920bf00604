"""Real containerd and the lazyblock snapshotter daemon for end-to-end tests (import as
``harness``).

Each test session gets its own containerd (own root, state, socket and config: nothing of a
system containerd is touched), with the daemon as ``[proxy_plugins.lazyblock]`` and the CRI
plugin set up the way a node is (``snapshotter = "lazyblock"``,
``disable_snapshot_annotations = false``, plain HTTP to the loopback test registry).
Teardown kills tasks, removes containers, stops containerd and its shims (found by our
socket path, never by name), the daemon, and unmounts whatever is left under the test root.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

# Shared with the cold-start benchmark: the hand-encoded CRI PullImage request, and the
# cleanup of shims left by our own containerd.
from benchmarks.coldstart.node import kill_processes_naming, pull_request, string_field

log = logging.getLogger(__name__)

NAMESPACE = "lbtest"
CRI_NAMESPACE = "k8s.io"


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
    """``python -m snapshotter.service`` (what ``snapshotter serve`` runs)."""

    def __init__(self, root: Path, insecure: str) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.address = root / "snapshotter.sock"
        self.config = root / "config.toml"
        self.config.write_text(
            f'[snapshotter]\nroot = "{root / "data"}"\n'
            f'[cache]\ndir = "{root / "cache"}"\n'
            f'[state]\ndir = "{root / "state"}"\n'
        )
        self.insecure = insecure
        self.log = root / "daemon.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.address.unlink(missing_ok=True)
        logf = open(self.log, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "snapshotter.service", "--config", str(self.config),
             "--address", str(self.address), "--insecure-registry", self.insecure, "-v"],
            stdout=logf, stderr=logf, start_new_session=True,
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
    def __init__(self, root: Path, snapshotter: SnapshotterDaemon, registry_host: str) -> None:
        self.root = root
        self.address = root / "containerd.sock"
        self.config = root / "config.toml"
        self.snapshotter = snapshotter
        (root / "cni").mkdir(exist_ok=True)
        self.config.write_text(
            f"""version = 2
root = "{root / "root"}"
state = "{root / "state"}"
[grpc]
  address = "{self.address}"
[ttrpc]
  address = "{self.address}.ttrpc"
[proxy_plugins]
  [proxy_plugins.lazyblock]
    type = "snapshot"
    address = "{snapshotter.address}"
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
        )
        self.log = root / "containerd.log"
        logf = open(self.log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            ["containerd", "--config", str(self.config)],
            stdout=logf, stderr=logf, start_new_session=True,
        )  # fmt: skip
        logf.close()
        wait_for(self.address, self.proc, "containerd")
        self.ctr("version")

    def ctr(
        self, *args: str, namespace: str = NAMESPACE, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            ["ctr", "--address", str(self.address), "--namespace", namespace, *args],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if check and proc.returncode != 0:
            raise AssertionError(
                f"ctr {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}\n"
                f"--- containerd log tail:\n{self.log.read_text(errors='replace')[-3000:]}\n"
                f"--- snapshotter log tail:\n{self.snapshotter.log_text()[-3000:]}"
            )
        return proc

    def cri_pull(self, image: str, timeout: float = 120) -> str:
        """Pull through the CRI plugin (runtime.v1.ImageService/PullImage), as kubelet does:
        the path that passes the image's labels to the snapshotter."""
        with grpc.insecure_channel(f"unix://{self.address}") as channel:
            call = channel.unary_unary("/runtime.v1.ImageService/PullImage")
            reply = call(pull_request(image), timeout=timeout)
        return string_field(reply, 1)

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
