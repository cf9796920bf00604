"""Sharing benchmark: what an image costs that shares layers with one the store and the node
already have. Block format v2 against v1 and against the OCI image itself, in one run,
measured in bytes (so the machine's noise does not matter).

Three images, written here as OCI layouts with gzip layers (deterministic):

    A = base + pip  + weights      base: 240 MB of libraries (compress ~2:1) and 2,000
    B = base + pip  + weights'     Python files; pip: a 'pip install' layer (300 modules, three
    C = base + pip' + weights      native libraries, two already-compressed wheels); weights:
                                   fp16 weights (zstd saves 8 % of them) and a config.json

B's top layer is another model of another size (weights' is 5 % bigger), C's middle layer
is rebuilt (one package changed: a library grew, five modules changed) under A's top layer.
For each format (v1, v2, v2 with startup profiles: A and B each converted with the profile
of their workload) and for B and C after A:

* **store**: growth of a directory store's ``blobs/`` when the image is converted into it;
* **registry**: growth of a registry's storage when the image is converted into it: the bytes
  pushed (the client does not send a blob the registry has, and it keeps each once); for the
  OCI image itself, what ``skopeo copy`` of it adds;
* **fetch**: a node mounts A, runs the workload (reads a fixed list of files: a fifth of the
  base's modules, four of its libraries, a third of pip's modules and two of its libraries,
  the model), unmounts; then mounts the image with the same sector cache and runs the
  workload again: bytes fetched from the store (``bytes_fetched``, prefetch included);
* **unique**: what is new in the image: the bytes its layers that A lacks hold (tar content)
  and, for the fetch, the bytes of the workload's files that those layers provide.

Targets (issue 22): store and registry growth <= 1.1 x unique; fetch <= 1.1 x the unique
bytes the workload reads.

Usage: python benchmarks/sharing/run.py [--scale 1.0] [--work DIR] [--out results/latest.json]
Needs root (FUSE mounts), ``docker-registry`` and ``skopeo``.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from ocibuild import DEFAULT_MTIME, add_image, tag_descriptor  # noqa: E402
from support import Registry  # noqa: E402

from benchmarks.convert.run import binary_like, text_like  # noqa: E402
from imagetool.format import Index  # noqa: E402
from imagetool.image import open_image  # noqa: E402
from imagetool.stores.base import StoreOptions  # noqa: E402
from snapshotter.config import MountConfig  # noqa: E402
from snapshotter.mount import api  # noqa: E402

MB = 1_000_000
SECTOR = 4 << 20
VARIANTS = {  # name: (format version, converted with the workload's profile)
    "v1": ("1", False),
    "v2": ("2", False),
    "v2+profile": ("2", True),
}


# --- the images -----------------------------------------------------------------------------


def fp16_weights(seed: int, n: int) -> bytes:
    """``n`` bytes of float16 N(0, 0.02), like a model's weights (zstd -3 saves ~8 %)."""
    rng = np.random.default_rng(seed)
    out = bytearray()
    while len(out) < n:
        count = min(n - len(out), 16 << 20) // 2
        out += rng.normal(0, 0.02, count).astype(np.float16).tobytes()
    return bytes(out)


