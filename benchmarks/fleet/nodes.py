"""Nodes of a fleet on one machine, and the image they start.

A ``Node`` is what a host of a fleet holds of lazyblock: its own sector cache, its own mount
state and its own mount server (``snapshotter.mount.api``), with the node's hosts directory
(``[store] registry_config_path``) given as data. ``Node.start`` mounts the image and reads
its startup files, as a starting container would, and returns what that took and cost:
seconds to mount, to read, the stored bytes fetched and the mount's per-host counts.
``start_all`` starts several nodes at once, each in a thread, as a rollout does.

``build_archive`` writes the image: a docker-archive (``docker save``'s format) of
incompressible files, so that stored bytes are image bytes; ``publish`` converts it with the
real ``imagetool`` into the registry.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imagetool.registry.hosts import HostsConfig, load_hosts_dir
from imagetool.stores.base import StoreOptions
from snapshotter.config import FetchConfig, MountConfig
from snapshotter.mount import api

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def file_bytes(seed: int, index: int, size: int) -> bytes:
    """The content of file ``index`` of an image: incompressible, reproducible."""
    return random.Random(f"{seed}:{index}").randbytes(size)


def build_archive(path: Path, files: int, size: int, seed: int = 0) -> dict[str, str]:
    """A docker-archive at ``path`` holding ``files`` files of ``size`` bytes under
    ``/data/part-NNN.bin``; returns ``name -> sha256`` of each file."""
    layer = io.BytesIO()
    digests = {}
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("data/",):
            info = tarfile.TarInfo(d.rstrip("/"))
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for i in range(files):
            data = file_bytes(seed, i, size)
            info = tarfile.TarInfo(f"data/part-{i:03d}.bin")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
            digests[info.name] = hashlib.sha256(data).hexdigest()
    layer_bytes = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps({
        "architecture": "amd64", "os": "linux", "config": {"Cmd": ["/bin/true"]},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }).encode()  # fmt: skip
    manifest = json.dumps(
        [{"Config": "config.json", "RepoTags": ["fleet:v1"], "Layers": ["layer.tar"]}]
    ).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as out:
        for name, data in (("layer.tar", layer_bytes), ("config.json", config),
                           ("manifest.json", manifest)):  # fmt: skip
            info = tarfile.TarInfo(name)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))
    return digests


def publish(archive: Path, ref: str) -> None:
    """``imagetool convert docker-archive:ARCHIVE REF`` over plain HTTP."""
    proc = subprocess.run(
        [sys.executable, "-m", "imagetool.cli", "--plain-http", "convert", "-q",
         f"docker-archive:{archive}", ref],
        capture_output=True, text=True, env=repo_env(),
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"imagetool convert failed: {proc.stderr.strip()}")


def publish_startup_image(
    remote_registry: str, work: Path, repo: str, files: int, size: int, startup_files: int,
    seed: int,
) -> tuple[str, dict[str, str]]:  # fmt: skip
    """Build the image (``build_archive``), convert it into ``remote_registry`` under
    ``repo:v1``; returns its reference and the files a start reads (the first
    ``startup_files``, ``path -> sha256``)."""
    archive = work / "image.tar"
    digests = build_archive(archive, files, size, seed=seed)
    ref = f"docker://{remote_registry}/{repo}:v1"
    publish(archive, ref)
    names = [f"data/part-{i:03d}.bin" for i in range(startup_files)]
    return ref, {name: digests[name] for name in names}


def repo_env() -> dict[str, str]:
    """This checkout first on PYTHONPATH: mount servers start in / and import it."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{REPO}:{path}" if path else str(REPO)}


