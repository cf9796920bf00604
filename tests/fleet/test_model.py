"""The fleet model's arithmetic (``benchmarks/fleet/model.py``): the tier's two latencies
taken from measured waves and added to each node's time through the tier, and the tier
sized for the bandwidth part where those latencies alone miss the goal."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.fleet import model

BASE = model.Params(
    name="t", startup_bytes=64e6, node_rate=500e6, fixed_seconds=0.1, origin_rate=25e6,
    tier_rate=model.TIER_HOST, tier_origin_ratio=1.0, spread=0.0, source="test",
)  # fmt: skip


def _wave(kind: str, nodes: int, seconds: list[float], round_: int = 0) -> dict:
    return {"wave": f"{kind}-{round_}-{nodes}", "nodes": nodes, "seconds": seconds}


def test_tier_latencies_from_the_waves() -> None:
    waves = [
        _wave("direct", 1, [2.5]), _wave("direct", 1, [2.7], 1),
        _wave("tier-cold", 1, [2.8]), _wave("tier-cold", 1, [2.8], 1),
        _wave("tier-cold", 4, [3.2, 3.4, 3.4, 3.6]),
        _wave("tier-warm", 4, [0.4, 0.5, 0.5, 0.5]),
    ]  # fmt: skip
    hop, wave = model.tier_latencies(waves)
    assert hop == pytest.approx(0.2) and wave == pytest.approx(0.6)


def test_latencies_are_added_through_the_tier_only() -> None:
    p = replace(BASE, tier_hop_seconds=0.2, tier_wave_seconds=0.5)
    plain = {s: model.simulate(s, 4, BASE).p50 for s in model.STRATEGIES}
    added = {s: model.simulate(s, 4, p).p50 for s in model.STRATEGIES}
    assert added["tier"] == pytest.approx(plain["tier"] + 0.7)
    assert added["direct"] == plain["direct"] and added["p2p"] == plain["p2p"]
    assert model.simulate("tier", 1, p).p50 == pytest.approx(
        model.simulate("tier", 1, BASE).p50 + 0.2
    )


def test_goal_out_of_reach_for_the_latencies_alone() -> None:
    t1 = model.one_node_seconds(BASE)  # ~2.7 s: 0.2 x that is ~0.54 s
    slow = replace(BASE, tier_hop_seconds=0.3, tier_wave_seconds=0.5)
    assert model.tier_rate_for_goal(slow) == float("inf")
    result = model.evaluate(slow, [1000])
    assert result["tier_sized_for"] == "bandwidth" and result["tier_hosts"] >= 1
    assert result["goal_at_1000"]["met"] is False
    assert result["goal_at_1000"]["p99_ratio"] > 1 + 0.8 / t1 - 0.01
    fine = model.evaluate(replace(BASE, tier_hop_seconds=0.1), [1000])
    assert fine["tier_sized_for"] == "goal" and fine["goal_at_1000"]["met"] is True
