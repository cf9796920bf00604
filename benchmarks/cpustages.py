"""CPU by stage of the data path, from a system-wide ``perf record`` (cpu-clock, call graphs).

    with CpuStages() as stages:          # perf record -a -g, for the duration
        ...the pass...
    report = stages.report(processes)    # {"mount_server": pid, "reader": pid, ...}

Every sample is put in one stage by its call chain (kernel and native frames; Python's own
frames are opaque to perf and count as ``python``), the first rule that matches from the
leaf up winning, so a ``memcpy`` under ``fuse_dev_write`` counts as the FUSE reply, not as
a copy of its own. The stages are the steps a cold byte takes: received from the store,
decompressed, hashed, written to the cache, replied to FUSE (the kernel's copy into the
page cache), read by the application; plus the interpreter, page faults and waking threads.
Samples of processes not named, and of the idle task, are summed per command name.

perf is Debian's ``linux-perf``; where it cannot record (no perf, or ``perf_event_paranoid``
forbids it) ``CpuStages`` says so and the report is empty.
"""

from __future__ import annotations

import collections
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

# (stage, substrings of a frame's symbol) in order of precedence: the first stage one of
# whose substrings occurs in any frame of a sample's chain, looking from the leaf up.
RULES: list[tuple[str, tuple[str, ...]]] = [
    ("fuse_reply", ("fuse_dev_write", "fuse_dev_splice_write")),
    ("fuse_request", ("fuse_dev_read", "fuse_dev_do_read", "fuse_dev_splice_read")),
    ("receive", ("tcp_recvmsg", "sock_recvmsg", "sock_read_iter", "__sys_recvfrom")),
    ("send", ("tcp_sendmsg", "sock_sendmsg", "sock_write_iter")),
    # Debian's libzstd (under imagetool._sectorcodec) has no symbols perf can name: by DSO.
    ("decompress", ("ZSTD_", "HUF_", "FSE_", "libzstd.so")),
    ("hash", ("XXH", "xxh")),
    # Making and removing the cache's entry files (inodes, directory entries): on an ext4
    # without a journal, choosing a new inode skips those freed in the last minutes, which
    # costs a scan of the inode table after many deletions (``recently_deleted``).
    (
        "cache_files",
        ("__ext4_new_inode", "do_mkdirat", "do_renameat", "do_unlinkat"),
    ),
    (
        "cache_write",
        (
            "ext4_file_write_iter",
            "iomap_dio",
            "fallocate",
            "ext4_fallocate",
            "ext4_sync",
        ),
    ),
    ("cache_read", ("ext4_file_read_iter", "filemap_read", "blkdev_read_iter")),
    ("page_fault", ("exc_page_fault", "do_anonymous_page", "handle_mm_fault")),
    ("memory", ("munmap", "mmap_region", "__vm_munmap", "madvise", "brk")),
    ("wakeup", ("futex", "try_to_wake_up", "schedule", "pv_native_safe_halt")),
    ("memcpy", ("memcpy", "memmove")),
    (
        "python",
        (
            "_PyEval",
            "PyObject",
            "_Py",
            "Py",
            "libpython",
            "gc_collect",
            "dict",
            "unicode",
            "tuple",
            "list_",
        ),
    ),
]


def _stage(frames: list[str]) -> str:
    for stage, needles in RULES:
        for frame in frames:
            if any(n in frame for n in needles):
                return stage
    return "kernel_other" if frames and frames[0].endswith("[kernel.kallsyms])") else "other"