@dataclass
class Layer:
    files: dict[str, bytes] = field(default_factory=dict)  # path -> content, tar order

    def blob(self) -> bytes:
        """The layer as a registry holds it: a gzip'd tar."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            dirs: set[str] = set()
            for path, data in self.files.items():
                parts = path.split("/")
                for i in range(1, len(parts)):
                    d = "/".join(parts[:i])
                    if d not in dirs:
                        dirs.add(d)
                        info = tarfile.TarInfo(d + "/")
                        info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, DEFAULT_MTIME
                        tar.addfile(info)
                info = tarfile.TarInfo(path)
                info.size, info.mode, info.mtime = len(data), 0o644, DEFAULT_MTIME
                tar.addfile(info, io.BytesIO(data))
        return gzip.compress(buf.getvalue(), compresslevel=6, mtime=0)

    @property
    def content_bytes(self) -> int:
        return sum(len(d) for d in self.files.values())


def make_layers(scale: float) -> dict[str, Layer]:
    rng = random.Random(22)
    base = Layer()
    for i in range(int(2000 * scale)):
        base.files[f"usr/lib/python3/dist-packages/pkg{i // 100:02d}/mod{i:04d}.py"] = text_like(
            rng, int(rng.lognormvariate(8.5, 1.0))
        )
    done, i = 0, 0
    while done < 240 * MB * scale:
        n = min(rng.randint(1 << 20, 24 << 20), int(240 * MB * scale) - done + (1 << 20))
        base.files[f"usr/lib/x86_64-linux-gnu/libbase{i:03d}.so"] = binary_like(rng, n)
        done, i = done + n, i + 1

    def pip(changed: bool) -> Layer:
        r = random.Random(7)
        layer = Layer()
        for i in range(300):
            data = text_like(r, int(r.lognormvariate(8.5, 1.0)))
            if changed and i % 60 == 5:
                data = text_like(random.Random(1000 + i), len(data) + 999)
            layer.files[f"opt/venv/lib/site-packages/pkg{i // 30}/m{i:03d}.py"] = data
        for i in range(3):
            n = int((6 + 2 * i) * MB * scale) + (3 * MB if changed and i == 1 else 0)
            layer.files[f"opt/venv/lib/site-packages/native{i}.so"] = binary_like(r, n)
        for i in range(2):
            data = gzip.compress(text_like(r, int(6 * MB * scale)), mtime=0)
            layer.files[f"opt/venv/share/wheels/dep{i}.whl"] = data
        return layer

    def weights(seed: int, size: int) -> Layer:
        return Layer(
            {
                "models/m/config.json": json.dumps({"seed": seed, "size": size}).encode(),
                "models/m/model.safetensors": fp16_weights(seed, size),
            }
        )

    w = int(200 * MB * scale) // 2 * 2
    return {
        "base": base,
        "pip": pip(False),
        "pip2": pip(True),
        "weights": weights(1, w),
        "weights2": weights(2, w * 21 // 20 // 2 * 2),
    }


IMAGES = {"A": ("base", "pip", "weights"), "B": ("base", "pip", "weights2"),
          "C": ("base", "pip2", "weights")}  # fmt: skip


def workload(layers: dict[str, Layer]) -> list[str]:
    """The files every image's workload reads, in order (paths all three images have)."""
    base = [p for p in layers["base"].files if p.endswith(".py")][::5]
    libs = [p for p in layers["base"].files if p.endswith(".so")][:4]
    pip = list(layers["pip"].files)
    mods = [p for p in pip if p.endswith(".py")][::3]
    native = [p for p in pip if p.endswith(".so")][:2]
    model = list(layers["weights"].files)
    return ["/" + p for p in [*base, *mods, *libs, *native, *model]]


def provider(image: str, path: str, layers: dict[str, Layer]) -> str:
    """The layer of ``image`` whose copy of ``path`` the tree shows (the top-most)."""
    return next(n for n in reversed(IMAGES[image]) if path.lstrip("/") in layers[n].files)


# --- measuring ------------------------------------------------------------------------------


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def convert(spec: str, dest: str, version: str, profile: Path | None, tmp: Path) -> None:
    args = ["--format-version", version, "--tmpdir", str(tmp)]
    if profile is not None:
        args += ["--profile", str(profile)]
    subprocess.run(
        [sys.executable, "-m", "imagetool.cli", "--plain-http", "convert", "-q", *args, spec,
         dest],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip


def run_workload(mnt: Path, paths: list[str]) -> int:
    total = 0
    for p in paths:
        with open(mnt / p.lstrip("/"), "rb") as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
    return total


def fetched_after(first: str, then: str, paths: list[str], work: Path) -> dict[str, int]:
    """Bytes fetched starting ``then`` on a node whose cache holds what ``first``'s workload
    read (each mounted, the workload run, prefetch waited for, unmounted)."""
    shutil.rmtree(work / "cache", ignore_errors=True)
    mnt = work / "mnt"
    mnt.mkdir(exist_ok=True)
    cfg = MountConfig(cache_dir=work / "cache", cache_size=64 << 30, state_dir=work / "state",
                      prefetch=True, store=StoreOptions(plain_http=True))  # fmt: skip
    out: dict[str, int] = {}
    for name, ref in (("first", first), ("then", then)):
        subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=True)
        api.mount(ref, mnt, cfg)
        try:
            read = run_workload(mnt, paths)
            deadline = time.monotonic() + 300
            while api.stats(mnt, cfg)["prefetch"]["running"] and time.monotonic() < deadline:
                time.sleep(0.2)
            stats = api.stats(mnt, cfg)
        finally:
            api.unmount(mnt, cfg)
        out[f"{name}_read"] = read
        out[f"{name}_fetched"] = stats["fetch"]["bytes_fetched"]
        out[f"{name}_sectors_fetched"] = stats["fetch"]["sectors_fetched"]
    return out


