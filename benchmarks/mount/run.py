"""Mount benchmark: one generated image of >= 2 GB, in one run (needs root, FUSE, a
``docker-registry`` binary for the loopback store).

    python benchmarks/mount/run.py [--size BYTES] [--work /var/tmp/lazyblock-bench]
        [--rounds N] [--reuse] [--variant NAME=CHECKOUT ...] [--json out.json]
        [--mount-only] [--mount-repeats N] [--link PRESET]
        [--content mixed|random|fp16] [--format-version 1|2] [--raw-saving S]
        [--backed-memory GIB] [--hold-reporting]

Measures, on the same image:
* mount time (``snapshotter.mount.api.mount`` wall time, and the server's own breakdown, by
  ``mounttime.py`` in a process running the checkout's code): a node's first mount
  (``first_mount_seconds``: the server started as a new interpreter), a mount with empty
  caches on a node that has mounted before (``mount_seconds``: server code in the page
  cache, the fork server running), and a remount of the same image (``remount_seconds``);
  the checkout's bytecode is compiled first, as an installed package's is;
  ``--mount-only`` measures only these;
* sequential read throughput (every file, in order) and random read throughput (128 KiB
  preads at random offsets) through the mount, **cold** (empty sector cache, store = a
  registry on loopback) and **warm** (sectors in the local cache, kernel page cache dropped;
  ``warm_rand_fresh`` in a new server process, which has verified nothing yet);
* the same reads from the tree unpacked on local disk (page cache dropped): the reference;
* what the store itself serves (parallel ranged reads of the whole data blob);
* where a warm random read's time goes: the same 128 KiB reads one at a time (p50 and p90
  latency, ``warm_qd1_us``) through the mount and through each layer under it, read with
  ``O_DIRECT`` (the FUSE file the server answers, the loop device on it), and from the local
  tree (``local_rand_qd1_p50_us``).

The machine is shared, so everything is measured in the same run: ``--rounds`` repeats the
whole set, interleaving the references with each ``--variant`` (another checkout of the
snapshotter, e.g. the last commit, run through ``PYTHONPATH``), and reports medians.
``--reuse`` keeps the image, its layout and the registry of an earlier run. ``--link
PRESET`` serves the same registry storage from the cold-start benchmark's "remote" network
namespace behind a shaped link (``benchmarks/coldstart/netns.py``: ``1g-1ms``, ``2g``,
``4g``, ...) instead of loopback, where the registry shares the mount's CPUs.

Medians are reported, and under ``per_round`` every round's figure (the spread on a shared
machine is wide). Targets: mount < 0.5 s whatever the size; warm >= 70% of local disk; cold
sequential >= 70% of the store's own throughput. The store serves compressed blob bytes and a
read through the mount returns image bytes, so cold sequential is reported both ways
(``cold_seq_MBps``: image bytes, ``cold_seq_blob_MBps``: the blob bytes that took).

CPU: the cold sequential pass and the store reference also record the CPU seconds their
processes used, per GB (``cold_seq_cpu``: of image; ``store_cpu``: of blob): the mount
server, the registry, the reader (this process), and the whole machine (``machine``: every
busy CPU; ``busy``: its share of all CPUs). The warm passes record theirs too, per GB
read (``warm_seq_cpu``, ``warm_rand_cpu``, ``warm_rand_fresh_cpu``; ``local_rand_cpu`` for
local disk's):
on a busy node it is the CPU, more than the rate of a short pass on a shared machine, that
says what a read path costs. ``cold_seq_cpu_bound_MBps`` is the cold
sequential throughput at which the pass's CPU per GB would keep every CPU busy, and
``cold_seq_cpu_per_GB_for_target`` the machine CPU per GB of image a pass may use at most to
reach 70 % of the store on this machine's CPUs: where the first is below the target, a pass
is limited by CPU, not by waiting. ``all_but_store`` is what a node pays per GB read
cold: the machine's busy CPU less the registry's, less the hypervisor's steal and other
processes' (``others``: whatever else ran on the machine meanwhile), which leaves the
mount server, the reader, kernel threads (``kernel``: the loop device's workers) and
interrupts (``CpuMeter``). ``cold_seq_stages`` splits the CPU of a
second cold sequential pass (an empty cache again) by process and by stage (received,
decompressed, hashed, written to the cache, replied to FUSE, the interpreter, ...) from a
system-wide ``perf record`` (``benchmarks/cpustages.py``; empty where perf cannot record);
``cold_seq_cpu_under_perf`` is that pass's CPU, which the sampling raises: ``cold_seq_cpu``
comes from a pass without it.

``server_memory_MB``: the mount server's resident memory after the cold pass (its peak,
then, and after it has been quiet a few seconds), which should not grow with the image
beyond its index: compare ``--size``s.

``--content random`` builds the image from random bytes alone (incompressible: zstd keeps
them as raw blocks), for the cost of a byte that needs no decompression; use another
``--work`` directory than the default image's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import mmap
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from ocibuild import DEFAULT_MTIME, write_oci_layout  # noqa: E402
from support import Registry  # noqa: E402

from benchmarks.coldstart import netns  # noqa: E402
from benchmarks.cpustages import CpuStages, format_report  # noqa: E402
from benchmarks.proccpu import (  # noqa: E402
    Snapshot,
    cpu_between,
    process_cpu_seconds,
    snapshot,
)
from imagetool.image import open_image  # noqa: E402
from imagetool.stores.base import StoreOptions  # noqa: E402
from snapshotter.config import MountConfig  # noqa: E402
from snapshotter.mount import api, kernel, state  # noqa: E402
from snapshotter.mount.fuse import IMAGE_NAME  # noqa: E402

MIB = 1 << 20
FILE_SIZE = 64 * MIB
RANDOM_READ = 128 << 10
RANDOM_COUNT = 2000
RANDOM_GB = RANDOM_COUNT * RANDOM_READ / 1e9  # what one random pass reads
QUIET_SECONDS = 5.0  # more than the mount server's 2 s of quiet before it trims its heap
LATENCY_COUNT = 500


def report(results: dict[str, object], path: Path | None) -> None:
    """A run's results as JSON: printed, and written to ``path`` (``--json``) if given."""
    text = json.dumps(results, indent=2)
    print(text)
    if path:
        path.write_text(text)


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def server_memory(pid: int) -> dict[str, float]:
    """A mount server's resident memory after a cold pass, in MB: its peak (``VmHWM``), now
    (``VmRSS``), and now after it has been quiet for ``QUIET_SECONDS`` (it gives the
    memory of a burst back then)."""

    def read() -> dict[str, float]:
        fields = {}
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                fields[key] = int(value.split()[0]) * 1024 / 1e6
        return fields

    now = read()
    time.sleep(QUIET_SECONDS)
    return {"peak": now["VmHWM"], "after_pass": now["VmRSS"], "quiet": read()["VmRSS"]}


