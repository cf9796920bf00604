"""Real fleet starts on this machine, and the per-node figures the fleet model is calibrated with.

The registry runs in a network namespace behind a shaped link (``benchmarks/coldstart/netns``),
nginx with ``deploy/nginx``'s configuration beside the nodes (``tier.py``), and each node is
its own cache, mount state and mount server (``nodes.py``), all starting one image at once.
For each node count and round, three waves, each on empty node caches:

* ``direct``: every node straight to the registry (no hosts.toml mirror);
* ``tier-cold``: through a tier with an empty cache (the tier fills from the registry);
* ``tier-warm``: through the same tier again (what the 2nd..Nth wave of a rollout sees).

Each wave records every node's time to ready (mount + reading the startup files, checked
against their sha256), its fetched bytes after its read-ahead settled, its mount server's CPU
seconds per GB fetched, and the registry's response bytes (its access log). The model
(``model.py``) takes from these: startup bytes, a node's fetch rate when nothing else limits
it (``tier-warm`` with one node), the mount time, CPU per GB, and the tier's origin bytes per
startup byte (its slice rounding).

    sudo python -m benchmarks.fleet.run [--preset 200m-20ms] [--nodes 1,4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.coldstart import netns
from benchmarks.fleet import nodes as fleet
from benchmarks.fleet.tier import NginxTier

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
NET = netns.NetConfig(
    namespace="lbfleetb", host_if="lbfb-host", remote_if="lbfb-remote",
    host_addr="10.213.79.1", remote_addr="10.213.79.2", queue_num=7215,
)  # fmt: skip
FILES, FILE_SIZE, STARTUP_FILES = 16, 4 << 20, 8

log = logging.getLogger("fleet.run")


def mount_server_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wave(
    name: str, remote: netns.RemoteHost, work: Path, ref: str, startup: dict[str, str],
    count: int, tier: NginxTier | None,
) -> dict[str, Any]:  # fmt: skip
    """``count`` nodes with empty caches starting ``ref`` at once; what it took."""
    hosts = fleet.hosts_dir(
        work / f"{name}-certs.d", remote.registry_host, tier.host if tier else None
    )
    nodes = [fleet.Node(work / f"{name}-{i}", hosts) for i in range(count)]
    try:
        mark = remote.traffic_mark()
        results = fleet.start_all(nodes, ref, startup)
        settled = fleet.settle_all(nodes)
        traffic = remote.traffic_since(mark)
        for r in results:
            if r.error or not r.files_ok or r.read_errors:
                raise RuntimeError(f"{name}: node {r.name} failed: {r.error or 'wrong bytes'}")
        fetched = [s["fetch"]["bytes_fetched"] for s in settled]
        cpu = [
            mount_server_cpu(s["pid"]) / (f / 1e9) for s, f in zip(settled, fetched, strict=True)
        ]
        return {
            "wave": name,
            "nodes": count,
            "seconds": [r.seconds for r in results],
            "mount_seconds": [r.mount_seconds for r in results],
            "fetched_bytes": fetched,
            "cpu_s_per_gb": cpu,
            "origin_bytes": traffic.body_bytes,
            "origin_range_gets": traffic.range_gets,
        }
    finally:
        for n in nodes:
            n.stop()
        for n in nodes:
            shutil.rmtree(n.root, ignore_errors=True)


def run(preset: netns.Preset, counts: list[int], rounds: int, work: Path) -> dict[str, Any]:
    remote = netns.RemoteHost(NET, work / "remote")
    remote.up()
    waves: list[dict[str, Any]] = []
    try:
        remote.start_registry(work / "registry-data")
        ref, startup = fleet.publish_startup_image(
            remote.registry_host, work, "fleet/bench", FILES, FILE_SIZE, STARTUP_FILES, 1000
        )
        remote.shape(preset)
        for r in range(rounds):
            for count in counts:
                log.info("round %d, %d nodes", r + 1, count)
                waves.append(wave(f"direct-{r}-{count}", remote, work, ref, startup, count, None))
                tier = NginxTier(work / f"tier-{r}-{count}", remote.registry_host)
                tier.start()
                try:
                    for kind in ("cold", "warm"):
                        w = wave(
                            f"tier-{kind}-{r}-{count}", remote, work, ref, startup, count, tier
                        )
                        waves.append(w)
                finally:
                    tier.stop()
                    shutil.rmtree(tier.workdir, ignore_errors=True)
    finally:
        remote.close()
    return {
        "generated": time.strftime("%Y-%m-%d %H:%M:%S"),
        "preset": {"name": preset.name, "rate_mbit": preset.rate_mbit, "rtt_ms": preset.rtt_ms},
        "image": {"files": FILES, "file_size": FILE_SIZE, "startup_files": STARTUP_FILES},
        "cpus": os.cpu_count(),
        "waves": waves,
        "calibration": calibrate(waves),
    }


def calibrate(waves: list[dict[str, Any]]) -> dict[str, float]:
    """The per-node figures the model takes, as medians over rounds."""

    def pick(prefix: str, count: int) -> list[dict[str, Any]]:
        return [w for w in waves if w["wave"].startswith(prefix) and w["nodes"] == count]

    direct1, warm1, cold = pick("direct-", 1), pick("tier-warm-", 1), pick("tier-cold-", 1)
    startup = statistics.median(f for w in direct1 for f in w["fetched_bytes"])
    one_node = statistics.median(s for w in direct1 for s in w["seconds"])
    warm = statistics.median(s for w in warm1 for s in w["seconds"])
    mount = statistics.median(s for w in warm1 for s in w["mount_seconds"])
    return {
        "startup_bytes": startup,
        "one_node_seconds": one_node,
        "node_fetch_rate": startup / max(1e-3, warm - mount),
        "mount_seconds": mount,
        "cpu_s_per_gb": statistics.median(c for w in waves for c in w["cpu_s_per_gb"]),
        "tier_origin_ratio": statistics.median(
            w["origin_bytes"] / max(1, statistics.median(w["fetched_bytes"])) for w in cold
        ),
        "direct_origin_ratio": statistics.median(
            w["origin_bytes"] / max(1, statistics.median(w["fetched_bytes"])) for w in direct1
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="200m-20ms", choices=sorted(netns.PRESETS))
    parser.add_argument("--nodes", default="1,4", help="node counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "real.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    os.environ["PYTHONPATH"] = fleet.repo_env()["PYTHONPATH"]
    counts = [int(n) for n in args.nodes.split(",")]
    if 1 not in counts:
        counts.insert(0, 1)  # the model's per-node figures come from one node
    with tempfile.TemporaryDirectory(prefix="lazyblock-fleet-") as tmp:
        results = run(netns.PRESETS[args.preset], counts, args.rounds, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    for w in results["waves"]:
        median, most = statistics.median(w["seconds"]), max(w["seconds"])
        print(f"{w['wave']:18s} {w['nodes']} nodes: median {median:.2f} s, max {most:.2f} s, "
              f"registry {w['origin_bytes'] / 1e6:.1f} MB")  # fmt: skip
    print(json.dumps(results["calibration"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
