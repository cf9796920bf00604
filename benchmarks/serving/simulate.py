# ruff: noqa: E501  (report tables are built from long f-strings)
"""Discrete-event simulation of the serving stack's policies (no network, no clock).

Part 1, load balancing: N pods, each an M/G/c server (``slots`` requests run at once, the
rest queue FIFO) with lognormal service times; a few pods are slow. R independent routers
each receive a share of Poisson arrivals and choose a pod with:

* ``round-robin`` (per router), ``random``,
* ``p2c-fresh``: two random pods, fewer outstanding requests (exact global counts, one
  omniscient router; the ideal),
* ``p2c-stale``: the same on load *reports* refreshed every ``report_s`` (every router sees the
  same snapshot, as when all routers scrape ``/metrics``),
* ``p2c-weighted``: the router's own exact in-flight counts plus the staleness-weighted others'
  share of the reports: the production policy, ``serving.balancer.score`` itself,
* ``jsq``: join the shortest queue (global exact counts).

Reported: p50/p99 latency (in units of the mean service time) and the max/mean ratio of the
pods' time-averaged outstanding requests, at 50-95% utilisation.

Part 2, autoscaling: traffic ramps 10x in 60 s, holds, then drops; pods cold-start in 5 s or
120 s; the real ``serving.scaling.decide`` runs every second on the measured concurrency.
Reported: requests over the latency SLO, peak queueing, pod-minutes, and flapping (reversals
of the scaling direction).

    python benchmarks/serving/simulate.py [--quick] [--out benchmarks/serving/results]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from serving.balancer import Backend, BalancerConfig, record_report, score  # noqa: E402
from serving.scaling import Observation, ScalerState, ScalingPolicy, decide  # noqa: E402


class Pod:
    __slots__ = (
        "speed",
        "slots",
        "running",
        "queue",
        "outstanding",
        "area",
        "last",
        "ready",
        "draining",
        "born",
        "gone",
    )

    def __init__(self, speed: float, slots: int, now: float = 0.0) -> None:
        self.speed = speed  # service-time multiplier (slow pods > 1)
        self.slots = slots
        self.running = 0
        self.queue: list = []
        self.outstanding = 0
        self.area = 0.0
        self.last = now
        self.ready = True
        self.draining = False
        self.born = now
        self.gone: float | None = None

    def touch(self, now: float) -> None:
        self.area += self.outstanding * (now - self.last)
        self.last = now


def lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


# -- part 1 -------------------------------------------------------------------------------------


@dataclass
class LBSetup:
    pods: int = 16
    slots: int = 4
    slow_pods: int = 2
    slowdown: float = 3.0
    sigma: float = 0.8
    routers: int = 8
    report_s: float = 1.0  # in mean service times
    requests: int = 40_000
    seed: int = 1


def simulate_lb(policy: str, util: float, s: LBSetup) -> dict:
    rng = random.Random(s.seed)
    pods = [Pod(s.slowdown if i < s.slow_pods else 1.0, s.slots) for i in range(s.pods)]
    capacity = sum(p.slots / p.speed for p in pods)  # requests per mean service time
    rate = util * capacity
    cfg = BalancerConfig(report_half_life_s=s.report_s, report_max_age_s=5 * s.report_s)
    own = [[Backend(f"p{i}") for i in range(s.pods)] for _ in range(s.routers)]
    reports = [0.0] * s.pods
    rr = [rng.randrange(s.pods) for _ in range(s.routers)]
    ev: list = []
    seq = 0
    t = 0.0
    for _ in range(s.requests):
        t += rng.expovariate(rate)
        heapq.heappush(ev, (t, seq, 0, None))
        seq += 1
    next_report = 0.0
    lat: list[float] = []
    n = s.pods

    def two():
        a = rng.randrange(n)
        b = rng.randrange(n - 1)
        return a, b + (b >= a)

    def start(pod: Pod, req, now):
        pod.running += 1
        heapq.heappush(ev, (now + lognormal(rng, pod.speed, s.sigma), next(counter), 1, req))

    counter = iter(range(10**9, 10**12))
    while ev:
        now, _, kind, req = heapq.heappop(ev)
        while now >= next_report:  # all routers get the same snapshot
            for i, p in enumerate(pods):
                reports[i] = p.outstanding
                for r in own:
                    record_report(r[i], p.outstanding, next_report)
            next_report += s.report_s
        if kind == 0:
            router = rng.randrange(s.routers)
            if policy == "round-robin":
                i = rr[router] = (rr[router] + 1) % n
            elif policy == "random":
                i = rng.randrange(n)
            elif policy == "p2c-fresh":
                a, b = two()
                i = a if pods[a].outstanding <= pods[b].outstanding else b
            elif policy == "p2c-stale":
                a, b = two()
                i = (
                    a
                    if reports[a] < reports[b] or (reports[a] == reports[b] and rng.random() < 0.5)
                    else b
                )
            elif policy == "p2c-weighted":
                a, b = two()
                sa, sb = score(own[router][a], now, cfg), score(own[router][b], now, cfg)
                i = a if sa < sb or (sa == sb and rng.random() < 0.5) else b
            elif policy == "jsq":
                m = min(p.outstanding for p in pods)
                i = rng.choice([k for k, p in enumerate(pods) if p.outstanding == m])
            else:
                raise ValueError(policy)
            pod = pods[i]
            pod.touch(now)
            pod.outstanding += 1
            own[router][i].inflight += 1
            r = (now, i, router)
            if pod.running < pod.slots:
                start(pod, r, now)
            else:
                pod.queue.append(r)
        else:
            arrived, i, router = req
            pod = pods[i]
            pod.touch(now)
            pod.outstanding -= 1
            pod.running -= 1
            own[router][i].inflight -= 1
            lat.append(now - arrived)
            if pod.queue:
                start(pod, pod.queue.pop(0), now)
    end = max(p.last for p in pods)
    for p in pods:
        p.touch(end)
    loads = [p.area / end for p in pods]
    mean = sum(loads) / len(loads)
    return {
        "policy": policy,
        "util": util,
        "p50": pct(lat, 50),
        "p99": pct(lat, 99),
        "max_mean_load": max(loads) / mean if mean else 0.0,
    }


# -- part 2 -------------------------------------------------------------------------------------


@dataclass
class ScaleSetup:
    base_rps: float = 20.0
    factor: float = 10.0
    ramp_start: float = 60.0
    ramp_s: float = 60.0
    hold_until: float = 420.0
    end: float = 1200.0
    service_s: float = 0.5
    sigma: float = 0.5
    slots: int = 8
    slo_s: float = 2.0
    seed: int = 2
    #: the mean service time fed to the demand estimate is over this window
    service_window_s: float = 30.0


def rate_at(t: float, s: ScaleSetup) -> float:
    if t < s.ramp_start:
        return s.base_rps
    if t < s.ramp_start + s.ramp_s:
        return s.base_rps * (1 + (s.factor - 1) * (t - s.ramp_start) / s.ramp_s)
    if t < s.hold_until:
        return s.base_rps * s.factor
    return s.base_rps


def simulate_scaling(
    policy: ScalingPolicy, cold_start_s: float, s: ScaleSetup, *, demand_signal: bool = True
) -> dict:
    """``demand_signal``: also pass the measured demand (arrivals in the last second x mean
    service time of the requests completed in the last ``service_window_s``, as routers and
    pods can count them) besides the concurrency."""
    rng = random.Random(s.seed)
    pods: list[Pod] = []
    all_pods: list[Pod] = []

    def add_pod(now: float, ready: bool) -> None:
        p = Pod(1.0, s.slots, now)
        p.ready = ready
        pods.append(p)
        all_pods.append(p)
        if not ready:
            heapq.heappush(ev, (now + cold_start_s, next(counter), 2, p))

    ev: list = []
    counter = iter(range(10**12))
    # thinning for the non-homogeneous Poisson arrivals
    peak = s.base_rps * s.factor
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= s.end:
            break
        if rng.random() < rate_at(t, s) / peak:
            heapq.heappush(ev, (t, next(counter), 0, None))
    for k in range(int(s.end)):
        heapq.heappush(ev, (float(k), next(counter), 3, None))
    start_n = max(policy.min_replicas, math.ceil(s.base_rps * s.service_s / policy.target_per_pod))
    for _ in range(start_n):
        add_pod(0.0, True)
    state = ScalerState()
    lat: list[float] = []
    over = 0
    peak_queue = 0
    history: list[int] = []
    pending: list[tuple[float]] = []  # requests with no ready pod yet
    arrivals = 0  # since the last tick
    served: list[tuple[float, float]] = []  # (completion time, service time), recent

    def start(pod: Pod, arrived: float, now: float):
        pod.running += 1
        svc = lognormal(rng, s.service_s, s.sigma)
        heapq.heappush(ev, (now + svc, next(counter), 1, (arrived, pod, svc)))

    def assign(arrived: float, now: float) -> None:
        live = [p for p in pods if p.ready and not p.draining]
        if not live:
            pending.append((arrived,))
            return
        a, b = rng.choice(live), rng.choice(live)
        p = a if a.outstanding <= b.outstanding else b
        p.touch(now)
        p.outstanding += 1
        if p.running < p.slots:
            start(p, arrived, now)
        else:
            p.queue.append(arrived)

    while ev:
        now, _, kind, data = heapq.heappop(ev)
        if kind == 0:
            arrivals += 1
            assign(now, now)
        elif kind == 1:
            arrived, p, svc = data
            served.append((now, svc))
            p.touch(now)
            p.outstanding -= 1
            p.running -= 1
            d = now - arrived
            lat.append(d)
            over += d > s.slo_s
            if p.queue:
                start(p, p.queue.pop(0), now)
            elif p.draining and p.outstanding == 0:
                p.gone = now
                pods.remove(p)
        elif kind == 2:
            if data.gone is None and not data.draining:
                data.ready = True
                data.last = now
                for (arrived,) in pending:
                    assign(arrived, now)
                pending.clear()
        else:
            queued = sum(len(p.queue) for p in pods) + len(pending)
            peak_queue = max(peak_queue, queued)
            conc = sum(p.outstanding for p in pods) + len(pending)
            live = [p for p in pods if not p.draining]
            ready = sum(1 for p in live if p.ready)
            demand = None
            if demand_signal:
                served = [x for x in served if x[0] > now - s.service_window_s]
                if served:
                    demand = arrivals * sum(v for _, v in served) / len(served)
            arrivals = 0
            obs = Observation(now, float(conc), len(live), ready, len(live) - ready, demand)
            d = decide(policy, state, obs)
            state = d.state
            history.append(d.desired)
            if d.desired > len(live):
                for _ in range(d.desired - len(live)):
                    add_pod(now, False)
            elif d.desired < len(live):
                victims = sorted(live, key=lambda p: (p.ready, p.born), reverse=False)
                for p in victims[: len(live) - d.desired]:
                    p.draining = True
                    if p.outstanding == 0:
                        p.gone = now
                        pods.remove(p)
    pod_s = sum((p.gone if p.gone is not None else s.end) - p.born for p in all_pods)
    moves = [b > a for a, b in zip(history, history[1:], strict=False) if b != a]
    reversals = sum(1 for x, y in zip(moves, moves[1:], strict=False) if x != y)
    need = math.ceil(s.base_rps * s.factor * s.service_s / policy.target_per_pod)
    return {
        "cold_start_s": cold_start_s,
        "requests": len(lat),
        "over_slo": over,
        "over_slo_pct": 100.0 * over / max(1, len(lat)),
        "p99_s": pct(lat, 99),
        "peak_queue": peak_queue,
        "pod_minutes": pod_s / 60.0,
        "max_replicas": max(history),
        "needed_at_peak": need,
        "reversals": reversals,
        "scale_events": len(moves),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer requests (for a smoke run)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = ap.parse_args()
    lb = LBSetup(requests=8_000 if a.quick else 40_000)
    policies = ["round-robin", "random", "p2c-stale", "p2c-weighted", "p2c-fresh", "jsq"]
    rows = []
    for util in (0.5, 0.7, 0.85, 0.95):
        for pol in policies:
            r = simulate_lb(pol, util, lb)
            rows.append(r)
            print(
                f"lb util={util:.2f} {pol:13s} p50={r['p50']:.2f} p99={r['p99']:.2f} max/mean={r['max_mean_load']:.2f}"
            )
    ss = ScaleSetup(end=600.0 if a.quick else 1200.0)
    base = dict(target_per_pod=6.0, min_replicas=1, max_replicas=100)
    scale_policies = {
        "asymmetric (default)": ScalingPolicy(**base),
        "symmetric, no stabilization": ScalingPolicy(
            **base,
            up_window_s=6,
            down_window_s=6,
            stabilization_s=1,
            down_max_pods=100,
            down_max_percent=100,
            down_period_s=1,
        ),
    }
    runs = [(name, pol, True) for name, pol in scale_policies.items()]
    runs.insert(1, ("asymmetric, concurrency only", scale_policies["asymmetric (default)"], False))
    # more headroom over the measured demand: the trade between SLO misses and pod-minutes
    for bf in (3.0, 4.0):
        runs.insert(
            -1, (f"asymmetric, demand cap {bf:g}x", ScalingPolicy(**base, backlog_factor=bf), True)
        )
    srows = []
    for name, pol, with_demand in runs:
        for cold in (5.0, 120.0):
            r = simulate_scaling(pol, cold, ss, demand_signal=with_demand)
            r["policy"] = name
            srows.append(r)
            print(
                f"scale {name:28s} cold={cold:5.0f}s over_slo={r['over_slo_pct']:.2f}% peak_queue={r['peak_queue']} "
                f"pod_min={r['pod_minutes']:.1f} max={r['max_replicas']} reversals={r['reversals']}"
            )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulation.json").write_text(
        json.dumps(
            {"lb": rows, "scaling": srows, "lb_setup": lb.__dict__, "scale_setup": ss.__dict__},
            indent=1,
        )
    )
    lines = [
        "# Simulation results",
        "",
        "Generated by `python benchmarks/serving/simulate.py`.",
        "",
    ]
    lines += [
        f"## Load balancing: {lb.pods} pods x {lb.slots} slots ({lb.slow_pods} pods {lb.slowdown}x slow), "
        f"lognormal service (sigma {lb.sigma}), {lb.routers} routers, reports every {lb.report_s} mean service times, "
        f"{lb.requests} requests per cell. Latency in mean service times.",
        "",
    ]
    lines += ["| util | policy | p50 | p99 | max/mean load |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['util']:.2f} | {r['policy']} | {r['p50']:.2f} | {r['p99']:.2f} | {r['max_mean_load']:.2f} |"
        for r in rows
    ]
    lines += [
        "",
        f"## Autoscaling: {ss.base_rps:g} rps, ramp x{ss.factor:g} over {ss.ramp_s:g} s at t={ss.ramp_start:g} s, "
        f"hold to t={ss.hold_until:g} s, run {ss.end:g} s; service {ss.service_s} s, {ss.slots} slots/pod, "
        f"target 6/pod, SLO {ss.slo_s} s. Rows other than *concurrency only* also pass the measured "
        f"demand (arrivals in the last second x mean service time over {ss.service_window_s:g} s), as "
        "`serving.autoscaler.LoadMeter` measures it live (there the rate is over 2 s), and the up "
        "signal is capped at "
        "`backlog_factor` (default 2x) times it.",
        "",
    ]
    lines += [
        "| policy | cold start | over SLO | p99 (s) | peak queue | pod-minutes | max replicas (need) | reversals |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['policy']} | {r['cold_start_s']:g} s | {r['over_slo_pct']:.2f}% ({r['over_slo']}) | {r['p99_s']:.2f} | {r['peak_queue']} | "
        f"{r['pod_minutes']:.1f} | {r['max_replicas']} ({r['needed_at_peak']}) | {r['reversals']} |"
        for r in srows
    ]
    (out / "simulation.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
