"""Conversion benchmark: imagetool convert vs. unpack + mkfs.erofs + zstd, same image, same run.

Generates a deterministic multi-layer image with a realistic file-size mix (a Python/CUDA-like
userland of many small files, shared libraries of a few MB, and model weights of hundreds of
MB), builds it with umoci (gzip layers, like a registry image), then measures in one run:

* ``imagetool convert`` from the OCI layout into a directory store: wall time, peak RSS,
  throughput in MB/s of uncompressed filesystem image, stored bytes; in block format v2 (the
  default) and v1;
* the reference a user would script instead: ``umoci unpack`` to a directory, ``mkfs.erofs``
  over it, ``zstd -T0`` of the result (each step timed, peak RSS of each).

Usage: python benchmarks/convert/run.py [--size-gb 2] [--work DIR] [--out results/latest.json]
Needs root (umoci unpack keeps owners) and erofs-utils, umoci, zstd.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(HERE.parents[1]))
    except ValueError:
        return str(path)


def run(cmd: list[str], **kw) -> dict:  # noqa: ANN003
    """Run a command; return wall seconds and the child's peak RSS in MiB."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, **kw)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed with {proc.returncode}")
    return {"seconds": round(wall, 2), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1)}


def text_like(rng: random.Random, n: int) -> bytes:
    words = [rng.randbytes(rng.randint(2, 9)).hex() for _ in range(64)]
    out = bytearray()
    while len(out) < n:
        out += (" ".join(rng.choice(words) for _ in range(12)) + "\n").encode()
    return bytes(out[:n])


def binary_like(rng: random.Random, n: int) -> bytes:
    # Half random, half structured: compresses about 2:1 like real shared objects.
    block = rng.randbytes(4096)
    out = bytearray()
    while len(out) < n:
        out += rng.randbytes(2048) + block[: rng.randint(1024, 4096)]
    return bytes(out[:n])


def weights_like(rng: random.Random, path: Path, n: int) -> None:
    # bf16-ish: random mantissas, a handful of exponents -> compresses ~1.3:1.
    with open(path, "wb") as f:
        left = n
        while left:
            chunk = min(left, 8 << 20)
            raw = bytearray(rng.randbytes(chunk))
            raw[1::2] = bytes((b & 0x07) | 0x38 for b in raw[1::2])
            f.write(raw)
            left -= chunk


def generate(root: Path, size: int) -> list[Path]:
    """Three layer trees (cumulative): userland, libraries, weights. Returns layer dirs."""
    rng = random.Random(42)
    userland, libs, weights = root / "l1", root / "l2", root / "l3"
    budget_small = int(size * 0.15)
    budget_libs = int(size * 0.25)
    done = 0
    n = 0
    while done < budget_small:
        d = userland / "usr/lib/python3/site-packages" / f"pkg{n // 200:03d}" / f"mod{n % 7}"
        d.mkdir(parents=True, exist_ok=True)
        k = int(rng.lognormvariate(8.5, 1.2))  # median ~5 KB, long tail
        (d / f"file{n:06d}.py").write_bytes(text_like(rng, k))
        done += k
        n += 1
    shutil.copytree(userland, libs, symlinks=True)
    done = 0
    i = 0
    while done < budget_libs:
        k = rng.randint(1 << 20, 24 << 20)
        d = libs / "usr/lib/x86_64-linux-gnu"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"libbench{i:03d}.so").write_bytes(binary_like(rng, k))
        done += k
        i += 1
    shutil.copytree(libs, weights, symlinks=True)
    left = size - budget_small - budget_libs
    (weights / "models").mkdir()
    part = 0
    while left > 0:
        k = min(left, 512 << 20)
        weights_like(rng, weights / "models" / f"model-{part:05d}.safetensors", k)
        left -= k
        part += 1
    return [userland, libs, weights]


def tree_bytes(root: Path) -> tuple[int, int]:
    total = files = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            total += os.lstat(os.path.join(dirpath, name)).st_size
            files += 1
    return total, files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--work", type=Path, default=HERE / "work")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "latest.json")
    args = ap.parse_args()
    work: Path = args.work
    size = int(args.size_gb * (1 << 30))
    layout = work / f"oci-{args.size_gb:g}g"
    if not (layout / "index.json").exists():  # built once and cached
        shutil.rmtree(work / "trees", ignore_errors=True)
        dirs = generate(work / "trees", size)
        sys.path.insert(0, str(HERE.parents[1] / "tests"))
        from ocibuild import build_with_umoci

        build_with_umoci(layout, "bench", dirs)
        shutil.rmtree(work / "trees")
    results: dict = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        # Where the layout was, relative to the repository when it is inside it: the
        # results are committed, and a machine's own paths mean nothing to a reader.
        "image": {"layout": _shown(layout)},
    }
    subprocess.run(["sync"], check=True)

    # Format v2 (the default) and v1, one after the other in the same run.
    for version, key in (("2", "imagetool"), ("1", "imagetool_v1")):
        store = work / "store"
        shutil.rmtree(store, ignore_errors=True)
        conv = run([sys.executable, "-m", "imagetool.cli", "convert", "-q", "--format-version",
                    version, f"oci:{layout}:bench", f"{store}/bench:x"],
                   stdout=subprocess.DEVNULL)  # fmt: skip
        info = json.loads(subprocess.run(
            [sys.executable, "-m", "imagetool.cli", "inspect", f"{store}/bench:x"],
            capture_output=True, check=True).stdout)  # fmt: skip
        conv["mb_per_s"] = round(info["image_size"] / conv["seconds"] / 1e6, 1)
        conv.update(
            image_size=info["image_size"], stored_bytes=info["stored_bytes"],
            sectors=info["sectors"], raw_sectors=info["raw_sectors"], blobs=len(info["blobs"]),
        )  # fmt: skip
        results[key] = conv
        if version == "2":
            results["image"].update(files=info["files"])
        shutil.rmtree(store, ignore_errors=True)

    bundle = work / "bundle"
    shutil.rmtree(bundle, ignore_errors=True)
    ref: dict = {"unpack": run(["umoci", "unpack", "--image", f"{layout}:bench", str(bundle)],
                               stdout=subprocess.DEVNULL)}  # fmt: skip
    data_bytes, files = tree_bytes(bundle / "rootfs")
    results["image"].update(tree_bytes=data_bytes, tree_files=files)
    erofs = work / "ref.erofs"
    ref["mkfs_erofs"] = run(["mkfs.erofs", "--quiet", str(erofs), str(bundle / "rootfs")])
    ref["zstd"] = run(["zstd", "-q", "-f", "-3", "-T0", str(erofs), "-o", f"{erofs}.zst"])
    ref["total_seconds"] = round(sum(v["seconds"] for v in ref.values()), 2)
    ref["without_unpack_seconds"] = round(ref["mkfs_erofs"]["seconds"] + ref["zstd"]["seconds"], 2)
    ref["erofs_size"] = erofs.stat().st_size
    ref["zst_size"] = Path(f"{erofs}.zst").stat().st_size
    ref["mb_per_s"] = round(ref["erofs_size"] / ref["total_seconds"] / 1e6, 1)
    results["reference"] = ref
    shutil.rmtree(bundle, ignore_errors=True)
    erofs.unlink()
    Path(f"{erofs}.zst").unlink()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
