"""The benchmark's node: its own containerd and the lazyblock snapshotter daemon.

Owns everything node-side of the cold-start benchmark (``netns.py`` owns the remote host):

* ``Containerd``: a private containerd (own root, state, sockets, config; never the
  system's). With ``cri_snapshotter`` set, its CRI plugin is on the way a Kubernetes node
  runs it: images are pulled through ``runtime.v1.ImageService/PullImage`` (what kubelet
  calls) into the ``k8s.io`` namespace and unpacked by that snapshotter (``overlayfs``, or
  ``lazyblock``: the proxy snapshotter, ``[proxy_plugins.lazyblock]``, with
  ``disable_snapshot_annotations = false`` so that every layer's Prepare carries the image
  labels the remote-snapshot handshake needs); plain HTTP to the benchmark's registry via a
  mirror entry. Without it (``cri_snapshotter=None``) CRI is off and only ``ctr`` is used.
* ``SnapshotterDaemon``: ``snapshotter serve`` with its own root, sector cache and mount
  state; prefetch on or off per start (a ``[prefetch]`` setting of its config file).
* ``cri_pull``: one CRI PullImage call over containerd's gRPC socket. The request is two
  nested strings, encoded by hand (no CRI stubs needed; ``grpc`` is a project dependency).

Both processes are started in their own sessions and stopped by their pid; containerd's
shims exit with the ``--rm`` containers, and anything a failed run left (tasks, mounts) is
removed by ``Containerd.clean`` and ``umount_all_under`` before the next run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("coldstart.node")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

NAMESPACE = "lazybench"  # containerd namespace of the ctr-only path
CRI_NAMESPACE = "k8s.io"  # where CRI keeps its images (and where kubelet's containers run)
PROXY_NAME = "lazyblock"  # [proxy_plugins.<name>], the snapshotter name ctr and CRI use
# ``ctr run`` options for a server the benchmark talks to (the vllm image): the host's network
# namespace, and a /dev/shm as large as a pod's memory-backed one (vLLM's engine puts its
# message queue there: 160 MiB, more than the default 64 MiB).
SERVER_ARGS = (
    "--net-host",
    "--mount", "type=tmpfs,src=shm,dst=/dev/shm,options=nosuid:nodev:noexec:size=2g",
)  # fmt: skip


class BenchError(RuntimeError):
    """A step of the benchmark failed."""


def repo_env() -> dict[str, str]:
    """The environment with this checkout first on ``PYTHONPATH``: the snapshotter's own
    children (mount servers start with ``cwd=/``) import it whether or not (or wherever)
    the project is installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def run_cmd(*args: str | os.PathLike, timeout: float = 600, **kw) -> str:  # noqa: ANN003
    """Run a command; its stdout, or ``BenchError`` with its stderr."""
    cmd = [str(a) for a in args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(cmd[:5])} ...: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def mounts_under(root: Path) -> list[str]:
    """Mount points at or below ``root``, deepest first."""
    root_s = str(root.resolve())
    targets = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        target = line.split()[1].replace("\\040", " ")
        if target == root_s or target.startswith(root_s + "/"):
            targets.append(target)
    return sorted(targets, key=len, reverse=True)


def umount_all_under(root: Path) -> None:
    """Unmount anything mounted below ``root`` (deepest first)."""
    for t in mounts_under(root):
        subprocess.run(["umount", "-l", t], capture_output=True)


def remove_tree(path: Path) -> None:
    """``rm -rf path``, refusing while anything is mounted below it (a live lazy mount
    must never be deleted through)."""
    left = mounts_under(path) if path.exists() else []
    if left:
        raise BenchError(f"still mounted under {path}: {left[:3]}")
    shutil.rmtree(path, ignore_errors=True)


