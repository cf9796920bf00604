"""The DaemonSet's pod deleted and recreated under a running container (issue 24), with real
containerd and runc.

The pod is simulated as the issue describes it: ``snapshotter serve`` runs in its own PID
namespace (``unshare --pid --fork``, the host's /proc left visible, as ``hostPID`` gives a
pod) and the pod is deleted by SIGKILLing that namespace's init, after which the kernel
SIGKILLs every process in it. The node launcher (``snapshotter launcher``) runs outside the
namespace, as the node service does. A container reads its lazily mounted 48 MiB file in a
loop, checking its digest each pass, with the page cache dropped between passes so that
every pass reads through FUSE; the pod is killed and recreated 20 times meanwhile.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import itool
import pytest
from harness import (
    BIG,
    CRI_NAMESPACE,
    Containerd,
    Flavour,
    SnapshotterDaemon,
    _unmount_lazyblock,
    alive_at,
    sample_image,
    unmount_under,
    wait_for,
)
from support import Registry, require_tool

from snapshotter.config import load_config
from snapshotter.mount import api as mount_api
from snapshotter.mount import launcher

CYCLES = 20


class PodDaemon(SnapshotterDaemon):
    """The daemon as a pod: in its own PID namespace and, where the kernel has cgroup v2's
    ``cgroup.kill``, its own cgroup; killed as Kubernetes kills a pod, alternately by its
    PID namespace's init and by its cgroup."""

    kills: dict[str, int]
    cgroup: Path | None = None

    def start(self) -> None:
        self.kills = getattr(self, "kills", {"pid-namespace": 0, "cgroup": 0})
        self.cgroup = _pod_cgroup()
        procs = self.cgroup / "cgroup.procs" if self.cgroup else None
        self.address.unlink(missing_ok=True)
        logf = open(self.log, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--", sys.executable, "-m", "snapshotter", "serve",
             "--config", str(self.config), "--address", str(self.address),
             "--insecure-registry", self.insecure, "-v"],
            stdout=logf, stderr=logf, start_new_session=True, env=self.env,
            preexec_fn=(lambda: procs.write_text("0")) if procs else None,
        )  # fmt: skip
        logf.close()
        wait_for(self.address, self.proc, "snapshotter daemon in its PID namespace")

    def init_pid(self) -> int:
        assert self.proc is not None
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return int(children.read_text().split()[0])

    def stop(self) -> None:
        """Delete the pod: SIGKILL its PID namespace's init (the kernel kills the rest) or,
        every other time, everything in its cgroup at once (``cgroup.kill``)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        namespace = os.readlink(f"/proc/{self.init_pid()}/ns/pid")
        if self.cgroup is not None and self.kills["cgroup"] < self.kills["pid-namespace"]:
            (self.cgroup / "cgroup.kill").write_text("1")
            self.kills["cgroup"] += 1
        else:
            os.kill(self.init_pid(), signal.SIGKILL)
            self.kills["pid-namespace"] += 1
        self.proc.wait(30)
        # Nothing of the pod is left (the kernel kills every process in it, asynchronously).
        deadline = time.monotonic() + 10
        while left := [p for p in os.listdir("/proc") if p.isdigit() and _ns(p) == namespace]:
            assert time.monotonic() < deadline, f"processes of the killed pod remain: {left}"
            time.sleep(0.02)
        if self.cgroup is not None:
            deadline = time.monotonic() + 10
            while (self.cgroup / "cgroup.procs").read_text().strip():
                assert time.monotonic() < deadline, "the pod's cgroup is not empty"
                time.sleep(0.02)
            self.cgroup.rmdir()


def _pod_cgroup() -> Path | None:
    """A new cgroup v2 group for a pod, where this machine has one with ``cgroup.kill``."""
    for root in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
        if (root / "cgroup.procs").exists() and (root / "cgroup.subtree_control").exists():
            group = root / f"lazyblock-test-pod-{os.getpid()}-{time.monotonic_ns()}"
            try:
                group.mkdir()
            except OSError:
                return None
            if (group / "cgroup.kill").exists():
                return group
            group.rmdir()
            return None
    return None


def _ns(pid: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


@pytest.fixture(scope="module")
def pod_image(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The 2-layer test image with 48 MiB of random data, converted into the registry: its
    reference and the data's sha256."""
    tmp = tmp_path_factory.mktemp("podimg")
    layout = sample_image(tmp, big=BIG)
    digest = hashlib.sha256((tmp / "t2/app/data.bin").read_bytes()).hexdigest()
    ref = f"{registry.host}/pod/app:v1"
    itool.imagetool("--plain-http", "convert", "-q", "--sector-size", "1MiB",
                    f"oci:{layout}:v1", f"docker://{ref}")  # fmt: skip
    return ref, digest


