"""One EROFS image of the flattened tree (what format v2 mounts: its regions are per layer,
its tree is one) against an overlay of one EROFS image per layer (what OverlayBD-like
designs mount), on the same files, in one run.

The image: ``--layers`` layers of ``--files`` small files each in 100 directories; every
upper layer replaces a tenth of the files below it and adds its own. Both forms are built
with ``mkfs.erofs`` (erofs-utils, uncompressed) and loop-mounted read-only; the overlay
stacks the layers' mounts as ``lowerdir``s. Measured, rounds interleaved, medians:

* ``mount_s``: loop devices, erofs mounts and the overlay, from nothing to a browsable tree;
* ``walk_cold_s``: ``lstat`` of every entry (``os.walk``), page cache dropped;
* ``read_cold_s``: open and read 2,000 files at random, page cache dropped;
* ``walk_warm_s``: the walk again.

Usage: python benchmarks/format/layouts.py [--layers 6] [--files 5000] [--rounds 3]
Needs root and erofs-utils.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from benchmarks.format.raw_sectors import save  # noqa: E402


def _drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def make_layers(root: Path, layers: int, files: int) -> list[Path]:
    rng = random.Random(6)
    dirs = []
    for k in range(layers):
        d = root / f"layer{k}"
        for i in range(files):
            if k and i % 10:  # a tenth of the lower layer's files replaced, the rest new
                name = f"d{i % 100:02d}/l{k}-f{i:05d}.py"
            else:
                name = f"d{i % 100:02d}/f{i:05d}.py"
            p = d / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(rng.randbytes(rng.randint(200, 6000)))
        dirs.append(d)
    return dirs


def mkfs(tree: Path, out: Path) -> Path:
    subprocess.run(["mkfs.erofs", "--quiet", str(out), str(tree)], check=True)
    return out


def _mount_loop(image: Path, mnt: Path) -> None:
    mnt.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "erofs", "-o", "loop,ro", str(image), str(mnt)], check=True)


def mount_flat(image: Path, work: Path) -> Path:
    mnt = work / "flat"
    _mount_loop(image, mnt)
    return mnt


def mount_overlay(images: list[Path], work: Path) -> Path:
    lowers = []
    for k, image in enumerate(images):
        _mount_loop(image, work / f"lower{k}")
        lowers.append(str(work / f"lower{k}"))
    mnt = work / "overlay"
    mnt.mkdir(exist_ok=True)
    lowerdir = ":".join(reversed(lowers))  # top layer first
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"ro,lowerdir={lowerdir}",
                    str(mnt)], check=True)  # fmt: skip
    return mnt


def unmount_all(work: Path) -> None:
    for name in ["overlay", "flat", *sorted(p.name for p in work.glob("lower*"))]:
        if (work / name).is_mount():
            subprocess.run(["umount", str(work / name)], check=True)


def walk(root: Path) -> tuple[float, list[Path]]:
    start = time.monotonic()
    found = []
    for dirpath, dirs, names in os.walk(root):
        for name in dirs + names:
            os.lstat(os.path.join(dirpath, name))
        found += [Path(dirpath) / n for n in names]
    return time.monotonic() - start, found


def read_random(files: list[Path], count: int = 2000) -> float:
    picked = random.Random(9).sample(files, min(count, len(files)))
    start = time.monotonic()
    for p in picked:
        p.read_bytes()
    return time.monotonic() - start


def measure(form: str, images: list[Path], flat: Path, work: Path) -> dict[str, float]:
    _drop_caches()
    start = time.monotonic()
    mnt = mount_flat(flat, work) if form == "flat" else mount_overlay(images, work)
    out = {"mount_s": time.monotonic() - start}
    try:
        _drop_caches()
        out["walk_cold_s"], files = walk(mnt)
        _drop_caches()
        out["read_cold_s"] = read_random(files)
        out["walk_warm_s"] = walk(mnt)[0]
        out["entries"] = len(files)
    finally:
        unmount_all(work)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--files", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "layouts.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lazyblock-layouts-", dir="/var/tmp"))
    try:
        dirs = make_layers(work / "src", args.layers, args.files)
        images = [mkfs(d, work / f"layer{k}.erofs") for k, d in enumerate(dirs)]
        merged = work / "merged"
        merged.mkdir()
        for d in dirs:  # no deletions: the flattened tree is the layers copied in order
            subprocess.run(["cp", "-a", f"{d}/.", str(merged)], check=True)
        flat = mkfs(merged, work / "flat.erofs")
        rows: dict[str, list[dict[str, float]]] = {"flat": [], "overlay": []}
        for round_ in range(args.rounds):
            for form in ("flat", "overlay") if round_ % 2 == 0 else ("overlay", "flat"):
                rows[form].append(measure(form, images, flat, work))
                print(round_, form, rows[form][-1], flush=True)
        results = {
            "layers": args.layers,
            "files_per_layer": args.files,
            "rounds": args.rounds,
            **{
                form: {k: round(statistics.median(r[k] for r in rs), 4) for k in rs[0]}
                for form, rs in rows.items()
            },
            "per_round": rows,
        }
    finally:
        unmount_all(work)
        shutil.rmtree(work, ignore_errors=True)
    save(results, args.out, "per_round")


if __name__ == "__main__":
    main()
