"""Warm small-file reads through a mount against local disk (needs root and FUSE).

    python benchmarks/mount/smallfiles.py [--tree DIR] [--pattern '*.py'] [--rounds 3]
        [--work /var/tmp/lazyblock-bench-smallfiles] [--reuse]
        [--variant NAME=CHECKOUT ...] [--backing auto|file|loop|copy ...] [--json out.json]

A Python start reads thousands of small files: the vLLM image's warm start read 10,588 of
them through the mount and took 3.4 s longer than from local disk. ``run.py`` measures large
files; this measures the other kind. The image is ``--tree`` (default: this interpreter's
``lib/pythonX.Y``, its standard library and site-packages: tens of thousands of files) as
one layer, converted into a directory store. Its sectors are put in the node cache once
(every file read through a mount); then, each round, with the kernel's page cache dropped:

* every file matching ``--pattern``, in path order (a package's modules side by side, as
  imports find them), opened and read whole through a fresh mount of this checkout and of
  each ``--variant`` (another checkout, run through ``PYTHONPATH``: its CLI, its server),
  with each ``--backing`` given (``mount --backing``; default ``auto``; ``copy``: a loop
  device switched to a local copy of the image, ``mount --local-copy``, the pass timed
  once it is);
* the same files from ``--tree`` on local disk: the reference.

Reported per checkout (medians over ``--rounds``, every round under ``per_round``): the
pass's seconds and its ratio to local disk's, the mount server's CPU seconds in the pass,
the FUSE reads it answered and, where the checkout counts them, the small reads answered
from a read-around window in memory (``SectorCache``'s ``READ_AROUND``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import ROOT, drop_caches, make_layout, report, wait_for_copy  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def setup(work: Path, tree: Path, reuse: bool) -> str:
    """The image of ``tree`` in a directory store under ``work``; its reference."""
    ref = f"{work / 'store'}/smallfiles:v1"
    marker = work / "converted"
    if reuse and marker.exists() and marker.read_text() == str(tree):
        return ref
    shutil.rmtree(work, ignore_errors=True)
    (work / "oci").mkdir(parents=True)
    make_layout(tree, work / "oci")
    subprocess.run(
        [sys.executable, "-m", "imagetool.cli", "convert", "-q", "--tmpdir", str(work),
         f"oci:{work / 'oci'}:v1", ref],
        check=True, capture_output=True,
    )  # fmt: skip
    shutil.rmtree(work / "oci")
    marker.write_text(str(tree))
    return ref


def snapshotter(checkout: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=checkout)
    # In the checkout: ``-m`` puts the working directory first on the path.
    done = subprocess.run([sys.executable, "-m", "snapshotter.cli", *args], env=env,
                          cwd=checkout, check=True, capture_output=True, text=True)  # fmt: skip
    return done.stdout


def cli_dirs(work: Path) -> list[str]:
    """The node's sector cache and mount state under ``work``, as ``snapshotter`` options."""
    return ["--cache-dir", str(work / "cache"), "--state-dir", str(work / "state")]


def mount_status(checkout: str, dirs: list[str]) -> dict[str, Any]:
    """``snapshotter status --json`` of the one mount under ``dirs``."""
    return json.loads(snapshotter(checkout, "status", "--json", *dirs))["mounts"][0]


def read_all(root: Path, paths: list[str]) -> float:
    """Seconds to open and read each file whole."""
    start = time.monotonic()
    for p in paths:
        with open(root / p, "rb", buffering=0) as f:
            while f.read(1 << 20):
                pass
    return time.monotonic() - start


