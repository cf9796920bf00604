"""A MODEL, not a measurement: N nodes starting one image at once, direct to the origin, through
a cache tier, or by P2P fan-out, calibrated with per-node figures measured on this machine.

Each node must fetch the image's startup bytes ``B`` and spends ``fixed_seconds`` on its own
work (mount, and the workload's reads from its cache, which overlap little with fetching in the
measurements); it fetches at most at ``node_rate`` bytes/s (what one node reached when nothing
else limited it), times a per-node factor drawn from a log-normal whose spread is the spread
of node times measured in one wave. It is a fluid model in small time steps:

* ``direct``: the origin's egress ``origin_rate`` is shared max-min fairly by the nodes still
  fetching; the origin sends ``N × B``.
* ``tier``: the tier's egress ``tier_rate`` is shared by the nodes; the tier fills from the
  origin once, at ``origin_rate``, and no node gets ahead of what the tier holds (the nodes
  read the same startup sequence); the origin sends ``B × tier_origin_ratio`` (measured: the
  slice rounding). One shared cache (a single nginx, or several that split the slices by key,
  e.g. ``upstream hash $lb_digest$slice_range``); independent caches each cost ``B``. Two
  latencies of the tier that no bandwidth explains are added to every node's time, both
  measured by ``run.py``: the hop (``tier_hop_seconds``: one node through a cold tier against
  one node direct; nginx fetches a slice before it serves it) and, when several nodes start,
  the wait behind the cache lock (``tier_wave_seconds``: several nodes through a cold tier
  against one: a request that finds a slice being filled waits for nginx's next look at the
  lock, which it takes every 500 ms, so each node ends up to one such interval after the
  tier holds its last slice).
* ``p2p`` (Dragonfly-like fan-out): the capacity is the origin's plus the upload
  (``node_rate``) of as many nodes as the swarm holds copies of pieces (4 MiB, Dragonfly's
  default; pieces are handed out in random order, so the copies are spread over the nodes);
  no node gets ahead of what the origin has sent into the swarm; the origin sends ``B``
  once (as Dragonfly's users report).

The tier is sized for the goal: the fewest hosts of 25 Gbit/s whose egress keeps p99 within
1.2x one node's time at 1,000 nodes. Outputs p50/p99 time to ready and origin egress per
node count and strategy, the model against the waves ``run.py`` measured, a table and a chart
(``README.md``, ``results/model.*``). Two calibrations: ``fleet`` (the image and link of
``run.py``, from ``results/real.json``) and ``ml-5g`` (the 5 GB model image of
``benchmarks/coldstart``, from its ``results/latest.json``, with an assumed 10 Gbit/s
registry and 1 Gbit/s nodes as measured there).

    python -m benchmarks.fleet.model [--nodes 100,300,1000,3000,10000]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
# The 5 GB image's cold-start run (its own record: the benchmark's latest.json moves on).
COLDSTART = HERE.parent / "coldstart" / "results" / "2026-12-03-ml-5g.json"
STRATEGIES = ("direct", "tier", "p2p")
GOAL_NODES = 1000
GOAL_P99 = 1.2  # x one node's time
GOAL_EGRESS = 1.1  # x the startup bytes
STEPS = 4000
PIECE = 4 << 20  # a P2P piece
TIER_HOST = 25e9 / 8  # bytes/s of one tier host (25 Gbit/s)


@dataclass(frozen=True)
class Params:
    name: str
    startup_bytes: float  # B, per node
    node_rate: float  # bytes/s a node fetches at when nothing else limits it
    fixed_seconds: float  # mount + the node's own work
    origin_rate: float  # bytes/s the origin (registry) can send
    tier_rate: float  # bytes/s the cache tier can send
    tier_origin_ratio: float  # origin bytes per startup byte through the tier
    spread: float  # log-normal sigma of per-node rates
    source: str  # where the figures come from
    tier_hop_seconds: float = 0.0  # added through the tier, one node
    tier_wave_seconds: float = 0.0  # added through the tier when several nodes start


@dataclass(frozen=True)
class Outcome:
    strategy: str
    nodes: int
    p50: float
    p99: float
    origin_bytes: float


def waterfill(capacity: float, caps: np.ndarray) -> np.ndarray:
    """Max-min fair shares of ``capacity`` among flows each capped at ``caps``."""
    if caps.size == 0 or caps.sum() <= capacity:
        return caps.copy()
    order = np.argsort(caps)
    s = caps[order]
    before = np.concatenate(([0.0], np.cumsum(s)[:-1]))
    level = (capacity - before) / (caps.size - np.arange(caps.size))
    return np.minimum(caps, level[np.argmax(level <= s)])


def horizon(strategy: str, n: int, p: Params) -> float:
    """An upper bound of the last node's time, for the step size."""
    alone = p.startup_bytes / p.node_rate
    if strategy == "direct":
        need = max(alone, n * p.startup_bytes / p.origin_rate)
    elif strategy == "tier":
        need = max(alone, p.startup_bytes / p.origin_rate, n * p.startup_bytes / p.tier_rate)
    else:
        need = max(alone, p.startup_bytes / p.origin_rate) * (2 + np.log2(max(n, 2)))
    return p.fixed_seconds + 2 * need / 0.5  # the slowest node's factor is >= 0.5


