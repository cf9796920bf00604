"""CI smoke version of the cold-start benchmark: tiny busybox image, no shaping, one run of
every scenario, end to end through the real tools (network namespace, docker-registry,
containerd + runc with CRI, and the snapshotter daemon as containerd's proxy snapshotter for
the lazy ones), then the report files.

It checks that the benchmark runs and reports, not how fast anything is."""

from __future__ import annotations

import importlib.util
import json

import pytest
import support

from benchmarks.coldstart import netns, run

pytestmark = [pytest.mark.root, pytest.mark.integration]

# Apart from a benchmark that may be running on the same machine (lbbench, 10.213.77.0/30).
TEST_NET = netns.NetConfig(
    namespace="lbsmoke",
    host_if="lbs-host",
    remote_if="lbs-remote",
    host_addr="10.213.78.1",
    remote_addr="10.213.78.2",
    queue_num=7214,
)


def test_smoke(tmp_path):
    support.require_root()
    support.require_tool("ip", "tc", "iptables", "containerd", "ctr", "runc", "skopeo", "umoci",
                         "docker-registry", "busybox")  # fmt: skip
    support.require(importlib.util.find_spec("matplotlib") is not None, "needs matplotlib")
    lazy_reason = run.Lazyblock.unavailable()
    # A profile of another image: one path this image has too, the others it lacks.
    foreign = tmp_path / "foreign-profile.txt"
    foreign.write_text("/bin/busybox\n/opt/venv/lib/libtorch_cpu.so\n/models/weights-0.bin\n")
    cfg = run.BenchConfig(
        kind="tiny",
        size=1 << 20,
        presets=("none",),
        scenarios=run.SCENARIOS,
        foreign_profile=foreign,
        runs=1,
        work=tmp_path / "work",
        out=tmp_path / "results",
        run_timeout=120,
        drop_caches=False,
        net=TEST_NET,
    )
    results = run.run_benchmark(cfg)

    scen = results["presets"]["none"]["scenarios"]
    for name in ("full-pull", "local"):
        assert scen[name]["status"] == "ok", scen[name]
    pull, local = scen["full-pull"], scen["local"]
    # A full pull moves the whole image; running it from local disk moves nothing.
    assert pull["registry_bytes"] >= results["image"]["compressed_bytes"]
    assert pull["wire_bytes"] >= pull["registry_bytes"]
    assert local["registry_bytes"] == 0
    for name in run.LAZY_SCENARIOS:
        if lazy_reason is None:
            assert scen[name]["status"] == "ok", scen[name]
        else:
            assert scen[name]["status"] == "not-run" and scen[name]["reason"] == lazy_reason
    if lazy_reason is None:
        assert scen["lazy"]["registry_bytes"] > 0
        # Through CRI and the proxy snapshotter: the pull mounted the image lazily.
        assert results["via"] == "cri"
        for name in run.LAZY_SCENARIOS:
            only = scen[name]["runs"][0]
            if name != "lazy-resident":  # its image was pulled before the timed run
                assert only["phases_s"]["pull_s"] > 0
            assert only["snapshotter"]["backing"] in ("file", "loop")
        # The node cache is warm: at most the index and metadata come again.
        assert scen["lazy-warm"]["registry_bytes"] < scen["lazy"]["registry_bytes"]
        # A second container of a mounted image: no pull, no mount.
        assert scen["lazy-resident"]["registry_bytes"] < scen["lazy"]["registry_bytes"]

    # The CPU of each start: the machine's busy and idle time add up to the start's span.
    for name, s in scen.items():
        if s["status"] == "ok":
            only = s["runs"][0]
            cpu = only["cpu_s"]
            span = (cpu["busy"] + cpu["idle"]) / results["host"]["cpus"]
            assert abs(span - only["seconds"]) < 0.1 * only["seconds"] + 0.1, (name, only)

    on_disk = json.loads((cfg.out / "latest.json").read_text())
    assert set(on_disk["presets"]["none"]["scenarios"]) == set(run.SCENARIOS)
    table = (cfg.out / "latest.md").read_text()
    assert "| full-pull |" in table and "| local |" in table
    assert "CPU-seconds from the first action to ready" in table
    assert (cfg.out / "latest.png").stat().st_size > 0
    assert not netns._ns_pids(TEST_NET.namespace)  # torn down