@pytest.fixture
def pod_node(tmp_path: Path, registry: Registry, flavour: Flavour) -> Iterator[Containerd]:
    """A node: the launcher (outside any test namespace), the daemon as a pod, containerd."""
    require_tool("unshare")
    daemon = PodDaemon(tmp_path / "lazyblock", registry.host)
    mount = load_config(daemon.config).mount
    socket_path = launcher.default_socket(mount.state_dir)
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    launcher_log = tmp_path / "launcher.log"
    with open(launcher_log, "ab") as logf:
        node_launcher = subprocess.Popen(
            [sys.executable, "-m", "snapshotter", "launcher", "--config", str(daemon.config)],
            stdout=logf, stderr=logf, start_new_session=True,
        )  # fmt: skip
    containerd: Containerd | None = None
    try:
        wait_for(socket_path, node_launcher, "node launcher")
        daemon.start()
        (tmp_path / "containerd").mkdir()
        containerd = Containerd(tmp_path / "containerd", daemon, registry.host, flavour)
        yield containerd
    finally:
        try:
            if containerd is not None:
                containerd.stop()
        finally:
            daemon.stop()
            _unmount_lazyblock(daemon)
            node_launcher.kill()
            node_launcher.wait()
            unmount_under(tmp_path)


READER = """
i=0
while [ ! -e /out/stop ]; do
  read s _ < /proc/uptime
  r=$(/bin/busybox sha256sum /app/data.bin 2>&1)
  read e _ < /proc/uptime
  echo "$s $e $r" >> /out/reads
  i=$((i+1))
  : > /out/drop.$i
  n=0
  while [ -e /out/drop.$i ] && [ $n -lt 400 ]; do /bin/busybox usleep 5000; n=$((n+1)); done
done
"""


class CacheDropper(threading.Thread):
    """Drops the page cache whenever the container's reader asks (``drop.N``), so that its
    next pass reads through FUSE."""

    def __init__(self, out: Path) -> None:
        super().__init__(daemon=True)
        self.out = out
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            requests = list(self.out.glob("drop.*"))
            if requests:
                os.sync()
                Path("/proc/sys/vm/drop_caches").write_text("3")
                for request in requests:
                    request.unlink(missing_ok=True)
            time.sleep(0.005)


