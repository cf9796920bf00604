"""The node launcher (``snapshotter launcher``): mount servers that outlive the daemon's pod.

The pod is simulated as issue 24 describes it: the process that mounts runs in its own PID
namespace (``unshare --pid --fork``, the host's /proc left visible) and is killed by killing
that namespace's init, after which the kernel SIGKILLs everything in the namespace. A reader
outside the namespace checks every byte of the mounted image (page cache dropped, so reads
reach FUSE) while that happens 20 times.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import mountimages as images
import pytest
from mounthelp import drop_caches, snapshotter
from ocibuild import TarEntry, make_layer_tar
from support import require_tool

from snapshotter.config import MountConfig
from snapshotter.metrics import read_counts
from snapshotter.mount import api, launcher, state

CYCLES = 20
FILES = {f"data/part-{i}.bin": random.Random(i).randbytes(2 << 20) for i in range(4)}


@pytest.fixture(scope="module")
def random_ref(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An image of 8 MiB of incompressible, known data in 4 files."""
    root = tmp_path_factory.mktemp("launcher-img")
    entries = [TarEntry("data/", type="dir")]
    entries += [TarEntry(name, data=data) for name, data in FILES.items()]
    layout = images.build_layout(root, [make_layer_tar(entries, compression=None)])
    ref = str(root / "store" / "rnd:v1")
    images.convert(layout, "v1", ref, "--sector-size", "256KiB")
    return ref


def start_launcher(path: Path, log: Path) -> subprocess.Popen:
    """``snapshotter launcher --listen path``, outside any test namespace; waits for it."""
    with open(log, "ab") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "snapshotter", "launcher", "--listen", str(path)],
            stdout=logf, stderr=logf, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        try:
            launcher.hello(path)
            return proc
        except launcher.LauncherError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"launcher did not start: {log.read_text()}") from None
            time.sleep(0.05)


@pytest.fixture
def node_launcher(config: MountConfig) -> Iterator[subprocess.Popen]:
    require_tool("unshare")
    path = launcher.default_socket(config.state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    proc = start_launcher(path, config.state_dir.parent / "launcher.log")
    yield proc
    proc.kill()
    proc.wait()


POD = """
import json, sys, time
from pathlib import Path
from snapshotter.config import MountConfig
from snapshotter.mount import api
config = MountConfig.from_dict(json.loads(sys.argv[1]))
mountpoint = Path(sys.argv[3])
live = [m for m in api.list_mounts(config) if m.alive and m.mountpoint == mountpoint]
if live:  # a new pod finds the mount the previous one made
    print(json.dumps({"found": live[0].pid}), flush=True)
else:
    info = api.mount(sys.argv[2], mountpoint, config)
    print(json.dumps({"mounted": info.pid}), flush=True)
time.sleep(3600)
"""


class Pod:
    """A process in its own PID namespace (``unshare --pid --fork``), like a pod's."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log  # stderr (unshare complains when its child is SIGKILLed: noise)
        with open(log, "ab") as logf:
            self.unshare = subprocess.Popen(
                ["unshare", "--pid", "--fork", "--", *args], stdout=subprocess.PIPE,
                stderr=logf, start_new_session=True,
            )  # fmt: skip

    def first_line(self, timeout: float = 90) -> dict:
        assert self.unshare.stdout is not None
        line = self.unshare.stdout.readline()
        assert line, f"the pod exited ({self.unshare.wait(timeout)}): {self.log.read_text()}"
        return json.loads(line)

    def init_pid(self) -> int:
        """The namespace's init (the forked child of unshare), as the host sees it."""
        for _ in range(200):
            children = Path(f"/proc/{self.unshare.pid}/task/{self.unshare.pid}/children")
            text = children.read_text().split()
            if text:
                return int(text[0])
            time.sleep(0.01)
        raise AssertionError("unshare forked no init")

    def kill(self) -> None:
        """What Kubernetes does to a pod: every process in it SIGKILLed (here: its PID
        namespace's init, after which the kernel kills the rest)."""
        os.kill(self.init_pid(), signal.SIGKILL)
        self.unshare.wait(30)


class Reader:
    """Reads every file of the mount in a loop from outside the pod, checking every byte,
    with the page cache dropped between passes."""

    def __init__(self, mountpoint: Path) -> None:
        self.mountpoint = mountpoint
        self.passes = self.failed = self.wrong = 0
        self.max_read = 0.0  # longest single file read (the stall a reader saw)
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            for name, data in FILES.items():
                start = time.monotonic()
                try:
                    got = (self.mountpoint / name).read_bytes()
                except OSError as e:
                    self.failed += 1
                    self.errors.append(f"{name}: {e}")
                    continue
                finally:
                    self.max_read = max(self.max_read, time.monotonic() - start)
                if got != data:
                    self.wrong += 1
            self.passes += 1
            drop_caches()

    def __enter__(self) -> Reader:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)


