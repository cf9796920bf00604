"""Fixtures for the source tests: a real multi-layer image built by umoci."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from ocibuild import build_with_umoci
from support import require_tool


def _trees(base: Path) -> list[Path]:
    """Two rootfs states: the second changes a file, adds one and deletes a directory."""
    l1 = base / "l1"
    (l1 / "etc").mkdir(parents=True)
    (l1 / "etc/hello").write_text("hello\n")
    (l1 / "gone").mkdir()
    (l1 / "gone/x").write_text("x")
    (l1 / "bin").mkdir()
    os.symlink("../etc/hello", l1 / "bin/hello")
    os.link(l1 / "etc/hello", l1 / "etc/hello.link")
    (l1 / "data.bin").write_bytes(os.urandom(1 << 20))
    l2 = base / "l2"
    subprocess.run(["cp", "-a", str(l1), str(l2)], check=True)
    subprocess.run(["rm", "-rf", str(l2 / "gone")], check=True)
    (l2 / "etc/new").write_text("new\n")
    (l2 / "data.bin").write_bytes(b"replaced")
    return [l1, l2]


@pytest.fixture(scope="session")
def umoci_layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An OCI layout holding tag "v1": two gzip layers built by umoci, with a config."""
    require_tool("umoci", "skopeo")
    base = tmp_path_factory.mktemp("umoci")
    layout = base / "image"
    build_with_umoci(
        layout,
        "v1",
        _trees(base / "trees"),
        entrypoint=["/bin/sh", "-c"],
        cmd=["cat /etc/hello"],
        env=["MODE=test"],
        user="1000:1000",
        workdir="/srv",
    )
    return layout
