"""CPU time of processes, read from ``/proc`` (Linux): what the benchmarks charge to the
parts they measure (a mount server, a registry, a front, nginx)."""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds process ``pid`` has used, all its threads (not its
    children). Raises ``OSError`` (``FileNotFoundError``) once it is gone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, all) CPU seconds of the whole machine since boot (idle and iowait not busy)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(ticks[:8])  # guest time is already counted in user
    return (total - ticks[3] - ticks[4]) / _TICK, total / _TICK