def simulate(strategy: str, n: int, p: Params, seed: int = 0) -> Outcome:
    rng = np.random.default_rng(seed)
    factor = np.ones(n) if n == 1 else np.clip(rng.lognormal(0.0, p.spread, n), 0.5, 2.0)
    caps = p.node_rate * factor
    size = p.startup_bytes
    got = np.zeros(n)
    done = np.full(n, np.nan)
    frontier = size if strategy == "direct" else 0.0
    dt = horizon(strategy, n, p) / STEPS
    t = 0.0
    while np.isnan(done).any():
        active = got < size
        if strategy == "direct":
            capacity = p.origin_rate
        elif strategy == "tier":
            capacity = p.tier_rate
        else:
            # a node uploads once it holds a piece; distinct pieces spread, so as many
            # nodes upload as the swarm holds piece copies (up to every node)
            uploaders = min(float(n), float(np.sum(got)) / min(PIECE, size))
            capacity = p.origin_rate + p.node_rate * uploaders
        rates = np.zeros(n)
        rates[active] = waterfill(capacity, caps[active])
        if strategy != "direct":
            frontier = min(size, frontier + p.origin_rate * dt)
        before = got.copy()
        got = np.minimum(np.minimum(got + rates * dt, frontier), size)
        finished = active & (got >= size)
        # the moment within the step it finished, as the rate was constant in it
        need = np.where(finished, size - before, 0.0)
        moved = np.where(finished, got - before, 1.0)
        done[finished] = t + dt * need[finished] / np.maximum(moved[finished], 1e-12)
        t += dt
    ready = done + p.fixed_seconds
    if strategy == "tier":
        ready += p.tier_hop_seconds + (p.tier_wave_seconds if n > 1 else 0.0)
    egress = {
        "direct": n * size,
        "tier": size * p.tier_origin_ratio,
        "p2p": size * p.tier_origin_ratio,
    }[strategy]
    return Outcome(
        strategy, n, float(np.percentile(ready, 50)), float(np.percentile(ready, 99)), egress
    )


def one_node_seconds(p: Params) -> float:
    return simulate("direct", 1, p).p50


def tier_rate_for_goal(p: Params, nodes: int = GOAL_NODES) -> float:
    """The smallest tier egress (bytes/s) with p99 <= GOAL_P99 x one node's time, or
    infinity where no egress does it (the origin's fill, or the tier's own latencies)."""
    goal = GOAL_P99 * one_node_seconds(p)
    low, high = p.origin_rate, p.node_rate * nodes * 2
    if simulate("tier", nodes, replace(p, tier_rate=high)).p99 > goal:
        return float("inf")  # the origin's fill alone is too slow
    for _ in range(30):
        mid = (low * high) ** 0.5
        if simulate("tier", nodes, replace(p, tier_rate=mid)).p99 <= goal:
            high = mid
        else:
            low = mid
        if high / low < 1.01:
            break
    return high


