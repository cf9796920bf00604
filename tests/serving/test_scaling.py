"""Unit tests of the autoscaler decision function."""

from __future__ import annotations

import pytest

from serving.errors import ConfigError
from serving.scaling import Observation, ScalerState, ScalingPolicy, decide

P = ScalingPolicy(
    target_per_pod=10,
    min_replicas=1,
    max_replicas=100,
    up_window_s=5,
    up_max_pods=4,
    up_max_percent=100,
    down_window_s=60,
    stabilization_s=120,
    down_max_pods=1,
    down_max_percent=10,
    down_period_s=30,
    panic_threshold=2.0,
    panic_hold_s=30,
)


def run(policy, series, *, start=0, ready=None, starting=0, state=None, t0=0.0, follow=True):
    """Feed per-second concurrency values; the workload follows the desired count at once.

    Returns the desired count after each tick and the final state.
    """
    state = state or ScalerState()
    current = start
    out = []
    for i, c in enumerate(series):
        r = current if ready is None else ready
        d = decide(policy, state, Observation(t0 + i, c, current, r, starting))
        state = d.state
        out.append(d.desired)
        if follow:
            current = d.desired
    return out, state


def test_policy_validation():
    with pytest.raises(ConfigError):
        ScalingPolicy(target_per_pod=0)
    with pytest.raises(ConfigError):
        ScalingPolicy(target_per_pod=1, min_replicas=0)
    with pytest.raises(ConfigError):
        ScalingPolicy(target_per_pod=1, min_replicas=5, max_replicas=2)


def test_steady_load_is_steady():
    out, _ = run(P, [30.0] * 100, start=3)
    assert set(out) == {3}


def test_desired_is_ceil_of_concurrency_over_target():
    out, _ = run(P, [41.0] * 10, start=5)
    assert out[-1] == 5
    out, _ = run(P, [51.0] * 10, start=5)
    assert out[-1] == 6


def test_scale_up_is_step_limited_per_tick():
    # 2 pods, short-window mean jumps; at most max(4, 100%) = +4 per tick at start
    out, _ = run(P, [10.0] * 10 + [300.0] * 10, start=1, ready=100)
    ups = [b - a for a, b in zip(out, out[1:], strict=False) if b > a]
    assert ups and ups[0] <= 4
    assert out[-1] == 30


def test_scale_up_follows_short_window_within_seconds():
    out, _ = run(P, [20.0] * 10 + [200.0] * 10, start=2, ready=100)
    # mean of the 5 s window passes 10 pods' worth within 2 ticks of the jump
    assert out[11] > 2
    assert out[-1] == 20


def test_panic_doubles_beyond_step_limit():
    policy = ScalingPolicy(target_per_pod=10, up_max_pods=1, up_max_percent=0, up_window_s=1)
    d = decide(policy, ScalerState(), Observation(0.0, 500.0, current=10, ready=10))
    assert d.panic
    assert d.desired == 50  # want 50; a +1 step limit would give 11
    d = decide(policy, ScalerState(), Observation(0.0, 210.0, current=10, ready=10))
    assert d.panic and d.desired == 21
    # at most 2x capacity of ready pods: no panic, normal step
    d = decide(policy, ScalerState(), Observation(0.0, 200.0, current=10, ready=10))
    assert not d.panic and d.desired == 11


def test_panic_counts_ready_pods_not_requested_ones():
    # 10 requested, 2 ready (8 starting): 50 in flight is > 2 * 2 * 10 -> panic, no shrink
    d = decide(P, ScalerState(), Observation(0.0, 50.0, current=10, ready=2, starting=8))
    assert d.panic
    assert d.desired == 10


def test_big_backlog_with_enough_pods_starting_buys_no_more():
    # cold-start backlog: 900 in flight but only 45 of demand (arrival rate x service time);
    # 10 pods (2 ready, 8 starting) cover it -> no scale-up, for a whole cold start
    obs = [
        Observation(float(t), 900.0 + 50 * t, current=10, ready=2, starting=8, demand=45.0)
        for t in range(120)
    ]
    st = ScalerState()
    for o in obs:
        d = decide(P, st, o)
        st = d.state
        assert d.desired == 10, d.reason  # panic may hold, but buys nothing more
    # the same backlog without a demand estimate would scale up (old behaviour)
    d = decide(P, ScalerState(), Observation(0.0, 900.0, current=10, ready=2, starting=8))
    assert d.panic and d.desired == 90


