"""Time ``snapshotter.mount.mount`` of one checkout: run with that checkout on ``PYTHONPATH``
(``run.py`` does), so that the mount API *and* the server it starts are that checkout's.

    PYTHONPATH=CHECKOUT python mounttime.py '{"ref": ..., "work": ..., "backing": ...,
                                              "repeats": N}'

Prints one JSON object:

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

import inspect
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from imagetool.stores.base import StoreOptions
from snapshotter import mount as api
from snapshotter.config import MountConfig


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
    shutil.rmtree(cache, ignore_errors=True)
    seconds, breakdown, launch = one(**({"fork_server": False} if forkable else {}))
    out.update(first_mount_seconds=seconds, first_mount_breakdown=breakdown)
    if forkable:
        from snapshotter import forkserver

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


if __name__ == "__main__":
    sys.exit(main())
