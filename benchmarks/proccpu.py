"""CPU time of processes, read from ``/proc`` (Linux): what the benchmarks charge to the
parts they measure (a mount server, a registry, a front, nginx)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def _process_stat(pid: int | str) -> tuple[str, list[str]]:
    """``/proc/<pid>/stat``: the command name, and the fields after it (``state`` first).
    Raises ``OSError`` once the process is gone."""
    head, _, rest = Path(f"/proc/{pid}/stat").read_text().rpartition(")")
    return head.partition("(")[2], rest.split()


def _machine_ticks() -> tuple[int, int, int]:
    """The machine's clock ticks since boot: all (guest time is already counted in user),
    idle (idle and iowait), stolen by the hypervisor."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(ticks[:8]), ticks[3] + ticks[4], ticks[7]


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds process ``pid`` has used, all its threads (not its
    children). Raises ``OSError`` (``FileNotFoundError``) once it is gone."""
    fields = _process_stat(pid)[1]
    return (int(fields[11]) + int(fields[12])) / _TICK


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, all) CPU seconds of the whole machine since boot (idle and iowait not busy)."""
    total, idle, _ = _machine_ticks()
    return (total - idle) / _TICK, total / _TICK


@dataclass(frozen=True)
class ProcessCpu:
    """One process in a ``Snapshot``."""

    comm: str
    ppid: int
    seconds: float  # its own user + system CPU (all its threads)
    children: float  # that of its children it has waited for
    started: int  # clock ticks after boot: tells a process from a later one of its pid


@dataclass(frozen=True)
class Snapshot:
    """The CPU time of the machine and of every process at one moment."""

    busy: float  # machine CPU-seconds since boot, not idle (steal included)
    idle: float  # idle and iowait
    steal: float  # taken by the hypervisor
    processes: dict[int, ProcessCpu]


def snapshot() -> Snapshot:
    """Read ``/proc/stat`` and every ``/proc/<pid>/stat`` (a few ms for a hundred
    processes; one that ends meanwhile is left out)."""
    total, idle, steal = _machine_ticks()
    processes = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            comm, f = _process_stat(entry.name)
        except OSError:
            continue
        processes[int(entry.name)] = ProcessCpu(
            comm=comm,
            ppid=int(f[1]),
            seconds=(int(f[11]) + int(f[12])) / _TICK,
            children=(int(f[13]) + int(f[14])) / _TICK,
            started=int(f[19]),
        )
    return Snapshot((total - idle) / _TICK, idle / _TICK, steal / _TICK, processes)


def cpu_between(
    before: Snapshot, after: Snapshot, classify: Callable[[int, Snapshot], str]
) -> dict[str, float]:
    """CPU-seconds spent from ``before`` to ``after``: the machine's (``busy``, ``idle``,
    ``steal``: busy time the hypervisor gave to others) and, by the name
    ``classify(pid, after)`` gives each process alive at ``after``, what those processes
    used (a process that started after ``before`` from zero, with the children it reaped);
    ``unaccounted`` is the machine's busy time, steal aside, that no living process holds
    (processes that ended, unless a new process reaped them; interrupts)."""
    out: dict[str, float] = {
        "busy": after.busy - before.busy,
        "idle": after.idle - before.idle,
        "steal": after.steal - before.steal,
    }
    named = 0.0
    for pid, p in after.processes.items():
        q = before.processes.get(pid)
        if q is not None and q.started != p.started:
            q = None  # another process with the same number (a kernel worker's name changes)
        # Children reaped by a process that was there before may have run before: left out
        # (then they are ``unaccounted``); a new process's children all ran since.
        used = p.seconds - q.seconds if q is not None else p.seconds + p.children
        if used <= 0:
            continue
        name = classify(pid, after)
        out[name] = out.get(name, 0.0) + used
        named += used
    out["unaccounted"] = max(0.0, out["busy"] - out["steal"] - named)
    return {k: round(v, 3) for k, v in out.items()}
