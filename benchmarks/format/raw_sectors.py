"""Raw sectors: what decompressing a sector costs against what storing it raw costs, to set
the threshold below which a sector is stored raw (``imagetool.format.DEFAULT_RAW_SAVING``).

1. For kinds of data an image holds (fp16 and bf16 weights, already-compressed files, random
   bytes, Python sources, shared libraries): zstd -3's ratio on 4 MiB sectors, the CPU
   seconds per GB its decompression takes, and those of the xxh3-128 hash a raw sector costs
   instead; and the link speed at which the bytes raw storage adds take as long to transfer
   as the decompression it saves takes on one core (above it, raw is cheaper).
2. Through the snapshotter's real fetcher: an image of fp16 weights converted twice (raw
   sectors, the default; and ``--raw-saving 0``, every sector zstd), every sector fetched
   from a directory store into a fresh sector cache, interleaved rounds: CPU seconds (this
   process: the fetcher's threads) and wall time per GB of image.

Usage: python benchmarks/format/raw_sectors.py [--mb 512] [--rounds 3] [--out results.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash
import zstandard

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from ocibuild import TarEntry, make_layer_tar, write_oci_layout  # noqa: E402

from benchmarks.convert.run import binary_like, text_like  # noqa: E402
from imagetool.image import open_image  # noqa: E402
from snapshotter.cache.sectors import SectorCache  # noqa: E402
from snapshotter.config import FetchConfig  # noqa: E402
from snapshotter.datapath.fetcher import SectorFetcher  # noqa: E402
from snapshotter.metrics import MountMetrics  # noqa: E402

SECTOR = 4 << 20
GB = 1e9


def _fp16(rng: np.random.Generator, n: int) -> bytes:
    return rng.normal(0, 0.02, n // 2).astype(np.float16).tobytes()


def _bf16(rng: np.random.Generator, n: int) -> bytes:
    bits = rng.normal(0, 0.02, n // 2).astype(np.float32).view(np.uint32) >> 16
    return bits.astype(np.uint16).tobytes()


def _gzipped(seed: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        out += gzip.compress(text_like(random.Random(seed + len(out)), 8 * n), mtime=0)
    return bytes(out[:n])


KINDS = {
    "fp16 weights": lambda: _fp16(np.random.default_rng(1), SECTOR),
    "bf16 weights": lambda: _bf16(np.random.default_rng(2), SECTOR),
    "gzip (wheels, .gz)": lambda: _gzipped(3, SECTOR),
    "random (media, encrypted)": lambda: os.urandom(SECTOR),
    "shared library": lambda: binary_like(random.Random(4), SECTOR),
    "python source": lambda: text_like(random.Random(5), SECTOR),
}


def _cpu_per_gb(fn, data_len: int, repeats: int = 20) -> float:  # noqa: ANN001
    start = time.process_time()
    for _ in range(repeats):
        fn()
    return (time.process_time() - start) / repeats / data_len * GB


def kinds() -> dict[str, dict[str, float]]:
    comp = zstandard.ZstdCompressor(level=3, write_checksum=False)
    dec = zstandard.ZstdDecompressor()
    out: dict[str, dict[str, float]] = {}
    for name, make in KINDS.items():
        data = make()
        stored = comp.compress(data)
        ratio = len(stored) / len(data)
        decompress = _cpu_per_gb(lambda s=stored: dec.decompress(s), len(data))
        hashing = _cpu_per_gb(lambda d=data: xxhash.xxh3_128_hexdigest(d), len(data))
        saved = decompress - hashing  # CPU-s per GB raw storage saves
        extra = 1 - ratio  # bytes per byte raw storage adds
        out[name] = {
            "zstd_ratio": round(ratio, 3),
            "decompress_cpu_s_per_GB": round(decompress, 3),
            "hash_cpu_s_per_GB": round(hashing, 3),
            # The link at which the added bytes take as long as the saved CPU on one core.
            "break_even_Gbit_s": round(extra * 8 / saved, 2) if saved > 0 else None,
        }
        print(name, out[name], flush=True)
    return out


def _image(work: Path, mb: int, raw_saving: str) -> str:
    layout = work / "oci"
    if not layout.exists():
        rng = np.random.default_rng(7)
        entries = [TarEntry("models/", type="dir")]
        for i in range(mb // 64):
            entries.append(TarEntry(f"models/shard{i:03d}.bin", data=_fp16(rng, 64 << 20)))
        write_oci_layout(layout, [make_layer_tar(entries, compression=None)], tag="v1")
    ref = f"{work}/store/w:raw{raw_saving}"
    subprocess.run(
        [sys.executable, "-m", "imagetool.cli", "convert", "-q", "--raw-saving", raw_saving,
         "--tmpdir", str(work), f"oci:{layout}:v1", ref],
        check=True,
    )  # fmt: skip
    return ref


def fetch_pass(ref: str, cache_dir: Path) -> dict[str, float]:
    """Every sector of ``ref`` through a fetcher into an empty cache: CPU and wall per GB."""
    shutil.rmtree(cache_dir, ignore_errors=True)
    with open_image(ref) as img:
        index = img.index
        cache = SectorCache(cache_dir, 64 << 30)
        config = FetchConfig(deadline=600.0)
        with SectorFetcher(img.store, index, cache, config, MountMetrics()) as fetcher:
            subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=True)
            cpu, wall = time.process_time(), time.monotonic()
            for start in range(0, index.sector_count, 16):
                fetcher.get(range(start, min(start + 16, index.sector_count)))
            cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    gigabytes = index.image_size / GB
    return {"cpu_s_per_GB": cpu / gigabytes, "wall_s_per_GB": wall / gigabytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=512, help="MB of fp16 weights in the image")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "raw_sectors.json")
    args = ap.parse_args()
    results: dict = {"machine": {"cpus": os.cpu_count()}, "kinds": kinds()}
    work = Path(tempfile.mkdtemp(prefix="lazyblock-raw-", dir="/var/tmp"))
    try:
        refs = {"raw (default)": _image(work, args.mb, "0.1"), "zstd": _image(work, args.mb, "0")}
        for name, ref in refs.items():
            with open_image(ref) as img:
                idx = img.index
                results.setdefault("image", {})[name] = {
                    "image_bytes": idx.image_size,
                    "stored_bytes": sum(b.size for b in idx.blobs),
                    "raw_sectors": sum(s.raw for s in idx.sectors),
                    "sectors": idx.sector_count,
                }
        passes: dict[str, list[dict[str, float]]] = {name: [] for name in refs}
        for round_ in range(args.rounds):
            order = list(refs.items())
            for name, ref in order if round_ % 2 == 0 else reversed(order):
                passes[name].append(fetch_pass(ref, work / "cache"))
                print(round_, name, passes[name][-1], flush=True)
        results["fetch"] = {
            name: {
                key: round(statistics.median(p[key] for p in rows), 3)
                for key in ("cpu_s_per_GB", "wall_s_per_GB")
            }
            | {"per_round": rows}
            for name, rows in passes.items()
        }
        results["rounds"] = args.rounds
    finally:
        shutil.rmtree(work, ignore_errors=True)
    save(results, args.out, "kinds")


def save(results: dict, out: Path, detail: str) -> None:
    """Write ``results`` to ``out`` (JSON) and print them but their ``detail`` key."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != detail}, indent=2))


if __name__ == "__main__":
    main()
