"""Cold-start benchmark: time until an ML container is ready, pulled over a shaped network.

One command (as root) builds or reuses the image, starts the "remote" registry host, and
compares, per network preset, from an empty cache every time (``drop_caches`` before each run):

    full-pull     containerd 1.6, default overlayfs snapshotter: ``ctr image pull`` (fetch +
                  unpack of every layer) then ``ctr run``
    lazy          lazyblock, cold (empty node cache), image laid out without a profile,
                  no prefetch
    lazy-profile  lazyblock, cold, image re-laid with ``imagetool convert --profile`` (the
                  profile recorded by ``snapshotter profile`` during a lazy run), prefetch on
    lazy-warm     lazyblock with the node's sector cache warm (page cache still dropped)
    local         the image already unpacked by containerd: the floor

The lazy scenarios mount with ``snapshotter mount`` (FUSE + erofs, metadata first) and run
the same container with ``ctr run --rootfs`` over an overlay (rw upper, the lazy tree as the
lower) - the data path the containerd proxy snapshotter sets up. containerd 1.6's
``ctr image pull`` cannot drive a remote snapshotter (it passes no layer labels; see
``snapshotter/remote.py``), so the proxy plugin is not on this path.

Ready = the workload printed its ``READY`` line (``image.py``: imported torch and loaded every
weight shard). Measured per run: seconds from the first action (pull / mount / run) to
READY, bytes from the registry (its access log: response bodies; and the host veth's
rx_bytes: on the wire), and the bytes the workload read (its own ``/proc/self/io``).

    python benchmarks/coldstart/run.py                        # ml image, 1g-1ms, 3 runs
    python benchmarks/coldstart/run.py --preset 1g-1ms --preset 200m-20ms --size 6GiB
    python benchmarks/coldstart/run.py --smoke                # CI: tiny image, no shaping

Writes ``results/latest.json``, ``results/latest.md`` and ``results/latest.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.coldstart import image as images  # noqa: E402
from benchmarks.coldstart import netns  # noqa: E402

log = logging.getLogger("coldstart")

SCENARIOS = ("full-pull", "lazy", "lazy-profile", "lazy-warm", "local")
LAZY_SCENARIOS = ("lazy", "lazy-profile", "lazy-warm")
NAMESPACE = "lazybench"  # containerd namespace
# The targets, checked on the preset they name.
TARGET_PRESET = "1g-1ms"
TARGET_SPEEDUP = 5.0  # lazy-profile at most 1/5 of full-pull
TARGET_FLOOR_S = 2.0  # ... and within 2 s of local
TARGET_AMPLIFICATION = 1.5  # registry bytes at most 1.5x the bytes the workload reads


class BenchError(RuntimeError):
    """A step of the benchmark failed."""


@dataclass(frozen=True)
class BenchConfig:
    kind: str = "ml"
    size: int | None = None
    presets: tuple[str, ...] = ("1g-1ms",)
    scenarios: tuple[str, ...] = SCENARIOS
    runs: int = 3
    work: Path = HERE / "work"
    out: Path = HERE / "results"
    run_timeout: float = 900.0
    drop_caches: bool = True  # off only for the CI smoke test, which checks plumbing, not speed
    net: netns.NetConfig = field(default_factory=netns.NetConfig)


# --- pure parts --------------------------------------------------------------------------------


def parse_ready(line: str) -> dict[str, str] | None:
    """``READY k=v k=v`` -> {k: v}; None if the line is not a READY line."""
    parts = line.strip().split()
    if not parts or parts[0] != "READY":
        return None
    out = {}
    for p in parts[1:]:
        k, eq, v = p.partition("=")
        if eq:
            out[k] = v
    return out


def summarize(values: Sequence[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def _median_int(values: Sequence[int | None]) -> int | None:
    vals = [v for v in values if v is not None]
    return int(statistics.median(vals)) if vals else None


def summarize_runs(runs: list[dict[str, Any]], image_bytes: int) -> dict[str, Any]:
    """A scenario's runs -> the numbers the report shows (medians for the byte counts)."""
    return {
        "status": "ok",
        "runs": runs,
        "time_to_ready_s": summarize([r["seconds"] for r in runs]),
        "registry_bytes": _median_int([r["registry_bytes"] for r in runs]),
        "wire_bytes": _median_int([r["wire_bytes"] for r in runs]),
        "workload_read_bytes": _median_int([r.get("read_bytes") for r in runs]),
        "image_bytes": image_bytes,
    }


