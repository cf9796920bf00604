"""The README's first command, ``./scripts/quickstart``, after its set-up: ``scripts/
quickstart.py`` run for real (registry, conversion, snapshotter daemon, containerd, a lazy
start and a full pull), on each containerd flavour: on Debian's 1.6 exactly as the README
runs it (its default sample, 256 MiB of weights) and twice in the same place, on 2.x with a
smaller sample. Then interrupted with Ctrl-C halfway, and failing halfway (its registry
killed). Every way, nothing it started may be left: no process, mount, loop device or
directory.

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
WEIGHTS_MIB = "32"  # the 2.x run's and the interrupted runs' sample
README_WEIGHTS_MIB = 256  # quickstart.py's default, which the README's command runs


def left_behind(where: Path) -> list[str]:
    """Processes, mounts and loop devices that name ``where``, and what is in it."""
    found = [f"file {p}" for p in where.iterdir()] if where.exists() else []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            cmdline = _cmdline(d)
            if str(where) in cmdline:
                found.append(f"process {d.name}: {cmdline[:200]}")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        if str(where) in line:
            found.append(f"mount {line.split()[4]}")
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        if str(where) in backing.read_text():
            found.append(f"loop device {backing.parts[3]}")
    return found


def _cmdline(proc_dir: Path) -> str:
    try:
        return (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def quickstart(
    flavour: str, workdir: Path, weights: str | None = WEIGHTS_MIB
) -> subprocess.Popen[str]:
    sample = ["--weights", weights] if weights else []
    return subprocess.Popen(
        [sys.executable, str(QUICKSTART), "--containerd", flavour, *sample,
         "--workdir", str(workdir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


def read_until(proc: subprocess.Popen[str], marker: bytes) -> bytes:
    """What ``proc`` printed up to and including ``marker``: a step's line ends only when
    the step is done, so this reads bytes, not lines."""
    assert proc.stdout is not None
    out = b""
    while marker not in out:
        chunk = os.read(proc.stdout.fileno(), 4096)
        assert chunk, out.decode()
        out += chunk
    return out


@pytest.fixture
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short one: the unix sockets under it must fit in 107 bytes."""
    return tmp_path_factory.mktemp("qs")


def test_quickstart_shows_a_lazy_start(flavour: Flavour, workdir: Path) -> None:
    readme = flavour.name == "1.6"  # the README's command: Debian's containerd, default sample
    for _ in range(2 if readme else 1):  # a second run works where the first one ran
        proc = quickstart(flavour.name, workdir, weights=None if readme else WEIGHTS_MIB)
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out
        for n in range(1, 7):
            assert re.search(rf"^\[{n}/6\] .* \.\.\. \d+\.\d s$", out, re.MULTILINE), out
        weights = README_WEIGHTS_MIB if readme else int(WEIGHTS_MIB)
        assert f"with {weights} MiB of weights" in out, out
        assert "the container printed: 'hello from lazyblock' (lazy), 'hello from lazyblock'" in out
        seconds = re.search(r"pull to first output +(\S+) s +(\S+) s", out)
        needed, read = (
            re.search(rf"{what} +(\S+) (\w+) +(\S+) (\w+)", out)
            for what in ("needed by the start", "read from the registry")
        )
        assert seconds and needed and read, out
        units = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}
        lazy_needed = float(needed.group(1)) * units[needed.group(2)]
        lazy_read = float(read.group(1)) * units[read.group(2)]
        full_read = float(read.group(3)) * units[read.group(4)]
        # The full pull reads the whole image (the weights are random: no compression); the
        # lazy start needs its metadata and what the app reads.
        assert full_read > weights << 20
        assert 0 < lazy_needed < full_read / 4, out
        streamed = "streamed the rest of the image in the background" in out
        if readme:
            # 256 MiB of weights hold most of the image (files of 64 MiB or more): it is
            # streamed whole behind the start, and the run waits for that to end.
            assert streamed and lazy_read > full_read * 0.9, out
        else:  # 32 MiB: no large file, nothing streamed
            assert not streamed and lazy_needed <= lazy_read < full_read / 4, out
        assert "cleaning up (containerd, snapshotter daemon, mounts, registry) ... done" in out
        assert left_behind(workdir) == []


def test_interrupted_quickstart_leaves_nothing(workdir: Path) -> None:
    """Ctrl-C (SIGINT to its process group, as a terminal sends it) once the lazy start
    began, on Debian's containerd: exit 130, everything stopped and removed."""
    require_fuse()
    require_tool("runc", "umoci", "skopeo", "docker-registry", "containerd", "ctr")
    proc = quickstart("1.6", workdir)
    out = read_until(proc, b"[5/6]")
    time.sleep(0.3)  # into the pull and the mount
    os.killpg(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=300)
    text = out.decode() + rest
    assert proc.returncode == 130, text
    assert "[5/6]" in text and " ... interrupted" in text, text
    assert "cleaning up (containerd, snapshotter daemon, mounts, registry) ... done" in text
    assert left_behind(workdir) == []


def test_failed_quickstart_leaves_nothing(workdir: Path) -> None:
    """A step that fails halfway (the registry killed as the lazy start begins, so the pull
    cannot read the image): exit 1, the failure named in one line with the logs' tails, and
    everything stopped and removed all the same."""
    require_fuse()
    require_tool("runc", "umoci", "skopeo", "docker-registry", "containerd", "ctr")
    proc = quickstart("1.6", workdir)
    out = read_until(proc, b"[5/6]")
    registries = [
        int(d.name)
        for d in Path("/proc").iterdir()
        if d.name.isdigit()
        and (cmdline := _cmdline(d)).startswith("docker-registry serve")
        and str(workdir) in cmdline
    ]
    assert len(registries) == 1, registries
    os.kill(registries[0], signal.SIGKILL)
    rest, _ = proc.communicate(timeout=300)
    text = out.decode() + rest
    assert proc.returncode == 1, text
    assert re.search(r"^\[5/6\] .* \.\.\. failed$", text, re.MULTILINE), text
    assert re.search(r"^quickstart: StepError: .+$", text, re.MULTILINE), text
    assert "cleaning up (containerd, snapshotter daemon, mounts, registry) ... done" in text
    assert left_behind(workdir) == []