def test_panic_still_doubles_when_starting_pods_are_not_enough():
    policy = ScalingPolicy(target_per_pod=10, up_max_pods=1, up_max_percent=0, up_window_s=1)
    # 10 ready + 2 starting = 120 of capacity on its way; 250 wanted > 2 x 120 -> panic,
    # step limit (+1) lifted
    d = decide(policy, ScalerState(), Observation(0.0, 250.0, 12, 10, 2, demand=250.0))
    assert d.panic and d.desired == 25
    # the backlog beyond backlog_factor (2x) times the demand does not count
    d = decide(policy, ScalerState(), Observation(0.0, 500.0, 10, 10, 0, demand=205.0))
    assert d.panic and d.desired == 41


def test_demand_does_not_slow_reaction_when_concurrency_matches_it():
    a, _ = run(P, [20.0] * 10 + [200.0] * 10, start=2, ready=100)
    st = ScalerState()
    b = []
    current = 2
    for i, c in enumerate([20.0] * 10 + [200.0] * 10):
        d = decide(P, st, Observation(float(i), c, current, 100, 0, demand=c * 0.8))
        st, current = d.state, d.desired
        b.append(current)
    assert a == b


def test_missing_demand_samples_fall_back_to_concurrency():
    d = decide(P, ScalerState(), Observation(0.0, 51.0, current=5, ready=5, demand=None))
    assert d.desired == 6


def test_no_scale_down_during_panic_hold():
    out, st = run(P, [500.0] * 3, start=10)
    assert out[-1] > 10
    d = decide(P, st, Observation(10.0, 0.0, out[-1], out[-1]))
    assert d.desired == out[-1] and d.panic


def test_scale_down_waits_for_stabilization_and_is_slow():
    hi, st = run(P, [100.0] * 130, start=10)
    assert hi[-1] == 10
    out, _ = run(P, [10.0] * 400, start=10, state=st, t0=130)
    # nothing for the stabilization period after the drop
    assert set(out[:110]) == {10}
    # then one pod per down period: never more than 1 at a time
    steps = [a - b for a, b in zip(out, out[1:], strict=False) if b < a]
    assert steps and all(s == 1 for s in steps)
    downs = [i for i in range(1, len(out)) if out[i] < out[i - 1]]
    assert all(b - a >= 30 for a, b in zip(downs, downs[1:], strict=False))
    assert out[-1] < 10


def test_short_dip_does_not_scale_down():
    hi, st = run(P, [100.0] * 130, start=10)
    out, st = run(P, [0.0] * 20 + [100.0] * 100, start=10, state=st, t0=130)
    assert min(out) == 10


def test_never_scale_down_while_pods_start():
    _, st = run(P, [100.0] * 130, start=10)
    out, _ = run(P, [0.0] * 400, start=10, starting=2, state=st, t0=130)
    assert set(out) == {10}


def test_missing_metrics_hold_and_never_zero():
    d = decide(P, ScalerState(), Observation(0.0, None, current=7, ready=7))
    assert d.desired == 7 and "missing" in d.reason
    d = decide(P, ScalerState(), Observation(0.0, None, current=0, ready=0))
    assert d.desired == 1
    out, _ = run(P, [0.0] * 1000, start=3)
    assert min(out) == 1


def test_clamped_to_max():
    d = decide(P, ScalerState(), Observation(0.0, 1e6, current=99, ready=99))
    assert d.desired == 100


def test_pure_same_inputs_same_output():
    a, _ = run(P, [float(i % 37) * 5 for i in range(500)], start=3)
    b, _ = run(P, [float(i % 37) * 5 for i in range(500)], start=3)
    assert a == b


def test_no_flapping_on_noisy_load():
    import random

    rng = random.Random(4)
    series = [100.0 + rng.uniform(-25, 25) for _ in range(900)]
    out, _ = run(P, series, start=10)
    changes = [i for i in range(1, len(out)) if out[i] != out[i - 1]]
    directions = [out[i] > out[i - 1] for i in changes]
    reversals = sum(1 for x, y in zip(directions, directions[1:], strict=False) if x != y)
    assert reversals <= 1
