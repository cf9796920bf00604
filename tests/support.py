"""Test support: environment checks and real servers (import as ``support``).

Tests that need root, loop devices, FUSE or an external tool call ``require(...)``. On a
laptop that skips with the reason; under ``.ci/run`` (LAZYBLOCK_REQUIRE_ALL=1) it fails, since
CI has all of them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

REQUIRE_ALL = os.environ.get("LAZYBLOCK_REQUIRE_ALL") == "1"


def require(condition: bool, reason: str) -> None:
    """Skip (or, in CI, fail) unless ``condition`` holds."""
    if condition:
        return
    if REQUIRE_ALL:
        pytest.fail(f"CI requires this test to run, but: {reason}", pytrace=False)
    pytest.skip(reason)


def require_root() -> None:
    require(os.geteuid() == 0, "needs root")


def require_tool(*names: str) -> None:
    for name in names:
        require(shutil.which(name) is not None, f"needs {name} on PATH")


def require_fuse() -> None:
    require_root()
    require(os.path.exists("/dev/fuse"), "needs /dev/fuse")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port}")


class Registry:
    """A real Distribution registry (Debian's docker-registry) on loopback."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        config = root / "config.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: false\n"
            f"storage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n"
            "  delete:\n    enabled: true\n"
            f"http:\n  addr: 127.0.0.1:{self.port}\n"
        )
        self.log = root / "registry.log"
        self._logf = open(self.log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            ["docker-registry", "serve", str(config)], stdout=self._logf, stderr=self._logf
        )
        try:
            wait_port(self.port)
        except TimeoutError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._logf.close()