def kill_processes_naming(text: str) -> None:
    """SIGKILL the processes whose command line contains ``text`` (a socket path of ours:
    only the containerd shims our own containerd started)."""
    me = os.getpid()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            log.warning("killing %s (left by a failed run): %s", d.name, cmdline[:200])
            try:
                os.kill(int(d.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _stop_process(proc: subprocess.Popen | None, timeout: float = 20) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_socket(path: Path, proc: subprocess.Popen, what: str, log_path: Path,
                 timeout: float = 60) -> None:  # fmt: skip
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"{what} exited with {proc.returncode}; see {log_path}")
        if path.exists():
            return
        time.sleep(0.05)
    raise BenchError(f"{what} did not create {path}; see {log_path}")


# --- containerd --------------------------------------------------------------------------------


def containerd_config(
    dir: Path, registry: str, cri_snapshotter: str | None, proxy: Path | None
) -> str:
    """containerd's config.toml (version 2) for the benchmark's node."""
    lines = [
        "version = 2",
        f'root = "{dir / "root"}"',
        f'state = "{dir / "state"}"',
    ]
    if cri_snapshotter is None:
        lines.append('disabled_plugins = ["io.containerd.grpc.v1.cri"]')
    lines += [
        f'[grpc]\n  address = "{dir / "containerd.sock"}"',
        f'[ttrpc]\n  address = "{dir / "ttrpc.sock"}"',
    ]
    if proxy is not None:
        lines.append(
            f'[proxy_plugins]\n  [proxy_plugins.{PROXY_NAME}]\n    type = "snapshot"\n'
            f'    address = "{proxy}"'
        )
    if cri_snapshotter is not None:
        cri = '[plugins."io.containerd.grpc.v1.cri"]'
        lines += [
            f'{cri}\n  disable_tcp_service = true\n  stream_server_address = "127.0.0.1"',
            f'{cri[:-1]}.containerd]\n  snapshotter = "{cri_snapshotter}"\n'
            "  disable_snapshot_annotations = false",
            f'{cri[:-1]}.cni]\n  bin_dir = "{dir / "cni"}"\n  conf_dir = "{dir / "cni"}"',
            f'{cri[:-1]}.registry.mirrors."{registry}"]\n  endpoint = ["http://{registry}"]',
        ]
    return "\n".join(lines) + "\n"


class Containerd:
    """Our own containerd (root, state and socket under ``dir``), never the system's."""

    def __init__(
        self,
        dir: Path,
        registry: str,
        cri_snapshotter: str | None = None,
        proxy: Path | None = None,
    ) -> None:
        self.dir = dir
        self.root = dir / "root"
        self.sock = dir / "containerd.sock"
        self.registry = registry
        self.cri_snapshotter = cri_snapshotter
        self.proxy = proxy
        self.namespace = NAMESPACE if cri_snapshotter is None else CRI_NAMESPACE
        # what ``ctr run`` unpacks with / runs on (CRI's, so the pulled snapshots are used)
        self.snapshotter = cri_snapshotter or "overlayfs"
        self.proc: subprocess.Popen | None = None
        self._seq = 0

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "cni").mkdir(exist_ok=True)
        config = self.dir / "config.toml"
        config.write_text(
            containerd_config(self.dir, self.registry, self.cri_snapshotter, self.proxy)
        )
        logf = open(self.dir / "containerd.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(["containerd", "--config", str(config)], stdout=logf,
                                     stderr=logf, start_new_session=True)  # fmt: skip
        logf.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"containerd exited; see {self.dir / 'containerd.log'}")
            if self.sock.exists() and subprocess.run(
                self._ctr("version"), capture_output=True).returncode == 0:  # fmt: skip
                return
            time.sleep(0.1)
        raise BenchError("containerd did not come up")

    def clean(self) -> None:
        """Kill every task and remove every container a failed run may have left."""
        out = subprocess.run(self._ctr("containers", "ls", "-q"), capture_output=True,
                             text=True).stdout  # fmt: skip
        for cid in out.split():
            subprocess.run(self._ctr("task", "delete", "--force", cid), capture_output=True)
            subprocess.run(self._ctr("containers", "rm", cid), capture_output=True)

    def stop(self) -> None:
        if self.running:
            self.clean()
        _stop_process(self.proc)
        self.proc = None
        kill_processes_naming(f"-address {self.sock}")  # shims of a container it could not end
        umount_all_under(self.dir)

    def reset(self) -> None:
        """Stop, forget every image and snapshot, start again: an empty node."""
        self.stop()
        remove_tree(self.root)
        remove_tree(self.dir / "state")
        self.start()

    def _ctr(self, *args: str) -> list[str]:
        return ["ctr", "--address", str(self.sock), "--namespace", self.namespace, *args]

    def ctr(self, *args: str, timeout: float = 1800) -> str:
        return run_cmd(*self._ctr(*args), timeout=timeout)

    def has_image(self, ref: str) -> bool:
        return ref in self.ctr("images", "ls", "-q").split()

    def pull(self, ref: str, timeout: float) -> None:
        """Pull and unpack ``ref``: through CRI (kubelet's path) when CRI is on, else with
        ``ctr image pull``."""
        if self.cri_snapshotter is not None:
            cri_pull(self.sock, ref, timeout)
        else:
            self.ctr("images", "pull", "--plain-http", ref, timeout=timeout)

    def container_id(self) -> str:
        self._seq += 1
        return f"bench-{os.getpid()}-{self._seq}"

    def run_image_cmd(self, ref: str, cid: str | None = None, server: bool = False) -> list[str]:
        """``ctr run --rm`` of ``ref`` as container ``cid`` (a new id if None); ``server``: see
        ``SERVER_ARGS``."""
        extra = SERVER_ARGS if server else ()
        return self._ctr("run", "--rm", *extra, "--snapshotter", self.snapshotter, ref,
                         cid or self.container_id())  # fmt: skip

    def run_rootfs_cmd(
        self, rootfs: Path, config: dict[str, Any], cid: str | None = None, server: bool = False
    ) -> list[str]:
        args = ["run", "--rm", *(SERVER_ARGS if server else ()), "--rootfs"]
        for e in config.get("Env") or ():
            args += ["--env", e]
        if config.get("WorkingDir"):
            args += ["--cwd", config["WorkingDir"]]
        argv = list(config.get("Entrypoint") or []) + list(config.get("Cmd") or [])
        return self._ctr(*args, str(rootfs), cid or self.container_id(), *argv)

    def task_pids(self, cid: str) -> list[int]:
        """The processes of container ``cid``'s task (``ctr task ps``)."""
        return parse_task_ps(self.ctr("task", "ps", cid, timeout=60))

    def kill_task(self, cid: str) -> None:
        """SIGKILL container ``cid``'s task (its ``ctr run --rm`` then removes it)."""
        subprocess.run(self._ctr("task", "kill", "--signal", "SIGKILL", cid),
                       capture_output=True, timeout=60)  # fmt: skip


