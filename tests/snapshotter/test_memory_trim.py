"""When a mount server gives freed memory back: once per burst of reads, after a quiet spell."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from snapshotter.mount import memory


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
    assert memory.tune()
    chunks = [bytearray(64 << 10) for _ in range(2000)]  # 125 MiB of heap...
    fence = bytearray(64 << 10)  # ...below a live block, so free() cannot shrink the heap
    held = _rss_mib()
    del chunks
    assert memory.trim()
    assert _rss_mib() < held - 100
    del fence


# Blocks of a sector's size, several alive at once and freed, on two threads (a cold read's
# pattern); prints the page faults taken after the first round touched the working set.
_CHURN = textwrap.dedent(
    """
    import resource, sys, threading
    from snapshotter.mount import memory
    if sys.argv[1] == "tuned":
        assert memory.tune()
    def churn():
        for _ in range(20):
            live = [bytearray(4 << 20) for _ in range(8)]
            del live
    churn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    worker = threading.Thread(target=churn)
    worker.start()
    worker.join()
    churn()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _faults(mode: str) -> int:
    run = subprocess.run(
        [sys.executable, "-c", _CHURN, mode], capture_output=True, text=True, check=True
    )
    return int(run.stdout)


def test_tuned_malloc_reuses_sector_sized_blocks_instead_of_faulting_in_new_pages() -> None:
    # In a child process each: the settings last for the life of a process.
    default, tuned = _faults("default"), _faults("tuned")
    working_set = 8 * (4 << 20) // 4096  # pages: the worker thread's arena touches its own
    assert tuned < 2 * working_set
    assert default > 10 * working_set  # glibc's defaults: new pages over and over