def test_mount_servers_outlive_the_pod(
    config: MountConfig, random_ref: str, node_launcher: subprocess.Popen, tmp_path: Path
) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    args = [sys.executable, "-c", POD, json.dumps(config.to_dict()), random_ref,
            str(mountpoint)]  # fmt: skip
    pod = Pod(args, tmp_path / "pod.log")
    first = pod.first_line()
    server = first["mounted"]
    info = api.list_mounts(config)[0]
    assert info.pid == server and info.alive
    # Forked by the launcher, outside the pod's PID namespace.
    assert os.readlink(f"/proc/{server}/ns/pid") == os.readlink("/proc/self/ns/pid")
    assert os.readlink(f"/proc/{pod.init_pid()}/ns/pid") != os.readlink("/proc/self/ns/pid")
    # So is the holder of its FUSE connection, which the server started.
    assert info.held and _ns(info.holder_pid) == _ns(os.getpid())
    kills = 0
    with Reader(mountpoint) as reader:
        time.sleep(1)
        for _ in range(CYCLES):
            pod.kill()
            kills += 1
            time.sleep(0.3)  # no pod at all for a moment: reads go on
            assert api.list_mounts(config)[0].alive
            pod = Pod(args, tmp_path / "pod.log")
            assert pod.first_line() == {"found": server}
            time.sleep(0.3)
        pod.kill()
    # Each pass read through FUSE (the page cache dropped): the server returned its bytes.
    served = api.stats(mountpoint, config)["fetch"]["read_bytes"]
    print(f"\n{kills} pod kills: {reader.passes} passes over {len(FILES)} files "
          f"({served >> 20} MiB served by FUSE), {reader.failed} failed reads, "
          f"{reader.wrong} wrong, longest read {reader.max_read:.3f} s")  # fmt: skip
    assert served >= (reader.passes - 1) * sum(map(len, FILES.values()))
    assert reader.failed == 0, reader.errors[:5]
    assert reader.wrong == 0
    assert reader.passes > CYCLES
    assert api.list_mounts(config)[0].pid == server
    log = (config.state_dir.parent / "launcher.log").read_text()
    assert f"pid {server}" in log


