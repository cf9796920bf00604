"""The autoscaler's decision function: observations in, desired replicas out. No I/O.

``decide(policy, state, obs)`` is called once per tick (every second) with the measured total
concurrency (in-flight requests summed over routers or pods) and the replica counts of the
workload; it returns the desired replica count, a reason, and the next state. The state is an
immutable value, so the function is pure and the simulator replays it exactly.

Rules, in order:

1. **Missing metrics hold steady.** No measurement (``concurrency is None``) keeps the current
   replica count: never scale to zero, never guess.
2. **Demand, not backlog, drives scale-up.** The up signal is the short-window mean of the
   measured concurrency; when the observation also carries ``demand`` (arrival rate x mean
   service time, Little's law), it is the smaller of the two. A backlog that piles up while
   pods cold-start inflates concurrency but not demand, and it drains once those pods are
   ready, so it must not buy more pods (with 120 s starts it would buy hundreds).
3. **Panic.** When the up signal exceeds ``panic_threshold`` (2x) times the capacity of the
   *ready* pods, the step limit is lifted and the target is at least double the ready pods
   (pods already starting count in ``current``, so a backlog they will absorb buys
   nothing); panic lasts ``panic_hold_s`` after the last trigger, and
   nothing scales down during it.
4. **Scale up on the short window.** ``ceil(up signal / target)``, compared with the current
   replicas (which include starting pods); if above, move there by at most
   ``max(up_max_pods, current * up_max_percent/100)`` per tick.
5. **Scale down on the long window.** ``ceil(mean over down_window_s / target)``; the
   recommendation is the *largest* one of the last ``stabilization_s`` (so a dip has to last
   that long), at most ``max(down_max_pods, current * down_max_percent/100)`` pods per
   ``down_period_s``, and never while pods are still starting.
6. Clamp to ``[min_replicas, max_replicas]``; ``min_replicas >= 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from serving.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ScalingPolicy:
    """Autoscaling policy (times in seconds)."""

    #: sustainable concurrent requests per pod (configured, or measured on one pod)
    target_per_pod: float
    min_replicas: int = 1
    max_replicas: int = 64
    #: scale-up averages concurrency over this short window
    up_window_s: float = 6.0
    up_max_pods: int = 4
    up_max_percent: float = 100.0
    #: scale-down averages over this long window ...
    down_window_s: float = 120.0
    #: ... takes the highest recommendation of this period ...
    stabilization_s: float = 300.0
    #: ... and removes at most this many pods per down_period_s
    down_max_pods: int = 1
    down_max_percent: float = 10.0
    down_period_s: float = 60.0
    panic_threshold: float = 2.0
    panic_hold_s: float = 60.0
    #: when demand is known, concurrency counts for scale-up only up to this many times it
    #: (queueing headroom and some backlog draining; beyond that it is cold-start backlog)
    backlog_factor: float = 2.0

    def __post_init__(self) -> None:
        if self.target_per_pod <= 0:
            raise ConfigError("target_per_pod must be positive")
        if self.min_replicas < 1:
            raise ConfigError("min_replicas must be at least 1 (never scale to zero)")
        if self.max_replicas < self.min_replicas:
            raise ConfigError("max_replicas must be >= min_replicas")
        if self.up_window_s <= 0 or self.down_window_s <= 0:
            raise ConfigError("windows must be positive")


@dataclass(frozen=True)
class Observation:
    """One tick's inputs."""

    now: float
    #: total in-flight requests, or None when no metrics could be read
    concurrency: float | None
    #: the workload's current desired replicas (spec)
    current: int
    #: pods that are ready to serve
    ready: int
    #: pods that exist but are not ready yet
    starting: int = 0
    #: offered load as concurrency: arrival rate x mean service time (Little's law), without
    #: the backlog; None when unknown (the concurrency alone is used)
    demand: float | None = None