def calibrations(real: Path, coldstart: Path) -> list[Params]:
    out = []
    if real.exists():
        doc = json.loads(real.read_text())
        c = doc["calibration"]
        rate = doc["preset"]["rate_mbit"] * 1e6 / 8
        hop, wave = tier_latencies(doc["waves"])
        out.append(
            Params(
                name="fleet",
                startup_bytes=c["startup_bytes"],
                node_rate=c["node_fetch_rate"],
                fixed_seconds=c["mount_seconds"],
                origin_rate=rate,
                tier_rate=TIER_HOST,  # sized in evaluate()
                tier_origin_ratio=c["tier_origin_ratio"],
                spread=spread(doc["waves"]),
                source=f"{real.name} ({doc['generated']}; origin link {doc['preset']['name']})",
                tier_hop_seconds=hop,
                tier_wave_seconds=wave,
            )
        )
    if coldstart.exists():
        doc = json.loads(coldstart.read_text())
        s = doc["presets"]["1g-1ms"]["scenarios"]
        warm = s["lazy-warm"]["time_to_ready_s"]["median"]
        profile = s["lazy-profile"]["time_to_ready_s"]["median"]
        fetched = s["lazy-profile"]["registry_bytes"]
        fleet = out[0] if out else None
        out.append(
            Params(
                name=doc["image"]["tag"],
                startup_bytes=fetched,
                node_rate=fetched / (profile - warm),
                fixed_seconds=warm,
                origin_rate=10e9 / 8,  # assumed: a registry with 10 Gbit/s of egress
                tier_rate=TIER_HOST,  # sized in evaluate()
                tier_origin_ratio=fleet.tier_origin_ratio if fleet else 1.0,
                spread=fleet.spread if fleet else 0.1,
                tier_hop_seconds=fleet.tier_hop_seconds if fleet else 0.0,
                tier_wave_seconds=fleet.tier_wave_seconds if fleet else 0.0,
                source=f"benchmarks/coldstart {coldstart.name} ({doc['generated']}; lazy-profile "
                "and lazy-warm at 1 Gbit/s; registry egress 10 Gbit/s assumed)",
            )
        )
    return out


def _median_time(waves: list[dict[str, Any]], kind: str, nodes: int) -> float | None:
    """Median over rounds of the median node time of the ``kind`` waves of ``nodes``."""
    times = [float(np.median(w["seconds"])) for w in waves
             if w["wave"].startswith(kind) and w["nodes"] == nodes]  # fmt: skip
    return float(np.median(times)) if times else None


def tier_latencies(waves: list[dict[str, Any]]) -> tuple[float, float]:
    """(hop, wave): a cold tier's time over direct for one node, and several nodes' time
    over one node's through it (the largest wave measured), both at least 0."""
    most = max(w["nodes"] for w in waves)
    direct1 = _median_time(waves, "direct-", 1)
    tier1 = _median_time(waves, "tier-cold-", 1)
    tiern = _median_time(waves, "tier-cold-", most)
    hop = max(0.0, tier1 - direct1) if tier1 is not None and direct1 is not None else 0.0
    wave = max(0.0, tiern - tier1) if tiern is not None and tier1 is not None and most > 1 else 0.0
    return hop, wave


def spread(waves: list[dict[str, Any]]) -> float:
    """Log-normal sigma of node times within one wave of several nodes (median over waves)."""
    sigmas = [
        float(np.std(np.log(w["seconds"])))
        for w in waves
        if w["nodes"] > 1 and w["wave"].startswith("tier-warm")
    ]
    return float(np.median(sigmas)) if sigmas else 0.1


