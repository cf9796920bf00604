"""Helpers for the mount tests: run the snapshotter CLI, drop caches, adjust configs."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from snapshotter.config import MountConfig


def with_store_options(cfg: MountConfig, **store: object) -> MountConfig:
    return replace(cfg, store=replace(cfg.store, **store))


def snapshotter(
    *args: str, check: bool = True, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the real CLI (what an operator runs)."""
    proc = subprocess.run(
        [sys.executable, "-m", "snapshotter.cli", *args], capture_output=True, text=True, cwd=cwd
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"snapshotter {' '.join(args)} failed: {proc.stderr}")
    return proc


def drop_caches() -> None:
    """Forget the kernel's page cache, so reads go down to FUSE again."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")
