"""The data path without FUSE: a mount server's fetcher and reader in one process, reading
the mount benchmark's image cold, against the essential work of the same bytes (needs the
``docker-registry`` binary for the loopback store; no root, no FUSE).

    python benchmarks/mount/datapath.py [--work /var/tmp/lazyblock-bench] [--size BYTES]
        [--rounds 3] [--reuse] [--variant NAME=CHECKOUT ...] [--json out.json]

``run.py``'s cold pass counts everything a node pays: the reader, the kernel's FUSE reply
into the page cache, the loop device. On a VM the reply's cost swings with the host's
memory reclaim (0.2 to 2 CPU-s per GB from one pass to the next), which hides changes of a
tenth of a CPU-second in the code. This benchmark leaves the kernel side out. Each round,
in a new interpreter running the checkout (``PYTHONPATH``: this one and each ``--variant``),
with ``snapshotter.mount.memory.tune()`` as a mount server has it:

* ``data_path``: a ``SectorFetcher`` and ``BlockReader`` over the registry store and an
  empty node cache, as a mount server builds them (default ``MountConfig``), answer the
  whole image in 1 MiB ``read_parts`` calls, 4 MiB at a time on 12 threads (a FUSE
  connection's requests for one read-ahead window: ``max_background`` is 12). Its CPU
  seconds per GB of image: fetching, verifying, caching, and serving from memory;
* ``receive``: the same blob bytes read from the same store in one ranged read per blob
  into memory touched beforehand (the socket's copy and the HTTP client);
* ``decode_hash``: every sector decoded and hashed from those bytes on one thread
  (``Index.decode_sector_into``, the codec the fetcher uses; raw sectors hashed) into one
  reused buffer;
* ``overhead``: ``data_path`` less the two: threads and their wake-ups, the interpreter, the
  node cache's writes, page faults of sector memory. What a compiled read path could save
  is at most this.

Medians over ``--rounds``, every round under ``per_round``; ``minor_faults_per_sector``
counts the data path's page faults.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import queue
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MIB = 1 << 20
READ = MIB  # a FUSE READ of the loop device's requests
WINDOW = 4 * MIB  # the mount's read-ahead window
THREADS = 12  # FUSE's max_background: the requests in flight at once


def _cpu() -> tuple[float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt


def child(doc: dict[str, Any]) -> dict[str, Any]:
    """One part of a round (``doc["part"]``: "data_path" or "essential") in this
    interpreter, the checkout on ``PYTHONPATH``."""
    from imagetool.image import open_image
    from imagetool.stores.base import StoreOptions
    from snapshotter.cache.entry import EntryBuffer
    from snapshotter.cache.sectors import SectorCache
    from snapshotter.config import MountConfig
    from snapshotter.datapath.fetcher import VERIFY_BLOCK, SectorFetcher
    from snapshotter.datapath.reader import BlockReader, scratch_memory
    from snapshotter.metrics import MountMetrics
    from snapshotter.mount import memory

    memory.tune()
    cache_dir = Path(doc["cache"])
    shutil.rmtree(cache_dir, ignore_errors=True)
    cfg = MountConfig(cache_dir=cache_dir, cache_size=64 << 30, store=StoreOptions(plain_http=True))
    opened = open_image(doc["ref"], cfg.store)
    index = opened.index
    gigabytes = index.image_size / 1e9
    out: dict[str, Any] = {}
    if doc["part"] == "essential":
        out.update(essential(opened, gigabytes, EntryBuffer(index.sector_size), VERIFY_BLOCK))
        opened.store.close()
        return out
    size = index.image_size
    fetcher = SectorFetcher(opened.store, index, SectorCache(cache_dir, cfg.cache_size),
                            cfg.fetch, MountMetrics())  # fmt: skip
    reader = BlockReader(index, fetcher, cfg.memory_sectors, timeout=cfg.read_timeout,
                         readahead_bytes=cfg.readahead_bytes)  # fmt: skip
    requests: queue.Queue[tuple[int, threading.Semaphore] | None] = queue.Queue()
    errors: list[BaseException] = []

    def serve() -> None:
        scratch = scratch_memory(2 * READ)
        while (item := requests.get()) is not None:
            offset, done = item
            try:
                got = sum(len(p) for p in reader.read_parts(offset, READ, scratch))
                if got != min(READ, size - offset):
                    raise RuntimeError(f"read {offset}+{READ} returned {got} bytes")
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)
            done.release()

    workers = [threading.Thread(target=serve, daemon=True) for _ in range(THREADS)]
    for t in workers:
        t.start()
    # With ``stages``, the reads under ``perf record -p``: their CPU by stage. The tool is
    # this script's own (beside it), whatever checkout is measured.
    sys.path.insert(0, str(HERE.parent))
    from cpustages import CpuStages

    stages = CpuStages(pid=os.getpid()) if doc.get("stages") else None
    with stages if stages is not None else contextlib.nullcontext():
        cpu0, faults0 = _cpu()
        start = time.monotonic()
        for window in range(0, size, WINDOW):
            done = threading.Semaphore(0)
            offsets = range(window, min(size, window + WINDOW), READ)
            for offset in offsets:
                requests.put((offset, done))
            for _ in offsets:
                done.acquire()
        seconds = time.monotonic() - start
        cpu1, faults1 = _cpu()
    if stages is not None:
        table = stages.report({"data_path": os.getpid()}, size / 1e9)["per_GB"]
        out["stages"] = table.get("data_path", {})  # type: ignore[union-attr]
        stages.close()
    for _ in workers:
        requests.put(None)
    for t in workers:
        t.join()
    fetcher.close()
    opened.store.close()
    shutil.rmtree(cache_dir, ignore_errors=True)
    if errors:
        raise errors[0]
    stored = [s for s in index.sectors if not s.is_zero]
    out["image_GB"] = gigabytes
    out["data_path_MBps"] = size / 1e6 / seconds
    out["data_path"] = (cpu1 - cpu0) / gigabytes
    out["minor_faults_per_sector"] = (faults1 - faults0) / max(1, len(stored))
    return out


def essential(opened: Any, gigabytes: float, decoded: Any, block: int) -> dict[str, float]:
    """The essential work of the image's bytes: receive them, then decode and hash them."""
    index = opened.index
    out = {}
    blobs: dict[str, bytearray] = {}
    for blob in index.blobs:  # memory touched before: its page faults are not the socket's
        blobs[blob.digest] = bytearray(blob.size)
        ctypes.memset((ctypes.c_char * blob.size).from_buffer(blobs[blob.digest]), 1, blob.size)
    cpu0, _ = _cpu()
    for blob in index.blobs:
        buf = blobs[blob.digest]
        with opened.store.open_range(blob.digest, 0, blob.size) as body:
            body.readinto(memoryview(buf))
    cpu1, _ = _cpu()
    out["receive"] = (cpu1 - cpu0) / gigabytes
    cpu0, _ = _cpu()
    for n, entry in enumerate(index.sectors):
        if entry.is_zero:
            continue
        view = memoryview(blobs[index.blobs[entry.blob].digest])[
            entry.offset : entry.offset + entry.length
        ]
        if entry.raw:
            index.verify_raw(n, view, block)
        else:
            target = decoded.data[: index.sector_span(n)[1]]
            index.decode_sector_into(n, view, target, block)
    cpu1, _ = _cpu()
    out["decode_hash"] = (cpu1 - cpu0) / gigabytes
    return out