def evaluate_targets(scenarios: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's three targets for one preset's results; ``met`` is None when a needed
    scenario did not run (with the reason)."""

    def ok(name: str) -> dict[str, Any] | None:
        s = scenarios.get(name)
        return s if s and s.get("status") == "ok" else None

    def missing(*names: str) -> str:
        why = [f"{n}: {scenarios.get(n, {}).get('reason', 'not run')}" for n in names if not ok(n)]
        return "not evaluated (" + "; ".join(why) + ")"

    out = []
    lp, fp, lo = ok("lazy-profile"), ok("full-pull"), ok("local")
    t = "lazy-profile time to ready <= full-pull / 5"
    if lp and fp:
        a, b = lp["time_to_ready_s"]["median"], fp["time_to_ready_s"]["median"]
        out.append({"target": t, "met": a <= b / TARGET_SPEEDUP,
                    "measured": f"{a:.2f}s vs {b:.2f}s: {b / a:.1f}x faster"})  # fmt: skip
    else:
        out.append({"target": t, "met": None, "measured": missing("lazy-profile", "full-pull")})
    t = "lazy-profile time to ready within 2 s of local"
    if lp and lo:
        a, b = lp["time_to_ready_s"]["median"], lo["time_to_ready_s"]["median"]
        out.append({"target": t, "met": a - b <= TARGET_FLOOR_S,
                    "measured": f"{a:.2f}s vs {b:.2f}s: +{a - b:.2f}s"})  # fmt: skip
    else:
        out.append({"target": t, "met": None, "measured": missing("lazy-profile", "local")})
    t = "lazy-profile registry bytes <= 1.5x bytes the workload reads (local, cold)"
    if lp and lo and lo.get("workload_read_bytes"):
        a, b = lp["registry_bytes"], lo["workload_read_bytes"]
        out.append({"target": t, "met": a <= TARGET_AMPLIFICATION * b,
                    "measured": f"{_mb(a)} vs {_mb(b)}: {a / b:.2f}x"})  # fmt: skip
    else:
        out.append({"target": t, "met": None, "measured": missing("lazy-profile", "local")})
    return out


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f} MB"


def markdown_table(results: dict[str, Any]) -> str:
    """The report: one table per preset, then the targets."""
    img = results["image"]
    lines = [
        f"Image `{img['tag']}`: {_mb(img['compressed_bytes'])} compressed "
        f"({img['layers']} layers), {_mb(img['rootfs_bytes'])} unpacked, "
        f"weights {_mb(img['weights_bytes'])}. {results['runs']} runs per scenario, "
        + (
            "page cache dropped before each."
            if results.get("caches_dropped", True)
            else "page cache NOT dropped (smoke test)."
        ),
        "",
    ]
    for name, pr in results["presets"].items():
        p = pr["preset"]
        rate = f"{p['rate_mbit']:g} Mbit/s" if p["rate_mbit"] else "unlimited"
        rtt = f"{p['rtt_ms']:g} ms RTT" if p["rtt_ms"] else "no added delay"
        meas = pr.get("measured_rtt_ms")
        measured = f" (measured TCP connect {meas:.2f} ms)" if meas is not None else ""
        lines.append(f"### {name}: {rate}, {rtt}{measured}")
        lines += [
            "",
            "| scenario | time to ready (median) | min | max | from registry | read by workload |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for scen, s in pr["scenarios"].items():
            if s.get("status") != "ok":
                lines.append(f"| {scen} | not run: {s.get('reason', '')} | | | | |")
                continue
            t = s["time_to_ready_s"]
            lines.append(
                f"| {scen} | {t['median']:.2f} s | {t['min']:.2f} s | {t['max']:.2f} s "
                f"| {_mb(s['registry_bytes'])} | {_mb(s['workload_read_bytes'])} |"
            )
        lines.append("")
        if pr.get("targets"):
            lines.append("| target | met | measured |")
            lines.append("|---|---|---|")
            for t in pr["targets"]:
                met = {True: "yes", False: "**no**", None: "-"}[t["met"]]
                lines.append(f"| {t['target']} | {met} | {t['measured']} |")
            lines.append("")
        for note in pr.get("notes", []):
            lines.append(f"- {note}")
        if pr.get("notes"):
            lines.append("")
    return "\n".join(lines)


def write_chart(results: dict[str, Any], path: Path) -> None:
    """Grouped bars: median time to ready per scenario, one group per preset; min-max as
    error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(results["presets"])
    scens = [s for s in SCENARIOS if any(s in p["scenarios"] for p in results["presets"].values())]
    fig, ax = plt.subplots(figsize=(2.2 + 2.2 * len(presets), 4))
    width = 0.8 / max(1, len(scens))
    for i, scen in enumerate(scens):
        xs, ys, lo, hi = [], [], [], []
        for j, pname in enumerate(presets):
            s = results["presets"][pname]["scenarios"].get(scen, {})
            if s.get("status") != "ok":
                continue
            t = s["time_to_ready_s"]
            xs.append(j + (i - (len(scens) - 1) / 2) * width)
            ys.append(t["median"])
            lo.append(t["median"] - t["min"])
            hi.append(t["max"] - t["median"])
        if xs:
            bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=scen)
            ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=2)
    ax.set_xticks(range(len(presets)), presets)
    ax.set_ylabel("time to ready, s (median; min-max)")
    ax.set_title(f"Cold start of {results['image']['tag']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


README_BEGIN = "<!-- latest:begin (written by run.py) -->"
README_END = "<!-- latest:end -->"


def with_latest(readme: str, table: str) -> str:
    """``readme`` with the text between the latest-results markers replaced by ``table``."""
    start, end = readme.find(README_BEGIN), readme.find(README_END)
    if start < 0 or end < start:
        raise BenchError("README has no latest-results markers")
    chart = "![time to ready](results/latest.png)\n\n"
    return readme[: start + len(README_BEGIN)] + "\n" + chart + table + "\n" + readme[end:]


def write_results(results: dict[str, Any], out: Path, readme: Path | None = None) -> None:
    """latest.json, latest.md and latest.png in ``out``; the table into ``readme`` too."""
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(results)
    (out / "latest.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "latest.md").write_text(table + "\n")
    write_chart(results, out / "latest.png")
    if readme is not None:
        readme.write_text(with_latest(readme.read_text(), table))


# --- host helpers ------------------------------------------------------------------------------


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _run(*args: str | os.PathLike, timeout: float = 600, **kw) -> str:  # noqa: ANN003
    cmd = [str(a) for a in args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(cmd[:5])} ...: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def _umount_all_under(root: Path) -> None:
    """Unmount anything mounted below ``root`` (deepest first)."""
    root_s = str(root.resolve())
    targets = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        target = line.split()[1].replace("\\040", " ")
        if target == root_s or target.startswith(root_s + "/"):
            targets.append(target)
    for t in sorted(targets, key=len, reverse=True):
        subprocess.run(["umount", "-l", t], capture_output=True)


def run_until_ready(cmd: list[str], timeout: float) -> tuple[float, dict[str, str], str]:
    """Start ``cmd``, wait for its READY line; returns (perf_counter when the line arrived,
    its fields, the output). Waits for the process to exit too (not timed)."""
    import queue
    import threading

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: queue.Queue[tuple[float, str | None]] = queue.Queue()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put((time.perf_counter(), line))
        lines.put((time.perf_counter(), None))

    threading.Thread(target=reader, daemon=True).start()
    output: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                at, line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                tail = "".join(output)[-2000:]
                raise BenchError(f"no READY within {timeout:.0f}s: {tail}") from None
            if line is None:
                proc.wait()
                raise BenchError(f"exited ({proc.returncode}) before READY: "
                                 f"{''.join(output)[-2000:]}")  # fmt: skip
            output.append(line)
            fields = parse_ready(line)
            if fields is not None:
                break
        if proc.wait(120) != 0:
            raise BenchError(f"{cmd[0]} exited with {proc.returncode}: {''.join(output)[-2000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return at, fields, "".join(output)


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


class Containerd:
    """Our own containerd (root, state and socket under ``work``), never the system's."""

    def __init__(self, work: Path) -> None:
        self.dir = work / "containerd"
        self.root = self.dir / "root"
        self.sock = self.dir / "containerd.sock"
        self.proc: subprocess.Popen | None = None
        self._seq = 0

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        config = self.dir / "config.toml"
        config.write_text(
            "version = 2\n"
            f'root = "{self.root}"\nstate = "{self.dir / "state"}"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            f'[grpc]\n  address = "{self.sock}"\n'
            f'[ttrpc]\n  address = "{self.dir / "ttrpc.sock"}"\n'
        )
        logf = open(self.dir / "containerd.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(["containerd", "--config", str(config)], stdout=logf,
                                     stderr=logf, start_new_session=True)  # fmt: skip
        logf.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"containerd exited; see {self.dir / 'containerd.log'}")
            if self.sock.exists() and subprocess.run(
                self._ctr("version"), capture_output=True).returncode == 0:  # fmt: skip
                return
            time.sleep(0.1)
        raise BenchError("containerd did not come up")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        _umount_all_under(self.dir)

    def reset(self) -> None:
        """Stop, forget every image and snapshot, start again: an empty node."""
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.dir / "state", ignore_errors=True)
        self.start()

    def _ctr(self, *args: str) -> list[str]:
        return ["ctr", "--address", str(self.sock), "--namespace", NAMESPACE, *args]

    def ctr(self, *args: str, timeout: float = 1800) -> str:
        return _run(*self._ctr(*args), timeout=timeout)

    def has_image(self, ref: str) -> bool:
        return ref in self.ctr("images", "ls", "-q").split()

    def pull(self, ref: str, timeout: float) -> None:
        self.ctr("images", "pull", "--plain-http", ref, timeout=timeout)

    def container_id(self) -> str:
        self._seq += 1
        return f"bench-{os.getpid()}-{self._seq}"

    def run_image_cmd(self, ref: str) -> list[str]:
        return self._ctr("run", "--rm", ref, self.container_id())

    def run_rootfs_cmd(self, rootfs: Path, config: dict[str, Any]) -> list[str]:
        args = ["run", "--rm", "--rootfs"]
        for e in config.get("Env") or ():
            args += ["--env", e]
        if config.get("WorkingDir"):
            args += ["--cwd", config["WorkingDir"]]
        argv = list(config.get("Entrypoint") or []) + list(config.get("Cmd") or [])
        return self._ctr(*args, str(rootfs), self.container_id(), *argv)


class Lazyblock:
    """The snapshotter's and imagetool's CLIs, as the benchmark uses them."""

    def __init__(self, work: Path, registry: str) -> None:
        self.dir = work / "lazy"
        self.cache = self.dir / "cache"
        self.state = self.dir / "state"
        self.registry = registry

    @staticmethod
    def unavailable() -> str | None:
        """Why the lazy scenarios cannot run here, or None."""
        for mod in ("snapshotter.cli", "snapshotter.mount"):
            if importlib.util.find_spec(mod) is None:
                return f"{mod} is not there yet"
        for tool in ("fusermount3",):
            if shutil.which(tool) is None and shutil.which("fusermount") is None:
                return f"needs {tool}"
        if not Path("/dev/fuse").exists():
            return "needs /dev/fuse"
        return None

    def ref(self, tag: str) -> str:
        return f"docker://{self.registry}/lazybench/block:{tag}"

    def _snap(self, *args: str, timeout: float = 600) -> str:
        return _run(sys.executable, "-m", "snapshotter.cli", *args, timeout=timeout, cwd=REPO)

    def _common(self) -> list[str]:
        return ["--cache-dir", str(self.cache), "--state-dir", str(self.state),
                "--set", "store.plain_http=true"]  # fmt: skip

    def up_to_date(self, tag: str, source_digest: str) -> bool:
        """Is ``tag`` in the registry, converted from the image with ``source_digest``?"""
        stamps = self._stamps()
        return (
            stamps.get(tag) == source_digest
            and registry_digest(self.registry, "lazybench/block", tag) is not None
        )

    def _stamps(self) -> dict[str, str]:
        path = self.dir / "converted.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def _stamp(self, tag: str, source_digest: str) -> None:
        stamps = self._stamps()
        stamps[tag] = source_digest
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "converted.json").write_text(json.dumps(stamps, indent=2))

    def convert(
        self, source: str, source_digest: str, tag: str, profile: Path | None = None
    ) -> None:
        args = ["--plain-http", "convert", "-q", source, self.ref(tag)]
        if profile is not None:
            args += ["--profile", str(profile)]
        _run(sys.executable, "-m", "imagetool.cli", *args, timeout=3600, cwd=REPO)
        self._stamp(tag, source_digest)

    def clear_cache(self) -> None:
        shutil.rmtree(self.cache, ignore_errors=True)

    def mount(self, tag: str, mountpoint: Path, prefetch: bool) -> str:
        mountpoint.mkdir(parents=True, exist_ok=True)
        flag = "--prefetch" if prefetch else "--no-prefetch"
        return self._snap("mount", self.ref(tag), str(mountpoint), flag, *self._common())

    def stats(self, mountpoint: Path) -> dict[str, Any]:
        doc = json.loads(self._snap("status", str(mountpoint), "--json", *self._common()))
        mounts = doc.get("mounts") or []
        return mounts[0].get("stats", {}) if mounts else {}

    def profile(self, mountpoint: Path, out: Path) -> None:
        self._snap("profile", str(mountpoint), "-o", str(out), *self._common())

    def umount(self, mountpoint: Path) -> None:
        subprocess.run([sys.executable, "-m", "snapshotter.cli", "umount", str(mountpoint),
                        *self._common()], capture_output=True, cwd=REPO)  # fmt: skip