@contextlib.contextmanager
def _registry(root: Path) -> Iterator[Registry]:
    root.mkdir()
    registry = Registry(root)
    try:
        yield registry
    finally:
        registry.stop()


def index_of(ref: str) -> Index:
    with open_image(ref, StoreOptions(plain_http=True)) as img:
        return img.index


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="image sizes (1.0: as described)")
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/lazyblock-sharing"))
    ap.add_argument("--out", type=Path, default=HERE / "results" / "latest.json")
    ap.add_argument("--variant", action="append", choices=sorted(VARIANTS))
    args = ap.parse_args()
    work: Path = args.work
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.monotonic()
    layers = make_layers(args.scale)
    blobs = {name: layer.blob() for name, layer in layers.items()}
    layout = work / "oci"
    for image, names in IMAGES.items():
        tag_descriptor(layout, add_image(layout, [blobs[n] for n in names]), image)
    paths = workload(layers)
    profile = work / "profile.txt"
    profile.write_text("\n".join(paths) + "\n")
    results: dict = {
        "scale": args.scale,
        "machine": {"cpus": os.cpu_count()},
        "layers": {
            n: {
                "files": len(layer.files),
                "content_bytes": layer.content_bytes,
                "gzip_bytes": len(blobs[n]),
            }
            for n, layer in layers.items()
        },  # fmt: skip
        "workload_files": len(paths),
    }
    for image in ("B", "C"):
        new = [n for n in IMAGES[image] if n not in IMAGES["A"]]
        reads = sum(
            len(layers[provider(image, p, layers)].files[p.lstrip("/")])
            for p in paths
            if provider(image, p, layers) in new
        )
        results[image] = {
            "new_layers": new,
            "unique_bytes": sum(layers[n].content_bytes for n in new),
            "unique_gzip_bytes": sum(len(blobs[n]) for n in new),
            "unique_bytes_read": reads,
        }
    # The reference: the OCI images themselves, pushed as they are.
    with _registry(work / "registry-oci") as registry:
        for image in ("A", "B", "C"):
            before = dir_bytes(registry.root / "data")
            subprocess.run(
                ["skopeo", "--insecure-policy", "copy", "-q", "--dest-tls-verify=false",
                 f"oci:{layout}:{image}", f"docker://{registry.host}/oci/app:{image}"],
                check=True,
            )  # fmt: skip
            if image != "A":
                results[image]["oci"] = {
                    "registry_growth": dir_bytes(registry.root / "data") - before
                }
    for variant in args.variant or list(VARIANTS):
        version, profiled = VARIANTS[variant]
        use = profile if profiled else None
        store = work / f"store-{variant}"
        refs, grown = {}, {}
        # A registry of its own: it keeps a blob once whichever repository pushed it.
        with _registry(work / f"registry-{variant}") as registry:
            for image in ("A", "B", "C"):
                spec = f"oci:{layout}:{image}"
                before = dir_bytes(store / "blobs") if (store / "blobs").exists() else 0
                refs[image] = f"{store}/app:{image}"
                convert(spec, refs[image], version, use, work)
                grown[image] = {"store_growth": dir_bytes(store / "blobs") - before}
                before = dir_bytes(registry.root / "data")
                convert(spec, f"docker://{registry.host}/lazy/app:{image}", version, use, work)
                grown[image]["registry_growth"] = dir_bytes(registry.root / "data") - before
        for image in ("B", "C"):
            row = grown[image]
            row.update(fetched_after(refs["A"], refs[image], paths, work))
            index = index_of(refs[image])
            row["image_size"] = index.image_size
            row["stored_bytes"] = sum(b.size for b in index.blobs)
            row["blobs"] = len(index.blobs)
            unique = results[image]["unique_bytes"]
            row["store_vs_unique"] = round(row["store_growth"] / unique, 3)
            row["registry_vs_unique"] = round(row["registry_growth"] / unique, 3)
            row["fetch_vs_unique_read"] = round(
                row["then_fetched"] / results[image]["unique_bytes_read"], 3
            )
            results[image][variant] = row
            print(variant, image, json.dumps(row), flush=True)
    results["seconds"] = round(time.monotonic() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
