"""The README's first command, ``./scripts/quickstart``, after its set-up: ``scripts/
quickstart.py`` run for real (registry, conversion, snapshotter daemon, containerd, a lazy
start and a full pull), on each containerd flavour, and interrupted with Ctrl-C halfway.
Either way nothing it started may be left: no process, mount, loop device or directory.

Marked root + integration: CI runs them as root (``.ci/run``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import REPO, Flavour
from support import require_fuse, require_tool

pytestmark = [pytest.mark.root, pytest.mark.integration]

QUICKSTART = REPO / "scripts/quickstart.py"
WEIGHTS_MIB = "32"


def left_behind(where: Path) -> list[str]:
    """Processes, mounts and loop devices that name ``where``, and what is in it."""
    found = [f"file {p}" for p in where.iterdir()] if where.exists() else []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(where) in cmdline:
                found.append(f"process {d.name}: {cmdline[:200]}")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        if str(where) in line:
            found.append(f"mount {line.split()[4]}")
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        if str(where) in backing.read_text():
            found.append(f"loop device {backing.parts[3]}")
    return found


def quickstart(flavour: str, workdir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(QUICKSTART), "--containerd", flavour, "--weights", WEIGHTS_MIB,
         "--workdir", str(workdir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


@pytest.fixture
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short one: the unix sockets under it must fit in 107 bytes."""
    return tmp_path_factory.mktemp("qs")


def test_quickstart_shows_a_lazy_start(flavour: Flavour, workdir: Path) -> None:
    proc = quickstart(flavour.name, workdir)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    for n in range(1, 7):
        assert re.search(rf"^\[{n}/6\] .* \.\.\. \d+\.\d s$", out, re.MULTILINE), out
    assert "the container printed: 'hello from lazyblock' (lazy), 'hello from lazyblock'" in out
    seconds = re.search(r"pull to first output +(\S+) s +(\S+) s", out)
    read = re.search(r"read from the registry +(\S+) (\w+) +(\S+) (\w+)", out)
    assert seconds and read, out
    units = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}
    lazy_bytes = float(read.group(1)) * units[read.group(2)]
    full_bytes = float(read.group(3)) * units[read.group(4)]
    # The full pull reads the whole image (the weights are random: no compression); the
    # lazy start reads its metadata and what the app reads.
    assert full_bytes > int(WEIGHTS_MIB) << 20
    assert 0 < lazy_bytes < full_bytes / 4, out
    assert "cleaning up (containerd, snapshotter daemon, mounts, registry) ... done" in out
    assert left_behind(workdir) == []


def test_interrupted_quickstart_leaves_nothing(workdir: Path) -> None:
    """Ctrl-C (SIGINT to its process group, as a terminal sends it) once the lazy start
    began, on Debian's containerd: exit 130, everything stopped and removed."""
    require_fuse()
    require_tool("runc", "umoci", "skopeo", "docker-registry", "containerd", "ctr")
    proc = quickstart("1.6", workdir)
    assert proc.stdout is not None
    out = b""
    while b"[5/6]" not in out:  # the step's line ends only when it is done: read bytes
        chunk = os.read(proc.stdout.fileno(), 4096)
        assert chunk, out.decode()
        out += chunk
    time.sleep(0.3)  # into the pull and the mount
    os.killpg(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=300)
    text = out.decode() + rest
    assert proc.returncode == 130, text
    assert "[5/6]" in text and " ... interrupted" in text, text
    assert "cleaning up (containerd, snapshotter daemon, mounts, registry) ... done" in text
    assert left_behind(workdir) == []
