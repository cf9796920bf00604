"""A mount's server dies or is replaced under running readers: no read fails, none is wrong.

Real mounts (FUSE + erofs, both backings). A reader thread reads the image's files without
pause at random offsets, dropping each file's page cache before every read
(``POSIX_FADV_DONTNEED``) so that each read reaches the FUSE file, and checks every byte
against the file's known content. Meanwhile the test SIGKILLs the mount's server 20 times
(the holder starts a successor each time), or replaces it 20 times with a new process
(``api.replace``, what ``snapshotter upgrade-mounts`` does). It counts failed reads, wrong
reads and the longest single read (the stall a handover costs), and prints them with the
time each handover took (SIGKILL to a successor's first answered read; ``api.replace``'s
call) and the requests the successors got back through ``FUSE_NOTIFY_RESEND``.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import mountimages as images
import pytest
from mounthelp import snapshotter
from ocibuild import TarEntry, make_layer_tar

from snapshotter.config import MountConfig
from snapshotter.mount import api, kernel, state

pytestmark = [pytest.mark.root, pytest.mark.integration]

MIB = 1 << 20
FILES = 6
FILE_SIZE = 8 * MIB
READ = 64 << 10
ROUNDS = 20
# Reads the reader must have done between two handovers (so each one lands under reads).
READS_BETWEEN = 30


def _content(i: int) -> bytes:
    """File ``i``'s bytes: distinct in every 32-byte run (a misplaced block shows)."""
    out = bytearray()
    n = 0
    while len(out) < FILE_SIZE:
        out += hashlib.sha256(f"{i}:{n}".encode()).digest()
        n += 1
    return bytes(out[:FILE_SIZE])


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, bytes]]:
    """A directory-store image of ``FILES`` incompressible files, and their contents."""
    root = tmp_path_factory.mktemp("handover")
    files = {f"data/f{i}.bin": _content(i) for i in range(FILES)}
    entries = [TarEntry("data/", type="dir")]
    entries += [TarEntry(name, data=data) for name, data in files.items()]
    layout = images.build_layout(root, [make_layer_tar(entries, compression=None)])
    ref = str(root / "store" / "handover:v1")
    images.convert(layout, "v1", ref, "--sector-size", "1MiB")
    return ref, files


