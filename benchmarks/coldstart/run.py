"""Cold-start benchmark: time until an ML container is ready, pulled over a shaped network.

One command (as root) builds or reuses the image, starts the "remote" registry host, and
compares, per network preset, from an empty cache every time (``drop_caches`` before each run):

    full-pull     containerd 1.6, default overlayfs snapshotter: the image pulled (fetch +
                  unpack of every layer) then run
    lazy          lazyblock, cold (empty node cache), image laid out without a profile,
                  the snapshotter's default settings
    lazy-profile  lazyblock, cold, image re-laid with ``imagetool convert --profile`` (the
                  profile recorded by ``snapshotter profile`` during a lazy run), prefetch on
    lazy-warm     lazyblock with the node's sector cache warm (page cache still dropped)
    lazy-foreign  lazyblock, cold, image laid out with a profile recorded on *another* image
                  (``--foreign-profile FILE``; not in the default set): a stale or foreign
                  profile must not make a start slower than none
    lazy-resident a second container of an image the node has pulled and still mounts (a
                  pod restarted, or another replica on the node): the image pulled and run
                  once untimed, its container gone, the page cache dropped, then run again;
                  with ``--set mount.local_copy=true`` the run waits (untimed) for the mount's
                  local copy first (``--via cri`` only; not in the default set)
    local         the image already unpacked by containerd: the floor

How the node pulls and runs (``--via``, ``node.py``):

    cri (default)  what a Kubernetes node does: containerd's CRI plugin pulls
                   (``runtime.v1.ImageService/PullImage``, kubelet's call) into overlayfs for
                   full-pull/local, and into the lazyblock proxy snapshotter (``snapshotter
                   serve``) for the lazy scenarios, whose Prepare of the image's index layer
                   mounts it lazily (FUSE + erofs, metadata first) inside the pull; then
                   ``ctr run`` with that snapshotter starts the container on the pulled
                   snapshots. Each lazy run starts from an empty node: containerd, the daemon
                   and its mounts restarted with no images or snapshots (untimed).
    ctr            the earlier path: ``ctr image pull`` for full-pull/local; ``snapshotter
                   mount`` + ``ctr run --rootfs`` over an overlay for the lazy ones (the same
                   kernel data path without the proxy plugin: containerd 1.6's ``ctr image
                   pull`` passes no layer labels, see ``snapshotter/remote.py``).

Ready = the workload printed its ``READY`` line (``image.py``: imported torch and loaded every
weight shard), or, for the ``vllm`` image (the runtime's vLLM server, CPU backend, in the
host's network namespace), the first completion the benchmark asks for over HTTP from the
host was answered. Measured per run: seconds from the first action (pull / mount / run) to
ready, bytes from the registry (its access log: response bodies; and the host veth's
rx_bytes: on the wire), and the bytes the workload read (its own ``/proc/self/io``; for
the server, summed over the container's processes when the answer came).

    python benchmarks/coldstart/run.py                        # ml image, 1g-1ms, 3 runs
    python benchmarks/coldstart/run.py --preset 1g-1ms --preset 200m-20ms --size 6GiB
    python benchmarks/coldstart/run.py --kind vllm            # the vLLM server
    python benchmarks/coldstart/run.py --smoke                # CI: tiny image, no shaping

Writes ``results/latest.json``, ``results/latest.md`` and ``results/latest.png``, keeping
the results already there for the other images and presets (``merge_earlier``; ``--fresh``
drops them). ``--prepare-only`` does the untimed preparation alone (build, push, convert,
profile), so that a timed run under the benchmark lock only measures.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import http.client
import importlib.util
import json
import logging
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import proccpu  # noqa: E402
from benchmarks.coldstart import image as images  # noqa: E402
from benchmarks.coldstart import netns  # noqa: E402
from benchmarks.coldstart.node import (  # noqa: E402
    BenchError,
    Containerd,
    LazyNode,
    repo_env,
    umount_all_under,
)
from benchmarks.coldstart.node import run_cmd as _run  # noqa: E402

log = logging.getLogger("coldstart")

SCENARIOS = ("full-pull", "lazy", "lazy-profile", "lazy-warm", "local", "lazy-foreign",
             "lazy-resident")  # fmt: skip
DEFAULT_SCENARIOS = ("full-pull", "lazy", "lazy-profile", "lazy-warm", "local")
LAZY_SCENARIOS = ("lazy", "lazy-profile", "lazy-warm", "lazy-foreign", "lazy-resident")
# The image tag each lazy scenario runs (after the image's own tag).
LAZY_TAG_SUFFIX = {"lazy": "", "lazy-profile": "-profile", "lazy-warm": "-profile",
                   "lazy-foreign": "-foreign", "lazy-resident": "-profile"}  # fmt: skip
# How long lazy-resident waits for the mount's local copy (mount.local_copy) to be made.
LOCAL_COPY_WAIT_S = 600.0
VIAS = ("cri", "ctr")  # how the node pulls and runs: see the module docstring
# The targets, checked on the preset they name.
TARGET_PRESET = "1g-1ms"
TARGET_SPEEDUP = 5.0  # lazy-profile at most 1/5 of full-pull
TARGET_FLOOR_S = 2.0  # ... and within 2 s of local
TARGET_AMPLIFICATION = 1.5  # registry bytes at most 1.5x the bytes the workload reads
WORKLOAD_KEYS = ("processes", "completion")  # a server's, kept with its run


@dataclass(frozen=True)
class BenchConfig:
    kind: str = "ml"
    size: int | None = None
    presets: tuple[str, ...] = ("1g-1ms",)
    scenarios: tuple[str, ...] = DEFAULT_SCENARIOS
    runs: int = 3
    work: Path = HERE / "work"
    out: Path = HERE / "results"
    run_timeout: float = 900.0
    drop_caches: bool = True  # off only for the CI smoke test, which checks plumbing, not speed
    via: str = "cri"  # "cri": kubelet's path (CRI pull; proxy snapshotter); "ctr": see docstring
    net: netns.NetConfig = field(default_factory=netns.NetConfig)
    # keep what out/latest.json holds for other images and presets (see merge_earlier)
    keep_earlier: bool = True
    prepare_only: bool = False  # build, push, convert, record the profile; measure nothing
    settings: tuple[str, ...] = ()  # the daemon's --set KEY=VALUE (--via cri)
    format_version: str = "2"  # the block format the lazy scenarios' images are converted to
    foreign_profile: Path | None = None  # lazy-foreign: a profile recorded on another image


# --- pure parts --------------------------------------------------------------------------------


def start_role(pid: int, snap: proccpu.Snapshot) -> str:
    """What process ``pid`` of ``snap`` is to a start: ``workload`` (the container's
    processes: under a containerd shim), ``mount_server`` (lazyblock's, for the image),
    ``lazyblock`` (its daemon, fork server, holders), ``registry``, ``containerd`` (with the
    shims, runc and ctr), ``kernel`` (its threads: softirqs, block I/O, the page cache) or
    ``other`` (this benchmark among them)."""
    p = snap.processes[pid]
    if pid == 2 or p.ppid == 2:
        return "kernel"
    if p.comm == "docker-registry":
        return "registry"
    ancestor, hops = snap.processes.get(p.ppid), 0
    while ancestor is not None and hops < 32:
        if ancestor.comm.startswith("containerd-shim"):
            return "workload"
        ancestor, hops = snap.processes.get(ancestor.ppid), hops + 1
    if p.comm.startswith("containerd") or p.comm in ("runc", "ctr"):
        return "containerd"
    if p.comm == "lazyblock-mount":
        return "mount_server"
    if p.comm.startswith("lazyblock"):
        return "lazyblock"
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "other"
    if b"snapshotter.mount.server" in cmdline:
        return "mount_server"
    return "lazyblock" if b"snapshotter" in cmdline else "other"


def parse_ready(line: str) -> dict[str, str] | None:
    """``READY k=v k=v`` -> {k: v}; None if the line is not a READY line."""
    parts = line.strip().split()
    if not parts or parts[0] != "READY":
        return None
    out = {}
    for p in parts[1:]:
        k, eq, v = p.partition("=")
        if eq:
            out[k] = v
    return out


def parse_proc_io(text: str) -> dict[str, int]:
    """``/proc/PID/io`` (``key: value`` lines) -> {key: int}."""
    out = {}
    for line in text.splitlines():
        k, sep, v = line.partition(":")
        if sep and v.strip().isdigit():
            out[k.strip()] = int(v)
    return out


def io_of(pids: Sequence[int]) -> dict[str, int]:
    """``read_bytes`` and ``rchar`` summed over ``pids`` (those still there). A process's
    counters include its reaped children's, so the live processes of a container cover what
    its exited ones read too."""
    total = {"read_bytes": 0, "rchar": 0, "processes": 0}
    for pid in pids:
        try:
            io = parse_proc_io(Path(f"/proc/{pid}/io").read_text())
        except OSError:  # exited meanwhile
            continue
        total["read_bytes"] += io.get("read_bytes", 0)
        total["rchar"] += io.get("rchar", 0)
        total["processes"] += 1
    return total


def completion_text(body: bytes) -> str | None:
    """The text of an OpenAI completions answer, None if ``body`` is not one."""
    try:
        doc = json.loads(body)
        return str(doc["choices"][0]["text"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


@dataclass(frozen=True)
class CompletionProbe:
    """One completion request to an OpenAI-compatible server (the readiness check of a
    serving workload: answered, not merely healthy)."""

    url: str  # base URL, e.g. http://127.0.0.1:18431
    model: str = images.VLLM_MODEL_NAME
    prompt: str = "Correct the grammar: She go to school every day.\nCorrected:"
    max_tokens: int = 4
    timeout_s: float = 60.0

    def body(self) -> bytes:
        return json.dumps({"model": self.model, "prompt": self.prompt,
                           "max_tokens": self.max_tokens, "temperature": 0.0}).encode()  # fmt: skip

    def ask(self) -> tuple[str, str | None]:
        """("refused" | "error" | "answered", the completion text when answered)."""
        req = urllib.request.Request(f"{self.url}/v1/completions", data=self.body(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                text = completion_text(resp.read())
                return ("answered", text) if text is not None else ("error", None)
        except urllib.error.HTTPError:  # the front is up; the engine not yet (502)
            return "error", None
        except (OSError, http.client.HTTPException):
            return "refused", None


def summarize(values: Sequence[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def _median_int(values: Sequence[int | None]) -> int | None:
    vals = [v for v in values if v is not None]
    return int(statistics.median(vals)) if vals else None


def summarize_runs(runs: list[dict[str, Any]], image_bytes: int) -> dict[str, Any]:
    """A scenario's runs -> the numbers the report shows (medians for the byte counts)."""
    return {
        "status": "ok",
        "runs": runs,
        "time_to_ready_s": summarize([r["seconds"] for r in runs]),
        "registry_bytes": _median_int([r["registry_bytes"] for r in runs]),
        "wire_bytes": _median_int([r["wire_bytes"] for r in runs]),
        "workload_read_bytes": _median_int([r.get("read_bytes") for r in runs]),
        "image_bytes": image_bytes,
        **({"cpu_s": cpu} if (cpu := median_cpu(runs)) else {}),
    }


# The columns of the report's CPU table, in order: the machine's, then by process.
CPU_COLUMNS = (
    ("busy", "busy"),
    ("idle", "idle"),
    ("steal", "stolen by the host"),
    ("workload", "workload"),
    ("mount_server", "mount server"),
    ("registry", "registry"),
    ("kernel", "kernel threads"),
    ("containerd", "containerd"),
    ("lazyblock", "lazyblock daemon"),
    ("other", "other"),
    ("unaccounted", "unaccounted"),
)


def median_cpu(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per key of the runs' ``cpu_s``, the median over the runs that measured it (a process
    kind a run did not see counts 0 in it)."""
    measured = [r["cpu_s"] for r in runs if r.get("cpu_s")]
    keys = {k for c in measured for k in c}
    return {k: round(statistics.median(c.get(k, 0.0) for c in measured), 3) for k in sorted(keys)}


def cpu_table(scenarios: dict[str, Any], cpus: int) -> list[str]:
    """The report's table of CPU-seconds spent during each scenario's start (medians), and
    the share of the machine that stayed idle: near 0, the start was bound by CPU, not by
    the link; the processes' columns say whose."""
    rows = [
        (name, s["cpu_s"], s["time_to_ready_s"]["median"])
        for name, s in scenarios.items()
        if s.get("status") == "ok" and s.get("cpu_s")
    ]
    if not rows:
        return []
    head = " | ".join(title for _, title in CPU_COLUMNS)
    lines = [
        f"CPU-seconds from the first action to ready (medians; {cpus} CPUs):",
        "",
        f"| scenario | {head} | idle share |",
        "|---|" + "---:|" * (len(CPU_COLUMNS) + 1),
    ]
    for name, cpu, seconds in rows:
        cells = " | ".join(f"{cpu.get(k, 0.0):.2f}" for k, _ in CPU_COLUMNS)
        share = cpu.get("idle", 0.0) / (cpus * seconds) if seconds > 0 else 0.0
        lines.append(f"| {name} | {cells} | {share:.0%} |")
    return lines + [""]


def evaluate_targets(scenarios: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's three targets for one preset's results; ``met`` is None when a needed
    scenario did not run (with the reason)."""

    def ok(name: str) -> dict[str, Any] | None:
        s = scenarios.get(name)
        return s if s and s.get("status") == "ok" else None

    def missing(*names: str) -> str:
        why = [f"{n}: {scenarios.get(n, {}).get('reason', 'not run')}" for n in names if not ok(n)]
        return "not evaluated (" + "; ".join(why) + ")"

    out = []
    lp, fp, lo = ok("lazy-profile"), ok("full-pull"), ok("local")
    # With more than one round, "met" also needs the median of the per-round (paired) values
    # to meet the target: medians of separate scenarios may come from rounds of different
    # load on a shared machine.
    t = "lazy-profile time to ready <= full-pull / 5"
    if lp and fp:
        a, b = lp["time_to_ready_s"]["median"], fp["time_to_ready_s"]["median"]
        met = a <= b / TARGET_SPEEDUP
        text = f"{a:.2f}s vs {b:.2f}s: {b / a:.1f}x faster"
        rounds = paired_by_round(scenarios, "full-pull", "lazy-profile", lambda x, y: x / y)
        if len(rounds) > 1:
            med = statistics.median(rounds)
            met = met and med >= TARGET_SPEEDUP
            each = ", ".join(f"{v:.1f}x" for v in rounds)
            text += f"; paired by round {med:.1f}x ({each})"
        out.append({"target": t, "met": met, "measured": text})
    else:
        out.append({"target": t, "met": None, "measured": missing("lazy-profile", "full-pull")})
    t = "lazy-profile time to ready within 2 s of local"
    if lp and lo:
        a, b = lp["time_to_ready_s"]["median"], lo["time_to_ready_s"]["median"]
        met = a - b <= TARGET_FLOOR_S
        text = f"{a:.2f}s vs {b:.2f}s: +{a - b:.2f}s"
        rounds = paired_by_round(scenarios, "lazy-profile", "local", lambda x, y: x - y)
        if len(rounds) > 1:
            med = statistics.median(rounds)
            met = met and med <= TARGET_FLOOR_S
            each = ", ".join(f"{v:+.2f}s" for v in rounds)
            text += f"; paired by round {med:+.2f}s ({each})"
        out.append({"target": t, "met": met, "measured": text})
    else:
        out.append({"target": t, "met": None, "measured": missing("lazy-profile", "local")})
    t = "lazy-profile registry bytes <= 1.5x bytes the workload reads (local, cold)"
    if lp and lo and lo.get("workload_read_bytes"):
        a, b = lp["registry_bytes"], lo["workload_read_bytes"]
        out.append({"target": t, "met": a <= TARGET_AMPLIFICATION * b,
                    "measured": f"{_mb(a)} vs {_mb(b)}: {a / b:.2f}x"})  # fmt: skip
    else:
        out.append({"target": t, "met": None, "measured": missing("lazy-profile", "local")})
    return out


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f} MB"


ENTRY_KEYS = ("generated", "host", "image", "runs", "via", "block_format", "settings",
              "caches_dropped", "presets")  # fmt: skip


def image_entries(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every image's results in ``results``: this run's and those kept from earlier runs
    (``other_images``, see ``merge_earlier``), smallest image first."""
    entries = [{k: results[k] for k in ENTRY_KEYS if k in results}]
    entries += results.get("other_images") or []
    return sorted(entries, key=lambda e: e["image"]["compressed_bytes"])


# how a preset's results came about
RUN_KEYS = ("generated", "runs", "via", "block_format", "settings", "caches_dropped")


def merge_earlier(results: dict[str, Any], earlier: dict[str, Any]) -> dict[str, Any]:
    """``results`` with an earlier ``latest.json``'s kept, per image and preset: other images
    go to ``other_images``; this image's presets that this run did not measure stay, each
    stamped with how its own run came about (``RUN_KEYS``), unless the image itself changed
    (another manifest digest). What this run measured replaces the earlier results."""
    tag = results["image"]["tag"]
    others, same = [], None
    for e in image_entries(earlier):
        if e["image"]["tag"] != tag:
            others.append(e)
        elif e["image"].get("manifest_digest") == results["image"].get("manifest_digest"):
            same = e
    presets = dict(results["presets"])
    for name, pr in (same or {}).get("presets", {}).items():
        if name not in presets:
            presets[name] = {**{k: same[k] for k in RUN_KEYS if k in same}, **pr}
    return {**results, "presets": presets, "other_images": others}


def markdown_table(results: dict[str, Any]) -> str:
    """The report: per image, one table per preset, then the targets."""
    entries = image_entries(results)
    return "\n".join(_image_section(e, len(entries) > 1) for e in entries)


READY_SERVED = (
    "Workload: the runtime's vLLM server (`runtime serve --device cpu`: front + vLLM's CPU "
    "backend); ready: the first completion asked over HTTP from the host answered. Read by "
    "workload: summed over the container's processes at that moment."
)


def _runs_per_scenario(runs: int) -> str:
    return f"{runs} run{'s' if runs != 1 else ''} per scenario"


def _run_text(entry: dict[str, Any]) -> str:
    """How a run came about, in words: when, how many rounds, the node path."""
    parts = [f"{entry['generated']}"] if entry.get("generated") else []
    if "runs" in entry:
        parts.append(_runs_per_scenario(entry["runs"]))
    if entry.get("via"):
        parts.append(f"`--via {entry['via']}`")
    if entry.get("settings"):
        parts.append("daemon settings " + ", ".join(f"`{kv}`" for kv in entry["settings"]))
    if entry.get("caches_dropped") is False:
        parts.append("page cache NOT dropped")
    return ", ".join(parts)


def _image_section(results: dict[str, Any], name_image: bool) -> str:
    img = results["image"]
    served = img.get("kind") == "vllm"
    lines = [
        f"Image `{img['tag']}`: {_mb(img['compressed_bytes'])} compressed "
        f"({img['layers']} layers), {_mb(img['rootfs_bytes'])} unpacked, "
        + f"{'model' if served else 'weights'} {_mb(img['weights_bytes'])}. "
        + (READY_SERVED + " " if served else "")
        + _runs_per_scenario(results["runs"])
        + (" (interleaved)" if results["runs"] > 1 else "")
        + ", "
        + (
            "page cache dropped before each."
            if results.get("caches_dropped", True)
            else "page cache NOT dropped (smoke test)."
        )
        + (f" Node path: `--via {results['via']}`." if results.get("via") else "")
        + (
            " Daemon settings: " + ", ".join(f"`{kv}`" for kv in results["settings"]) + "."
            if results.get("settings")
            else ""
        ),
        "",
    ]
    for name, pr in results["presets"].items():
        p = pr["preset"]
        rate = f"{p['rate_mbit']:g} Mbit/s" if p["rate_mbit"] else "unlimited"
        rtt = f"{p['rtt_ms']:g} ms RTT" if p["rtt_ms"] else "no added delay"
        meas = pr.get("measured_rtt_ms")
        measured = f" (measured TCP connect {meas:.2f} ms)" if meas is not None else ""
        title = f"{img['tag']}, {name}" if name_image else name
        lines.append(f"### {title}: {rate}, {rtt}{measured}")
        lines.append("")
        own = {k: pr[k] for k in RUN_KEYS if k in pr and pr[k] != results.get(k)}
        if own:  # kept from an earlier run than the image's header describes
            lines += [f"Measured by an earlier run: {_run_text(pr)}.", ""]
        runs = pr.get("runs", results["runs"])
        if pr.get("rounds", runs) < runs:
            lines += [f"**Partial: {pr['rounds']} of {runs} rounds so far.**", ""]
        floor = pr.get("floor")
        lines += [
            "| scenario | time to ready (median) | min | max | from registry | read by workload "
            "| ÷ floor | stalled: late / missing |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for scen, s in pr["scenarios"].items():
            if s.get("status") != "ok":
                lines.append(f"| {scen} | not run: {s.get('reason', '')} | | | | | | |")
                continue
            t = s["time_to_ready_s"]
            ratio = f"{t['median'] / floor['seconds']:.2f}" if floor else "-"
            stall = stall_seconds(s)
            stalled = f"{stall[0]:.2f} / {stall[1]:.2f} s" if stall else "-"
            lines.append(
                f"| {scen} | {t['median']:.2f} s | {t['min']:.2f} s | {t['max']:.2f} s "
                f"| {_mb(s['registry_bytes'])} | {_mb(s['workload_read_bytes'])} "
                f"| {ratio} | {stalled} |"
            )
        lines.append("")
        lines += cpu_table(
            pr["scenarios"], results.get("host", {}).get("cpus") or os.cpu_count() or 1
        )
        if floor:
            rate = floor["rate_bytes_per_s"]
            lines += [
                f"Floor {floor['seconds']:.2f} s = max(local {floor['local_s']:.2f} s, "
                f"{_mb(floor['fetched_bytes'])} needed ÷ {rate * 8 / 1e6:,.0f} Mbit/s = "
                f"{floor['transfer_s']:.2f} s) + {FLOOR_SLACK_S:g} s; the link rate is the "
                f"store's, measured in this run ({pr['store_rate']['connections']} connections, "
                f"{_mb(pr['store_rate']['bytes'])} of ranged reads).",
                "",
            ]
        if pr.get("floor_targets"):
            lines += ["| against the floor | met | measured |", "|---|---|---|"]
            for t in pr["floor_targets"]:
                met = {True: "yes", False: "**no**", None: "-"}[t["met"]]
                lines.append(f"| {t['target']} | {met} | {t['measured']} |")
            lines.append("")
        if pr.get("targets"):
            lines.append("| target | met | measured |")
            lines.append("|---|---|---|")
            for t in pr["targets"]:
                met = {True: "yes", False: "**no**", None: "-"}[t["met"]]
                lines.append(f"| {t['target']} | {met} | {t['measured']} |")
            lines.append("")
        for note in pr.get("notes", []):
            lines.append(f"- {note}")
        if pr.get("notes"):
            lines.append("")
    return "\n".join(lines)


def write_chart(results: dict[str, Any], path: Path) -> None:
    """Grouped bars: median time to ready per scenario, one group per image and preset;
    min-max as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = image_entries(results)
    groups = [(e, name) for e in entries for name in e["presets"]]
    scens = [s for s in SCENARIOS if any(s in e["presets"][n]["scenarios"] for e, n in groups)]
    fig, ax = plt.subplots(figsize=(2.2 + 2.2 * len(groups), 4))
    width = 0.8 / max(1, len(scens))
    for i, scen in enumerate(scens):
        xs, ys, lo, hi = [], [], [], []
        for j, (e, pname) in enumerate(groups):
            s = e["presets"][pname]["scenarios"].get(scen, {})
            if s.get("status") != "ok":
                continue
            t = s["time_to_ready_s"]
            xs.append(j + (i - (len(scens) - 1) / 2) * width)
            ys.append(t["median"])
            lo.append(t["median"] - t["min"])
            hi.append(t["max"] - t["median"])
        if xs:
            bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=scen)
            ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=2)
    labels = [f"{e['image']['tag']}\n{n}" if len(entries) > 1 else n for e, n in groups]
    ax.set_xticks(range(len(groups)), labels)
    ax.set_ylabel("time to ready, s (median; min-max)")
    tags = ", ".join(e["image"]["tag"] for e in entries)
    ax.set_title(f"Cold start of {tags}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


README_BEGIN = "<!-- latest:begin (written by run.py) -->"
README_END = "<!-- latest:end -->"


def with_latest(readme: str, table: str) -> str:
    """``readme`` with the text between the latest-results markers replaced by ``table``."""
    start, end = readme.find(README_BEGIN), readme.find(README_END)
    if start < 0 or end < start:
        raise BenchError("README has no latest-results markers")
    chart = "![time to ready](results/latest.png)\n\n"
    return readme[: start + len(README_BEGIN)] + "\n" + chart + table + "\n" + readme[end:]


def write_results(results: dict[str, Any], out: Path, readme: Path | None = None) -> None:
    """latest.json, latest.md and latest.png in ``out``; the table into ``readme`` too."""
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(results)
    (out / "latest.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "latest.md").write_text(table + "\n")
    write_chart(results, out / "latest.png")
    if readme is not None:
        readme.write_text(with_latest(readme.read_text(), table))


# --- host helpers ------------------------------------------------------------------------------


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


@dataclass(frozen=True)
class Ready:
    """A workload that printed its READY line."""

    at: float  # perf_counter when the line (or the answer) arrived
    fields: dict[str, str]
    exit_code: int  # of the run command, which is waited for after READY (not timed)
    output: str
    marks: dict[str, float] = field(default_factory=dict)  # name -> perf_counter on the way
    cpu: proccpu.Snapshot | None = None  # the machine's CPU time when ready


def run_until_ready(cmd: list[str], timeout: float) -> Ready:
    """Start ``cmd`` and wait for its READY line, then for it to exit. An exit status other
    than 0 after READY (e.g. ``ctr run --rm`` failing to remove the container) does not undo
    the readiness: it is returned, logged, and reported with the run."""
    import queue
    import threading

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    # (when, the line, its READY fields, the CPU time as a READY line came)
    Line = tuple[float, str | None, dict[str, str] | None, proccpu.Snapshot | None]
    lines: queue.Queue[Line] = queue.Queue()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            at = time.perf_counter()
            fields = parse_ready(line)
            # the CPU time while the workload that printed READY still runs
            lines.put((at, line, fields, proccpu.snapshot() if fields is not None else None))
        lines.put((time.perf_counter(), None, None, None))

    reading = threading.Thread(target=reader, daemon=True)
    reading.start()
    output: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                at, line, fields, cpu = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                tail = "".join(output)[-2000:]
                raise BenchError(f"no READY within {timeout:.0f}s: {tail}") from None
            if line is None:
                proc.wait()
                raise BenchError(f"exited ({proc.returncode}) before READY: "
                                 f"{''.join(output)[-2000:]}")  # fmt: skip
            output.append(line)
            if fields is not None:
                break
        proc.wait(120)
        reading.join(10)
        while not lines.empty():
            rest = lines.get()[1]
            if rest is not None:
                output.append(rest)
        if proc.returncode != 0:
            log.warning("%s exited with %d after READY: %s", " ".join(cmd[:6]), proc.returncode,
                        "".join(output)[-1000:].strip())  # fmt: skip
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return Ready(at, fields, proc.returncode, "".join(output), cpu=cpu)


def run_until_served(
    cmd: list[str],
    timeout: float,
    probe: CompletionProbe,
    pids: Callable[[], list[int]],
    stop: Callable[[], None],
    interval: float = 0.2,
    log_path: Path | None = None,
) -> Ready:
    """Start ``cmd`` (a server's ``ctr run --rm``), ask ``probe`` every ``interval`` until a
    completion is answered; then read the container's I/O counters (``pids``), ``stop`` it
    (SIGKILL: not timed) and wait for ``cmd`` to exit. Marks: ``front`` when the server
    first answered anything (before its engine was up). The server's whole output goes to
    ``log_path`` (named in errors); errors quote its tail."""
    import threading

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    output: list[str] = []

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)

    reading = threading.Thread(target=reader, daemon=True)
    reading.start()
    marks: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                reading.join(10)
                raise BenchError(f"exited ({proc.returncode}) before answering: "
                                 f"{_tail(output, log_path)}")  # fmt: skip
            state, text = probe.ask()
            at = time.perf_counter()
            if state != "refused":
                marks.setdefault("front", at)
            if state == "answered":
                cpu = proccpu.snapshot()
                break
            if time.monotonic() > deadline:
                raise BenchError(f"no completion answered within {timeout:.0f}s: "
                                 f"{_tail(output, log_path)}")  # fmt: skip
            time.sleep(interval)
        fields = {k: str(v) for k, v in io_of(pids()).items()}
        fields["completion"] = json.dumps(text)
    finally:
        if proc.poll() is None:
            stop()
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reading.join(10)
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_path.write_text("".join(output))
    # killed after the answer, as intended: SIGKILL (ctr run reports it as 137) is the end
    killed = (0, -signal.SIGKILL, 128 + signal.SIGKILL)
    code = 0 if proc.returncode in killed else proc.returncode
    if code:
        log.warning("%s exited with %d after the answer: %s", " ".join(cmd[:6]), code,
                    "".join(output)[-1000:].strip())  # fmt: skip
    return Ready(at, fields, code, "".join(output), marks, cpu)


def _tail(output: list[str], log_path: Path | None, n: int = 2000) -> str:
    """The end of a server's output without the front's retry warnings (it logs one per
    request while its engine starts), and where the whole of it is."""
    lines = [x for x in output if "engine unreachable" not in x]
    where = f" (whole output: {log_path})" if log_path is not None else ""
    return "".join(lines)[-n:] + where


def port_in_use(host: str, port: int) -> bool:
    """Does anything accept connections on ``host:port``?"""
    import socket

    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


class Lazyblock:
    """The snapshotter's and imagetool's CLIs, as the benchmark uses them."""

    def __init__(self, work: Path, registry: str, format_version: str = "2") -> None:
        self.dir = work / "lazy"
        self.cache = self.dir / "cache"
        self.state = self.dir / "state"
        self.registry = registry
        # Images of another block format go to another repository, stamped apart.
        self.format_version = format_version
        self.repository = "lazybench/block" + ("" if format_version == "2" else "-v1")

    @staticmethod
    def unavailable() -> str | None:
        """Why the lazy scenarios cannot run here, or None."""
        for mod in ("snapshotter.cli", "snapshotter.mount.api"):
            if importlib.util.find_spec(mod) is None:
                return f"{mod} is not there yet"
        if not Path("/dev/fuse").exists():
            return "needs /dev/fuse"
        return None

    def ref(self, tag: str) -> str:
        return f"docker://{self.registry}/{self.repository}:{tag}"

    def _snap(self, *args: str, timeout: float = 600) -> str:
        return _run(sys.executable, "-m", "snapshotter.cli", *args, timeout=timeout, cwd=REPO,
                    env=repo_env())  # fmt: skip

    def _common(self) -> list[str]:
        return ["--cache-dir", str(self.cache), "--state-dir", str(self.state),
                "--set", "store.plain_http=true"]  # fmt: skip

    def up_to_date(self, tag: str, source_digest: str) -> bool:
        """Is ``tag`` in the registry, converted from the image with ``source_digest``?"""
        stamps = self._stamps()
        return (
            stamps.get(tag) == source_digest
            and registry_digest(self.registry, self.repository, tag) is not None
        )

    def _stamps(self) -> dict[str, str]:
        path = self.dir / self._stamps_name
        return json.loads(path.read_text()) if path.exists() else {}

    def _stamp(self, tag: str, source_digest: str) -> None:
        stamps = self._stamps()
        stamps[tag] = source_digest
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / self._stamps_name).write_text(json.dumps(stamps, indent=2))

    @property
    def _stamps_name(self) -> str:
        return "converted.json" if self.format_version == "2" else "converted-v1.json"

    def convert(
        self, source: str, source_digest: str, tag: str, profile: Path | None = None
    ) -> None:
        args = ["--plain-http", "convert", "-q", "--format-version", self.format_version,
                source, self.ref(tag)]  # fmt: skip
        if profile is not None:
            args += ["--profile", str(profile)]
        _run(sys.executable, "-m", "imagetool.cli", *args, timeout=3600, cwd=REPO, env=repo_env())
        self._stamp(tag, source_digest)

    def clear_cache(self) -> None:
        shutil.rmtree(self.cache, ignore_errors=True)

    def mount(self, tag: str, mountpoint: Path, prefetch: bool) -> str:
        mountpoint.mkdir(parents=True, exist_ok=True)
        flag = "--prefetch" if prefetch else "--no-prefetch"
        return self._snap("mount", self.ref(tag), str(mountpoint), flag, *self._common())

    def stats(self, mountpoint: Path) -> dict[str, Any]:
        doc = json.loads(self._snap("status", str(mountpoint), "--json", *self._common()))
        mounts = doc.get("mounts") or []
        return mounts[0].get("stats", {}) if mounts else {}

    def profile(self, mountpoint: Path, out: Path) -> None:
        self._snap("profile", str(mountpoint), "-o", str(out), *self._common())

    def umount(self, mountpoint: Path) -> None:
        cmd = [sys.executable, "-m", "snapshotter.cli", "umount", str(mountpoint), *self._common()]
        subprocess.run(cmd, capture_output=True, cwd=REPO, env=repo_env())


@contextlib.contextmanager
def overlay(lower: Path, base: Path) -> Iterator[Path]:
    """A writable overlay over the read-only ``lower`` (the container's root)."""
    shutil.rmtree(base, ignore_errors=True)
    upper, workdir, merged = base / "upper", base / "work", base / "rootfs"
    for d in (upper, workdir, merged):
        d.mkdir(parents=True)
    _run("mount", "-t", "overlay", "overlay", "-o",
         f"lowerdir={lower},upperdir={upper},workdir={workdir}", merged)  # fmt: skip
    try:
        yield merged
    finally:
        subprocess.run(["umount", str(merged)], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


# --- the benchmark -----------------------------------------------------------------------------


class Bench:
    def __init__(self, cfg: BenchConfig, img: images.BuiltImage, remote: netns.RemoteHost) -> None:
        self.cfg = cfg
        self.img = img
        self.remote = remote
        self.registry = remote.registry_host
        self.ref = f"{self.registry}/lazybench/oci:{img.tag}"
        cri = "overlayfs" if cfg.via == "cri" else None
        # the node for full-pull and local: containerd's default snapshotter
        self.ctrd = Containerd(cfg.work / "containerd", self.registry, cri_snapshotter=cri)
        # the node for the lazy scenarios through CRI (--via cri): the proxy snapshotter
        self.node: LazyNode | None = None
        self.lazy: Lazyblock | None = None
        self.lazy_reason: str | None = None
        self.image_config = self._image_config()
        # a server (the vllm image): ready = a completion answered over HTTP from the host
        self.served = img.kind == "vllm"
        self.probe = CompletionProbe(f"http://127.0.0.1:{images.VLLM_PORT}")

    def _run_workload(self, ctrd: Containerd, cmd: list[str], cid: str) -> Ready:
        """Run the container ``cmd`` starts (as ``cid`` on ``ctrd``) until it is ready."""
        if not self.served:
            return run_until_ready(cmd, self.cfg.run_timeout)
        for port in (images.VLLM_PORT, images.VLLM_ENGINE_PORT):
            if port_in_use("127.0.0.1", port):  # an answer from it would not be ours
                raise BenchError(f"port {port} is in use on this host; the server needs it")
        return run_until_served(
            cmd, self.cfg.run_timeout, self.probe,
            pids=lambda: ctrd.task_pids(cid), stop=lambda: ctrd.kill_task(cid),
            log_path=self.cfg.work / "logs" / f"{cid}.log",
        )  # fmt: skip

    def _run_image(self, ctrd: Containerd, ref: str) -> Ready:
        cid = ctrd.container_id()
        return self._run_workload(ctrd, ctrd.run_image_cmd(ref, cid, server=self.served), cid)

    def _image_config(self) -> dict[str, Any]:
        layout = images.Layout(self.img.layout)
        m = layout.manifest(self.img.tag)
        return json.loads(layout._blob(m["config"]["digest"]).read_text()).get("config", {})

    # preparation (unshaped, untimed)

    def prepare(self) -> None:
        pushed = registry_digest(self.registry, "lazybench/oci", self.img.tag)
        if pushed != self.img.manifest_digest:
            log.info("pushing %s to %s", self.img.source, self.ref)
            _run("skopeo", "--insecure-policy", "copy", "-q", "--dest-tls-verify=false",
                 self.img.source, f"docker://{self.ref}", timeout=3600)  # fmt: skip
        if not any(s in LAZY_SCENARIOS for s in self.cfg.scenarios):
            return
        self.lazy_reason = Lazyblock.unavailable()
        if self.lazy_reason:
            log.warning("lazy scenarios not run: %s", self.lazy_reason)
            return
        self.lazy = Lazyblock(self.cfg.work, self.registry, self.cfg.format_version)
        if self.cfg.via == "cri":
            self.node = LazyNode(self.cfg.work / "node", self.registry, self.cfg.settings)
        try:
            self._prepare_lazy()
        except (BenchError, subprocess.TimeoutExpired) as e:
            self.lazy_reason = f"preparing the lazyblock images failed: {_short(e)}"
            log.error("%s", self.lazy_reason)
            self.lazy = None

    def _prepare_lazy(self) -> None:
        assert self.lazy is not None
        tag, src, digest = self.img.tag, self.img.source, self.img.manifest_digest
        if not self.lazy.up_to_date(tag, digest):
            log.info("converting %s -> %s", src, self.lazy.ref(tag))
            self.lazy.convert(src, digest, tag)
        profile = self.cfg.work / "profiles" / f"{tag}.txt"
        stamp = self.cfg.work / "profiles" / f"{tag}.source"  # the image it was recorded on
        recorded = profile.exists() and stamp.exists() and stamp.read_text().strip() == digest
        if not recorded:
            log.info("recording the startup profile of %s", tag)
            profile.parent.mkdir(parents=True, exist_ok=True)
            self._lazy_setup(prefetch=False, keep_cache=False)
            self._lazy_timed(tag, prefetch=False, record_profile=profile)
            stamp.write_text(digest + "\n")
        if not recorded or not self.lazy.up_to_date(f"{tag}-profile", digest):
            # a profile names files, so one recorded on this source image still fits it
            log.info("converting %s with its profile", tag)
            self.lazy.convert(src, digest, f"{tag}-profile", profile)
        if "lazy-foreign" in self.cfg.scenarios:
            foreign = self.cfg.foreign_profile
            if foreign is None or not foreign.is_file():
                raise BenchError("lazy-foreign needs --foreign-profile FILE (a profile of "
                                 "another image)")  # fmt: skip
            # always converted: the stamp knows the source image, not the profile's
            log.info("converting %s with the foreign profile %s", tag, foreign)
            self.lazy.convert(src, digest, f"{tag}-foreign", foreign)

    # nodes

    def _use_overlay_node(self) -> None:
        """containerd with overlayfs up (the lazy node down: one node at a time)."""
        if self.node is not None and self.node.running:
            self.node.stop()
        if not self.ctrd.running:
            self.ctrd.start()

    def _lazy_setup(self, prefetch: bool, keep_cache: bool) -> None:
        """Untimed: an empty node (no images, snapshots, mounts), the sector cache emptied
        unless ``keep_cache``."""
        assert self.lazy is not None
        if self.node is not None:
            if self.ctrd.running:
                self.ctrd.stop()
            self.node.fresh(prefetch, keep_cache)
        else:
            self.lazy.umount(self.lazy.dir / "mnt")
            if not keep_cache:
                self.lazy.clear_cache()
            if not self.ctrd.running:
                self.ctrd.start()

    # scenarios

    def measure(self, scenario: str) -> dict[str, Any]:
        """One run of ``scenario`` from a dropped page cache."""
        if scenario == "full-pull":
            if self.node is not None and self.node.running:
                self.node.stop()
            self.ctrd.reset()
        elif scenario == "local":
            self._use_overlay_node()
            if not self.ctrd.has_image(self.ref):
                self.ctrd.pull(self.ref, self.cfg.run_timeout)
        elif scenario == "lazy-resident":
            self._resident_setup(self.img.tag + LAZY_TAG_SUFFIX[scenario])
        else:
            self._lazy_setup(prefetch=True, keep_cache=scenario == "lazy-warm")
        self.remote.check()
        if self.cfg.drop_caches:
            drop_caches()
        mark = self.remote.traffic_mark()
        cpu0 = proccpu.snapshot()
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        extra: dict[str, Any] = {}
        if scenario == "full-pull":
            self.ctrd.pull(self.ref, self.cfg.run_timeout)
            phases["pull_s"] = time.perf_counter() - t0
            ready = self._run_image(self.ctrd, self.ref)
        elif scenario == "local":
            ready = self._run_image(self.ctrd, self.ref)
        elif scenario == "lazy-resident":
            assert self.node is not None and self.lazy is not None
            ready = self._run_image(self.node.ctrd, self._lazy_ref(scenario))
            extra = {"snapshotter": _snapshotter_stats(self._resident_mount())}
        else:
            tag = self.img.tag + LAZY_TAG_SUFFIX[scenario]
            ready, phases, extra = self._lazy_timed(tag, prefetch=True, t0=t0)
        fields = ready.fields
        seconds = ready.at - t0
        phases.update({f"{k}_s": at - t0 for k, at in ready.marks.items()})
        traffic = self.remote.traffic_since(mark)
        self.remote.check()
        read_bytes = _int(fields.get("read_bytes"))
        if extra.get("snapshotter", {}).get("backing") == "file":
            # erofs on the FUSE file directly: its reads are not block I/O, so the process's
            # read_bytes stays 0 whatever it reads; touched_bytes (sectors) is reported instead.
            read_bytes = None
        run = {
            "seconds": round(seconds, 3),
            "registry_bytes": traffic.body_bytes,
            "wire_bytes": traffic.wire_bytes,
            "registry_requests": traffic.requests,
            "read_bytes": read_bytes,
            "rchar": _int(fields.get("rchar")),
            "phases_s": {k: round(v, 3) for k, v in phases.items()},
            "workload": {k: v for k, v in fields.items() if k.endswith("_s") or k in WORKLOAD_KEYS},
            **extra,
        }
        if ready.cpu is not None:
            run["cpu_s"] = proccpu.cpu_between(cpu0, ready.cpu, start_role)
        if ready.exit_code != 0:
            run["exit_code_after_ready"] = ready.exit_code
        log.info("%s: ready in %.2fs, %s from the registry, workload read %s", scenario,
                 seconds, _mb(traffic.body_bytes), _mb(run["read_bytes"]))  # fmt: skip
        return run

    def _lazy_ref(self, scenario: str) -> str:
        assert self.lazy is not None
        return self.lazy.ref(self.img.tag + LAZY_TAG_SUFFIX[scenario]).removeprefix("docker://")

    def _resident_mount(self) -> dict[str, Any]:
        assert self.node is not None
        mounts = [m for m in self.node.daemon.mounts() if m.get("stats")]
        if len(mounts) != 1:
            raise BenchError(f"expected the image's one lazy mount, found {len(mounts)}")
        return mounts[0]["stats"]

    def _resident_setup(self, tag: str) -> None:
        """Untimed, for lazy-resident: the image pulled and run once on a node with a warm
        sector cache, the container gone, the mount kept; its local copy made, when the
        node's configuration asks for one."""
        if self.node is None:
            raise BenchError("lazy-resident runs on the CRI node (--via cri)")
        self._lazy_setup(prefetch=True, keep_cache=True)
        self._lazy_timed(tag, prefetch=True)
        deadline = time.monotonic() + LOCAL_COPY_WAIT_S
        while (copy := self._resident_mount().get("local_copy", {})).get("state") in (
            "waiting",
            "copying",
        ):
            if time.monotonic() > deadline:
                raise BenchError(f"the mount's local copy was not made: {copy}")
            time.sleep(0.5)
        if copy.get("state") not in (None, "off", "done"):
            raise BenchError(f"the mount's local copy was not made: {copy}")

    def _lazy_timed(
        self, tag: str, prefetch: bool, t0: float | None = None, record_profile: Path | None = None
    ) -> tuple[Ready, dict[str, float], dict[str, Any]]:
        """The timed part of a lazy run, on a node ``_lazy_setup`` prepared: (when READY
        came, its fields, phases, extra measurements)."""
        t0 = time.perf_counter() if t0 is None else t0
        if self.node is not None:
            return self._cri_once(tag, t0, record_profile)
        return self._mount_once(tag, prefetch, t0, record_profile)

    def _cri_once(
        self, tag: str, t0: float, record_profile: Path | None
    ) -> tuple[Ready, dict[str, float], dict[str, Any]]:
        """CRI PullImage (the proxy snapshotter mounts the image during it), then ``ctr run``
        with the lazyblock snapshotter: what kubelet makes a node do."""
        assert self.node is not None and self.lazy is not None
        ref = self.lazy.ref(tag).removeprefix("docker://")
        ctrd = self.node.ctrd
        try:
            ctrd.pull(ref, self.cfg.run_timeout)
            phases = {"pull_s": time.perf_counter() - t0}
            ready = self._run_image(ctrd, ref)
        except BenchError as e:
            raise BenchError(f"{e}; snapshotter log: {self.node.daemon.log_tail(600)}") from None
        mounts = [m for m in self.node.daemon.mounts() if m.get("stats")]
        if len(mounts) != 1:
            raise BenchError(f"expected the image's one lazy mount, found {len(mounts)}")
        if record_profile is not None:
            self.node.daemon.profile(mounts[0]["mountpoint"], record_profile)
        return ready, phases, {"snapshotter": _snapshotter_stats(mounts[0]["stats"])}

    def _mount_once(
        self, tag: str, prefetch: bool, t0: float, record_profile: Path | None
    ) -> tuple[Ready, dict[str, float], dict[str, Any]]:
        """``snapshotter mount``, then ``ctr run --rootfs`` over an overlay on it."""
        assert self.lazy is not None
        mnt = self.lazy.dir / "mnt"
        mount_out = self.lazy.mount(tag, mnt, prefetch)
        phases = {"mount_s": time.perf_counter() - t0}
        extra: dict[str, Any] = {"mount": mount_out.strip()}
        try:
            with overlay(mnt, self.lazy.dir / "container") as rootfs:
                cid = self.ctrd.container_id()
                cmd = self.ctrd.run_rootfs_cmd(rootfs, self.image_config, cid, self.served)
                ready = self._run_workload(self.ctrd, cmd, cid)
            stats = self.lazy.stats(mnt)
            if record_profile is not None:
                self.lazy.profile(mnt, record_profile)
        finally:
            self.lazy.umount(mnt)
        extra["snapshotter"] = _snapshotter_stats(stats)
        return ready, phases, extra

    def run_preset(
        self, preset: netns.Preset, on_round: Callable[[dict[str, Any]], None] | None = None
    ) -> dict[str, Any]:
        """Every scenario ``cfg.runs`` times on ``preset``; ``on_round`` gets the results so
        far after each round (so that a run stopped early leaves what it measured)."""
        self.remote.shape(preset)
        head: dict[str, Any] = {"preset": asdict(preset),
                                "measured_rtt_ms": measure_rtt(self.remote)}  # fmt: skip
        if self.lazy is not None:
            head["store_rate"] = measure_store_rate(
                self.registry, self.lazy.repository, f"{self.img.tag}-profile"
            )
        not_run: dict[str, Any] = {}
        active = []
        for scen in self.cfg.scenarios:
            if scen in LAZY_SCENARIOS and self.lazy is None:
                not_run[scen] = {"status": "not-run", "reason": self.lazy_reason}
            else:
                active.append(scen)
        # Interleaved: round i runs every scenario once, so that a slow spell of this shared
        # machine hits all of them rather than one scenario's block.
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in active}
        failed: dict[str, list[str]] = {s: [] for s in active}
        last = None
        out = self._preset_out(head, not_run, runs, failed)
        for i in range(self.cfg.runs):
            for scen in active:
                try:
                    if scen == "lazy-warm" and last != "lazy-profile":  # fill the node's cache
                        self._lazy_setup(prefetch=True, keep_cache=False)
                        self._lazy_timed(f"{self.img.tag}-profile", prefetch=True)
                    log.info("[%s] %s run %d/%d", preset.name, scen, i + 1, self.cfg.runs)
                    runs[scen].append(self.measure(scen))
                    last = scen
                except (BenchError, subprocess.TimeoutExpired, OSError) as e:
                    # recorded; the next round tries again from an empty node
                    log.error("%s failed: %s", scen, e)
                    failed[scen].append(_short(e))
                    last = None
            out = self._preset_out(head, not_run, runs, failed)
            out["rounds"] = i + 1
            if on_round is not None:
                on_round(out)
        return out

    def _preset_out(
        self,
        head: dict[str, Any],
        not_run: dict[str, Any],
        runs: dict[str, list[dict[str, Any]]],
        failed: dict[str, list[str]],
    ) -> dict[str, Any]:
        scenarios = dict(not_run)
        for scen, done in runs.items():
            if done:
                scenarios[scen] = summarize_runs(done, self.img.compressed_bytes)
                if failed[scen]:
                    scenarios[scen]["failed_runs"] = failed[scen]
            elif failed[scen]:
                scenarios[scen] = {"status": "failed", "reason": failed[scen][-1], "runs": []}
            else:
                scenarios[scen] = {"status": "not-run", "reason": "no run finished"}
        scenarios = {s: scenarios[s] for s in self.cfg.scenarios}  # in the order asked
        floor = physical_floor(scenarios, head.get("store_rate"))
        return {
            **head,
            "scenarios": scenarios,
            "floor": floor,
            "floor_targets": floor_targets(scenarios, floor),
            "targets": evaluate_targets(scenarios) if head["preset"]["name"] == TARGET_PRESET
            else [],
            "notes": explain(scenarios, self.cfg.via, head["preset"].get("rate_mbit")),
        }  # fmt: skip

    def close(self) -> None:
        if self.node is not None:
            self.node.stop()
        if self.lazy is not None:
            self.lazy.umount(self.lazy.dir / "mnt")
            umount_all_under(self.lazy.dir)
        self.ctrd.stop()


def _snapshotter_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """The mount server's statistics the report uses."""
    fetch = stats.get("fetch", {})
    reads = stats.get("reads", {})
    sector = stats.get("image", {}).get("sector_size", 0)
    return {
        "backing": stats.get("backing"),
        # the mount server's own phases: index, metadata, fuse, kernel, total
        "mount_server_s": stats.get("mount_seconds"),
        "bytes_fetched": fetch.get("bytes_fetched"),
        "sectors_fetched": fetch.get("sectors_fetched"),
        "store_requests": fetch.get("store_requests"),
        "touched_bytes": reads.get("touched_sectors", 0) * sector,
        "touched_sectors": reads.get("touched_sectors", 0),
        "touched_stored_bytes": reads.get("touched_stored_bytes"),
        "image_sectors": stats.get("image", {}).get("sectors"),
        "prefetch": stats.get("prefetch"),
        # seconds readers waited on the network: for sectors in flight, for ones not asked for
        "stall_late_s": fetch.get("stall_late_seconds"),
        "stall_missing_s": fetch.get("stall_missing_seconds"),
        # its state and how long it took (not its path: results name no host path)
        "local_copy": {k: v for k, v in (stats.get("local_copy") or {}).items() if k != "path"},
    }


def explain(
    scenarios: dict[str, Any], via: str = "cri", rate_mbit: float | None = None
) -> list[str]:
    """Measured breakdowns that say where the time went (``rate_mbit``: the link's rate,
    for what the transfer alone costs)."""
    notes = []
    fp = scenarios.get("full-pull", {})
    lo_read = scenarios.get("local", {}).get("workload_read_bytes")
    if fp.get("status") == "ok":
        pulls = [r["phases_s"].get("pull_s", 0) for r in fp["runs"]]
        total = fp["time_to_ready_s"]["median"]
        how = "CRI PullImage into overlayfs" if via == "cri" else "`ctr image pull`"
        fp_read = fp.get("workload_read_bytes")
        if fp_read is not None and lo_read and fp_read < 0.1 * lo_read:
            after = "the workload's reads then come from the page cache the unpack just filled."
        else:
            after = (
                f"the workload then still read {_mb(fp_read)} from disk (the unpack's page "
                "cache did not keep it)."
            )
        notes.append(
            f"full-pull: {how} (fetch + unpack) took a median "
            f"{statistics.median(pulls):.2f} s of the {total:.2f} s; {after}"
        )
    lo = scenarios.get("local", {})
    if fp.get("status") == "ok" and lo.get("status") == "ok":
        full, floor = fp["time_to_ready_s"]["median"], lo["time_to_ready_s"]["median"]
        if floor > full / TARGET_SPEEDUP:
            notes.append(
                f"The floor bounds the speedup: from local disk the workload needs {floor:.2f} s "
                f"to be ready, only {full / floor:.1f}x less than full-pull's {full:.2f} s, so "
                f"no start, lazy or not, can be {TARGET_SPEEDUP:g}x faster than the full pull "
                "here; the best a lazy start can do is local plus the fetch of what it reads."
            )
    lp = scenarios.get("lazy-profile", {})
    if rate_mbit and fp.get("status") == "ok" and lp.get("status") == "ok":
        fetched = lp["registry_bytes"]
        wire = fetched * 8 / (rate_mbit * 1e6)
        full = fp["time_to_ready_s"]["median"]
        if wire > full / TARGET_SPEEDUP:
            read = lo_read or lp.get("workload_read_bytes")
            notes.append(
                f"The link bounds the speedup: this workload reads {_mb(read)} to start (from "
                f"local disk, cold), so lazy-profile had to fetch {_mb(fetched)}, {wire:.1f} s at "
                f"{rate_mbit:g} Mbit/s even with nothing else to do, more than full-pull / "
                f"{TARGET_SPEEDUP:g} = {full / TARGET_SPEEDUP:.1f} s: no lazy start of a workload "
                "that needs that much can meet the target on this link. What a lazy start "
                "saves is the unpack and the overlap of the fetch with the workload's own "
                "start."
            )
    pairs = [
        ("full-pull", "lazy-profile", "x", lambda a, b: a / b),
        ("lazy-profile", "local", " s", lambda a, b: a - b),
        ("lazy-warm", "local", " s", lambda a, b: a - b),
        ("lazy-profile", "lazy-warm", " s", lambda a, b: a - b),
        ("lazy-foreign", "lazy", " s", lambda a, b: a - b),
    ]
    paired = []
    for a, b, unit, op in pairs:
        values = paired_by_round(scenarios, a, b, op)
        if values:
            each = ", ".join(f"{v:+.2f}" if unit == " s" else f"{v:.2f}" for v in values)
            med = statistics.median(values)
            paired.append(
                f"{a} {'/' if unit == 'x' else '-'} {b}: "
                + (f"{med:+.2f}" if unit == " s" else f"{med:.2f}")
                + f"{unit} ({each})"
            )
    if paired:
        notes.append(
            "Paired by round (the runs of one round saw the same load on this shared machine; "
            "median, then each round): " + "; ".join(paired) + ". lazy-warm - local is the "
            "node's read path (FUSE, decompression, checksums; nothing is fetched), "
            "lazy-profile - lazy-warm the fetching."
        )
    for scen, s in scenarios.items():
        if s.get("failed_runs"):
            notes.append(
                f"{scen}: {len(s['failed_runs'])} run(s) failed and are not in the figures: "
                + "; ".join(s["failed_runs"])[:300]
            )
        odd = [
            r["exit_code_after_ready"] for r in s.get("runs", []) if "exit_code_after_ready" in r
        ]
        if odd:
            notes.append(
                f"{scen}: {len(odd)} run(s) exited with {sorted(set(odd))} after READY (the "
                "container's removal failed; see containerd's log); their time to ready counts."
            )
    served = []
    for scen, s in scenarios.items():
        fronts = [r["phases_s"]["front_s"] for r in s.get("runs", []) if "front_s" in r["phases_s"]]
        if s.get("status") == "ok" and fronts:
            pulls = [r["phases_s"]["pull_s"] for r in s["runs"] if "pull_s" in r["phases_s"]]
            pull = f"{statistics.median(pulls):.1f}" if pulls else "-"
            served.append(
                f"{scen} {pull} / {statistics.median(fronts):.1f} / "
                f"{s['time_to_ready_s']['median']:.1f}"
            )
    if served:
        notes.append(
            "Server start (median s from the first action: pull done / the runtime's front "
            "answering, 502 while vLLM starts / first completion answered): "
            + "; ".join(served)
            + "."
        )
    for scen in LAZY_SCENARIOS:
        s = scenarios.get(scen, {})
        if s.get("status") != "ok":
            continue
        cri = any("pull_s" in r["phases_s"] for r in s["runs"])
        first = [r["phases_s"].get("pull_s" if cri else "mount_s", 0) for r in s["runs"]]
        snap = s["runs"][-1].get("snapshotter", {})
        server = [r.get("snapshotter", {}).get("mount_server_s") or {} for r in s["runs"]]
        server_s = [x["total"] for x in server if "total" in x]
        inside = (
            f", {statistics.median(server_s):.2f} s of it in the mount server" if server_s else ""
        )
        what = "CRI pull (the proxy snapshotter mounts the image)" if cri else "`snapshotter mount`"
        share = ""
        if snap.get("touched_sectors") and snap.get("image_sectors"):
            pct = 100 * snap["touched_sectors"] / snap["image_sectors"]
            share = (
                f" ({snap['touched_sectors']} of the image's {snap['image_sectors']} sectors, "
                f"{pct:.0f}%)"
            )
        notes.append(
            f"{scen}: {what} {statistics.median(first):.2f} s (median{inside}); "
            f"it fetched {_mb(snap.get('bytes_fetched'))} and the kernel touched "
            f"{_mb(snap.get('touched_bytes'))} of sectors{share} (backing: {snap.get('backing')}"
            + (
                "; the workload's read_bytes does not see file-backed erofs reads"
                if snap.get("backing") == "file"
                else ""
            )
            + ")."
        )
    return notes


def paired_by_round(
    scenarios: dict[str, Any], a: str, b: str, op: Callable[[float, float], float]
) -> list[float]:
    """``op(a's time, b's time)`` for each round, when both ran every round without a failed
    run (so that their i-th runs are from the same round); [] otherwise."""
    sa, sb = scenarios.get(a, {}), scenarios.get(b, {})
    if sa.get("status") != "ok" or sb.get("status") != "ok":
        return []
    if sa.get("failed_runs") or sb.get("failed_runs") or len(sa["runs"]) != len(sb["runs"]):
        return []
    return [
        round(op(x["seconds"], y["seconds"]), 3)
        for x, y in zip(sa["runs"], sb["runs"], strict=True)
    ]


FLOOR_SLACK_S = 1.0  # the floor's allowance for what no start avoids (container, runc)
# Time to ready at most this x the floor (a foreign profile: no worse than none).
FLOOR_TARGETS = {"lazy-profile": 1.15, "lazy": 1.5, "lazy-foreign": 1.5}


def measure_store_rate(
    registry: str, repo: str, tag: str, connections: int = 4, limit: int = 256 << 20
) -> dict[str, Any] | None:
    """The store's raw ranged-read rate, as a plain client gets it: ``connections`` threads
    reading 8 MiB ranges of the image's data blobs (up to ``limit`` bytes) over keep-alive
    connections, bytes discarded. The link rate of the physical floor; None if the image's
    manifest cannot be read."""
    host, port = registry.rsplit(":", 1)
    req = urllib.request.Request(f"http://{registry}/v2/{repo}/manifests/{tag}")
    req.add_header("Accept", "application/vnd.oci.image.manifest.v1+json")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            manifest = json.load(resp)
    except (OSError, ValueError) as e:
        log.warning("store rate not measured: %s", e)
        return None
    layers = manifest.get("layers", [])
    data = [d for d in layers if d.get("annotations", {}).get("dev.lazyblock.role") == "blob"]
    step = 8 << 20
    ranges = [
        (d["digest"], off, min(step, d["size"] - off))
        for d in data or layers
        for off in range(0, d["size"], step)
    ]
    todo, total = [], 0
    for r in ranges:
        if total >= limit:
            break
        todo.append(r)
        total += r[2]
    lock = threading.Lock()

    def worker() -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        buf = bytearray(1 << 20)
        try:
            while True:
                with lock:
                    if not todo:
                        return
                    digest, off, n = todo.pop(0)
                conn.request("GET", f"/v2/{repo}/blobs/{digest}",
                             headers={"Range": f"bytes={off}-{off + n - 1}"})  # fmt: skip
                resp = conn.getresponse()
                if resp.status not in (200, 206):
                    raise BenchError(f"store rate: HTTP {resp.status} for {digest}")
                while resp.readinto(buf):
                    pass
        finally:
            conn.close()

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(connections) as pool:
        for f in [pool.submit(worker) for _ in range(connections)]:
            f.result()
    seconds = time.perf_counter() - t0
    return {"bytes": total, "seconds": round(seconds, 3), "connections": connections,
            "bytes_per_s": round(total / seconds)}  # fmt: skip


def physical_floor(
    scenarios: dict[str, Any], store_rate: dict[str, Any] | None
) -> dict[str, Any] | None:
    """``max(local run, bytes fetched / link rate) + 1 s``: no lazy start can be ready before
    the workload has run from local disk, nor before the bytes it needs have crossed the
    link. Bytes: those the profiled start's workload needed (``needed_bytes``), else the
    plain lazy start's; the link rate: the store's, measured in the same run
    (``measure_store_rate``)."""
    local = scenarios.get("local", {})
    fetched = next(
        (needed_bytes(scenarios[s]) for s in ("lazy-profile", "lazy")
         if scenarios.get(s, {}).get("status") == "ok"),
        None,
    )  # fmt: skip
    if local.get("status") != "ok" or not fetched or not store_rate:
        return None
    local_s = local["time_to_ready_s"]["median"]
    transfer_s = fetched / store_rate["bytes_per_s"]
    return {
        "seconds": round(max(local_s, transfer_s) + FLOOR_SLACK_S, 3),
        "local_s": local_s,
        "transfer_s": round(transfer_s, 3),
        "fetched_bytes": fetched,
        "rate_bytes_per_s": store_rate["bytes_per_s"],
    }


def needed_bytes(s: dict[str, Any]) -> int | None:
    """The stored bytes a lazy scenario's workload needed: the median over its runs of the
    sectors the kernel read (the mount's ``touched_stored_bytes``), not what the registry
    sent (a prefetch streams more once the start is under way); the registry's bytes for
    runs from before the mount reported it."""
    touched = [r.get("snapshotter", {}).get("touched_stored_bytes") for r in s.get("runs", [])]
    return _median_int(touched) or s.get("registry_bytes")


def floor_targets(scenarios: dict[str, Any], floor: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each lazy scenario's median time to ready against the floor (``FLOOR_TARGETS``)."""
    out = []
    for scen, most in FLOOR_TARGETS.items():
        if scen not in DEFAULT_SCENARIOS and scen not in scenarios:
            continue  # an optional scenario, not asked for
        s = scenarios.get(scen, {})
        target = f"{scen} <= {most:g} x floor"
        if s.get("status") != "ok" or floor is None:
            out.append({"target": target, "met": None, "measured": "not evaluated"})
            continue
        ratio = s["time_to_ready_s"]["median"] / floor["seconds"]
        out.append({"target": target, "met": ratio <= most, "ratio": round(ratio, 3),
                    "measured": f"{s['time_to_ready_s']['median']:.2f} s / "
                                f"{floor['seconds']:.2f} s = {ratio:.2f}"})  # fmt: skip
    return out


def stall_seconds(s: dict[str, Any]) -> tuple[float, float] | None:
    """Median seconds a scenario's readers waited on the network: (late, missing)."""
    late = [r["snapshotter"]["stall_late_s"] for r in s.get("runs", [])
            if r.get("snapshotter", {}).get("stall_late_s") is not None]  # fmt: skip
    missing = [r["snapshotter"]["stall_missing_s"] for r in s.get("runs", [])
               if r.get("snapshotter", {}).get("stall_missing_s") is not None]  # fmt: skip
    if not late or not missing:
        return None
    return statistics.median(late), statistics.median(missing)


def registry_digest(registry: str, repo: str, tag: str) -> str | None:
    """The digest of ``repo:tag``'s manifest in the registry, None if it has none."""
    req = urllib.request.Request(f"http://{registry}/v2/{repo}/manifests/{tag}", method="HEAD")
    req.add_header("Accept", "application/vnd.oci.image.manifest.v1+json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.headers.get("Docker-Content-Digest")
    except OSError:
        return None


def measure_rtt(remote: netns.RemoteHost, samples: int = 5) -> float | None:
    """Median TCP connect time to the registry, in ms (the link's effective RTT)."""
    import socket

    times = []
    host, port = remote.registry_host.rsplit(":", 1)
    for _ in range(samples):
        t = time.perf_counter()
        try:
            with socket.create_connection((host, int(port)), timeout=5):
                times.append((time.perf_counter() - t) * 1000)
        except OSError:
            return None
    return round(statistics.median(times), 3)


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def preflight(cfg: BenchConfig) -> None:
    if os.geteuid() != 0:
        raise BenchError("needs root (network namespaces, mounts, containerd, drop_caches)")
    tools = ["ip", "tc", "iptables", "containerd", "ctr", "runc", "skopeo", "umoci",
             "docker-registry"]  # fmt: skip
    if cfg.kind in ("ml", "vllm"):
        tools.append("debootstrap")
    missing = [t for t in tools if shutil.which(t) is None]
    unknown = [p for p in cfg.presets if p not in netns.PRESETS]
    if unknown:
        raise BenchError(f"unknown preset(s) {unknown}; known: {list(netns.PRESETS)}")
    delayed = any(netns.PRESETS[p].rtt_ms for p in cfg.presets)
    if delayed and importlib.util.find_spec("netfilterqueue") is None:
        missing.append("the NetfilterQueue Python package (the link's delay)")
    if missing:
        raise BenchError(f"missing: {', '.join(missing)} (scripts/install-bench-deps installs "
                         "what the benchmark needs)")  # fmt: skip


def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    preflight(cfg)
    img = images.build(cfg.kind, cfg.size, cfg.work)
    results: dict[str, Any] = {
        "generated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "containerd": _run("containerd", "--version").split()[2],
        },  # fmt: skip
        "image": img.to_json(),
        "runs": cfg.runs,
        "via": cfg.via,
        "block_format": cfg.format_version,
        "settings": list(cfg.settings),
        "caches_dropped": cfg.drop_caches,
        "presets": {},
    }
    earlier_path = cfg.out / "latest.json"
    earlier = None
    if cfg.keep_earlier and earlier_path.exists():
        earlier = json.loads(earlier_path.read_text())
    default_out = cfg.out.resolve() == (HERE / "results").resolve()
    readme = HERE / "README.md" if default_out else None

    def write(partial: bool) -> None:
        done = merge_earlier(results, earlier) if earlier is not None else results
        write_results(done, cfg.out, readme)
        if partial:
            log.info("results so far written to %s", cfg.out)

    with netns.RemoteHost(cfg.net, cfg.work / "remote") as remote:
        remote.start_registry(cfg.work / "registry")
        bench = Bench(cfg, img, remote)
        try:
            bench.prepare()
            if cfg.prepare_only:
                if bench.lazy_reason:
                    raise BenchError(bench.lazy_reason)
                log.info("prepared %s; nothing measured", img.tag)
                return results
            for name in cfg.presets:

                def on_round(out: dict[str, Any], name: str = name) -> None:
                    results["presets"][name] = out
                    write(partial=True)

                results["presets"][name] = bench.run_preset(netns.PRESETS[name], on_round)
        finally:
            bench.close()
    write(partial=False)
    return merge_earlier(results, earlier) if earlier is not None else results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Cold-start benchmark (run as root).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"presets: {', '.join(netns.PRESETS)}; scenarios: {', '.join(SCENARIOS)}",
    )
    parser.add_argument("--kind", choices=images.KINDS, default="ml",
                        help="ml: torch + weights (default); vllm: the runtime's vLLM server "
                        "(CPU backend); tiny: busybox (CI)")  # fmt: skip
    parser.add_argument("--size", type=images.parse_size,
                        help="weights bytes (default 512MiB for ml), e.g. 6GiB")  # fmt: skip
    parser.add_argument("--preset", action="append", dest="presets",
                        help="network preset (repeatable; default 1g-1ms)")  # fmt: skip
    parser.add_argument("--scenario", action="append", dest="scenarios", choices=SCENARIOS)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--foreign-profile", type=Path,
                        help="lazy-foreign: a profile recorded on another image")  # fmt: skip
    parser.add_argument(
        "--via",
        choices=VIAS,
        default="cri",
        help="cri: pull through CRI, lazy images through the proxy snapshotter (default); "
        "ctr: ctr image pull, snapshotter mount + ctr run --rootfs",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="drop the earlier results in latest.json (by default the other images' and "
        "presets' results are kept beside this run's)",
    )
    # the default now; accepted so that earlier command lines still run
    parser.add_argument("--keep-other-images", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--prepare-only",
        action="store_true",
        help="only build, push and convert the images and record the profile (untimed; "
        "so that a timed run holding the benchmark lock measures and nothing else)",
    )
    parser.add_argument("--format-version", choices=("1", "2"), default="2",
                        help="block format of the lazy scenarios' images (default 2)")  # fmt: skip
    parser.add_argument("--set", action="append", dest="settings", default=[],
                        metavar="KEY=VALUE",
                        help="a setting of the lazyblock daemon (--via cri), as its --set; "
                        "recorded with the results")  # fmt: skip
    parser.add_argument("--work", type=Path, default=HERE / "work")
    parser.add_argument("--out", type=Path,
                        help="results folder (default: results/; work/smoke-results/ with "
                        "--smoke)")  # fmt: skip
    parser.add_argument("--smoke", action="store_true",
                        help="CI: tiny image, no shaping, 1 run (unless given)")  # fmt: skip
    parser.add_argument(
        "--report", action="store_true", help="only re-render the report from latest.json"
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = args.work / "smoke-results" if args.smoke else HERE / "results"
    if args.report:
        results = json.loads((args.out / "latest.json").read_text())
        for entry in [results, *(results.get("other_images") or [])]:
            for name, pr in entry["presets"].items():
                pr["targets"] = evaluate_targets(pr["scenarios"]) if name == TARGET_PRESET else []
                if pr.get("store_rate"):
                    pr["floor"] = physical_floor(pr["scenarios"], pr["store_rate"])
                    pr["floor_targets"] = floor_targets(pr["scenarios"], pr["floor"])
                pr["notes"] = explain(
                    pr["scenarios"],
                    pr.get("via", entry.get("via", "ctr")),
                    pr.get("preset", {}).get("rate_mbit"),
                )
        default_out = args.out.resolve() == (HERE / "results").resolve()
        write_results(results, args.out, HERE / "README.md" if default_out else None)
        print(markdown_table(results))
        return 0
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    if "lazy-foreign" in (args.scenarios or ()) and not args.foreign_profile:
        parser.error("--scenario lazy-foreign needs --foreign-profile FILE")
    if args.kind == "vllm" and args.size is not None:
        parser.error("--size does not apply to --kind vllm (its model is fixed)")
    if args.smoke:
        args.kind = "tiny"
        args.presets = args.presets or ["none"]
        if "--runs" not in (argv or sys.argv):
            args.runs = 1
    cfg = BenchConfig(
        kind=args.kind,
        size=args.size,
        presets=tuple(args.presets or ["1g-1ms"]),
        scenarios=tuple(args.scenarios or DEFAULT_SCENARIOS),
        foreign_profile=args.foreign_profile.resolve() if args.foreign_profile else None,
        runs=args.runs,
        via=args.via,
        keep_earlier=not args.fresh,
        prepare_only=args.prepare_only,
        format_version=args.format_version,
        settings=tuple(args.settings),
        work=args.work.resolve(),
        out=args.out.resolve(),
    )
    # Stopped with SIGTERM or SIGINT (also when started in the background, where SIGINT is
    # ignored): unwind, so that the remote host, containerd and the mounts are torn down.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        results = run_benchmark(cfg)
    except (BenchError, images.ImageBuildError, netns.NetError) as e:
        print(f"coldstart: error: {e}", file=sys.stderr)
        return 3
    if cfg.prepare_only:
        print(f"prepared {results['image']['tag']} (nothing measured, results untouched)")
        return 0
    print(markdown_table(results))
    print(f"\nwritten: {cfg.out / 'latest.json'}, latest.md, latest.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