def hosts_dir(root: Path, origin: str, tier: str | None) -> HostsConfig:
    """A node's hosts directory for ``origin`` (over plain HTTP), with the cache tier at
    ``tier`` as its mirror (``deploy/nginx/hosts.toml``, rendered), or none."""
    from benchmarks.fleet.tier import DEPLOY_HOSTS, render_hosts

    ns = root / origin
    ns.mkdir(parents=True, exist_ok=True)
    if tier is None:
        (ns / "hosts.toml").write_text(f'server = "http://{origin}"\n')
    else:
        (ns / "hosts.toml").write_text(render_hosts(DEPLOY_HOSTS.read_text(), origin, tier, True))
    return load_hosts_dir(root)


@dataclass
class NodeResult:
    name: str
    mount_seconds: float
    read_seconds: float
    fetched_bytes: int
    read_errors: int
    checksum_errors: int
    sources: list[dict[str, Any]]
    files_ok: bool
    error: str = ""

    @property
    def seconds(self) -> float:
        return self.mount_seconds + self.read_seconds


@dataclass
class Node:
    """One node: cache, state and mount point under ``root``."""

    root: Path
    hosts: HostsConfig
    fetch: FetchConfig = field(default_factory=FetchConfig)
    store_options: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def mountpoint(self) -> Path:
        return self.root / "mnt"

    def config(self) -> MountConfig:
        return MountConfig(
            cache_dir=self.root / "cache",
            cache_size=8 << 30,
            state_dir=self.root / "state",
            prefetch=False,
            registry_config_path=None,
            fetch=self.fetch,
            store=StoreOptions(
                plain_http=True,
                docker_config=self.root / "no-docker-config.json",
                registry_hosts=self.hosts,
                **self.store_options,
            ),  # fmt: skip
        )

    def start(self, ref: str, files: dict[str, str]) -> NodeResult:
        """Mount ``ref`` and read ``files`` (``path -> sha256``) in order, checking each."""
        cfg = self.config()
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        api.mount(ref, self.mountpoint, cfg)
        t1 = time.monotonic()
        ok, error = True, ""
        for path, digest in files.items():
            try:
                data = (self.mountpoint / path).read_bytes()
            except OSError as e:
                ok, error = False, f"{path}: {e}"
                break
            ok = ok and hashlib.sha256(data).hexdigest() == digest
        t2 = time.monotonic()
        s = api.stats(self.mountpoint, cfg)
        f = s["fetch"]
        return NodeResult(
            self.name, t1 - t0, t2 - t1, f["bytes_fetched"], s["reads"]["errors"],
            f["checksum_errors"], s.get("sources", []), ok, error,
        )  # fmt: skip

    def settle(self, timeout: float = 60.0) -> dict[str, Any]:
        """Wait until the mount has no fetch queued or in flight (read-ahead still running
        after the start), and return its stats then: what the start cost in the end."""
        cfg = self.config()
        deadline = time.monotonic() + timeout
        quiet = 0
        while True:
            s = api.stats(self.mountpoint, cfg)
            quiet = quiet + 1 if s["fetch"]["inflight"] == s["fetch"]["queued"] == 0 else 0
            if quiet >= 2 or time.monotonic() > deadline:
                return s
            time.sleep(0.1)

    def stop(self) -> None:
        cfg = self.config()
        for info in api.list_mounts(cfg):
            try:
                api.unmount(info.mountpoint, cfg, lazy=True)
            except Exception as e:  # noqa: BLE001 - the others are still unmounted
                print(f"unmount of {info.mountpoint} failed: {e}", file=sys.stderr)


def start_all(nodes: list[Node], ref: str, files: dict[str, str]) -> list[NodeResult]:
    """Start every node at once (a thread each); results in the nodes' order."""
    results: list[NodeResult | None] = [None] * len(nodes)

    def run(i: int) -> None:
        try:
            results[i] = nodes[i].start(ref, files)
        except Exception as e:  # noqa: BLE001 - reported in the result
            results[i] = NodeResult(nodes[i].name, 0, 0, 0, 0, 0, [], False, repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None]


def settle_all(nodes: list[Node]) -> list[dict[str, Any]]:
    """``Node.settle`` of each node (after ``start_all``)."""
    return [n.settle() for n in nodes]
