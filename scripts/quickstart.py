#!/usr/bin/env python3
"""lazyblock's main job on this machine, end to end: the second half of the README's first
command (``./scripts/quickstart`` runs ``./scripts/install-deps``, then this). As root.

1. build a sample image with umoci: a busybox userland, then an app layer with a message
   and ``--weights`` MiB of data the app does not read when it starts (as a model server's
   weights): two gzip layers;
2. start a registry (Debian's ``docker-registry`` on 127.0.0.1) and push the image to it;
3. convert it with ``imagetool convert`` into a block image in the same registry;
4. start lazyblock's snapshotter daemon (``snapshotter serve``) and a containerd that has it
   as ``[proxy_plugins.lazyblock]``: Debian 12's 1.6, or 2.x (``--containerd 2.x``, from
   ``scripts/fetch-containerd2``);
5. lazy start: ``snapshotter pull`` (lazyblock's pull for ctr users; containerd 1.6's
   ``ctr image pull`` cannot pull a block image lazily) then ``ctr run --snapshotter
   lazyblock``;
6. the same image pulled in full, for comparison: ``ctr image pull`` (overlayfs) then
   ``ctr run``;
7. the summary: time from the pull to the container's first line and bytes the registry
   sent, for both, and the bytes the lazy start needed (the sectors its reads touched),
   next to the image's size. The sample's weights hold most of it, so lazyblock streams it
   whole behind the start (``prefetch.stream_large_share``): the summary says so.

Its registry, daemon and containerd are its own (own sockets, roots and ports under a work
directory; nothing of the system's is used or changed), and on the way out - success,
failure, Ctrl-C or SIGTERM - every container, containerd and its shims, the daemon, the
mounts (and their loop devices), the fork server the daemon started and the registry are
stopped, and the work directory is removed (``--keep`` keeps it). The node pieces are the
containerd tests' own (``tests/containerd/harness.py``), so what is shown here is what the
tests check.

    scripts/quickstart.py [--containerd 1.6|2.x] [--weights MIB] [--keep] [--workdir DIR]

Exit status: 0 done, 1 a step failed (what failed, and the tail of its logs, on stderr), 130
interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "containerd")]
# Every process started from here (the daemon, its mount servers, imagetool) runs this
# checkout, installed or not.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
)

import harness  # noqa: E402
from ocibuild import push_to_registry  # noqa: E402
from support import Registry  # noqa: E402

from benchmarks.coldstart.node import mounts_under  # noqa: E402
from snapshotter.config import PrefetchConfig  # noqa: E402

REPO = "quickstart/app"
FULL_TAG = "v1"
LAZY_TAG = "v1-lazy"
TOOLS = ("umoci", "skopeo", "docker-registry", "runc")
# The deepest socket under the work directory (containerd's ttrpc socket) adds 40 bytes; a
# unix socket's path has at most 107.
MAX_WORKDIR = 64


class StepError(Exception):
    """A step failed; the message says what (one line)."""


@dataclass
class Timed:
    seconds: float  # from the start of the pull to the container's first line
    registry_bytes: int  # what the registry sent meanwhile (its access log)
    first_line: str


@dataclass
class LazyMounts:
    """What the snapshotter's mounts of the image say (``snapshotter status --json``)."""

    needed: int  # stored bytes of the sectors the start's reads touched (metadata too)
    streamed: bool  # whether a mount streams its image whole (prefetch, "auto")


# --- output ----------------------------------------------------------------------------------