def _process_cpu(pid: int) -> float:
    """``process_cpu_seconds``, 0 once the process is gone."""
    try:
        return process_cpu_seconds(pid)
    except OSError:
        return 0.0


KERNEL_THREADS = 2  # kthreadd: the parent of every kernel thread


@dataclass
class CpuMeter:
    """CPU seconds used between ``start`` and ``stop``: by the named processes, by this one
    (``reader``), by the whole machine (``machine``: busy time, the hypervisor's steal
    included; ``busy``: its share of all CPUs), by kernel threads (``kernel``: the loop
    device's workers, ksoftirqd), by every other process (``others``: what else ran on the
    machine meanwhile), by the hypervisor (``steal``), and by no living process
    (``unaccounted``: interrupts, processes that ended). ``all_but_store`` is what a node
    pays for the pass: everything but the store (``store_names``), other processes and
    steal."""

    pids: dict[str, int]
    store_names: tuple[str, ...] = ("registry",)

    def start(self) -> CpuMeter:
        self._snapshot = snapshot()
        return self

    def stop(self, gigabytes: float) -> dict[str, float]:
        """Seconds per GB of ``gigabytes`` (and ``busy``, a fraction)."""
        named = {os.getpid(): "reader"} | {pid: name for name, pid in self.pids.items()}

        def classify(pid: int, now: Snapshot) -> str:
            if pid in named:
                return named[pid]
            if pid == KERNEL_THREADS or now.processes[pid].ppid == KERNEL_THREADS:
                return "kernel"
            return "others"

        split = cpu_between(self._snapshot, snapshot(), classify)
        parts = (*self.pids, "reader", "kernel", "others", "steal", "unaccounted")
        used = {name: split.get(name, 0.0) for name in parts}
        busy = used["machine"] = split["busy"]
        used["all_but_store"] = (
            busy
            - used["steal"]
            - used["others"]
            - sum(used.get(name, 0.0) for name in self.store_names)
        )
        out = {name: seconds / gigabytes for name, seconds in used.items()}
        total = busy + split["idle"]
        out["busy"] = busy / total if total else 0.0
        return out


@dataclass(frozen=True)
class MemoryPrep:
    """How a cold pass meets memory on a VM whose host takes free memory back
    (``machine_facts``): ``backed_bytes`` written and freed just before it
    (``back_memory``). ``hold_reporting``: free page reporting is paused for the whole run
    (``reporting_held``), and all free memory but ``FREE_HEADROOM`` is backed before each
    cold pass, so that every page the pass takes is backed whichever free block the
    kernel hands out (backing 6 GiB of 23 free left the pass on unbacked blocks in one
    round of two)."""

    backed_bytes: int = 0
    hold_reporting: bool = False

    def bytes_to_back(self) -> int:
        if not self.hold_reporting:
            return self.backed_bytes
        free = next(
            int(line.split()[1]) << 10
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemFree:")
        )
        return max(self.backed_bytes, free - FREE_HEADROOM, 0)


FREE_HEADROOM = 2 << 30  # memory ``MemoryPrep`` leaves untouched when it backs the rest


