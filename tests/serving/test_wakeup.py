"""The serving benchmark's measure of the machine's floor: cross-CPU wake-up round trips."""

from __future__ import annotations

import os

import pytest

from benchmarks.serving import wakeup


def test_round_trips_between_cpus_are_measured() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    m = wakeup.measure(cpus[0], cpus[-1], count=300)
    for kind in ("same_cpu", "cross_cpu"):
        q = m[kind]
        assert 0 < q["p50_us"] <= q["p99_us"] <= q["p999_us"] < 1e6
    assert os.sched_getaffinity(0) == before  # the caller's affinity is given back


def test_an_unknown_cpu_is_an_error() -> None:
    with pytest.raises(OSError):
        wakeup.round_trips(0, 10_000, count=10)