def parse_task_ps(text: str) -> list[int]:
    """``ctr task ps`` output (a ``PID INFO`` header, then one process per line) -> pids."""
    pids = []
    for line in text.splitlines():
        first = line.split(maxsplit=1)[0] if line.strip() else ""
        if first.isdigit():
            pids.append(int(first))
    return pids


# --- CRI ---------------------------------------------------------------------------------------


def cri_pull(sock: Path, image: str, timeout: float) -> str:
    """``runtime.v1.ImageService/PullImage`` of ``image`` on containerd's socket; returns the
    image reference CRI answers (its digest)."""
    import grpc

    try:
        with grpc.insecure_channel(f"unix://{sock}") as channel:
            call = channel.unary_unary("/runtime.v1.ImageService/PullImage")
            reply = call(pull_request(image), timeout=timeout)
    except grpc.RpcError as e:
        raise BenchError(f"CRI pull of {image}: {e.code().name}: {e.details()}") from None
    return string_field(reply, 1)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def pull_request(image: str) -> bytes:
    """PullImageRequest { ImageSpec image = 1 { string image = 1 } }, serialized."""
    return _field(1, _field(1, image.encode()))


def string_field(message: bytes, number: int) -> str:
    """Field ``number`` of a message whose fields are all length-delimited ("" if absent)."""
    i = 0
    while i < len(message):
        key, i = _read_varint(message, i)
        if key & 7 != 2:
            raise ValueError("unexpected wire type in a CRI reply")
        length, i = _read_varint(message, i)
        if key >> 3 == number:
            return message[i : i + length].decode()
        i += length
    return ""


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


# --- the lazyblock snapshotter daemon ------------------------------------------------------------