def _ns(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/pid")


REPLACE = """
import json, sys, time
from pathlib import Path
from snapshotter.config import MountConfig
from snapshotter.mount import api
info = api.replace(Path(sys.argv[2]), MountConfig.from_dict(json.loads(sys.argv[1])))
print(json.dumps({"replaced": info.pid}), flush=True)
time.sleep(3600)  # the pod lives on until it is deleted
"""


def test_a_replacement_asked_from_the_pod_is_started_outside_it(
    config: MountConfig, random_ref: str, node_launcher: subprocess.Popen, tmp_path: Path
) -> None:
    """``snapshotter upgrade-mounts`` run in the pod (``kubectl exec``): the new server is
    the launcher's too, and the pod's deletion right after leaves it serving."""
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    first = api.mount(random_ref, mountpoint, config)
    pod = Pod([sys.executable, "-c", REPLACE, json.dumps(config.to_dict()), str(mountpoint)],
              tmp_path / "pod.log")  # fmt: skip
    new = pod.first_line()["replaced"]
    assert new != first.pid and _ns(new) == _ns(os.getpid())
    pod.kill()
    drop_caches()
    assert (mountpoint / "data/part-3.bin").read_bytes() == FILES["data/part-3.bin"]
    info = api.list_mounts(config)[0]
    assert info.pid == new and info.alive and info.servers == 2
    api.unmount(mountpoint, config)


def test_without_a_launcher_the_mount_dies_with_the_pod(
    config: MountConfig, random_ref: str, tmp_path: Path
) -> None:
    """Today's behaviour, kept where no launcher runs (``auto`` finds no socket): the mount
    server is the pod's, and killing the pod kills it."""
    require_tool("unshare")
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    args = [sys.executable, "-c", POD, json.dumps(config.to_dict()), random_ref,
            str(mountpoint)]  # fmt: skip
    pod = Pod(args, tmp_path / "pod.log")
    pod.first_line()
    assert (mountpoint / "data/part-0.bin").read_bytes() == FILES["data/part-0.bin"]
    assert state.MountRecord.load(state.mount_dir(config.state_dir, mountpoint)) is not None
    pod.kill()
    time.sleep(0.5)
    drop_caches()
    with pytest.raises(OSError):
        (mountpoint / "data/part-0.bin").read_bytes()
    # The pod's mount server and holder recorded their pids as the pod's namespace numbers
    # them, which this /proc (the host's) gives to other processes: mark them dead, so
    # that the cleanup signals nothing (a real pod sees its own /proc, or uses hostPID).
    directory = state.mount_dir(config.state_dir, mountpoint)
    record = state.MountRecord.load(directory)
    assert record is not None
    dataclasses.replace(record, pid_start=-1, holder_start=-1).save(directory)
    assert not (config.state_dir / launcher.FALLBACKS_FILE).exists()  # nothing configured


def test_a_configured_launcher_that_is_gone_falls_back(
    config: MountConfig, random_ref: str, tmp_path: Path
) -> None:
    """``[mount] launcher`` names a socket nobody listens on (the launcher died): the mount
    is made in the caller's context, with a warning, and counted."""
    path = tmp_path / "gone.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.bind(str(path))  # a stale socket file: bound once, nobody listens
    cfg = dataclasses.replace(config, launcher=str(path))
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    info = api.mount(random_ref, mountpoint, cfg)
    assert (mountpoint / "data/part-1.bin").read_bytes() == FILES["data/part-1.bin"]
    assert info.alive
    counts = read_counts(config.state_dir / launcher.FALLBACKS_FILE)
    assert counts == {"unreachable": 1}
    api.unmount(mountpoint, cfg)


def test_the_launcher_refuses_other_code_and_other_directories(
    config: MountConfig, random_ref: str, node_launcher: subprocess.Popen, tmp_path: Path
) -> None:
    """The context check, relaxed for the launcher, still holds where it matters: a caller
    running other code, or seeing other directories at the request's paths, is refused
    (nothing started), and ``api.mount`` falls back and counts it."""
    path = launcher.default_socket(config.state_dir)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    request = {"ref": random_ref, "mountpoint": str(mountpoint), "config": config.to_dict()}
    r, w = os.pipe()
    try:
        launcher._version_cache = (launcher._stamp(launcher._sources()), "0" * 24)
        with pytest.raises(launcher.LauncherError, match="runs lazyblock code"):
            launcher.spawn(path, request, w, w)
        launcher._version_cache = None
        other = tmp_path / "other"
        other.mkdir()
        moved = {**request, "mountpoint": str(other)}
        message = {"mount": moved, "env": {}, "umask": 0o22, "code": launcher.code_version(),
                   "paths": {str(other): launcher._identity(mountpoint)}}  # fmt: skip
        answer = launcher._call(path, message, [w, w])
        assert "is not the same directory" in answer["error"]
    finally:
        launcher._version_cache = None
        os.close(r)
        os.close(w)
    assert api.list_mounts(config) == []
    # api.mount with a launcher that refuses: a fallback, counted as "refused".
    launcher._version_cache = (launcher._stamp(launcher._sources()), "1" * 24)
    try:
        info = api.mount(random_ref, mountpoint, config)
    finally:
        launcher._version_cache = None
    assert os.readlink(f"/proc/{info.pid}/ns/pid") == os.readlink("/proc/self/ns/pid")
    counts = read_counts(config.state_dir / launcher.FALLBACKS_FILE)
    assert counts == {"refused": 1}
    api.unmount(mountpoint, config)


def test_a_launcher_is_replaced_when_its_code_changes(
    config: MountConfig, random_ref: str, node_launcher: subprocess.Popen, tmp_path: Path
) -> None:
    """Installing a new release on the node changes the launcher's source files: it exits
    (for the service manager to start the new code), and the mount servers it started
    live on and are found by the next launcher's callers."""
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    info = api.mount(random_ref, mountpoint, config)
    before = launcher.hello(launcher.default_socket(config.state_dir))
    source = Path(launcher.__file__)
    st = source.stat()
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    try:
        assert node_launcher.wait(launcher.STALE_CHECK_INTERVAL + 10) == 0
    finally:
        os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    drop_caches()
    assert (mountpoint / "data/part-2.bin").read_bytes() == FILES["data/part-2.bin"]
    assert api.list_mounts(config)[0].pid == info.pid and api.list_mounts(config)[0].alive
    path = launcher.default_socket(config.state_dir)
    replacement = start_launcher(path, tmp_path / "launcher2.log")
    try:
        after = launcher.hello(path)
        assert after["pid"] != before["pid"] and after["code"] == before["code"]
        check = snapshotter("launcher", "--check", "--listen", str(path))
        assert f"launcher pid {after['pid']}" in check.stdout and "(ours)" in check.stdout
        other = tmp_path / "mnt2"
        other.mkdir()
        second = api.mount(random_ref, other, config)
        assert f"pid {second.pid}" in (tmp_path / "launcher2.log").read_text()
        api.unmount(other, config)
    finally:
        replacement.kill()
        replacement.wait()
    api.unmount(mountpoint, config)
