"""The cluster cache tier for real: a registry in its own network namespace behind a shaped
link (benchmarks/coldstart/netns.py), Debian's nginx beside the nodes with the configuration
in deploy/nginx (benchmarks/fleet/tier.py renders it), and nodes that each have their own
sector cache, mount state and mount server (benchmarks/fleet/nodes.py), pointed at the tier by
deploy/nginx/hosts.toml, starting the same converted image at once.

* Four nodes through the tier cost the registry about what one node costs it alone (its
  access log: at most 1.1 times); the tier's log shows the other nodes' reads as cache hits.
* A slice corrupted in the tier's cache is refused by the node that reads it (checksum),
  reported to the store (the tier backs off) and read from the registry: no failed read.
* The tier killed while the nodes start: every read still succeeds, from the registry.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import require, require_fuse, require_tool

from benchmarks.coldstart import netns
from benchmarks.fleet import nodes as fleet
from benchmarks.fleet.tier import NginxTier
from snapshotter.prometheus import exposition

NET = netns.NetConfig(
    namespace="lbfleet", host_if="lbf-host", remote_if="lbf-remote",
    host_addr="10.213.78.1", remote_addr="10.213.78.2", queue_num=7214,
)  # fmt: skip
LINK = netns.Preset("fleet-test", 200.0, 2.0)  # 200 Mbit/s, 2 ms RTT
FILES, FILE_SIZE, STARTUP_FILES = 10, 4 << 20, 5
NODES = 4


@dataclass
class Fleet:
    remote: netns.RemoteHost
    ref: str
    startup: dict[str, str]  # path -> sha256 of the files a start reads
    work: Path

    @property
    def origin(self) -> str:
        return self.remote.registry_host

    def nodes(self, prefix: str, count: int, tier: NginxTier | None, **store: object):
        hosts = fleet.hosts_dir(
            self.work / f"{prefix}-certs.d", self.origin, tier.host if tier else None
        )
        return [
            fleet.Node(self.work / f"{prefix}{i}", hosts, store_options=dict(store))
            for i in range(count)
        ]


@pytest.fixture(scope="module")
def the_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    require_fuse()
    require_tool("nginx", "docker-registry", "ip", "tc", "iptables")
    try:
        import netfilterqueue  # noqa: F401
    except ImportError:
        require(False, "needs python netfilterqueue (the link's delay)")
    work = tmp_path_factory.mktemp("fleet")
    remote = netns.RemoteHost(NET, work / "remote")
    remote.up()
    try:
        remote.start_registry(work / "registry-data")
        ref, startup = fleet.publish_startup_image(
            remote.registry_host, work, "fleet/app", FILES, FILE_SIZE, STARTUP_FILES, 25
        )
        remote.shape(LINK)
        yield Fleet(remote, ref, startup, work)
    finally:
        remote.close()


@pytest.fixture
def started() -> Iterator[list]:
    """Nodes a test started and tiers it ran: stopped at its end, whatever happened."""
    things: list = []
    yield things
    for thing in reversed(things):
        thing.stop()


def _check(results: list[fleet.NodeResult]) -> None:
    for r in results:
        assert r.error == "" and r.files_ok, f"{r.name}: {r.error or 'wrong bytes'}"
        assert r.read_errors == 0


def test_four_nodes_through_the_tier_cost_the_registry_one(the_fleet, started, tmp_path):
    # One node alone, straight to the registry: the reference.
    (alone,) = the_fleet.nodes("alone", 1, None)
    started.append(alone)
    mark = the_fleet.remote.traffic_mark()
    (solo,) = fleet.start_all([alone], the_fleet.ref, the_fleet.startup)
    fleet.settle_all([alone])  # its read-ahead counts too
    one_node = the_fleet.remote.traffic_since(mark)
    _check([solo])
    assert solo.fetched_bytes >= STARTUP_FILES * FILE_SIZE

    tier = NginxTier(tmp_path / "tier", the_fleet.origin)
    tier.start()
    started.append(tier)
    nodes = the_fleet.nodes("node", NODES, tier)
    started.extend(nodes)
    mark = the_fleet.remote.traffic_mark()
    results = fleet.start_all(nodes, the_fleet.ref, the_fleet.startup)
    fleet.settle_all(nodes)
    through_tier = the_fleet.remote.traffic_since(mark)
    _check(results)
    # The registry served about one node's bytes for four nodes.
    assert through_tier.body_bytes <= 1.1 * one_node.body_bytes, (through_tier, one_node)
    # Every node read through the tier, never from the registry.
    for r in results:
        mirror, server = r.sources
        assert mirror["role"] == "mirror" and mirror["bytes"] >= STARTUP_FILES * FILE_SIZE
        assert server["requests"] == 0 and mirror["errors"] == mirror["rejected"] == 0
    blob_reads = [e for e in tier.entries() if "/blobs/" in e.path]
    served = sum(e.body_bytes for e in blob_reads)
    assert served >= NODES * STARTUP_FILES * FILE_SIZE
    assert sum(e.body_bytes for e in blob_reads if e.cache == "HIT") >= (NODES - 1) / NODES * (
        served - one_node.body_bytes
    )

    # A second wave on empty node caches: all from the tier's cache, nothing from the registry.
    again = the_fleet.nodes("again", 2, tier)
    started.extend(again)
    mark = the_fleet.remote.traffic_mark()
    _check(fleet.start_all(again, the_fleet.ref, the_fleet.startup))
    fleet.settle_all(again)
    blob_bytes_at_origin = the_fleet.remote.traffic_since(mark)
    assert blob_bytes_at_origin.range_gets == 0, blob_bytes_at_origin

    # A corrupted slice: the first slice of the data blob, which every start reads (its
    # metadata sectors), one byte flipped on the tier's disk.
    data_blob = _data_blob_digest(tier)
    key = f"{data_blob}bytes=0-1048575"
    md5 = hashlib.md5(key.encode()).hexdigest()
    slice_file = tier.cache_dir / md5[-1] / md5[-3:-1] / md5
    raw = bytearray(slice_file.read_bytes())
    raw[-100] ^= 0xFF  # in the body: blob byte 1 MiB - 100
    slice_file.write_bytes(raw)
    (victim,) = the_fleet.nodes("victim", 1, tier)
    started.append(victim)
    (r,) = fleet.start_all([victim], the_fleet.ref, the_fleet.startup)
    _check([r])
    mirror, server = r.sources
    assert r.checksum_errors >= 1 and mirror["rejected"] >= 1
    assert mirror["backoff_seconds"] > 0 and server["bytes"] > 0
    # ... and so do the node's Prometheus metrics.
    rejected = [
        float(line.rsplit(" ", 1)[1])
        for line in exposition(victim.config()).decode().splitlines()
        if line.startswith("lazyblock_source_requests_total{")
        and 'outcome="rejected"' in line
        and 'role="mirror"' in line
    ]
    assert rejected and rejected[0] >= 1
    status = subprocess.run(
        [sys.executable, "-m", "snapshotter.cli", "status",
         "--state-dir", str(victim.root / "state"), "--cache-dir", str(victim.root / "cache"),
         "--set", "store.registry_config_path="],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert f"mirror http://{tier.host}/v2: " in status and "rejected" in status


def test_tier_killed_while_nodes_start(the_fleet, started, tmp_path):
    tier = NginxTier(tmp_path / "tier", the_fleet.origin)  # cold: slices cross the link
    tier.start()
    started.append(tier)
    nodes = the_fleet.nodes("kill", NODES, tier, mirror_timeout=1.0)
    started.extend(nodes)
    results: list = []
    runner = threading.Thread(
        target=lambda: results.extend(fleet.start_all(nodes, the_fleet.ref, the_fleet.startup))
    )
    start = time.monotonic()
    runner.start()
    # Kill it once the nodes are reading data through it (past their mounts).
    while time.monotonic() - start < 60:
        if sum(e.body_bytes for e in tier.entries() if "/blobs/" in e.path) > 4 << 20:
            break
        time.sleep(0.02)
    tier.kill()
    killed_at = time.monotonic() - start
    runner.join(120)
    assert not runner.is_alive()
    _check(results)
    for r in results:
        mirror, server = r.sources
        assert mirror["bytes"] + server["bytes"] >= STARTUP_FILES * FILE_SIZE
    assert any(r.sources[0]["errors"] + r.sources[0]["timeouts"] for r in results)
    assert all(r.sources[1]["bytes"] > 0 for r in results), "the registry served the rest"
    assert killed_at < max(r.seconds for r in results)  # it died in the middle


def _data_blob_digest(tier: NginxTier) -> str:
    """The data blob: the digest most bytes were read of through the tier."""
    sizes: dict[str, int] = {}
    for e in tier.entries():
        if "/blobs/" in e.path:
            digest = e.path.split("/blobs/", 1)[1].split("?", 1)[0]
            sizes[digest] = sizes.get(digest, 0) + e.body_bytes
    return max(sizes, key=sizes.__getitem__)


def teardown_module() -> None:
    netns.teardown(NET)  # also after an interrupted run