@dataclass(frozen=True)
class ScalerState:
    """What decide() remembers between ticks."""

    #: (time, concurrency) samples, oldest first, within the longest window
    samples: tuple[tuple[float, float], ...] = ()
    #: (time, demand) samples, oldest first, within the short window
    demand_samples: tuple[tuple[float, float], ...] = ()
    #: (time, recommendation) of the down path, within the stabilization period
    recommendations: tuple[tuple[float, int], ...] = ()
    last_scale_down: float = -math.inf
    panic_until: float = -math.inf


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str
    state: ScalerState = field(repr=False)
    panic: bool = False


def _mean_since(samples: tuple[tuple[float, float], ...], since: float) -> float | None:
    vals = [c for t, c in samples if t > since]
    if not vals:
        return None
    return sum(vals) / len(vals)


def _clamp(n: int, p: ScalingPolicy) -> int:
    return max(p.min_replicas, min(p.max_replicas, n))


def decide(policy: ScalingPolicy, state: ScalerState, obs: Observation) -> Decision:
    """One autoscaling tick. Pure: the same inputs always give the same decision."""
    p = policy
    now = obs.now
    current = max(obs.current, 0)
    if obs.concurrency is None:
        # rule 1: hold (but never below min_replicas, never to zero)
        return Decision(_clamp(max(current, p.min_replicas), p), "metrics missing: hold", state)

    horizon = now - max(p.down_window_s, p.up_window_s)
    samples = tuple(s for s in state.samples if s[0] > horizon) + ((now, obs.concurrency),)
    dsamples = tuple(s for s in state.demand_samples if s[0] > now - p.up_window_s)
    if obs.demand is not None:
        dsamples += ((now, max(obs.demand, 0.0)),)
    short = _mean_since(samples, now - p.up_window_s) or 0.0
    long_ = _mean_since(samples, now - p.down_window_s) or 0.0
    # rule 2: demand (when known) caps the up signal, so a cold-start backlog buys no pods
    demand = _mean_since(dsamples, now - p.up_window_s)
    up = short if demand is None else min(short, p.backlog_factor * demand)
    want_up = math.ceil(up / p.target_per_pod - 1e-9)
    want_down = math.ceil(long_ / p.target_per_pod - 1e-9)

    # stabilization: the down path may only go as low as the highest recent recommendation
    recs = tuple(r for r in state.recommendations if r[0] > now - p.stabilization_s)
    recs += ((now, max(want_down, want_up)),)
    stable = max(r for _, r in recs)
    st = replace(state, samples=samples, demand_samples=dsamples, recommendations=recs)

    # rule 3: panic, against the capacity of the ready pods
    panic_now = up > 0 and up > p.panic_threshold * p.target_per_pod * max(obs.ready, 0)
    if panic_now:
        st = replace(st, panic_until=now + p.panic_hold_s)
    panicking = now < st.panic_until
    if panic_now:
        desired = _clamp(max(current, want_up, 2 * obs.ready), p)
        return Decision(
            desired,
            f"panic: {up:.1f} wanted, {obs.ready} ready + {obs.starting} starting",
            st,
            True,
        )

    # rule 4: up (current includes the pods still starting)
    if want_up > current:
        step = max(p.up_max_pods, math.ceil(current * p.up_max_percent / 100.0))
        desired = _clamp(min(want_up, current + step), p)
        return Decision(desired, f"up: short-window load {up:.1f}", st, panicking)

    # rule 5: down
    if stable < current:
        if panicking:
            return Decision(_clamp(current, p), "hold: panic mode", st, True)
        if obs.starting > 0:
            return Decision(_clamp(current, p), "hold: pods still starting", st)
        if now - state.last_scale_down < p.down_period_s:
            return Decision(_clamp(current, p), "hold: scale-down period", st)
        step = max(p.down_max_pods, math.floor(current * p.down_max_percent / 100.0))
        desired = _clamp(max(stable, current - step), p)
        if desired < current:
            st = replace(st, last_scale_down=now)
        return Decision(desired, f"down: long-window concurrency {long_:.1f}", st)

    return Decision(_clamp(current, p), "steady", st, panicking)