@contextlib.contextmanager
def overlay(lower: Path, base: Path) -> Iterator[Path]:
    """A writable overlay over the read-only ``lower`` (the container's root)."""
    shutil.rmtree(base, ignore_errors=True)
    upper, workdir, merged = base / "upper", base / "work", base / "rootfs"
    for d in (upper, workdir, merged):
        d.mkdir(parents=True)
    _run("mount", "-t", "overlay", "overlay", "-o",
         f"lowerdir={lower},upperdir={upper},workdir={workdir}", merged)  # fmt: skip
    try:
        yield merged
    finally:
        subprocess.run(["umount", str(merged)], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


# --- the benchmark -----------------------------------------------------------------------------


class Bench:
    def __init__(self, cfg: BenchConfig, img: images.BuiltImage, remote: netns.RemoteHost) -> None:
        self.cfg = cfg
        self.img = img
        self.remote = remote
        self.registry = remote.registry_host
        self.ref = f"{self.registry}/lazybench/oci:{img.tag}"
        self.ctrd = Containerd(cfg.work)
        self.lazy: Lazyblock | None = None
        self.lazy_reason: str | None = None
        self.image_config = self._image_config()

    def _image_config(self) -> dict[str, Any]:
        layout = images.Layout(self.img.layout)
        m = layout.manifest(self.img.tag)
        return json.loads(layout._blob(m["config"]["digest"]).read_text()).get("config", {})

    # preparation (unshaped, untimed)

    def prepare(self) -> None:
        pushed = registry_digest(self.registry, "lazybench/oci", self.img.tag)
        if pushed != self.img.manifest_digest:
            log.info("pushing %s to %s", self.img.source, self.ref)
            _run("skopeo", "--insecure-policy", "copy", "-q", "--dest-tls-verify=false",
                 self.img.source, f"docker://{self.ref}", timeout=3600)  # fmt: skip
        if not any(s in LAZY_SCENARIOS for s in self.cfg.scenarios):
            return
        self.lazy_reason = Lazyblock.unavailable()
        if self.lazy_reason:
            log.warning("lazy scenarios not run: %s", self.lazy_reason)
            return
        self.lazy = Lazyblock(self.cfg.work, self.registry)
        try:
            self._prepare_lazy()
        except (BenchError, subprocess.TimeoutExpired) as e:
            self.lazy_reason = f"preparing the lazyblock images failed: {_short(e)}"
            log.error("%s", self.lazy_reason)
            self.lazy = None

    def _prepare_lazy(self) -> None:
        assert self.lazy is not None
        tag, src, digest = self.img.tag, self.img.source, self.img.manifest_digest
        if not self.lazy.up_to_date(tag, digest):
            log.info("converting %s -> %s", src, self.lazy.ref(tag))
            self.lazy.convert(src, digest, tag)
        profile = self.cfg.work / "profiles" / f"{tag}.txt"
        if not profile.exists() or not self.lazy.up_to_date(f"{tag}-profile", digest):
            log.info("recording the startup profile of %s", tag)
            profile.parent.mkdir(parents=True, exist_ok=True)
            self.lazy.clear_cache()
            self._lazy_once(tag, prefetch=False, record_profile=profile)
            log.info("converting %s with its profile", tag)
            self.lazy.convert(src, digest, f"{tag}-profile", profile)

    # scenarios

    def measure(self, scenario: str) -> dict[str, Any]:
        """One run of ``scenario`` from a dropped page cache."""
        if scenario == "full-pull":
            self.ctrd.reset()
        elif scenario == "local":
            if self.ctrd.proc is None:
                self.ctrd.start()
            if not self.ctrd.has_image(self.ref):
                self.ctrd.pull(self.ref, self.cfg.run_timeout)
        elif scenario in ("lazy", "lazy-profile"):
            assert self.lazy is not None
            self.lazy.clear_cache()
        if self.ctrd.proc is None:
            self.ctrd.start()
        self.remote.check()
        if self.cfg.drop_caches:
            drop_caches()
        mark = self.remote.traffic_mark()
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        extra: dict[str, Any] = {}
        if scenario == "full-pull":
            self.ctrd.pull(self.ref, self.cfg.run_timeout)
            phases["pull_s"] = time.perf_counter() - t0
            ready_at, fields, _ = run_until_ready(self.ctrd.run_image_cmd(self.ref),
                                                  self.cfg.run_timeout)  # fmt: skip
        elif scenario == "local":
            ready_at, fields, _ = run_until_ready(self.ctrd.run_image_cmd(self.ref),
                                                  self.cfg.run_timeout)  # fmt: skip
        else:
            tag = self.img.tag if scenario == "lazy" else f"{self.img.tag}-profile"
            ready_at, fields, phases, extra = self._lazy_once(
                tag, prefetch=scenario != "lazy", t0=t0)  # fmt: skip
        seconds = ready_at - t0
        traffic = self.remote.traffic_since(mark)
        self.remote.check()
        read_bytes = _int(fields.get("read_bytes"))
        if extra.get("snapshotter", {}).get("backing") == "file":
            # erofs on the FUSE file directly: its reads are not block I/O, so the process's
            # read_bytes stays 0 whatever it reads; touched_bytes (sectors) is reported instead.
            read_bytes = None
        run = {
            "seconds": round(seconds, 3),
            "registry_bytes": traffic.body_bytes,
            "wire_bytes": traffic.wire_bytes,
            "registry_requests": traffic.requests,
            "read_bytes": read_bytes,
            "rchar": _int(fields.get("rchar")),
            "phases_s": {k: round(v, 3) for k, v in phases.items()},
            "workload": {k: v for k, v in fields.items() if k.endswith("_s")},
            **extra,
        }
        log.info("%s: ready in %.2fs, %s from the registry, workload read %s", scenario,
                 seconds, _mb(traffic.body_bytes), _mb(run["read_bytes"]))  # fmt: skip
        return run

    def _lazy_once(
        self, tag: str, prefetch: bool, t0: float | None = None, record_profile: Path | None = None
    ) -> tuple[float, dict[str, str], dict[str, float], dict[str, Any]]:
        assert self.lazy is not None
        if self.ctrd.proc is None:
            self.ctrd.start()
        t0 = time.perf_counter() if t0 is None else t0
        mnt = self.lazy.dir / "mnt"
        self.lazy.umount(mnt)
        mount_out = self.lazy.mount(tag, mnt, prefetch)
        phases = {"mount_s": time.perf_counter() - t0}
        extra: dict[str, Any] = {"mount": mount_out.strip()}
        try:
            with overlay(mnt, self.lazy.dir / "container") as rootfs:
                cmd = self.ctrd.run_rootfs_cmd(rootfs, self.image_config)
                ready_at, fields, _ = run_until_ready(cmd, self.cfg.run_timeout)
            stats = self.lazy.stats(mnt)
            if record_profile is not None:
                self.lazy.profile(mnt, record_profile)
        finally:
            self.lazy.umount(mnt)
        fetch = stats.get("fetch", {})
        reads = stats.get("reads", {})
        sector = stats.get("image", {}).get("sector_size", 0)
        extra["snapshotter"] = {
            "backing": stats.get("backing"),
            # the mount server's own phases: index, metadata, fuse, kernel, total
            "mount_server_s": stats.get("mount_seconds"),
            "bytes_fetched": fetch.get("bytes_fetched"),
            "sectors_fetched": fetch.get("sectors_fetched"),
            "store_requests": fetch.get("store_requests"),
            "touched_bytes": reads.get("touched_sectors", 0) * sector,
            "prefetch": stats.get("prefetch"),
        }
        return ready_at, fields, phases, extra

    def run_preset(self, preset: netns.Preset) -> dict[str, Any]:
        self.remote.shape(preset)
        out: dict[str, Any] = {"preset": asdict(preset),
                               "measured_rtt_ms": measure_rtt(self.remote)}  # fmt: skip
        scenarios: dict[str, Any] = {}
        for scen in self.cfg.scenarios:
            if scen in LAZY_SCENARIOS and self.lazy is None:
                scenarios[scen] = {"status": "not-run", "reason": self.lazy_reason}
                continue
            runs = []
            try:
                if scen == "lazy-warm":
                    self.lazy.clear_cache()  # type: ignore[union-attr]
                    self._lazy_once(f"{self.img.tag}-profile", prefetch=True)  # warm it
                for i in range(self.cfg.runs):
                    log.info("[%s] %s run %d/%d", preset.name, scen, i + 1, self.cfg.runs)
                    runs.append(self.measure(scen))
                scenarios[scen] = summarize_runs(runs, self.img.compressed_bytes)
            except (BenchError, subprocess.TimeoutExpired, OSError) as e:
                log.error("%s failed: %s", scen, e)
                scenarios[scen] = {"status": "failed", "reason": _short(e), "runs": runs}
        out["scenarios"] = scenarios
        out["targets"] = evaluate_targets(scenarios) if preset.name == TARGET_PRESET else []
        out["notes"] = explain(scenarios)
        return out

    def close(self) -> None:
        if self.lazy is not None:
            self.lazy.umount(self.lazy.dir / "mnt")
            _umount_all_under(self.lazy.dir)
        self.ctrd.stop()


def explain(scenarios: dict[str, Any]) -> list[str]:
    """Measured breakdowns that say where the time went."""
    notes = []
    fp = scenarios.get("full-pull", {})
    if fp.get("status") == "ok":
        pulls = [r["phases_s"].get("pull_s", 0) for r in fp["runs"]]
        total = fp["time_to_ready_s"]["median"]
        notes.append(
            f"full-pull: `ctr image pull` (fetch + unpack) took a median "
            f"{statistics.median(pulls):.2f} s of the {total:.2f} s; the workload's reads then "
            "come from the page cache the unpack just filled."
        )
    warm, local, prof = (scenarios.get(n, {}) for n in ("lazy-warm", "local", "lazy-profile"))
    if all(x.get("status") == "ok" for x in (warm, local, prof)):
        w, lo, p = (x["time_to_ready_s"]["median"] for x in (warm, local, prof))
        notes.append(
            f"lazy-warm fetches almost nothing ({_mb(warm['registry_bytes'])}) yet is "
            f"{w - lo:+.2f} s from local: that much of lazy-profile's {p - lo:+.2f} s is the "
            "node's read path (FUSE, decompression, checksums), not the network; the rest "
            f"({p - w:+.2f} s) is fetching."
        )
    for scen in LAZY_SCENARIOS:
        s = scenarios.get(scen, {})
        if s.get("status") != "ok":
            continue
        mounts = [r["phases_s"].get("mount_s", 0) for r in s["runs"]]
        snap = s["runs"][-1].get("snapshotter", {})
        server = [r.get("snapshotter", {}).get("mount_server_s") or {} for r in s["runs"]]
        server_s = [x["total"] for x in server if "total" in x]
        inside = (
            f", {statistics.median(server_s):.2f} s of it in the mount server" if server_s else ""
        )
        notes.append(
            f"{scen}: `snapshotter mount` {statistics.median(mounts):.2f} s (median{inside}); "
            f"it fetched {_mb(snap.get('bytes_fetched'))} and the kernel touched "
            f"{_mb(snap.get('touched_bytes'))} of sectors (backing: {snap.get('backing')}"
            + (
                "; the workload's read_bytes does not see file-backed erofs reads"
                if snap.get("backing") == "file"
                else ""
            )
            + ")."
        )
    return notes


def registry_digest(registry: str, repo: str, tag: str) -> str | None:
    """The digest of ``repo:tag``'s manifest in the registry, None if it has none."""
    req = urllib.request.Request(f"http://{registry}/v2/{repo}/manifests/{tag}", method="HEAD")
    req.add_header("Accept", "application/vnd.oci.image.manifest.v1+json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.headers.get("Docker-Content-Digest")
    except OSError:
        return None


def measure_rtt(remote: netns.RemoteHost, samples: int = 5) -> float | None:
    """Median TCP connect time to the registry, in ms (the link's effective RTT)."""
    import socket

    times = []
    host, port = remote.registry_host.rsplit(":", 1)
    for _ in range(samples):
        t = time.perf_counter()
        try:
            with socket.create_connection((host, int(port)), timeout=5):
                times.append((time.perf_counter() - t) * 1000)
        except OSError:
            return None
    return round(statistics.median(times), 3)


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def preflight(cfg: BenchConfig) -> None:
    if os.geteuid() != 0:
        raise BenchError("needs root (network namespaces, mounts, containerd, drop_caches)")
    tools = ["ip", "tc", "iptables", "containerd", "ctr", "runc", "skopeo", "umoci",
             "docker-registry"]  # fmt: skip
    if cfg.kind == "ml":
        tools.append("debootstrap")
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise BenchError(f"missing tools: {', '.join(missing)}")
    unknown = [p for p in cfg.presets if p not in netns.PRESETS]
    if unknown:
        raise BenchError(f"unknown preset(s) {unknown}; known: {list(netns.PRESETS)}")


def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    preflight(cfg)
    img = images.build(cfg.kind, cfg.size, cfg.work)
    results: dict[str, Any] = {
        "generated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "containerd": _run("containerd", "--version").split()[2],
        },  # fmt: skip
        "image": img.to_json(),
        "runs": cfg.runs,
        "caches_dropped": cfg.drop_caches,
        "presets": {},
    }
    with netns.RemoteHost(cfg.net, cfg.work / "remote") as remote:
        remote.start_registry(cfg.work / "registry")
        bench = Bench(cfg, img, remote)
        try:
            bench.prepare()
            for name in cfg.presets:
                results["presets"][name] = bench.run_preset(netns.PRESETS[name])
        finally:
            bench.close()
    default_out = cfg.out.resolve() == (HERE / "results").resolve()
    write_results(results, cfg.out, HERE / "README.md" if default_out else None)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Cold-start benchmark (run as root).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"presets: {', '.join(netns.PRESETS)}; scenarios: {', '.join(SCENARIOS)}",
    )
    parser.add_argument("--kind", choices=("ml", "tiny"), default="ml")
    parser.add_argument("--size", type=images.parse_size,
                        help="weights bytes (default 512MiB for ml), e.g. 6GiB")  # fmt: skip
    parser.add_argument("--preset", action="append", dest="presets",
                        help="network preset (repeatable; default 1g-1ms)")  # fmt: skip
    parser.add_argument("--scenario", action="append", dest="scenarios", choices=SCENARIOS)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--work", type=Path, default=HERE / "work")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--smoke", action="store_true",
                        help="CI: tiny image, no shaping, 1 run (unless given)")  # fmt: skip
    parser.add_argument(
        "--report", action="store_true", help="only re-render the report from latest.json"
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.report:
        results = json.loads((args.out / "latest.json").read_text())
        for name, pr in results["presets"].items():
            pr["targets"] = evaluate_targets(pr["scenarios"]) if name == TARGET_PRESET else []
            pr["notes"] = explain(pr["scenarios"])
        default_out = args.out.resolve() == (HERE / "results").resolve()
        write_results(results, args.out, HERE / "README.md" if default_out else None)
        print(markdown_table(results))
        return 0
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    if args.smoke:
        args.kind = "tiny"
        args.presets = args.presets or ["none"]
        if "--runs" not in (argv or sys.argv):
            args.runs = 1
    cfg = BenchConfig(
        kind=args.kind,
        size=args.size,
        presets=tuple(args.presets or ["1g-1ms"]),
        scenarios=tuple(args.scenarios or SCENARIOS),
        runs=args.runs,
        work=args.work.resolve(),
        out=args.out.resolve(),
    )
    try:
        results = run_benchmark(cfg)
    except (BenchError, images.ImageBuildError, netns.NetError) as e:
        print(f"coldstart: error: {e}", file=sys.stderr)
        return 3
    print(markdown_table(results))
    print(f"\nwritten: {cfg.out / 'latest.json'}, latest.md, latest.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