def evaluate(p: Params, counts: list[int], real: dict[str, Any] | None = None) -> dict[str, Any]:
    t1 = one_node_seconds(p)
    need = tier_rate_for_goal(p)
    sized_for = "goal"
    if not np.isfinite(need):
        # Out of reach whatever the egress (the tier's latencies alone): size it for the
        # bandwidth part, which is what more hosts buy.
        need = tier_rate_for_goal(replace(p, tier_hop_seconds=0.0, tier_wave_seconds=0.0))
        sized_for = "bandwidth"
    hosts = int(np.ceil(need / TIER_HOST)) if np.isfinite(need) else 0
    if hosts:
        p = replace(p, tier_rate=hosts * TIER_HOST)
    rows = [asdict(simulate(s, n, p)) for n in counts for s in STRATEGIES]
    at = {r["strategy"]: r for r in rows if r["nodes"] == GOAL_NODES}
    goal = {}
    if "tier" in at:
        tier = at["tier"]
        goal = {
            "p99_ratio": tier["p99"] / t1,
            "egress_ratio": tier["origin_bytes"] / p.startup_bytes,
            "met": tier["p99"] <= GOAL_P99 * t1
            and tier["origin_bytes"] <= GOAL_EGRESS * p.startup_bytes,
        }
    return {
        "params": asdict(p),
        "one_node_seconds": t1,
        "rows": rows,
        "goal_at_1000": goal,
        "tier_rate_for_goal": need,
        "tier_sized_for": sized_for,
        "tier_hosts": hosts,
        "validation": validate(p, real) if real else [],
    }


def validate(p: Params, real: dict[str, Any]) -> list[dict[str, Any]]:
    """The model of each wave ``run.py`` measured (same node count; the tier on this machine
    does not limit), against the measured median node time and registry bytes."""
    out = []
    for kind, strategy in (("direct-", "direct"), ("tier-cold-", "tier")):
        for n in sorted({w["nodes"] for w in real["waves"]}):
            waves = [w for w in real["waves"] if w["wave"].startswith(kind) and w["nodes"] == n]
            if not waves:
                continue
            measured = float(np.median([np.median(w["seconds"]) for w in waves]))
            origin = float(np.median([w["origin_bytes"] for w in waves]))
            m = simulate(strategy, n, replace(p, tier_rate=p.node_rate * n))
            out.append({"strategy": strategy, "nodes": n, "measured_p50": measured,
                        "model_p50": m.p50, "measured_origin_bytes": origin,
                        "model_origin_bytes": m.origin_bytes})  # fmt: skip
    return out


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def markdown(models: list[dict[str, Any]]) -> str:
    lines = ["**A model, not a measurement** (`benchmarks/fleet/model.py`); its inputs were "
             "measured on this machine (2 vCPUs) as listed.", ""]  # fmt: skip
    for m in models:
        p, t1 = m["params"], m["one_node_seconds"]
        lines += [
            f"### {p['name']}: startup bytes {_gb(p['startup_bytes'])}, one node {t1:.2f} s",
            "",
            f"Inputs: node fetch rate {p['node_rate'] / 1e6:,.0f} MB/s, fixed "
            f"{p['fixed_seconds']:.2f} s, origin egress {p['origin_rate'] * 8 / 1e9:g} Gbit/s, "
            f"tier egress {p['tier_rate'] * 8 / 1e9:,.0f} Gbit/s, tier origin bytes per startup "
            f"byte {p['tier_origin_ratio']:.4f}, tier latencies {p['tier_hop_seconds']:.2f} s "
            f"(hop) + {p['tier_wave_seconds']:.2f} s (several nodes: the cache lock), node "
            f"spread sigma {p['spread']:.3f}; from {p['source']}.",
            "",
            "| nodes | strategy | p50 | p99 | p99 / one node | origin egress | x startup bytes |",
            "|---:|---|---:|---:|---:|---:|---:|",
        ]
        for r in m["rows"]:
            lines.append(
                f"| {r['nodes']:,} | {r['strategy']} | {r['p50']:,.1f} s | {r['p99']:,.1f} s | "
                f"{r['p99'] / t1:,.2f} | {_gb(r['origin_bytes'])} | "
                f"{r['origin_bytes'] / p['startup_bytes']:,.2f} |"
            )
        g = m["goal_at_1000"]
        need = m["tier_rate_for_goal"]
        sized = (
            "the fewest that do it"
            if m["tier_sized_for"] == "goal"
            else "the fewest that keep its bandwidth part within the goal; its latencies alone "
            f"({p['tier_hop_seconds'] + p['tier_wave_seconds']:.2f} s) are more than "
            f"{GOAL_P99 - 1:.0%} of one node's time, whatever its egress"
        )
        lines += [
            "",
            f"At 1,000 nodes with the tier ({m['tier_hosts']} hosts of 25 Gbit/s, {sized}; "
            f"it needs {need * 8 / 1e9:,.0f} Gbit/s): p99 {g['p99_ratio']:.2f}x one node, "
            f"origin egress {g['egress_ratio']:.2f}x the startup bytes: goal (<= 1.2x, <= 1.1x) "
            f"{'**met**' if g['met'] else '**not met**'}.",
            "",
        ]
        if m["validation"]:
            lines += [
                "The model against the waves measured here (`results/real.json`; the tier's two "
                "latencies are taken from these waves, so its rows check the arithmetic, the "
                "direct rows the model):",
                "",
                "| nodes | strategy | measured p50 | model p50 | measured origin | model origin |",
                "|---:|---|---:|---:|---:|---:|",
            ]
            for v in m["validation"]:
                lines.append(
                    f"| {v['nodes']} | {v['strategy']} | {v['measured_p50']:.2f} s | "
                    f"{v['model_p50']:.2f} s | {_gb(v['measured_origin_bytes'])} | "
                    f"{_gb(v['model_origin_bytes'])} |"
                )
            lines.append("")
    return "\n".join(lines)


