"""The sector cache's cap under parallel readers (needs root and FUSE).

    python benchmarks/mount/cachecap.py [--size BYTES] [--cap BYTES] [--readers N]
        [--work DIR] [--json out.json]

Two images of ``--size`` bytes each (the mount benchmark's mixed content: half random, half
text-like) in a directory store, both mounted with one cache of ``--cap`` bytes, read by
``--readers`` threads (alternating between the images, each file in a shuffled order, every
byte checked against the tree's sha256). Meanwhile the cache directory is sampled two ways:

* ``du``: every regular file under the cache directory (entries, reservations in ``wip/``,
  the counter file, the index cache), apparent sizes, every 0.1 s without any lock, as
  ``du --apparent-size`` would (what issue 24 measured: 71.6 MB under a 64 MiB cap). A walk
  that races the writers can count a file twice (seen in ``wip/``, then renamed into place)
  or an evicted entry beside the reservation that replaced it, so it may read a little high;
* ``locked``: the entries and reservations under ``v3/``, apparent and allocated bytes,
  every 20 ms holding the directory's lock (what every process takes to reserve, install
  or delete an entry): one moment's exact state.

Prints (and with ``--json`` writes) the peaks against the cap, the reads' wrong files (0
expected) and the sectors served without being cached for want of room.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from benchmarks.mount.run import drop_caches, make_layout  # noqa: E402
from snapshotter.cache.sectors import LAYOUT_VERSION, USAGE_FILE  # noqa: E402
from snapshotter.config import MountConfig  # noqa: E402
from snapshotter.mount import api  # noqa: E402

MIB = 1 << 20


def make_tree(root: Path, total: int, seed: int) -> None:
    """``total`` bytes in 64 MiB files, half random and half text-like (the mount
    benchmark's mixed content), of their own ``seed``: no sector shared between images."""
    rng = random.Random(seed)
    (root / "weights").mkdir(parents=True)
    for i in range(max(1, total // (64 * MIB))):
        with open(root / "weights" / f"shard-{i:03d}.bin", "wb") as f:
            for _ in range(16):
                f.write(rng.randbytes(2 * MIB))
                pattern = b"lazyblock %d %d " % (seed, i)
                f.write((pattern * (2 * MIB // len(pattern) + 1))[: 2 * MIB])


def _digests(tree: Path) -> dict[str, str]:
    out = {}
    for p in sorted(tree.rglob("*.bin")):
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(4 * MIB):
                h.update(chunk)
        out[str(p.relative_to(tree))] = h.hexdigest()
    return out


def build(work: Path, size: int) -> list[tuple[str, dict[str, str]]]:
    """Two images of ``size`` bytes: (directory store reference, file -> sha256)."""
    images = []
    for n in (1, 2):
        tree, layout = work / f"tree{n}", work / f"oci{n}"
        make_tree(tree, size, seed=n)
        make_layout(tree, layout)
        ref = str(work / "store" / f"img{n}:v1")
        subprocess.run(
            [sys.executable, "-m", "imagetool.cli", "convert", "-q", "--tmpdir", str(work),
             f"oci:{layout}:v1", ref],
            check=True, capture_output=True,
        )  # fmt: skip
        images.append((ref, _digests(tree)))
        shutil.rmtree(tree)
        shutil.rmtree(layout)
    return images


def du_sample(cache_dir: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(cache_dir):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass
    return total


def locked_sample(layout: Path) -> tuple[int, int]:
    with open(layout / USAGE_FILE, "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            apparent = allocated = 0
            for dirpath, _, names in os.walk(layout):
                for name in names:
                    if name == USAGE_FILE and dirpath == str(layout):
                        continue
                    try:
                        st = os.lstat(os.path.join(dirpath, name))
                    except FileNotFoundError:
                        continue
                    apparent += st.st_size
                    allocated += st.st_blocks * 512
            return apparent, allocated
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_all(mnt: Path, expected: dict[str, str], seed: int) -> tuple[int, int]:
    """(wrong files, bytes read)."""
    paths = sorted(expected)
    random.Random(seed).shuffle(paths)
    wrong = total = 0
    for p in paths:
        h = hashlib.sha256()
        with open(mnt / p, "rb") as f:
            while chunk := f.read(MIB):
                h.update(chunk)
                total += len(chunk)
        wrong += h.hexdigest() != expected[p]
    return wrong, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=512 * MIB)
    ap.add_argument("--cap", type=int, default=64 * MIB)
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/lazyblock-cachecap"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    images = build(args.work, args.size)
    cfg = MountConfig(
        cache_dir=args.work / "cache", cache_size=args.cap, state_dir=args.work / "state",
        prefetch=False,
    )  # fmt: skip
    mounts = []
    try:
        for i, (ref, expected) in enumerate(images):
            mnt = args.work / f"mnt{i}"
            mnt.mkdir()
            api.mount(ref, mnt, cfg)
            mounts.append((mnt, expected))
        layout = cfg.cache_dir / LAYOUT_VERSION
        peaks = {"du": 0, "locked_apparent": 0, "locked_allocated": 0}
        counts = {"du": 0, "locked": 0}
        stop = threading.Event()

        def du_loop() -> None:
            while not stop.is_set():
                peaks["du"] = max(peaks["du"], du_sample(cfg.cache_dir))
                counts["du"] += 1
                time.sleep(0.1)

        def locked_loop() -> None:
            while not stop.is_set():
                apparent, allocated = locked_sample(layout)
                peaks["locked_apparent"] = max(peaks["locked_apparent"], apparent)
                peaks["locked_allocated"] = max(peaks["locked_allocated"], allocated)
                counts["locked"] += 1
                time.sleep(0.02)

        drop_caches()
        samplers = [threading.Thread(target=f) for f in (du_loop, locked_loop)]
        for t in samplers:
            t.start()
        start = time.monotonic()
        try:
            with ThreadPoolExecutor(args.readers) as pool:
                jobs = [
                    pool.submit(read_all, *mounts[r % len(mounts)], r) for r in range(args.readers)
                ]
                results = [j.result() for j in jobs]
        finally:
            stop.set()
            for t in samplers:
                t.join()
        seconds = time.monotonic() - start
        stats = [api.stats(mnt, cfg) for mnt, _ in mounts]
        out = {
            "cap": args.cap,
            "image_bytes": args.size,
            "readers": args.readers,
            "bytes_read": sum(t for _, t in results),
            "seconds": round(seconds, 2),
            "wrong_files": sum(w for w, _ in results),
            "read_errors": sum(s["reads"]["errors"] for s in stats),
            "sectors_fetched": sum(s["fetch"]["sectors_fetched"] for s in stats),
            "uncached": sum(s["cache"]["uncached"] for s in stats),
            "peak": peaks,
            "peak_over_cap": {k: round(v / args.cap, 4) for k, v in peaks.items()},
            "samples": counts,
        }
    finally:
        for mnt, _ in mounts:
            api.unmount(mnt, cfg, lazy=True)
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
