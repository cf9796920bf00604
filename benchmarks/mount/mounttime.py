"""Time ``snapshotter.mount.api.mount`` of one checkout: run with that checkout on ``PYTHONPATH``
(``run.py`` does), so that the mount API *and* the server it starts are that checkout's.

    PYTHONPATH=CHECKOUT python mounttime.py '{"ref": ..., "work": ..., "backing": ...,
                                              "repeats": N}'

Prints one JSON object:

* ``cli_first_mount_seconds``: ``snapshotter mount`` run alone on a node with empty caches and
  no fork server of this context (one that runs is stopped first): wall time of the whole
  command, its interpreter's start included;
* ``first_mount_seconds``: a node's first mount: empty caches, the server started as a new
  interpreter (no fork server yet);
* ``mount_seconds``: median of ``repeats`` mounts with an empty sector and index cache, on a
  node that has mounted before (its fork server running, where the checkout has one);
* ``remount_seconds``: median of as many mounts of the same image again (index and metadata
  sectors cached);

each with the server's own breakdown (``*_breakdown``, of the median run) and how the server
was started (``launch``). Every mount is unmounted before the next.
"""

from __future__ import annotations

import glob
import inspect
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from imagetool.stores.base import StoreOptions
from snapshotter.config import MountConfig
from snapshotter.mount import api


def main() -> int:
    args = json.loads(sys.argv[1])
    work = Path(args["work"])
    ref = args["ref"]
    mnt = work / "mnt"
    mnt.mkdir(exist_ok=True)
    cache = work / "cache"
    cfg = MountConfig(cache_dir=cache, cache_size=64 << 30, state_dir=work / "state",
                      prefetch=False, store=StoreOptions(plain_http=True),
                      backing=args.get("backing", "auto"))  # fmt: skip
    api.unmount(mnt, cfg)
    forkable = "fork_server" in inspect.signature(api.mount).parameters

    def one(**kwargs: Any) -> tuple[float, dict[str, float], str]:
        start = time.monotonic()
        api.mount(ref, mnt, cfg, **kwargs)
        seconds = time.monotonic() - start
        try:
            stats = api.stats(mnt, cfg)
        finally:
            api.unmount(mnt, cfg)
        return seconds, stats["mount_seconds"], stats.get("launch", "exec")

    out: dict[str, object] = {}
    if forkable:
        stop_fork_server()
    shutil.rmtree(cache, ignore_errors=True)
    seconds, breakdown = cli_mount(ref, mnt, cfg, work)
    out.update(cli_first_mount_seconds=seconds, cli_first_mount_breakdown=breakdown)
    if forkable:
        stop_fork_server()  # the one that command started, for the mounts that follow it
    shutil.rmtree(cache, ignore_errors=True)
    seconds, breakdown, launch = one(**({"fork_server": False} if forkable else {}))
    out.update(first_mount_seconds=seconds, first_mount_breakdown=breakdown)
    if forkable:
        from snapshotter.mount import forkserver

        forkserver.ensure_running(timeout=120)
    cold, warm = [], []
    for _ in range(int(args.get("repeats", 3))):
        shutil.rmtree(cache, ignore_errors=True)
        cold.append(one())
        warm.append(one())
    for name, runs in (("mount", cold), ("remount", warm)):
        runs.sort(key=lambda r: r[0])
        seconds, breakdown, launch = runs[len(runs) // 2]
        out[f"{name}_seconds"] = statistics.median(r[0] for r in runs)
        out[f"{name}_breakdown"] = breakdown
        out[f"{name}_launch"] = launch
    print(json.dumps(out))
    return 0


def cli_mount(ref: str, mnt: Path, cfg: MountConfig, work: Path) -> tuple[float, dict[str, float]]:
    """Wall time of ``snapshotter mount`` as a command of its own (a new interpreter, run
    from ``/`` as an operator would), and the server's breakdown, with ``command``: what
    was not the server's (the command's interpreter start, imports and configuration before
    it, its exit after)."""
    empty = work / "empty.toml"
    empty.write_text("")
    command = [
        sys.executable, "-m", "snapshotter.cli", "mount", "--config", str(empty),
        "--no-prefetch", "--cache-dir", str(cfg.cache_dir), "--cache-size", str(cfg.cache_size),
        "--state-dir", str(cfg.state_dir), "--backing", cfg.backing,
        "--set", f"store.plain_http={str(cfg.store.plain_http).lower()}", ref, str(mnt),
    ]  # fmt: skip
    start = time.monotonic()
    subprocess.run(command, check=True, capture_output=True, cwd="/")
    seconds = time.monotonic() - start
    try:
        breakdown = dict(api.stats(mnt, cfg)["mount_seconds"])
    finally:
        api.unmount(mnt, cfg)
    if "launch" in breakdown:
        breakdown["command"] = seconds - breakdown["launch"] - breakdown["total"]
    return seconds, breakdown


def stop_fork_server(timeout: float = 10.0) -> None:
    """End the fork server of this context, if one listens (found by its socket's name), so
    that the next command starts as on a node that has never mounted."""
    from snapshotter.mount import forkserver

    name = "@" + forkserver.socket_name(forkserver.context_key())[1:].decode()
    with open("/proc/net/unix") as f:
        inodes = {p[6] for p in (line.split() for line in f) if len(p) > 7 and p[7] == name}
    pids = set()
    for fd in glob.glob("/proc/[0-9]*/fd/*"):
        try:
            if os.readlink(fd).removeprefix("socket:[").rstrip("]") in inodes:
                pids.add(int(fd.split("/")[2]))
        except OSError:
            continue
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)


if __name__ == "__main__":
    sys.exit(main())