class CpuStages:
    """``perf record -a -g`` while the ``with`` block runs (``pid``: of that process
    alone, ``-p``)."""

    def __init__(self, frequency: int = 499, pid: int | None = None) -> None:
        self.frequency = frequency
        self.target = ["-a"] if pid is None else ["-p", str(pid)]
        self.available = shutil.which("perf") is not None
        self._dir = tempfile.mkdtemp(prefix="lazyblock-perf-")
        self.data = Path(self._dir) / "perf.data"
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> CpuStages:
        if self.available:
            self._proc = subprocess.Popen(
                ["perf", "record", "-q", "-e", "cpu-clock", "-F", str(self.frequency),
                 *self.target, "-g", "-o", str(self.data)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )  # fmt: skip
            try:
                self._proc.wait(0.5)  # it failed to start
                self.available = False
            except subprocess.TimeoutExpired:
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)
            self._proc.wait(60)

    def samples(self) -> list[tuple[str, int, list[str]]]:
        """(command, pid, frames leaf first) of each sample."""
        if not self.available or not self.data.exists():
            return []
        out = subprocess.run(
            ["perf", "script", "-i", str(self.data), "-F", "comm,pid,ip,sym,dso"],
            capture_output=True, text=True, check=False,
        ).stdout  # fmt: skip
        return parse_script(out)

    def report(self, processes: dict[str, int], gigabytes: float) -> dict[str, object]:
        """CPU-seconds per GB by process and stage; other processes by command, and what
        the sampling covered (``seconds``: CPU-seconds sampled, idle included)."""
        return tabulate(self.samples(), processes, gigabytes, self.frequency)

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


def parse_script(out: str) -> list[tuple[str, int, list[str]]]:
    """``perf script -F comm,pid,ip,sym,dso`` output as (command, pid, frames leaf first)."""
    samples = []
    for block in out.split("\n\n"):
        lines = block.strip("\n").splitlines()
        if not lines:
            continue
        head = lines[0].split()
        try:
            comm, pid = " ".join(head[:-1]), int(head[-1].split("/")[0])
        except (ValueError, IndexError):
            continue
        frames = [line.strip().split(" ", 1)[-1] for line in lines[1:]]
        samples.append((comm, pid, frames))
    return samples


def tabulate(
    samples: list[tuple[str, int, list[str]]], processes: dict[str, int], gigabytes: float,
    frequency: int,
) -> dict[str, object]:  # fmt: skip
    """``CpuStages.report`` of these samples (taken at ``frequency`` per CPU-second)."""
    by_pid = {pid: name for name, pid in processes.items()}
    table: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    total = 0
    for comm, pid, frames in samples:
        total += 1
        name = by_pid.get(pid)
        if name is None:
            name = "idle" if pid == 0 else f"other:{comm}"
        table[name][_stage(frames)] += 1
    per = 1.0 / frequency / max(gigabytes, 1e-9)
    result: dict[str, object] = {
        "seconds": total / frequency,
        "per_GB": {
            name: dict(
                sorted(((k, round(v * per, 3)) for k, v in counts.items()), key=lambda kv: -kv[1])
            )
            | {"total": round(sum(counts.values()) * per, 3)}
            for name, counts in sorted(table.items(), key=lambda kv: -sum(kv[1].values()))
        },
    }
    return result


def format_report(report: dict[str, object], limit: int = 8) -> str:
    """The per-GB table as lines of text: each process, its stages largest first."""
    lines = []
    for name, stages in report.get("per_GB", {}).items():  # type: ignore[union-attr]
        if name.startswith("other:") and stages["total"] < 0.02:
            continue
        parts = [f"{k} {v:.2f}" for k, v in stages.items() if k != "total"][:limit]
        lines.append(f"{name:16} {stages['total']:5.2f}  " + ", ".join(parts))
    return "\n".join(lines)


if __name__ == "__main__":  # summarise a perf.data: cpustages.py DATA GIGABYTES PID=NAME...
    import sys

    text = subprocess.run(
        ["perf", "script", "-i", sys.argv[1], "-F", "comm,pid,ip,sym,dso"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    named = {kv.split("=")[1]: int(kv.split("=")[0]) for kv in sys.argv[3:]}
    print(format_report(tabulate(parse_script(text), named, float(sys.argv[2]), 499)))