@dataclass
class Reader:
    """Reads the mounted files at random offsets until stopped; checks every byte."""

    mountpoint: Path
    files: dict[str, bytes]
    reads: int = 0
    failed: int = 0
    wrong: int = 0
    longest: float = 0.0
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Reader:
        self._thread = threading.Thread(target=self._run, name="reader", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(120)
        assert not self._thread.is_alive(), "the reader hangs"

    def wait_reads(self, more: int, timeout: float = 60.0) -> None:
        want, deadline = self.reads + more, time.monotonic() + timeout
        while self.reads < want:
            assert time.monotonic() < deadline, f"reader stuck at {self.reads} reads"
            time.sleep(0.01)

    def _run(self) -> None:
        rng = random.Random(24)
        names = sorted(self.files)
        fds = {n: os.open(self.mountpoint / n, os.O_RDONLY) for n in names}
        try:
            while not self._stop.is_set():
                name = rng.choice(names)
                offset = rng.randrange(0, FILE_SIZE - READ) & ~4095
                fd = fds[name]
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                began = time.monotonic()
                try:
                    got = os.pread(fd, READ, offset)
                except OSError as e:
                    self.failed += 1
                    self.errors.append(f"{name}@{offset}: {e}")
                    continue
                finally:
                    self.longest = max(self.longest, time.monotonic() - began)
                if got != self.files[name][offset : offset + READ]:
                    self.wrong += 1
                    self.errors.append(f"{name}@{offset}: wrong bytes")
                self.reads += 1
        finally:
            for fd in fds.values():
                os.close(fd)


def _mount(ref: str, tmp_path: Path, config: MountConfig, backing: str) -> tuple[Path, MountConfig]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    # No memory sectors: every read goes to the node's cache, as after a restart.
    cfg = replace(config, backing=backing, memory_sectors=0)
    info = api.mount(ref, mnt, cfg)
    assert info.held and info.holder_pid, "the mount has no holder"
    return mnt, cfg


def _wait_served(mnt: Path, cfg: MountConfig, not_pid: int, timeout: float = 60.0) -> int:
    """The pid of a live, ready server other than ``not_pid``."""
    directory = state.mount_dir(cfg.state_dir, mnt)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = state.MountRecord.load(directory)
        if record and record.pid != not_pid and record.alive and record.phase == "ready":
            return record.pid
        time.sleep(0.01)
    raise AssertionError(f"no successor of server {not_pid} serves {mnt}")


def _report(what: str, reader: Reader, stalls: list[float], resent: int) -> None:
    print(
        f"\n{what}: {ROUNDS} rounds, {reader.reads} reads, {reader.failed} failed, "
        f"{reader.wrong} wrong, longest read {reader.longest:.3f}s, handover stalls "
        f"median {sorted(stalls)[len(stalls) // 2]:.3f}s max {max(stalls):.3f}s, "
        f"{resent} requests resent"
    )


@pytest.mark.parametrize("backing", ["file", "loop"])
def test_sigkilled_server_is_succeeded_with_no_failed_read(
    backing, config, image, tmp_path
) -> None:  # noqa: ANN001
    ref, files = image
    mnt, cfg = _mount(ref, tmp_path, config, backing)
    reader = Reader(mnt, files).start()
    stalls, resent = [], 0
    try:
        reader.wait_reads(READS_BETWEEN)
        pid = api.list_mounts(cfg)[0].pid
        for _ in range(ROUNDS):
            reader.wait_reads(READS_BETWEEN)
            resent += api.stats(mnt, cfg)["handover"]["resent_requests"]
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            pid = _wait_served(mnt, cfg, pid)
            reader.wait_reads(1)
            stalls.append(time.monotonic() - killed)
        reader.wait_reads(READS_BETWEEN)
    finally:
        reader.stop()
    stats = api.stats(mnt, cfg)
    resent += stats["handover"]["resent_requests"]
    _report(f"SIGKILL ({backing})", reader, stalls, resent)
    assert (reader.failed, reader.wrong) == (0, 0), reader.errors[:5]
    assert stats["handover"]["servers"] == ROUNDS + 1 and stats["handover"]["adopted"]
    # The reads reached FUSE: the last server answered some of them.
    assert stats["fetch"]["cache_hits"] > 0
    (info,) = api.list_mounts(cfg)
    assert info.alive and info.held
    api.unmount(mnt, cfg)
    assert not kernel.is_mountpoint(mnt) and api.list_mounts(cfg) == []
    assert state.process_start(info.holder_pid) is None, "the holder outlived the mount"


@pytest.mark.parametrize("backing", ["file", "loop"])
def test_replaced_server_hands_over_with_no_failed_read(backing, config, image, tmp_path) -> None:  # noqa: ANN001
    ref, files = image
    mnt, cfg = _mount(ref, tmp_path, config, backing)
    reader = Reader(mnt, files).start()
    stalls, resent = [], 0
    try:
        for i in range(ROUNDS):
            reader.wait_reads(READS_BETWEEN)
            old = api.list_mounts(cfg)[0].pid
            resent += api.stats(mnt, cfg)["handover"]["resent_requests"]
            began = time.monotonic()
            # Forked by the fork server or a new interpreter; with the mount's own
            # configuration (kept by the holder) or the caller's.
            info = api.replace(mnt, cfg, fork_server=i % 2 == 0, reconfigure=i % 5 == 0)
            stalls.append(time.monotonic() - began)
            assert info.pid != old and info.alive and state.process_start(old) is None
        reader.wait_reads(READS_BETWEEN)
    finally:
        reader.stop()
    stats = api.stats(mnt, cfg)
    resent += stats["handover"]["resent_requests"]
    _report(f"replace ({backing})", reader, stalls, resent)
    assert (reader.failed, reader.wrong) == (0, 0), reader.errors[:5]
    assert stats["handover"]["servers"] == ROUNDS + 1
    api.unmount(mnt, cfg)
    assert not kernel.is_mountpoint(mnt) and api.list_mounts(cfg) == []


def test_upgrade_mounts_cli_and_a_mount_without_holder(config, image, tmp_path) -> None:  # noqa: ANN001
    """``snapshotter upgrade-mounts`` replaces every live server; a mount without a holder
    (as a version before holders recorded it) cannot be replaced (one line, exit 1) and
    keeps its server."""
    ref, files = image
    mnt, cfg = _mount(ref, tmp_path, config, "file")
    args = ["--state-dir", str(cfg.state_dir), "--cache-dir", str(cfg.cache_dir)]
    old = api.list_mounts(cfg)[0]
    out = snapshotter("upgrade-mounts", *args).stdout
    new = api.list_mounts(cfg)[0]
    assert f"pid {old.pid} -> {new.pid}" in out and new.alive and new.servers == 2
    assert (mnt / "data/f3.bin").read_bytes() == files["data/f3.bin"]
    assert "[ready]" in snapshotter("status", *args).stdout

    directory = state.mount_dir(cfg.state_dir, mnt)
    record = state.MountRecord.load(directory)
    replace(record, holder_pid=0, holder_start=0).save(directory)
    res = snapshotter("upgrade-mounts", str(mnt), *args, check=False)
    assert res.returncode == 1 and "HandoverError" in res.stderr and "no holder" in res.stderr
    assert api.list_mounts(cfg)[0].pid == new.pid and api.list_mounts(cfg)[0].alive
    record.save(directory)


def test_a_killed_holder_is_restarted_by_its_server(config, image, tmp_path) -> None:  # noqa: ANN001
    """The holder SIGKILLed: the live server starts a new one, and the mount then survives
    a SIGKILL of its server as before."""
    ref, files = image
    mnt, cfg = _mount(ref, tmp_path, config, "file")
    first = api.list_mounts(cfg)[0]
    os.kill(first.holder_pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not ((m := api.list_mounts(cfg)[0]).held and m.holder_pid != first.holder_pid):
        assert time.monotonic() < deadline, "no new holder"
        time.sleep(0.05)
    reader = Reader(mnt, files).start()
    try:
        reader.wait_reads(READS_BETWEEN)
        os.kill(first.pid, signal.SIGKILL)
        _wait_served(mnt, cfg, first.pid)
        reader.wait_reads(READS_BETWEEN)
    finally:
        reader.stop()
    assert (reader.failed, reader.wrong) == (0, 0), reader.errors[:5]