class Steps:
    """``[n/total] what ... 1.2 s`` lines."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0

    @contextlib.contextmanager
    def step(self, text: str) -> Iterator[None]:
        self.done += 1
        print(f"[{self.done}/{self.total}] {text} ...", end="", flush=True)
        started = time.monotonic()
        try:
            yield
        except KeyboardInterrupt:
            print(" interrupted", flush=True)
            raise
        except BaseException:
            print(" failed", flush=True)
            raise
        print(f" {time.monotonic() - started:.1f} s", flush=True)


def human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n} B"


# --- commands --------------------------------------------------------------------------------


def run(*cmd: str | os.PathLike, timeout: float = 600) -> str:
    """Run a command; its stdout, or ``StepError`` with the last lines it wrote."""
    args = [str(c) for c in cmd]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise StepError(f"{' '.join(args[:4])} ... exited {proc.returncode}: {' | '.join(said)}")
    return proc.stdout


def python(*args: str | os.PathLike, timeout: float = 600) -> str:
    return run(sys.executable, "-m", *args, timeout=timeout)


def ctr_args(node: harness.Containerd, *args: str) -> list[str]:
    return [node.flavour.binary("ctr"), "--address", str(node.address),
            "--namespace", harness.NAMESPACE, *args]  # fmt: skip


def registry_bytes(registry: Registry, since: int) -> int:
    """Bytes of manifests and blobs the registry sent since log offset ``since``."""
    with open(registry.log, "rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    pattern = r'"GET /v2/[^ ]*/(?:blobs|manifests)/[^ ]* HTTP/[0-9.]+" \d+ (\d+)'
    return sum(int(m) for m in re.findall(pattern, text))


def pull_and_first_line(
    node: harness.Containerd, registry: Registry, pull: list[str], run_args: list[str]
) -> Timed:
    """Time ``pull`` then the container ``run_args`` starts, to its first line of output."""
    since = harness.registry_log_end(registry)
    started = time.monotonic()
    run(*pull)
    proc = subprocess.Popen(ctr_args(node, "run", "--rm", *run_args), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=node.flavour.env())  # fmt: skip
    try:
        first = proc.stdout.readline() if proc.stdout else ""
        seconds = time.monotonic() - started
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0 or not first:
        raise StepError(f"ctr run exited {proc.returncode}: {err.strip()[-300:]}")
    return Timed(seconds, registry_bytes(registry, since), first.strip())


def lazy_mounts(node: harness.Containerd, timeout: float = 300) -> LazyMounts:
    """Once the lazy start is done and any background prefetch has ended (so that the full
    pull does not share the registry with it): what the start needed, whether it streamed."""
    deadline = time.monotonic() + timeout
    while True:
        doc = json.loads(python("snapshotter", "status", "--json", "--config",
                                node.snapshotter.config))  # fmt: skip
        stats = [m["stats"] for m in doc["mounts"] if "stats" in m]
        if not stats:
            raise StepError(f"snapshotter status shows no mount with statistics: {doc['mounts']}")
        # A prefetcher that is not streaming runs on too, watching the start's reads (for
        # minutes): only a stream is waited for.
        streams = [s["prefetch"]["running"] for s in stats if s["prefetch"]["streaming"]]
        if not any(streams) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return LazyMounts(
        needed=sum(s["reads"]["touched_stored_bytes"] for s in stats),
        streamed=any(s["prefetch"]["streaming"] for s in stats),
    )


# --- what this run started, to stop it -------------------------------------------------------


def fork_servers() -> set[int]:
    """Fork servers of this checkout's snapshotter (``snapshotter.mount.forkserver``): a
    daemon's first mount starts one, which would otherwise idle for ten minutes."""
    package = f"--package-dir\0{ROOT / 'snapshotter'}\0"
    found = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                cmdline = (d / "cmdline").read_text(errors="replace")
                if "snapshotter.mount.forkserver" in cmdline and package in cmdline:
                    found.add(int(d.name))
    return found


def stop_new_fork_servers(before: set[int]) -> None:
    for pid in fork_servers() - before:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def remove_workdir(work: Path) -> None:
    """``rm -rf`` the work directory, never through a mount that is still there."""
    left = mounts_under(work)
    if left:
        print(f"quickstart: still mounted, {work} kept: {left[:3]}", file=sys.stderr)
        return
    shutil.rmtree(work, ignore_errors=True)


def log_tails(work: Path) -> None:
    """The end of each daemon's log, for a failed run (before the directory goes)."""
    for log in sorted(work.rglob("*.log")):
        text = log.read_text(errors="replace").strip()
        if text:
            tail = "\n  ".join(text.splitlines()[-8:])
            print(f"--- {log.relative_to(work)} (last lines):\n  {tail}", file=sys.stderr)


# --- the run ---------------------------------------------------------------------------------