class SnapshotterDaemon:
    """``snapshotter serve``: containerd's proxy snapshotter, with its own root, sector cache
    and mount state under ``dir``."""

    def __init__(self, dir: Path, registry: str, settings: tuple[str, ...] = ()) -> None:
        self.dir = dir
        self.settings = settings  # KEY=VALUE, passed as --set (the user's configuration)
        self.root = dir / "data"
        self.cache = dir / "cache"
        self.state = dir / "state"
        self.config = dir / "config.toml"
        self.address = dir / "snapshotter.sock"
        self.log = dir / "daemon.log"
        self.registry = registry
        self.proc: subprocess.Popen | None = None

    def start(self, prefetch: bool) -> None:
        """Start serving; ``prefetch``: warm the cache from each image's profile on mount."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config.write_text(
            f'[cache]\ndir = "{self.cache}"\n'
            f'[state]\ndir = "{self.state}"\n'
            f"[prefetch]\nenabled = {'true' if prefetch else 'false'}\n"
        )
        self.address.unlink(missing_ok=True)
        logf = open(self.log, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "snapshotter.cli", "serve", "--config", str(self.config),
             "--address", str(self.address), "--root", str(self.root),
             "--insecure-registry", self.registry,
             *(a for kv in self.settings for a in ("--set", kv))],
            stdout=logf, stderr=logf, start_new_session=True, cwd=REPO, env=repo_env(),
        )  # fmt: skip
        logf.close()
        _wait_socket(self.address, self.proc, "snapshotter serve", self.log)

    def stop(self) -> None:
        """Stop the daemon and every mount server it started (they outlive it by design)."""
        _stop_process(self.proc)
        self.proc = None
        for _ in range(3):  # a mount still busy (a container being torn down) gets retried
            left = self.mounts()
            if not left:
                break
            for m in left:
                cmd = self._snap("umount", "--lazy", m["mountpoint"])
                subprocess.run(cmd, capture_output=True, cwd=REPO, env=repo_env(), timeout=120)
        umount_all_under(self.dir)

    def reset(self, keep_cache: bool) -> None:
        """Stopped, with no snapshots or mounts left (and an empty cache unless kept)."""
        self.stop()
        remove_tree(self.root)
        remove_tree(self.state)
        if not keep_cache:
            self.clear_cache()

    def clear_cache(self) -> None:
        remove_tree(self.cache)

    def _snap(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "snapshotter.cli", args[0], "--config", str(self.config),
                *args[1:]]  # fmt: skip

    def mounts(self) -> list[dict[str, Any]]:
        """The mounts of this daemon's state dir, with their statistics
        (``snapshotter status --json``)."""
        if not self.config.exists():
            return []
        proc = subprocess.run(self._snap("status", "--json"), capture_output=True, text=True,
                              cwd=REPO, env=repo_env(), timeout=120)  # fmt: skip
        if proc.returncode != 0:
            log.warning("snapshotter status failed: %s", proc.stderr.strip())
            return []
        return json.loads(proc.stdout).get("mounts") or []

    def profile(self, mountpoint: str, out: Path) -> None:
        run_cmd(*self._snap("profile", mountpoint, "-o", str(out)), cwd=REPO, env=repo_env())

    def log_tail(self, n: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


class LazyNode:
    """A Kubernetes-style node for the lazy scenarios: ``SnapshotterDaemon`` + a containerd
    whose CRI plugin unpacks with it."""

    def __init__(self, dir: Path, registry: str, settings: tuple[str, ...] = ()) -> None:
        self.daemon = SnapshotterDaemon(dir / "lazyblock", registry, settings)
        self.ctrd = Containerd(dir / "containerd", registry, cri_snapshotter=PROXY_NAME,
                               proxy=self.daemon.address)  # fmt: skip

    @property
    def running(self) -> bool:
        return self.ctrd.running

    def fresh(self, prefetch: bool, keep_cache: bool) -> None:
        """An empty node (no images, snapshots or mounts) with the daemon up; the sector
        cache cleared unless ``keep_cache``."""
        self.stop()
        remove_tree(self.ctrd.root)
        remove_tree(self.ctrd.dir / "state")
        self.daemon.reset(keep_cache)
        self.daemon.start(prefetch)
        self.ctrd.start()

    def stop(self) -> None:
        self.ctrd.stop()
        self.daemon.stop()