def make_tree(root: Path, total: int, content: str = "mixed") -> None:
    """``total`` bytes in 64 MiB files: ``mixed``, half random (weights-like), half
    text-like; ``random``, all random (incompressible: what zstd keeps as raw blocks);
    ``fp16``, float16 N(0, 0.02) weights (zstd saves 8 % of them)."""
    rng = random.Random(42)
    if content == "fp16":
        import numpy as np

        weights = np.random.default_rng(42)
    (root / "weights").mkdir(parents=True)
    for i in range(total // FILE_SIZE):
        with open(root / "weights" / f"shard-{i:03d}.bin", "wb") as f:
            for _ in range(FILE_SIZE // (4 * MIB)):
                if content == "fp16":
                    f.write(weights.normal(0, 0.02, 2 * MIB).astype(np.float16).tobytes())
                    continue
                f.write(rng.randbytes(2 * MIB))
                if content == "random":
                    f.write(rng.randbytes(2 * MIB))
                    continue
                pattern = b"lazyblock %d " % i
                f.write((pattern * (2 * MIB // len(pattern) + 1))[: 2 * MIB])
    (root / "etc").mkdir()
    (root / "etc/config.txt").write_text("bench\n")


def make_layout(tree: Path, layout: Path) -> None:
    tar_path = layout.parent / "layer.tar"
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for p in sorted(tree.rglob("*")):
            info = tar.gettarinfo(str(p), arcname=str(p.relative_to(tree)))
            info.mtime = DEFAULT_MTIME
            if p.is_file():
                with open(p, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    write_oci_layout(layout, [tar_path.read_bytes()], tag="v1")
    tar_path.unlink()


def files_of(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.bin"))


def seq_read(root: Path) -> float:
    """MB/s reading every big file sequentially (1 MiB reads)."""
    total = 0
    start = time.monotonic()
    for p in files_of(root):
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(MIB):
                total += len(chunk)
    return total / (time.monotonic() - start) / 1e6


def rand_read(root: Path, seed: int = 7) -> float:
    """MB/s of 128 KiB preads at random offsets over all big files (4 threads)."""
    rng = random.Random(seed)
    files = files_of(root)
    plan = [
        (rng.choice(files), rng.randrange(0, FILE_SIZE - RANDOM_READ)) for _ in range(RANDOM_COUNT)
    ]
    fds = {p: os.open(p, os.O_RDONLY) for p in files}

    def one(item: tuple[Path, int]) -> int:
        return len(os.pread(fds[item[0]], RANDOM_READ, item[1]))

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        total = sum(pool.map(one, plan))
    elapsed = time.monotonic() - start
    for fd in fds.values():
        os.close(fd)
    return total / elapsed / 1e6


def rand_latency(root: Path, seed: int = 11) -> dict[str, float]:
    """p50 and p90 (us) of 128 KiB preads at random offsets over all big files, one at a
    time: the latency the throughput of ``rand_read`` hides."""
    rng = random.Random(seed)
    files = files_of(root)
    fds = {p: os.open(p, os.O_RDONLY) for p in files}
    try:
        plan = [
            (fds[rng.choice(files)], rng.randrange(0, FILE_SIZE - RANDOM_READ))
            for _ in range(LATENCY_COUNT)
        ]
        return _latencies(lambda fd, offset: os.pread(fd, RANDOM_READ, offset), plan)
    finally:
        for fd in fds.values():
            os.close(fd)


def raw_latency(path: Path, seed: int = 12) -> dict[str, float]:
    """As ``rand_latency``, on one file or block device read with ``O_DIRECT`` at random
    page-aligned offsets (the FUSE file, the loop device: the layers under the mount)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        rng = random.Random(seed)
        plan = [(fd, rng.randrange(0, size - RANDOM_READ) // 4096 * 4096)
                for _ in range(LATENCY_COUNT)]  # fmt: skip
        buf = mmap.mmap(-1, RANDOM_READ)  # page-aligned, as O_DIRECT needs
        return _latencies(lambda fd, offset: os.preadv(fd, [buf], offset), plan)
    finally:
        os.close(fd)


def _latencies(read: Callable[[int, int], object], plan: list[tuple[int, int]]) -> dict[str, float]:
    took = []
    for fd, offset in plan:
        start = time.perf_counter()
        read(fd, offset)
        took.append(time.perf_counter() - start)
    took.sort()
    return {"p50": took[len(took) // 2] * 1e6, "p90": took[len(took) * 9 // 10] * 1e6}


def store_throughput(
    ref: str,
    options: StoreOptions,
    parallel: int = 8,
    cpu: dict[str, float] | None = None,
    pids: dict[str, int] | None = None,
) -> float:
    """MB/s the store serves: every data blob in 16 MiB ranged reads, ``parallel`` at
    once; ``cpu`` (if given) receives ``CpuMeter``'s figures per GB of blob, ``pids`` the
    processes it names."""
    with open_image(ref, options) as img:
        chunks = [
            (blob.digest, o, min(16 * MIB, blob.size - o))
            for blob in img.index.blobs
            for o in range(0, blob.size, 16 * MIB)
        ]
        meter = CpuMeter(pids or {}).start()
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
            total = sum(len(b) for b in pool.map(lambda c: img.store.read_range(*c), chunks))
        elapsed = time.monotonic() - start
        if cpu is not None:
            cpu.update(meter.stop(total / 1e9))
        return total / elapsed / 1e6


def setup(
    work: Path, size: int, reuse: bool, content: str = "mixed", convert: tuple[str, ...] = ()
) -> tuple[Registry, str, Path]:
    """The tree, its OCI layout and the image converted (with ``convert``'s options) in a
    loopback registry; with ``reuse``, what an earlier run left in ``work`` (same size,
    content and options) is used as is."""
    tree = work / "tree"
    marker = work / "converted"
    made = " ".join([str(size), content, *convert]) if convert else str(size)
    if content != "mixed" and not convert:
        made = f"{size} {content}"
    if not (reuse and marker.exists() and marker.read_text() == made):
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        make_tree(tree, size, content)
        make_layout(tree, work / "oci")
        (work / "registry").mkdir()
    registry = Registry(work / "registry")
    ref = f"docker://{registry.host}/bench/image:v1"
    if not marker.exists():
        subprocess.run(
            [sys.executable, "-m", "imagetool.cli", "--plain-http", "convert", "-q",
             *convert, "--tmpdir", str(work), f"oci:{work / 'oci'}:v1", ref],
            check=True, capture_output=True,
        )  # fmt: skip
        marker.write_text(made)
    return registry, ref, tree


def measure_mount(ref: str, work: Path, backing: str, repeats: int) -> dict[str, object]:
    """Mount times of the checkout on ``PYTHONPATH`` (see ``mounttime.py``)."""
    # Its bytecode compiled, as an installed package has it (the environment may say
    # PYTHONDONTWRITEBYTECODE, and compiling every module at every start is no node's cost)...
    checkout = Path(os.environ["PYTHONPATH"])
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(checkout / "snapshotter"),
                    str(checkout / "imagetool")], check=True)  # fmt: skip
    # ...and the server's code in the page cache, as on a node that has mounted before.
    subprocess.run([sys.executable, "-c", "import snapshotter.mount.server"], check=True)
    doc = json.dumps({"ref": ref, "work": str(work), "backing": backing, "repeats": repeats})
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("mounttime.py")), doc],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(proc.stdout.splitlines()[-1])


def measure(
    ref: str,
    work: Path,
    options: StoreOptions,
    backing: str,
    pids: dict[str, int],
    prep: MemoryPrep = MemoryPrep(),
    local_copy: bool = False,
) -> dict[str, object]:
    """One pass of reads over the mount with the snapshotter code on ``PYTHONPATH`` (the
    server started as a new interpreter, so that it is that checkout's); ``pids``: other
    processes whose CPU the cold sequential pass records (the registry); ``prep``: how the
    cold sequential passes meet memory (``MemoryPrep``); ``local_copy``: also
    measure warm reads of a mount whose loop device reads a copy of the image
    (``measure_local_copy``)."""
    out: dict[str, object] = {}
    mnt = work / "mnt"
    mnt.mkdir(exist_ok=True)
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    cfg = MountConfig(cache_dir=cache, cache_size=64 << 30, state_dir=work / "state",
                      prefetch=False, store=options, backing=backing)  # fmt: skip
    api.unmount(mnt, cfg)
    _reset_loop_devices()
    try:
        server = api.mount(ref, mnt, cfg, fork_server=False)
        stats = api.stats(mnt, cfg)
        out["backing"] = stats["backing"]
        out["read_ahead_kb"] = _read_ahead_kb(mnt)
        out["max_sectors_kb"] = _queue_setting(mnt, "max_sectors_kb")
        out["cold_seq_MBps"], out["cold_seq_cpu"], _ = cold_seq_pass(mnt, server.pid, pids, prep)
        stats = api.stats(mnt, cfg)
        fetch = stats["fetch"]
        out["cold_fetch"] = {k: v for k, v in fetch.items() if not isinstance(v, dict)}
        out["cold_fetch"]["readahead_sectors"] = stats.get("readahead_sectors")  # type: ignore[index]
        out["server_memory_MB"] = server_memory(server.pid)
        drop_caches()
        meter = CpuMeter({"mount_server": server.pid}).start()
        out["warm_seq_MBps"] = seq_read(mnt)
        out["warm_seq_cpu"] = meter.stop(sum(p.stat().st_size for p in files_of(mnt)) / 1e9)
        drop_caches()
        meter = CpuMeter({"mount_server": server.pid}).start()
        out["warm_rand_MBps"] = rand_read(mnt)
        out["warm_rand_cpu"] = meter.stop(RANDOM_GB)
        fetch = api.stats(mnt, cfg)["fetch"]
        out["warm_reads"] = fetch["reads"] - out["cold_fetch"]["reads"]  # type: ignore[index]
        out["warm_qd1_us"] = layer_latencies(mnt, cfg)
    finally:
        api.unmount(mnt, cfg)
    # warm random in a new server process: nothing of the cache verified yet
    try:
        fresh = api.mount(ref, mnt, cfg, fork_server=False)
        drop_caches()
        meter = CpuMeter({"mount_server": fresh.pid}).start()
        out["warm_rand_fresh_MBps"] = rand_read(mnt, seed=8)
        out["warm_rand_fresh_cpu"] = meter.stop(RANDOM_GB)
    finally:
        api.unmount(mnt, cfg)
    if local_copy:
        out.update(measure_local_copy(ref, mnt, replace(cfg, backing="loop", local_copy=True)))
    out.update(measure_stages(ref, mnt, cfg, pids, prep))
    # cold random: a fresh cache
    shutil.rmtree(cache, ignore_errors=True)
    try:
        api.mount(ref, mnt, cfg, fork_server=False)
        drop_caches()
        out["cold_rand_MBps"] = rand_read(mnt)
    finally:
        api.unmount(mnt, cfg)
    return out


def measure_stages(
    ref: str, mnt: Path, cfg: MountConfig, pids: dict[str, int], prep: MemoryPrep
) -> dict[str, object]:
    """The cold sequential pass again, from an empty cache, under a system-wide ``perf
    record``: its CPU by process and stage (``cold_seq_stages``), and what the pass cost
    with perf running (``cold_seq_cpu_under_perf``). A pass of its own, because sampling
    at 499 Hz with call chains costs CPU itself: 0.2-0.4 s per GB of image here, in the
    reader, the mount server and perf, which ``cold_seq_cpu`` must not count."""
    out: dict[str, object] = {}
    shutil.rmtree(cfg.cache_dir, ignore_errors=True)
    try:
        server = api.mount(ref, mnt, cfg, fork_server=False)
        stages = CpuStages()  # recording only during the read
        _, out["cold_seq_cpu_under_perf"], gigabytes = cold_seq_pass(
            mnt, server.pid, pids, prep, stages
        )
        named = {"mount_server": server.pid, "reader": os.getpid(), **pids}
        out["cold_seq_stages"] = stages.report(named, gigabytes).get("per_GB", {})
        stages.close()
    finally:
        api.unmount(mnt, cfg)
    return out


def measure_local_copy(ref: str, mnt: Path, cfg: MountConfig) -> dict[str, object]:
    """A fresh mount of the image, whole in the cache, with ``mount.local_copy``: how long
    the copy takes and its server's CPU (from the mount to the loop device's switch), then
    warm reads through the loop device reading the copy, past FUSE."""
    out: dict[str, object] = {}
    try:
        server = api.mount(ref, mnt, cfg, fork_server=False)
        cpu = _process_cpu(server.pid)
        state = wait_for_copy(lambda: api.stats(mnt, cfg)["local_copy"])
        out["local_copy_seconds"] = state["seconds"]
        out["local_copy_server_cpu_s"] = _process_cpu(server.pid) - cpu
        drop_caches()
        out["warm_seq_copy_MBps"] = seq_read(mnt)
        drop_caches()
        out["warm_rand_copy_MBps"] = rand_read(mnt)
    finally:
        api.unmount(mnt, cfg)
    return out


def wait_for_copy(status: Callable[[], dict[str, Any]], timeout: float = 600.0) -> dict[str, Any]:
    """Poll a mount's ``local_copy`` status (``status()``) until its copy is made, and
    return that status; RuntimeError if it will not be."""
    deadline = time.monotonic() + timeout
    while (state := status())["state"] != "done":
        if state["state"] not in ("waiting", "copying") or time.monotonic() > deadline:
            raise RuntimeError(f"no local copy: {state}")
        time.sleep(0.1)
    return state


def cold_seq_pass(
    mnt: Path,
    server_pid: int,
    pids: dict[str, int],
    prep: MemoryPrep,
    stages: CpuStages | None = None,
) -> tuple[float, dict[str, float], float]:
    """One cold sequential read of the whole mount, the page cache dropped and memory met
    as ``prep`` says (``MemoryPrep``); ``stages``: a ``CpuStages`` recording, kept to the
    read. Returns (MB/s, ``CpuMeter``'s CPU per GB of the mount server, ``pids`` and the
    reader, GB of image read)."""
    drop_caches()
    if size := prep.bytes_to_back():
        back_memory(size)
    meter = CpuMeter({"mount_server": server_pid, **pids}).start()
    with stages if stages is not None else contextlib.nullcontext():
        mbps = seq_read(mnt)
    gigabytes = sum(p.stat().st_size for p in files_of(mnt)) / 1e9
    return mbps, meter.stop(gigabytes), gigabytes


def checkouts(variants: list[str]) -> dict[str, Path]:
    """This checkout as ``current``, and each ``--variant NAME=DIR`` (made absolute): the
    code each round measures, by name (this benchmark's, ``datapath.py``'s, ``wakeups.py``'s).
    """
    out = {"current": ROOT}
    for spec in variants:
        name, _, path = spec.partition("=")
        out[name] = Path(path).resolve()
    return out


def back_memory(size: int) -> None:
    """Write to ``size`` bytes of fresh anonymous memory and free them: the host backs that
    much of the guest's free memory again. Under free page reporting (``machine_facts``) the
    host takes back free memory in blocks of 2^``page_reporting_order`` pages, which are the
    blocks a large page-cache folio is allocated from; the first write to each of their
    pages then costs a fault on the host, which this VM charges to the writer (the mount
    server's FUSE replies: ~1.5 CPU-s per GB of a cold pass with 4 MiB read-ahead, measured
    in the results README). A host without free page reporting, or bare metal, has no such
    cost; ``--backed-memory`` measures the data path as it would run there."""
    with mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as m:
        for offset in range(0, size, mmap.PAGESIZE):
            m[offset] = 1


REPORTING_ORDER = Path("/sys/module/page_reporting/parameters/page_reporting_order")


@contextlib.contextmanager
def reporting_held(hold: bool) -> Iterator[None]:
    """With ``hold``, free page reporting paused for the block: ``page_reporting_order``
    set above the largest order the page allocator has (``/proc/buddyinfo``), so that no
    free block is large enough to be reported, and put back after. A measuring condition,
    not a setting lazyblock asks of a node: on bare metal, or a host that keeps its guests'
    memory, no free memory is taken back at all. Without reporting (no such parameter), a
    no-op."""
    if not hold or not REPORTING_ORDER.exists():
        yield
        return
    orders = max(len(line.split()) - 4 for line in Path("/proc/buddyinfo").read_text().splitlines())
    before = REPORTING_ORDER.read_text().strip()
    REPORTING_ORDER.write_text(str(orders))
    try:
        yield
    finally:
        REPORTING_ORDER.write_text(before)


def layer_latencies(mnt: Path, cfg: MountConfig) -> dict[str, dict[str, float]]:
    """Warm random reads one at a time, through the mount and through each layer under it:
    the FUSE file the server answers, and the loop device on it (when there is one). Where a
    read's time goes on this machine, the page cache dropped before each."""
    stats = api.stats(mnt, cfg)
    layers = {"fuse_file": state.mount_dir(cfg.state_dir, mnt) / state.FUSE_DIR / IMAGE_NAME}
    if stats.get("loop_device"):
        layers["loop_device"] = Path(stats["loop_device"])
    out = {}
    for name, path in layers.items():
        drop_caches()
        out[name] = raw_latency(path)
    drop_caches()
    out["mount"] = rand_latency(mnt)
    return out


def _reset_loop_devices() -> None:
    """Put the request size of every free loop device back to the kernel's default: a
    checkout that tunes it leaves it so on the device, and the next variant to get that
    device would inherit it."""
    for queue in Path("/sys/block").glob("loop*/queue"):
        if (queue.parent / "loop" / "backing_file").exists():
            continue  # in use
        try:
            (queue / "max_sectors_kb").write_text((queue / "max_hw_sectors_kb").read_text())
        except OSError:
            pass


def _queue_setting(mnt: Path, name: str) -> int | None:
    dev = os.stat(mnt).st_dev
    try:
        return int(Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/queue/{name}").read_text())
    except OSError:
        return None


def _read_ahead_kb(mnt: Path) -> int | None:
    name = kernel.bdi_name(mnt)  # a loop device's, or a file-backed erofs mount's own
    try:
        return int(Path(f"{kernel.SYS_BDI}/{name}/read_ahead_kb").read_text()) if name else None
    except OSError:
        return None


def machine_facts() -> dict[str, object]:
    """What the figures depend on besides the code. ``free_page_reporting``: the VM's
    balloon hands memory freed in the guest back to the host (virtio-balloon's REPORTING
    feature), in blocks of 2^``page_reporting_order`` pages: the host then backs a page again
    only when the guest next touches it, and filling the page cache of a cold pass (every
    page new) costs several times what filling pages already backed does (results README,
    session 10)."""
    facts: dict[str, object] = {"cpus": os.cpu_count(), "kernel": os.uname().release}
    reporting = False
    for features in Path("/sys/bus/virtio/drivers/virtio_balloon").glob("virtio*/features"):
        bits = features.read_text().strip()
        reporting |= len(bits) > 5 and bits[5] == "1"  # VIRTIO_BALLOON_F_REPORTING
    facts["free_page_reporting"] = reporting
    order = Path("/sys/module/page_reporting/parameters/page_reporting_order")
    if reporting and order.exists():
        facts["page_reporting_order"] = int(order.read_text())
    return facts


def _median_stages(rows: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per process and stage, the median over rounds (a stage a round lacks counts 0)."""
    out: dict[str, dict[str, float]] = {}
    for name in {n for row in rows for n in row}:
        stages = {s for row in rows for s in row.get(name, {})}
        out[name] = {s: median([row.get(name, {}).get(s, 0.0) for row in rows]) for s in stages}
        out[name] = dict(sorted(out[name].items(), key=lambda kv: -kv[1]))
    return dict(sorted(out.items(), key=lambda kv: -kv[1].get("total", 0.0)))


def median(values: list[float]) -> float:
    return statistics.median(values)


def _median_of(rows: list[dict[str, float]]) -> dict[str, float]:
    """Key by key medians of rows with the same keys."""
    return {k: median([row[k] for row in rows]) for k in rows[0]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=2 << 30, help="image bytes (default 2 GiB)")
    parser.add_argument(
        "--format-version",
        choices=["1", "2"],
        default="2",
        help="block format the image is converted to",
    )
    parser.add_argument("--raw-saving", help="imagetool convert --raw-saving (format 2)")
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/lazyblock-bench"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--backing", default="auto")
    parser.add_argument(
        "--backed-memory", type=float, default=0, metavar="GIB",
        help="have the host back this much free memory just before each cold pass (back_memory)",
    )  # fmt: skip
    parser.add_argument(
        "--hold-reporting", action="store_true",
        help="pause the VM's free page reporting for the run and back all free memory before "
        "each cold pass: the data path as on a host that does not take memory back (MemoryPrep)",
    )  # fmt: skip
    parser.add_argument(
        "--local-copy", action="store_true",
        help="also read a warm mount whose loop device reads a local copy (mount.local_copy)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds; medians")
    parser.add_argument("--reuse", action="store_true", help="keep the image of an earlier run")
    parser.add_argument(
        "--content", choices=("mixed", "random", "fp16"), default="mixed",
        help="mixed: half random, half text-like (default); random: incompressible; fp16: "
        "float16 weights",
    )  # fmt: skip
    parser.add_argument("--mount-only", action="store_true", help="measure only mount times")
    parser.add_argument("--mount-repeats", type=int, default=3, help="mounts per round (median)")
    parser.add_argument(
        "--link", choices=sorted(netns.PRESETS), metavar="PRESET",
        help="serve the store from another network namespace over a shaped link "
        f"({', '.join(sorted(netns.PRESETS))}) instead of loopback",
    )  # fmt: skip
    parser.add_argument(
        "--variant", action="append", default=[], metavar="NAME=DIR",
        help="also measure the snapshotter in DIR (a checkout), interleaved with this one",
    )  # fmt: skip
    args = parser.parse_args()
    work: Path = args.work
    variants = {name: str(path) for name, path in checkouts(args.variant).items()}
    t = time.monotonic()
    convert = ["--format-version", args.format_version]
    if args.raw_saving is not None:
        convert += ["--raw-saving", args.raw_saving]
    registry, ref, tree = setup(work, args.size, args.reuse, args.content, tuple(convert))
    results: dict[str, object] = {
        "image_bytes": args.size,
        "content": args.content,
        "convert": convert,
        "setup_seconds": time.monotonic() - t,
        "machine": machine_facts(),
        "backed_memory_GiB": args.backed_memory,
        "reporting_held": args.hold_reporting,
    }
    prep = MemoryPrep(int(args.backed_memory * (1 << 30)), args.hold_reporting)
    remote = None
    options = StoreOptions(plain_http=True)
    runs: dict[str, list[dict[str, object]]] = {name: [] for name in variants}
    base: dict[str, list[float]] = {
        "store_MBps": [], "local_seq_MBps": [], "local_rand_MBps": [], "local_rand_qd1_p50_us": []
    }  # fmt: skip
    store_cpu: list[dict[str, float]] = []
    local_rand_cpu: list[dict[str, float]] = []
    pids = {"registry": registry.proc.pid}
    held = contextlib.ExitStack()
    try:
        held.enter_context(reporting_held(args.hold_reporting))
        if args.link:
            # The same registry storage, served from the "remote" namespace.
            registry.stop()
            remote = netns.RemoteHost(netns.NetConfig(), work / "remote")
            remote.up()
            host = remote.start_registry(work / "registry" / "data")
            remote.shape(netns.PRESETS[args.link])
            ref = f"docker://{host}/bench/image:v1"
            results["link"] = args.link
            pids = {"registry": remote.registry_pid}
        with open_image(ref, options) as img:
            results["blob_bytes"] = sum(b.size for b in img.index.blobs)
        for round_ in range(args.rounds):
            if not args.mount_only:
                drop_caches()
                store_cpu.append({})
                base["store_MBps"].append(
                    store_throughput(ref, options, cpu=store_cpu[-1], pids=pids)
                )
                drop_caches()
                base["local_seq_MBps"].append(seq_read(tree))
                drop_caches()
                meter = CpuMeter({}).start()
                base["local_rand_MBps"].append(rand_read(tree))
                local_rand_cpu.append(meter.stop(RANDOM_GB))
                drop_caches()
                base["local_rand_qd1_p50_us"].append(rand_latency(tree)["p50"])
            # Alternate the variants' order: what runs first after the references meets the
            # machine in another state (page cache, disk queue) than what follows it.
            order = list(variants.items())
            for name, path in order if round_ % 2 == 0 else reversed(order):
                os.environ["PYTHONPATH"] = path
                out = measure_mount(ref, work, args.backing, args.mount_repeats)
                if not args.mount_only:
                    out.update(measure(ref, work, options, args.backing, pids, prep,
                                       args.local_copy))  # fmt: skip
                runs[name].append(out)
            if remote is not None:
                remote.check()
    finally:
        held.close()
        os.environ.pop("PYTHONPATH", None)
        registry.stop()
        if remote is not None:
            remote.close()
    results.update({k: median(v) for k, v in base.items() if v})
    results["per_round"] = {k: v for k, v in base.items() if v}  # the spread behind a median
    if store_cpu:
        results["store_cpu"] = _median_of(store_cpu)
    if local_rand_cpu:
        results["local_rand_cpu"] = _median_of(local_rand_cpu)
    results["rounds"] = args.rounds
    ratio = args.size / results["blob_bytes"]  # type: ignore[operator]
    for name, passes in runs.items():
        r: dict[str, object] = {
            k: median([p[k] for p in passes])  # type: ignore[misc]
            for k in passes[0]
            if isinstance(passes[0][k], float | int)
        }
        for key in ("cli_first_mount_breakdown", "first_mount_breakdown", "mount_breakdown",
                    "mount_launch", "remount_breakdown", "remount_launch"):  # fmt: skip
            if key in passes[-1]:
                r[key] = passes[-1][key]
        r["targets"] = {"mount_under_0.5s": r["mount_seconds"] < 0.5}  # type: ignore[operator]
        r["per_round"] = {
            k: [p[k] for p in passes]
            for k in passes[0]
            if k.endswith(("_MBps", "_seconds")) and isinstance(passes[0][k], float | int)
        }
        if args.mount_only:
            results[name] = r
            continue
        r["cold_seq_cpu"] = cpu = _median_of([p["cold_seq_cpu"] for p in passes])  # type: ignore[misc]
        r["per_round"]["cold_seq_cpu"] = [p["cold_seq_cpu"] for p in passes]
        cpus = os.cpu_count() or 1
        r["cold_seq_cpu_bound_MBps"] = cpus / cpu["machine"] * 1e3
        target = 0.7 * results["store_MBps"] / 1e3  # type: ignore[operator]  # GB/s of image
        r["cold_seq_cpu_per_GB_for_target"] = cpus / target
        r["cold_fetch"] = passes[-1]["cold_fetch"]
        r["server_memory_MB"] = _median_of([p["server_memory_MB"] for p in passes])  # type: ignore[misc]
        r["cold_seq_stages"] = _median_stages([p["cold_seq_stages"] for p in passes])  # type: ignore[misc]
        for key in ("warm_seq_cpu", "warm_rand_cpu", "warm_rand_fresh_cpu"):
            r[key] = _median_of([p[key] for p in passes])  # type: ignore[misc]
        r["cold_seq_cpu_under_perf"] = _median_of([p["cold_seq_cpu_under_perf"] for p in passes])  # type: ignore[misc]
        layers = passes[0]["warm_qd1_us"]
        r["warm_qd1_us"] = {
            layer: _median_of([p["warm_qd1_us"][layer] for p in passes])  # type: ignore[index]
            for layer in layers  # type: ignore[union-attr]
        }
        r["backing"] = passes[-1]["backing"]
        r["read_ahead_kb"] = passes[-1]["read_ahead_kb"]
        r["max_sectors_kb"] = passes[-1]["max_sectors_kb"]
        # The store serves compressed blob bytes; a read through the mount returns image
        # bytes. Both ways of comparing are reported.
        r["cold_seq_blob_MBps"] = r["cold_seq_MBps"] / ratio  # type: ignore[operator]
        r["targets"] |= {
            "warm_seq_vs_local": r["warm_seq_MBps"] / results["local_seq_MBps"],  # type: ignore[operator]
            "warm_rand_vs_local": r["warm_rand_MBps"] / results["local_rand_MBps"],  # type: ignore[operator]
            **({
                "warm_seq_copy_vs_local": r["warm_seq_copy_MBps"] / results["local_seq_MBps"],  # type: ignore[operator]
                "warm_rand_copy_vs_local": r["warm_rand_copy_MBps"] / results["local_rand_MBps"],  # type: ignore[operator]
            } if "warm_rand_copy_MBps" in r else {}),
            "cold_seq_vs_store": r["cold_seq_MBps"] / results["store_MBps"],  # type: ignore[operator]
            "cold_seq_blob_vs_store": r["cold_seq_blob_MBps"] / results["store_MBps"],  # type: ignore[operator]
        }  # fmt: skip
        results[name] = r
    report(results, args.json)
    for name in variants:
        stages = results[name].get("cold_seq_stages")  # type: ignore[union-attr]
        if stages:
            print(f"cold sequential, CPU-s per GB of image by stage ({name}):", file=sys.stderr)
            print(format_report({"per_GB": stages}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
