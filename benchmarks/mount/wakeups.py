"""Wake-ups of a mount server during a cold sequential pass (needs root, FUSE and perf).

    python benchmarks/mount/wakeups.py [--work /var/tmp/lazyblock-bench] [--size BYTES]
        [--rounds 3] [--reuse] [--variant NAME=CHECKOUT ...] [--json out.json]

The mount benchmark's image (``run.py``'s setup: the loopback registry, format 2) is mounted
with an empty node cache and read once in order, with ``perf stat`` counting, for the mount
server alone: ``futex`` system calls (threads that sleep on, or wake, a lock or a condition
variable), context switches and CPU time. Counts per GB of image, which vary much less from
pass to pass than this VM's CPU seconds do (the FUSE reply's page faults on the host swing
them; ``run.py``'s README). Each round runs every variant (``PYTHONPATH``: this checkout and
each ``--variant``, whose compiled modules must be built there), alternating their order;
medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run as bench  # noqa: E402  (the mount benchmark's setup and passes)

EVENTS = {"futex": "syscalls:sys_enter_futex", "context_switches": "context-switches"}


def cold_pass(ref: str, work: Path) -> dict[str, float]:
    """One cold sequential pass through a fresh mount; counts per GB of image."""
    from snapshotter.config import MountConfig, StoreOptions
    from snapshotter.mount import api

    mnt, cache = work / "mnt", work / "cache"
    mnt.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(cache, ignore_errors=True)
    cfg = MountConfig(
        cache_dir=cache, cache_size=64 << 30, state_dir=work / "state", prefetch=False,
        store=StoreOptions(plain_http=True),
    )  # fmt: skip
    api.unmount(mnt, cfg)
    server = api.mount(ref, mnt, cfg, fork_server=False)
    out = work / "perf-stat.csv"
    try:
        bench.drop_caches()
        events = ",".join([*EVENTS.values(), "task-clock"])
        perf = subprocess.Popen(
            ["perf", "stat", "-x,", "-o", str(out), "-e", events, "-p", str(server.pid)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(0.5)  # perf attached
        gigabytes = sum(p.stat().st_size for p in bench.files_of(mnt)) / 1e9
        mbps = bench.seq_read(mnt)
        perf.send_signal(signal.SIGINT)
        perf.wait(30)
    finally:
        api.unmount(mnt, cfg)
    counts: dict[str, float] = {}
    for line in out.read_text().splitlines():
        fields = line.split(",")
        if line.startswith("#") or len(fields) < 3 or not fields[0].replace(".", "").isdigit():
            continue
        counts[fields[2]] = float(fields[0])
    result = {name: counts.get(event, 0.0) / gigabytes for name, event in EVENTS.items()}
    result["cpu_s"] = counts.get("task-clock", 0.0) / 1e3 / gigabytes
    result["MBps"] = mbps
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/lazyblock-bench"))
    parser.add_argument("--size", type=int, default=2 << 30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reuse", action="store_true")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=CHECKOUT")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if shutil.which("perf") is None:
        sys.exit("wakeups.py: needs perf (Debian's linux-perf)")
    variants = {name: str(path) for name, path in bench.checkouts(args.variant).items()}
    registry, ref, _ = bench.setup(
        args.work, args.size, args.reuse, "mixed", ("--format-version", "2")
    )
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    try:
        for round_ in range(args.rounds):
            order = list(variants.items())
            for name, path in order if round_ % 2 == 0 else reversed(order):
                os.environ["PYTHONPATH"] = path
                result = cold_pass(ref, args.work)
                runs[name].append(result)
                print(f"round {round_} {name}: " + ", ".join(
                    f"{k} {v:.3f}" if k == "cpu_s" else f"{k} {v:.0f}" for k, v in result.items()
                ), flush=True)  # fmt: skip
    finally:
        os.environ.pop("PYTHONPATH", None)
        registry.stop()
    medians = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    report = {
        "per_GB_of_image": "futex calls, context switches and CPU seconds of the mount server",
        "rounds": args.rounds,
        "size": args.size,
        "medians": medians,
        "runs": runs,
    }
    print(json.dumps(medians, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