def run_part(checkout: Path, ref: str, cache: Path, part: str, stages: bool = False
             ) -> dict[str, Any]:  # fmt: skip
    """``child``'s ``part`` in a new interpreter running ``checkout``; with ``stages``, its
    reads split by stage under ``perf`` (``stages`` in the result)."""
    doc = {"ref": ref, "cache": str(cache), "part": part, "stages": stages}
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(doc)], env=env,
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"data path {part} of {checkout} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def run_round(checkout: Path, ref: str, cache: Path) -> dict[str, Any]:
    out = run_part(checkout, ref, cache, "data_path")
    out.update(run_part(checkout, ref, cache, "essential"))
    out["overhead"] = out["data_path"] - out["receive"] - out["decode_hash"]
    return out


def data_path_stages(checkout: Path, ref: str, cache: Path) -> dict[str, float]:
    """The data path once more under ``perf record``: its CPU per GB of image by stage
    (``benchmarks/cpustages.py``'s rules); empty where perf cannot record."""
    if shutil.which("perf") is None:
        return {}
    try:
        return run_part(checkout, ref, cache, "data_path", stages=True)["stages"]
    except SystemExit as e:
        print(f"no stages: {e}", file=sys.stderr)
        return {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/lazyblock-bench"))
    parser.add_argument("--size", type=int, default=2 << 30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reuse", action="store_true")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=CHECKOUT")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--stages", action="store_true",
                        help="also split the data path's CPU by stage under perf")  # fmt: skip
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # the checkout's own code, from PYTHONPATH
        print(json.dumps(child(json.loads(args.child))))
        return 0
    sys.path.insert(0, str(HERE))
    from run import checkouts as checkouts_of  # importing run puts ROOT on sys.path
    from run import report, setup

    checkouts = checkouts_of(args.variant)
    registry, ref, _ = setup(args.work, args.size, args.reuse)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in checkouts}
    try:
        for _ in range(args.rounds):
            for name, checkout in checkouts.items():  # interleaved: the machine drifts
                rows[name].append(run_round(checkout, ref, args.work / "datapath-cache"))
                print(name, json.dumps({k: round(v, 3) for k, v in rows[name][-1].items()}),
                      file=sys.stderr)  # fmt: skip
        results: dict[str, Any] = {"image_bytes": args.size, "rounds": args.rounds}
        for name, per_round in rows.items():
            results[name] = {k: statistics.median(r[k] for r in per_round) for k in per_round[0]}
            results[name]["per_round"] = per_round
            if args.stages:
                results[name]["data_path_stages"] = data_path_stages(
                    checkouts[name], ref, args.work / "datapath-cache"
                )
    finally:
        registry.stop()
    report(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