def server_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def through_mount(
    checkout: str, backing: str, ref: str, work: Path, paths: list[str]
) -> dict[str, float]:
    """One pass through a fresh mount of ``checkout`` (page cache dropped first); backing
    ``copy``: a loop device that reads a local copy of the image (``mount.local_copy``),
    once it does."""
    mnt = work / "mnt"
    dirs = cli_dirs(work)
    subprocess.run(["pkill", "-f", "snapshotter.mount.forkserver"], check=False)
    options = ["--backing", "loop", "--local-copy"] if backing == "copy" else ["--backing", backing]
    drop_caches()
    snapshotter(checkout, "mount", "--no-prefetch", *options, *dirs, ref, str(mnt))
    copy: dict[str, float] = {}
    try:
        if backing == "copy":
            copy = copy_made(checkout, dirs)
            drop_caches()
        status = mount_status(checkout, dirs)
        pid, before = status["pid"], status["stats"]
        cpu = server_cpu(pid)
        seconds = read_all(mnt, paths)
        cpu = server_cpu(pid) - cpu
        after = mount_status(checkout, dirs)["stats"]
    finally:
        snapshotter(checkout, "umount", "--state-dir", str(work / "state"), str(mnt))
    return {
        "seconds": seconds,
        "server_cpu_seconds": cpu,
        "fuse_reads": after["fetch"]["reads"] - before["fetch"]["reads"],
        "read_around_hits": after["cache"].get("read_around_hits", 0)
        - before["cache"].get("read_around_hits", 0),
        **copy,
    }


def copy_made(checkout: str, dirs: list[str]) -> dict[str, float]:
    """Wait for the mount's local copy; how long making it took, and how long after the
    mount it was in use."""
    started = time.monotonic()
    state = wait_for_copy(lambda: mount_status(checkout, dirs)["stats"]["local_copy"])
    return {"copy_seconds": state["seconds"], "copy_ready_after_s": time.monotonic() - started}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--pattern", default="*.py")
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/lazyblock-bench-smallfiles"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reuse", action="store_true", help="keep the image of an earlier run")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument(
        "--backing",
        action="append",
        choices=["auto", "file", "loop", "copy"],
        help="copy: a loop device reading a local copy (mount.local_copy)",
    )
    args = parser.parse_args()
    backings = args.backing or ["auto"]
    tree = args.tree.resolve()
    checkouts = {"current": str(ROOT)}
    for v in args.variant:
        name, _, path = v.partition("=")
        checkouts[name] = str(Path(path).resolve())
    ref = setup(args.work, tree, args.reuse)
    paths = sorted(
        str(p.relative_to(tree)) for p in tree.rglob(args.pattern)
        if p.is_file() and not p.is_symlink()
    )  # fmt: skip
    (args.work / "mnt").mkdir(exist_ok=True)
    # Every sector into the node cache once, through this checkout's mount.
    dirs = cli_dirs(args.work)
    snapshotter(str(ROOT), "mount", "--no-prefetch", *dirs, ref, str(args.work / "mnt"))
    try:
        for p in sorted((args.work / "mnt").rglob("*")):
            if p.is_file() and not p.is_symlink():
                p.read_bytes()
    finally:
        snapshotter(str(ROOT), "umount", "--state-dir", str(args.work / "state"),
                    str(args.work / "mnt"))  # fmt: skip
    mounts = {
        (f"{name}/{backing}" if len(backings) > 1 else name): (checkout, backing)
        for name, checkout in checkouts.items()
        for backing in backings
    }
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in [*mounts, "local"]}
    for _ in range(args.rounds):
        for name, (checkout, backing) in mounts.items():
            runs[name].append(through_mount(checkout, backing, ref, args.work, paths))
        drop_caches()
        runs["local"].append({"seconds": read_all(tree, paths)})
    local = statistics.median(r["seconds"] for r in runs["local"])
    results: dict[str, object] = {
        "tree": str(tree), "pattern": args.pattern, "files": len(paths),
        "bytes": sum((tree / p).stat().st_size for p in paths), "rounds": args.rounds,
    }  # fmt: skip
    for name, passes in runs.items():
        r: dict[str, object] = {k: statistics.median(p[k] for p in passes) for k in passes[0]}
        r["vs_local"] = r["seconds"] / local  # type: ignore[operator]
        r["per_round"] = passes
        results[name] = r
    report(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
