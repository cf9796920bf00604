"""The machine's own floor under a proxy's added latency: how long one process takes to wake
another and be woken back, on the same CPU and across two CPUs.

A request through a proxy pinned to one CPU, from a load generator and to backends on
another, crosses between them four times (two round trips) that a direct request does not.
On a virtual machine, waking a thread on another virtual CPU goes through the hypervisor
(an inter-processor interrupt), and its tail can be long: that tail is in every proxy's
added latency, whatever the proxy does. ``round_trips`` measures it with a pipe ping-pong
between two processes pinned to the given CPUs.

    python benchmarks/serving/wakeup.py [--count 20000] [--cpus 0,1]
"""

from __future__ import annotations

import argparse
import json
import os
import time


def round_trips(cpu_a: int, cpu_b: int, count: int = 20000) -> dict[str, float]:
    """p50/p99/p99.9 in microseconds of a one-byte pipe round trip between a process on
    ``cpu_a`` and one on ``cpu_b``."""
    to_child, from_parent = os.pipe()
    to_parent, from_child = os.pipe()
    before = os.sched_getaffinity(0)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the echoing child
        try:
            os.close(from_parent)
            os.close(to_parent)
            os.sched_setaffinity(0, {cpu_b})
            for _ in range(count):
                os.read(to_child, 1)
                os.write(from_child, b"x")
        finally:
            os._exit(0)
    os.close(to_child)
    os.close(from_child)
    try:
        os.sched_setaffinity(0, {cpu_a})
        samples = []
        for _ in range(count):
            start = time.perf_counter_ns()
            os.write(from_parent, b"x")
            if not os.read(to_parent, 1):
                raise OSError(f"the process on CPU {cpu_b} is gone (no such CPU?)")
            samples.append(time.perf_counter_ns() - start)
    finally:
        os.sched_setaffinity(0, before)
        os.close(from_parent)
        os.close(to_parent)
        os.waitpid(pid, 0)
    samples.sort()

    def at(q: float) -> float:
        return samples[min(len(samples) - 1, int(q * len(samples)))] / 1e3

    return {"p50_us": at(0.50), "p99_us": at(0.99), "p999_us": at(0.999)}


def measure(cpu_a: int, cpu_b: int, count: int = 20000) -> dict[str, dict[str, float]]:
    """Round trips on ``cpu_a`` alone and between ``cpu_a`` and ``cpu_b``."""
    return {
        "same_cpu": round_trips(cpu_a, cpu_a, count),
        "cross_cpu": round_trips(cpu_a, cpu_b, count),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=20000)
    ap.add_argument("--cpus", default="0,1", help="two CPUs: A,B")
    a = ap.parse_args()
    cpu_a, cpu_b = (int(x) for x in a.cpus.split(","))
    print(json.dumps(measure(cpu_a, cpu_b, a.count), indent=1))


if __name__ == "__main__":
    main()
