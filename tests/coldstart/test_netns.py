# ruff: noqa: E501  (the access-log sample has real, long lines)
"""The remote host's pure parts: presets, tbf sizing, command lists, the delay line, the
registry access log. No root, no network."""

from __future__ import annotations

import pytest

from benchmarks.coldstart import netns
from benchmarks.coldstart.netns import PRESETS, DelayLine, NetConfig


def test_presets_cover_the_issue():
    assert PRESETS["1g-1ms"].rate_mbit == 1000 and PRESETS["1g-1ms"].rtt_ms == 1
    assert PRESETS["200m-20ms"].rate_mbit == 200 and PRESETS["200m-20ms"].rtt_ms == 20
    assert not PRESETS["none"].shaped
    assert PRESETS["1g-1ms"].shaped


def test_tbf_params():
    p = netns.tbf_params(1000)
    assert p.rate_bit == 1_000_000_000
    assert p.burst_bytes >= 64 << 10  # holds a GSO super-packet
    assert p.burst_bytes == 250_000  # 2 ms at 125 MB/s
    assert p.limit_bytes == p.burst_bytes + 6_250_000  # + 50 ms of queue
    slow = netns.tbf_params(10)
    assert slow.burst_bytes == netns.MIN_BURST
    with pytest.raises(ValueError):
        netns.tbf_params(0)


def test_interface_names_fit_ifnamsiz():
    cfg = NetConfig()
    assert len(cfg.host_if) <= 15 and len(cfg.remote_if) <= 15


def test_setup_commands_move_the_peer_and_address_both_ends():
    cfg = NetConfig()
    cmds = [" ".join(c) for c in netns.setup_commands(cfg)]
    assert cmds[0] == f"ip netns add {cfg.namespace}"
    assert f"ip link set {cfg.remote_if} netns {cfg.namespace}" in cmds
    assert f"ip addr add {cfg.host_addr}/30 dev {cfg.host_if}" in cmds
    assert (f"ip netns exec {cfg.namespace} ip addr add {cfg.remote_addr}/30 "
            f"dev {cfg.remote_if}") in cmds  # fmt: skip


def _joined(cmds: list[list[str]]) -> list[str]:
    return [" ".join(c) for c in cmds]


def test_shaping_none_only_resets():
    cmds = _joined(netns.shaping_commands(NetConfig(), PRESETS["none"]))
    assert not any("tbf" in c for c in cmds)
    assert not any("NFQUEUE" in c for c in cmds)
    # resets are optional (a default qdisc cannot be deleted)
    assert all(c.startswith("-") for c in cmds if "qdisc del" in c)


def test_shaping_shapes_both_directions_and_queues_inbound_packets():
    cfg = NetConfig()
    cmds = _joined(netns.shaping_commands(cfg, PRESETS["200m-20ms"]))
    tbf = [c for c in cmds if " tbf " in c]
    assert len(tbf) == 2
    assert any(f"dev {cfg.host_if} root tbf rate 200000000bit" in c for c in tbf)
    assert any(c.startswith(f"ip netns exec {cfg.namespace} tc qdisc add dev {cfg.remote_if}")
               for c in tbf)  # fmt: skip
    nfq = [c for c in cmds if "NFQUEUE" in c]
    assert nfq == [
        f"ip netns exec {cfg.namespace} iptables -t mangle -A PREROUTING -i {cfg.remote_if} "
        f"-j NFQUEUE --queue-num {cfg.queue_num}"
    ]


def test_run_commands_tolerates_only_optional_failures():
    netns.run_commands([["-", "false"], ["true"]])
    with pytest.raises(netns.NetError):
        netns.run_commands([["false"]])


def test_delay_line_releases_in_order_after_the_delay():
    line: DelayLine[str] = DelayLine(0.010)
    assert line.timeout(0.0) is None
    line.push("a", 1.000)
    line.push("b", 1.004)
    assert line.pop_due(1.009) == []
    assert line.timeout(1.005) == pytest.approx(0.005)
    assert line.pop_due(1.010) == ["a"]
    assert len(line) == 1
    assert line.timeout(2.0) == 0.0  # overdue
    assert line.pop_due(2.0) == ["b"]
    assert line.timeout(2.0) is None


LOG = """\
10.213.77.1 - - [02/Dec/2026:12:00:00 +0000] "HEAD /v2/lazybench/oci/manifests/t HTTP/1.1" 200 0 "" "containerd/1.6"
10.213.77.1 - - [02/Dec/2026:12:00:00 +0000] "GET /v2/lazybench/oci/manifests/sha256:ab HTTP/1.1" 200 1234 "" "containerd/1.6"
time="2026-12-02T12:00:00Z" level=error msg="not an access line"
10.213.77.1 - - [02/Dec/2026:12:00:01 +0000] "GET /v2/lazybench/block/blobs/sha256:cd HTTP/1.1" 206 4194304 "" "python-httpx"
10.213.77.1 - - [02/Dec/2026:12:00:01 +0000] "GET /v2/lazybench/oci/blobs/sha256:ef HTTP/1.1" 200 1000 "" "containerd/1.6"
10.213.77.1 - - [02/Dec/2026:12:00:02 +0000] "GET /v2/ HTTP/1.1" 401 - "" "containerd/1.6"
"""


def test_parse_access_log():
    s = netns.parse_access_log(LOG)
    assert s.requests == 5
    assert s.body_bytes == 1234 + 4194304 + 1000
    assert s.blob_gets == 2
    assert s.range_gets == 1
    assert netns.parse_access_log("") == netns.AccessSummary()