def test_pod_deletion_keeps_running_containers_reading(
    pod_node: Containerd, pod_image: tuple[str, str], tmp_path: Path
) -> None:
    ref, digest = pod_image
    node = pod_node
    daemon = node.snapshotter
    assert isinstance(daemon, PodDaemon)
    mount = load_config(daemon.config).mount
    out = tmp_path / "out"
    out.mkdir()
    node.cri_pull(ref)
    node.ctr("run", "-d", "--snapshotter", "lazyblock",
             "--mount", f"type=bind,src={out},dst=/out,options=rbind:rw",
             ref, "reader", "/bin/sh", "-c", READER, namespace=CRI_NAMESPACE)  # fmt: skip
    dropper = CacheDropper(out)
    dropper.start()
    try:
        servers = {m.mountpoint: m.pid for m in mount_api.list_mounts(mount) if m.alive}
        assert servers, "nothing lazily mounted"
        # Started by the launcher: outside the pod's PID namespace.
        pod_ns = os.readlink(f"/proc/{daemon.init_pid()}/ns/pid")
        assert all(_ns(str(pid)) != pod_ns for pid in servers.values())
        holders = [m.holder_pid for m in mount_api.list_mounts(mount) if m.held]
        assert len(holders) == len(servers)  # so are their holders, which they started
        assert all(_ns(str(pid)) != pod_ns for pid in holders)
        deadline = time.monotonic() + 60
        while len(_passes(out)) < 3:  # the reader runs
            assert time.monotonic() < deadline, _passes(out)
            time.sleep(0.2)
        for _ in range(CYCLES):
            daemon.stop()  # the pod deleted: every process in it killed
            assert alive_at(node, list(servers))
            time.sleep(0.5)  # no pod for a while: the container reads on
            daemon.start()  # the pod recreated
            node.wait_snapshotter()
            time.sleep(0.5)
        # The last pod knows every snapshot, remounted nothing and starts new containers.
        now = {m.mountpoint: m.pid for m in mount_api.list_mounts(mount) if m.alive}
        assert now == servers
        msg = node.ctr("run", "--rm", "--snapshotter", "lazyblock", ref, "after",
                       namespace=CRI_NAMESPACE).stdout  # fmt: skip
        assert msg == "hello from lazyblock\n"
        (out / "stop").touch()
        time.sleep(1)
    finally:
        dropper.stopped.set()
        (out / "stop").touch()
        node.cleanup_namespace(CRI_NAMESPACE)
    passes = _passes(out)
    failed = [p for p in passes if len(p[2]) != 64]
    wrong = [p for p in passes if len(p[2]) == 64 and p[2] != digest]
    durations = sorted(end - start for start, end, _ in passes)
    longest, median = durations[-1], durations[len(durations) // 2]
    served = sum(mount_api.stats(m, mount)["fetch"]["read_bytes"] for m in servers)
    log = daemon.log_text()
    print(f"\n{CYCLES} pod deletions ({node.flavour.name}; killed by {daemon.kills}): "
          f"{len(passes)} passes over the "
          f"48 MiB file in the container, {len(failed)} failed, {len(wrong)} wrong, longest "
          f"pass {longest:.2f} s (median {median:.2f} s); {served >> 20} MiB served by "
          "FUSE")  # fmt: skip
    assert not failed, failed[:3]
    assert not wrong
    assert len(passes) > CYCLES
    assert served >= (len(passes) - 1) * BIG
    assert "remounting" not in log
    assert log.count("mount servers are started by the node launcher") == CYCLES + 1


def _passes(out: Path) -> list[tuple[float, float, str]]:
    """(start, end, sha256 or the error) of each pass the reader finished."""
    path = out / "reads"
    if not path.exists():
        return []
    passes = []
    for line in path.read_text().splitlines():
        parts = line.split(maxsplit=2)
        if len(parts) == 3:
            result = parts[2].split()[0] if parts[2].endswith("/app/data.bin") else parts[2]
            passes.append((float(parts[0]), float(parts[1]), result))
    return passes


def test_daemon_falls_back_when_the_launcher_dies(
    tmp_path: Path, registry: Registry, flavour: Flavour, pod_image: tuple[str, str]
) -> None:
    """``[mount] launcher`` names the node launcher, which dies: the mount servers it started
    live on; a mount the daemon then needs (here: a remount after a mount server and its
    holder were killed) is made in the daemon's own context, with a warning in its log and
    ``lazyblock_launcher_fallbacks_total{reason="unreachable"}``, and containers run."""
    from snapshotter.metrics import read_counts
    from snapshotter.prometheus import exposition

    ref, _ = pod_image
    daemon = SnapshotterDaemon(tmp_path / "lazyblock", registry.host,
                               {"remount_interval": "1"})  # fmt: skip
    socket_path = tmp_path / "launcher" / "launcher.sock"
    with open(daemon.config, "a") as f:
        f.write(f'[mount]\nlauncher = "{socket_path}"\n')
    mount = load_config(daemon.config).mount
    node_launcher = subprocess.Popen(
        [sys.executable, "-m", "snapshotter", "launcher", "--config", str(daemon.config),
         "--listen", str(socket_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    containerd: Containerd | None = None
    try:
        wait_for(socket_path, node_launcher, "node launcher")
        daemon.start()
        (tmp_path / "containerd").mkdir()
        containerd = Containerd(tmp_path / "containerd", daemon, registry.host, flavour)
        containerd.cri_pull(ref)
        run = ["run", "--rm", "--snapshotter", "lazyblock", ref]
        assert containerd.ctr(*run, "first", namespace=CRI_NAMESPACE).stdout == (
            "hello from lazyblock\n"
        )
        first = {m.mountpoint: m.pid for m in mount_api.list_mounts(mount) if m.alive}
        assert all(_ns(str(pid)) == _ns("self") for pid in first.values())
        assert not (mount.state_dir / launcher.FALLBACKS_FILE).exists()
        node_launcher.kill()
        node_launcher.wait()
        # Its mount servers were not its children in any way that matters: they live on.
        assert alive_at(containerd, list(first))
        # A mount lost with its holder (a server alone is succeeded by its holder): the
        # daemon remounts it, and must do so without the launcher.
        victim = next(m for m in mount_api.list_mounts(mount) if m.alive)
        os.kill(victim.holder_pid, signal.SIGKILL)
        os.kill(victim.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not alive_at(containerd, list(first)):
            assert time.monotonic() < deadline, daemon.log_text()[-3000:]
            time.sleep(0.2)
        assert containerd.ctr(*run, "second", namespace=CRI_NAMESPACE).stdout == (
            "hello from lazyblock\n"
        )
        log = daemon.log_text()
        assert "cannot reach the node launcher" in log
        assert "will not outlive it" in log
        counts = read_counts(mount.state_dir / launcher.FALLBACKS_FILE)
        assert counts.get("unreachable", 0) >= 1
        text = exposition(mount).decode()
        assert 'lazyblock_launcher_fallbacks_total{reason="unreachable"}' in text
        print(f"\nfallbacks counted: {counts}")
    finally:
        try:
            if containerd is not None:
                containerd.stop()
        finally:
            daemon.stop()
            _unmount_lazyblock(daemon)
            node_launcher.kill()
            node_launcher.wait()
            unmount_under(tmp_path)
