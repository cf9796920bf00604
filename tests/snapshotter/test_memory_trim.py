"""When a mount server gives freed memory back: once per burst of reads, after a quiet spell."""

from __future__ import annotations

from snapshotter import memory


def test_trims_once_per_burst_after_it_has_been_quiet() -> None:
    t = memory.Trimmer(quiet=2.0)
    assert not t.due(0, 0.0)  # the first reading is only a baseline
    assert not t.due(0, 10.0)  # no work at all: nothing to give back
    assert not t.due(100, 11.0)  # a burst...
    assert not t.due(250, 12.0)
    assert not t.due(250, 13.5)  # ...quiet for 1.5 s only
    assert t.due(250, 14.0)  # 2 s: trim
    assert not t.due(250, 20.0)  # once
    assert not t.due(300, 21.0)  # the next burst
    assert not t.due(300, 22.5)
    assert t.due(300, 23.0)


def _rss_mib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS")


def test_trim_gives_freed_heap_memory_back() -> None:
    # the CI machine runs glibc; elsewhere both calls are no-ops that report False
    assert memory.limit_arenas(memory.ARENAS)
    chunks = [bytearray(64 << 10) for _ in range(2000)]  # 125 MiB of heap...
    fence = bytearray(64 << 10)  # ...below a live block, so free() cannot shrink the heap
    held = _rss_mib()
    del chunks
    assert memory.trim()
    assert _rss_mib() < held - 100
    del fence