def quickstart(args: argparse.Namespace, work: Path, cleanup: contextlib.ExitStack) -> None:
    steps = Steps(6)
    flavour = harness.find_flavour(args.containerd)
    if isinstance(flavour, str):
        raise StepError(f"containerd {args.containerd}: {flavour}")
    weights = args.weights << 20

    with steps.step(f"build a sample image: busybox + an app with {args.weights} MiB of "
                    "weights it does not read at start (umoci, 2 gzip layers)"):  # fmt: skip
        layout = harness.sample_image(work / "image", big=weights)

    with steps.step("start a registry (docker-registry on 127.0.0.1) and push the image"):
        (work / "registry").mkdir()
        registry = Registry(work / "registry")
        cleanup.callback(registry.stop)
        push_to_registry(layout, "v1", registry.host, REPO, FULL_TAG)
        full_ref = f"{registry.host}/{REPO}:{FULL_TAG}"
        lazy_ref = f"{registry.host}/{REPO}:{LAZY_TAG}"

    with steps.step(f"convert it into a block image: imagetool convert docker://{full_ref} "
                    f"docker://{lazy_ref}"):  # fmt: skip
        python("imagetool.cli", "--plain-http", "convert", "-q", f"docker://{full_ref}",
               f"docker://{lazy_ref}")  # fmt: skip
        summary = json.loads(python("imagetool.cli", "--plain-http", "inspect",
                                    f"docker://{lazy_ref}"))  # fmt: skip

    version = run(flavour.binary("containerd"), "--version").split()[2]
    with steps.step(f"start lazyblock's snapshotter daemon and containerd {version}"):
        node = cleanup.enter_context(harness.running_node(work / "node", registry.host, flavour))

    with steps.step(f"lazy start: snapshotter pull {lazy_ref}, ctr run --snapshotter lazyblock"):
        since = harness.registry_log_end(registry)
        lazy = pull_and_first_line(
            node,
            registry,
            [sys.executable, "-m", "snapshotter", "pull", "--address", str(node.address),
             "--namespace", harness.NAMESPACE, "--plain-http", lazy_ref],
            ["--snapshotter", "lazyblock", lazy_ref, "quickstart-lazy"],
        )  # fmt: skip
        mounts = lazy_mounts(node)
        lazy_read = registry_bytes(registry, since)  # the background stream's bytes too

    with steps.step(f"full pull for comparison: ctr image pull {full_ref}, ctr run (overlayfs)"):
        full = pull_and_first_line(
            node,
            registry,
            ctr_args(node, "image", "pull", "--plain-http", full_ref),
            ["--snapshotter", "overlayfs", full_ref, "quickstart-full"],
        )

    manifest = json.loads(
        run("skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{full_ref}")
    )
    compressed = sum(layer["size"] for layer in manifest["layers"])
    print()
    print(f"Same image, same registry and containerd {version}, this run:")
    print(f"  {'':28}{'lazyblock':>14}{'full pull':>14}")
    print(f"  {'pull to first output':28}{lazy.seconds:>12.2f} s{full.seconds:>12.2f} s"
          f"   ({full.seconds / lazy.seconds:.1f}x faster)")  # fmt: skip
    print(f"  {'needed by the start':28}{human(mounts.needed):>14}{human(full.registry_bytes):>14}"
          f"   ({mounts.needed / full.registry_bytes:.1%} of it)")  # fmt: skip
    print(f"  {'read from the registry':28}{human(lazy_read):>14}"
          f"{human(full.registry_bytes):>14}")  # fmt: skip
    if mounts.streamed:
        rule = PrefetchConfig()  # the daemon runs with the defaults
        print("  (lazyblock streamed the rest of the image in the background, behind the "
              f"start: its files of {rule.large_file_bytes >> 20} MiB\n   or more hold "
              f"{rule.stream_large_share:.0%} of it or more, as model weights do; "
              "prefetch.stream_large_share)")  # fmt: skip
    print(f"  image: {len(manifest['layers'])} layers, {human(compressed)} compressed, "
          f"{human(summary['image_size'])} unpacked (EROFS); block image "
          f"{human(sum(b['size'] for b in summary['blobs']))} in "
          f"{len(summary['blobs'])} blobs, {summary['stored_sectors']} sectors of "
          f"{summary['sector_size'] >> 20} MiB")  # fmt: skip
    print(f"  the container printed: {lazy.first_line!r} (lazy), {full.first_line!r} (full)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--containerd", choices=("1.6", "2.x"), default="1.6",
                        help="Debian 12's 1.6 (default) or 2.x (fetch-containerd2)")  # fmt: skip
    parser.add_argument("--weights", type=int, default=256, metavar="MIB",
                        help="MiB in the image that the app does not read at start")  # fmt: skip
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp"),
                        help="where the work directory goes (default /var/tmp)")  # fmt: skip
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("quickstart: run as root (it mounts and starts containerd)", file=sys.stderr)
        return 1
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        print(f"quickstart: {', '.join(missing)} missing: run ./scripts/install-deps",
              file=sys.stderr)  # fmt: skip
        return 1

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # SIGINT too: Python leaves it ignored when it starts with it ignored (a shell without
    # job control starts background commands so: then Ctrl-C, sent to the process group,
    # did nothing and the run went on to its end).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupted)
    args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="lazyblock-quickstart-", dir=args.workdir.absolute()))
    if len(str(work)) > MAX_WORKDIR:
        work.rmdir()
        print(f"quickstart: --workdir {args.workdir} is too deep for the unix sockets under "
              "it (108 bytes at most): choose a shorter one", file=sys.stderr)  # fmt: skip
        return 1
    print(f"quickstart: working in {work}")
    started = time.monotonic()
    before = fork_servers()
    cleanup = contextlib.ExitStack()
    status = 0
    try:
        quickstart(args, work, cleanup)
    except KeyboardInterrupt:
        print("quickstart: interrupted", file=sys.stderr)
        status = 130
    except Exception as e:  # noqa: BLE001 - any step's failure: say what, clean up
        print(f"quickstart: {type(e).__name__}: {' '.join(str(e).split())[:2000]}",
              file=sys.stderr)  # fmt: skip
        log_tails(work)
        status = 1
    finally:
        # Cleaning up is not interrupted: a second Ctrl-C would leave things behind.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        print("quickstart: cleaning up (containerd, snapshotter daemon, mounts, registry) ...",
              end="", flush=True)  # fmt: skip
        try:
            cleanup.close()
        finally:
            stop_new_fork_servers(before)
            if args.keep:
                print(f" done; {work} kept", flush=True)
            else:
                remove_workdir(work)
                print(" done", flush=True)
    if status == 0:
        print(f"quickstart: done in {time.monotonic() - started:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