def chart(models: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(models), 2, figsize=(11, 4 * len(models)), squeeze=False)
    for row, m in zip(axes, models, strict=True):
        t1, size = m["one_node_seconds"], m["params"]["startup_bytes"]
        for strategy in STRATEGIES:
            rs = [r for r in m["rows"] if r["strategy"] == strategy]
            n = [r["nodes"] for r in rs]
            row[0].plot(n, [r["p99"] / t1 for r in rs], marker="o", label=strategy)
            row[1].plot(n, [r["origin_bytes"] / size for r in rs], marker="o", label=strategy)
        row[0].axhline(GOAL_P99, color="grey", linestyle="--", linewidth=1, label="goal 1.2x")
        row[1].axhline(GOAL_EGRESS, color="grey", linestyle="--", linewidth=1, label="goal 1.1x")
        for ax, what in ((row[0], "p99 time to ready / one node"),
                         (row[1], "origin egress / startup bytes")):  # fmt: skip
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("nodes starting at once")
            ax.set_ylabel(what)
            ax.set_title(f"{m['params']['name']} (MODEL)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def with_latest(readme: str, table: str) -> str:
    start, end = "<!-- model: start -->", "<!-- model: end -->"
    head, _, rest = readme.partition(start)
    _, _, tail = rest.partition(end)
    return f"{head}{start}\n{table}\n{end}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="100,300,1000,3000,10000")
    parser.add_argument("--real", type=Path, default=RESULTS / "real.json")
    parser.add_argument("--coldstart", type=Path, default=COLDSTART)
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.nodes.split(",")]
    real = json.loads(args.real.read_text()) if args.real.exists() else None
    models = [
        evaluate(p, counts, real if p.name == "fleet" else None)
        for p in calibrations(args.real, args.coldstart)
    ]
    if not models:
        print("no calibration: run benchmarks.fleet.run first", file=sys.stderr)
        return 1
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "model.json").write_text(json.dumps(models, indent=2) + "\n")
    table = markdown(models)
    (RESULTS / "model.md").write_text(table + "\n")
    chart(models, RESULTS / "model.png")
    readme = HERE / "README.md"
    if readme.exists():
        readme.write_text(with_latest(readme.read_text(), table))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
