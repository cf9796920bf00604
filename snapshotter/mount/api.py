"""Mount, inspect and unmount block images: the snapshotter's Python API.

This is what the CLI and the containerd-facing service call; it is stable::

    info = mount("docker://reg/app:v1", Path("/mnt/app"), config)   # -> MountInfo
    stats(Path("/mnt/app"), config)                                  # -> dict (JSON-able)
    replace(Path("/mnt/app"), config)                                # -> MountInfo (new server)
    list_mounts(config)                                              # -> [MountInfo]
    unmount(Path("/mnt/app"), config)                                # idempotent

Each mount is served by its own long-lived process (``snapshotter.mount.server``), started detached
here, so the caller may exit or restart without disturbing running containers: forked from
the pre-imported fork server of this context (``snapshotter.mount.forkserver``), which spares it
the interpreter's start and imports, or, when there is none yet (the first mount), as a new
interpreter (the ``snapshotter`` command instead forks itself into the server: it has
imported much of the server's code already), after which the fork server is started for the
mounts that follow. ``mount``
returns once that server reports the tree browsable (index verified, metadata sectors local,
erofs mounted). Everything a later process needs to find and clean up a mount is recorded
under ``config.state_dir`` (``snapshotter.mount.state``), so ``unmount`` also works after the
server died (killed, crashed): it takes erofs down (lazily: users of a dead mount get EIO
anyway), aborts and unmounts the FUSE file system and lets the loop device go.

A mount's FUSE connection outlives its server: the mount's holder keeps it
(``snapshotter.mount.holder``) and starts a successor when the server dies; ``replace``
starts a successor of the installed version while the old server runs (an upgrade), which
takes the connection over and retires the old one. Readers wait during either; none fails.
A mount whose server is dead but whose holder lives (``MountInfo.held``) is being taken over,
not dead: ``mount`` refuses it as mounted, ``unmount`` ends the holder too.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imagetool.errors import InvalidReferenceError
from imagetool.profile import Profile, ProfileEntry
from imagetool.stores.refs import absolute_ref
from snapshotter.cache import sectors
from snapshotter.config import MountConfig
from snapshotter.errors import CacheError, SnapshotterError
from snapshotter.mount import control, forkserver, handover, kernel, launcher, state

log = logging.getLogger(__name__)

# How long unmount waits for a server to exit after its FUSE file system is gone.
SERVER_EXIT_TIMEOUT = 10.0
# Extra seconds mount() waits beyond config.mount_timeout (process start, imports).
STARTUP_SLACK = 15.0


class MountError(SnapshotterError):
    """A mount could not be set up (the message says why: store, index, kernel...).
    ``cause``: the name of the error the mount server met (``AuthError`` when the registry
    refused the credentials or wanted some), where it said."""

    def __init__(self, message: str, cause: str | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class AlreadyMountedError(MountError):
    errno = errno.EBUSY


class NotMountedError(SnapshotterError):
    """No live lazyblock mount at that mountpoint."""

    errno = errno.EINVAL


class MountBusyError(SnapshotterError):
    """The mount is in use; unmount it lazily or stop its users first."""

    errno = errno.EBUSY


@dataclass(frozen=True)
class MountInfo:
    mountpoint: Path
    ref: str
    index_digest: str
    pid: int
    alive: bool  # the server process runs
    phase: str  # "starting" or "ready"
    backing: str  # "file" (erofs file-backed) or "loop"
    loop_device: str
    started_at: float
    state_dir: Path  # this mount's directory under config.state_dir
    held: bool = False  # its holder lives: the FUSE connection survives the server
    holder_pid: int = 0
    servers: int = 1  # servers the mount has had (1 + handovers)

    @classmethod
    def from_record(cls, record: state.MountRecord, directory: Path) -> MountInfo:
        return cls(
            mountpoint=Path(record.mountpoint),
            ref=record.ref,
            index_digest=record.index_digest,
            pid=record.pid,
            alive=record.alive,
            phase=record.phase,
            backing=record.backing,
            loop_device=record.loop_device,
            started_at=record.started_at,
            state_dir=directory,
            held=record.held,
            holder_pid=record.holder_pid,
            servers=record.servers,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "mountpoint": str(self.mountpoint),
            "ref": self.ref,
            "index_digest": self.index_digest,
            "pid": self.pid,
            "alive": self.alive,
            "phase": self.phase,
            "backing": self.backing,
            "loop_device": self.loop_device,
            "started_at": self.started_at,
            "held": self.held,
            "holder_pid": self.holder_pid,
            "servers": self.servers,
        }


def mount(
    ref: str,
    mountpoint: Path,
    config: MountConfig,
    *,
    log_level: int = logging.INFO,
    fork_server: bool = True,
    fork_self: bool = False,
) -> MountInfo:
    """Mount image ``ref`` read-only at ``mountpoint`` (an existing directory), served by a
    new detached server process. Returns when the tree is browsable.

    ``fork_server=False`` starts the server as a new interpreter rather than forking it
    from the fork server (slower; for callers that import other code than they run).
    ``fork_self=True``: when the fork server cannot be used (none runs yet, or not asked
    for), this process forks itself into the server instead of starting a new interpreter;
    only for a caller that has no threads and runs the code it imported (the
    ``snapshotter`` command; a process with threads gets a new interpreter)."""
    mountpoint = Path(os.path.abspath(mountpoint))
    # The server does not work in this directory: relative paths are this one's.
    ref, config = _absolute(ref, mountpoint), config.absolute()
    directory = state.mount_dir(config.state_dir, mountpoint)
    record = state.MountRecord.load(directory)
    if record is not None:
        if record.alive and (record.phase != "ready" or kernel.is_mountpoint(mountpoint)):
            raise AlreadyMountedError(f"{mountpoint} is already mounted ({record.ref})")
        if record.held and record.phase == "ready" and kernel.is_mountpoint(mountpoint):
            raise AlreadyMountedError(
                f"{mountpoint} is already mounted ({record.ref}; its server is being restarted)"
            )
        log.info("cleaning up after the dead or orphaned server of %s", mountpoint)
        unmount(mountpoint, config)
    if not mountpoint.is_dir():
        raise MountError(f"mountpoint {mountpoint} is not a directory")
    directory.mkdir(parents=True, exist_ok=True)
    request = {
        "ref": ref,
        "mountpoint": str(mountpoint),
        "config": config.to_dict(),
        "log_level": log_level,
        "sent_at": time.time(),  # the server reports how long it took to start ("launch")
    }
    read_end, write_end = os.pipe()
    server: _Server | None = None
    try:
        with open(directory / state.LOG_FILE, "ab") as logf:
            server = _start_server(
                request,
                logf.fileno(),
                write_end,
                fork_server,
                fork_self,
                close=(read_end,),
                launcher_at=launcher.resolve(config.launcher, config.state_dir),
                state_dir=config.state_dir,
            )
        os.close(write_end)
        write_end = -1
        answer = _read_ready(read_end, config.mount_timeout + STARTUP_SLACK)
    except BaseException:
        # Interrupted while waiting (Ctrl-C, a signal): nobody will use this mount, so it
        # must not go on being made (the server may be stuck on the store).
        if server is not None:
            server.kill()
            server.wait(SERVER_EXIT_TIMEOUT)
            with contextlib.suppress(Exception):
                unmount(mountpoint, config)
        raise
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
    if answer is None or not answer.get("ok"):
        if answer is None:
            server.kill()
        server.wait(SERVER_EXIT_TIMEOUT)
        server.start_fork_server()
        reason = (
            f"{answer.get('type')}: {answer.get('error')}"
            if answer
            else f"server exited or timed out: {_log_tail(directory / state.LOG_FILE)}"
        )
        with contextlib.suppress(SnapshotterError):
            unmount(mountpoint, config)
        raise MountError(
            f"cannot mount {ref} at {mountpoint}: {reason}",
            answer.get("type") if answer else None,
        )
    server.reap_in_background()
    server.start_fork_server()
    record = state.MountRecord.load(directory)
    if record is None:
        raise MountError(f"server for {mountpoint} is ready but left no state")
    return MountInfo.from_record(record, directory)


class _Server:
    """A mount server just started: our child (a new interpreter, ``proc``, or this process
    forked, ``child``), or the fork server's (``pid`` None if the fork server did not say)."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes] | None,
        pid: int | None,
        want_fork_server: bool = False,
        child: bool = False,
    ) -> None:
        self.proc = proc
        self.want_fork_server = want_fork_server  # there was none; start it for next time
        self.pid = proc.pid if proc is not None else pid
        self.child = child  # ``pid`` is a child of ours (to be reaped by us)
        self._start = state.process_start(self.pid) if self.pid else None

    def _running(self) -> bool:
        if self.child:
            with contextlib.suppress(ChildProcessError):
                return os.waitpid(self.pid or 0, os.WNOHANG)[0] == 0
            return False
        return self._start is not None and state.process_start(self.pid or 0) == self._start

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
        elif self.pid and self._running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float) -> None:
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
            return
        deadline = time.monotonic() + timeout
        while self._running() and time.monotonic() < deadline:
            time.sleep(0.02)

    def start_fork_server(self) -> None:
        if self.want_fork_server:
            self.want_fork_server = False
            try:
                forkserver.start()
            except forkserver.ForkServerError as e:
                log.info("%s", e)

    def reap_in_background(self) -> None:
        """Reap our child whenever it exits, so a long-lived caller collects no zombies
        (the fork server reaps its own)."""
        if self.proc is not None:
            threading.Thread(target=self.proc.wait, name="lazyblock-reap", daemon=True).start()
        elif self.child:
            threading.Thread(target=_reap, args=(self.pid,), name="lazyblock-reap",
                             daemon=True).start()  # fmt: skip


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _start_server(
    request: dict[str, Any], log_fd: int, ready_fd: int, fork: bool, fork_self: bool,
    close: tuple[int, ...], launcher_at: Path | None = None, state_dir: Path | None = None,
) -> _Server:  # fmt: skip
    """Start the mount server for ``request``, detached, logging to ``log_fd`` and reporting
    readiness on ``ready_fd``: by the node launcher at ``launcher_at`` if one is given and
    it can (``snapshotter.mount.launcher``), else forked by the fork server if it can, else
    (``fork_self``) by forking this process, else as a new interpreter. ``close``:
    descriptors of ours that the server must not keep; ``state_dir``: where a fallback
    from the launcher is counted."""
    if launcher_at is not None:
        try:
            return _Server(None, launcher.spawn(launcher_at, request, log_fd, ready_fd))
        except launcher.LauncherError as e:
            log.warning("%s; starting the mount server of %s in this process's context (it "
                        "will not outlive it)", e, request["mountpoint"])  # fmt: skip
            if state_dir is not None:
                launcher.count_fallback(state_dir, e.reason)
    unavailable = False
    if fork:
        try:
            return _Server(None, forkserver.spawn(request, log_fd, ready_fd))
        except forkserver.ForkServerUnavailable:
            unavailable = True
        except forkserver.ForkServerError as e:
            log.info("fork server: %s; starting the mount server directly", e)
    if fork_self:
        try:
            pid = forkserver.fork_self(request, log_fd, ready_fd, close)
            return _Server(None, pid, want_fork_server=unavailable, child=True)
        except forkserver.ForkServerError as e:
            log.info("%s; starting the mount server as a new interpreter", e)
    proc = subprocess.Popen(
        [sys.executable, "-m", "snapshotter.mount.server", "--ready-fd", str(ready_fd)],
        stdin=subprocess.PIPE, stdout=log_fd, stderr=log_fd, pass_fds=(ready_fd,),
        start_new_session=True, cwd="/",
    )  # fmt: skip
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(request).encode())
    proc.stdin.close()
    return _Server(proc, None, want_fork_server=unavailable)


def replace(
    mountpoint: Path,
    config: MountConfig,
    *,
    log_level: int = logging.INFO,
    fork_server: bool = True,
    reconfigure: bool = False,
) -> MountInfo:
    """Replace the server of the live mount at ``mountpoint`` by a new process of the
    installed version: it takes the FUSE connection over from the mount's holder, retires
    the old server and serves; readers only wait. Returns once it serves. The new server
    keeps the old one's configuration (its credentials included, which the holder keeps in
    memory), unless ``reconfigure``: then it takes ``config`` (whose ``state_dir`` finds the
    mount either way).
    ``HandoverError`` for a mount without a holder (made by a version before handovers:
    only a remount helps) or whose takeover failed (the old server then goes on)."""
    mountpoint = Path(os.path.abspath(mountpoint))
    config = config.absolute()
    directory = state.mount_dir(config.state_dir, mountpoint)
    record = state.MountRecord.load(directory)
    if record is None or record.phase != "ready" or not kernel.is_mountpoint(mountpoint):
        raise NotMountedError(f"no lazyblock mount at {mountpoint}")
    if not record.held:
        raise handover.HandoverError(
            f"the mount at {mountpoint} has no holder (made before handovers, or its holder "
            "was killed): its server cannot be replaced, only remounted"
        )
    request: dict[str, Any] = {
        "ref": record.ref,
        "mountpoint": str(mountpoint),
        "mount_dir": str(directory),
        "sent_at": time.time(),
        "adopt": True,
    }
    if reconfigure:
        request.update(config=config.to_dict(), log_level=log_level)
    read_end, write_end = os.pipe()
    try:
        with open(directory / state.LOG_FILE, "ab") as logf:
            server = _start_server(request, logf.fileno(), write_end, fork_server, False,
                                   close=(read_end,),
                                   launcher_at=launcher.resolve(config.launcher,
                                                                config.state_dir),
                                   state_dir=config.state_dir)  # fmt: skip
        os.close(write_end)
        write_end = -1
        answer = _read_ready(read_end, config.mount_timeout + STARTUP_SLACK)
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
    if answer is None or not answer.get("ok"):
        reason = (
            f"{answer.get('type')}: {answer.get('error')}"
            if answer
            else f"server exited or timed out: {_log_tail(directory / state.LOG_FILE)}"
        )
        raise handover.HandoverError(f"cannot replace the server of {mountpoint}: {reason}")
    server.reap_in_background()
    server.start_fork_server()
    new = state.MountRecord.load(directory)
    if new is None:
        raise handover.HandoverError(f"the new server of {mountpoint} left no state")
    return MountInfo.from_record(new, directory)


def _read_ready(fd: int, timeout: float) -> dict[str, Any] | None:
    """The server's readiness line, or None if it closed the pipe or timed out."""
    deadline = time.monotonic() + timeout
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    try:
        return json.loads(data.split(b"\n", 1)[0])
    except ValueError:
        return None


def _absolute(ref: str, mountpoint: Path) -> str:
    """``ref`` with a relative directory store made absolute (``absolute_ref``)."""
    try:
        return absolute_ref(ref)
    except InvalidReferenceError as e:
        raise MountError(
            f"cannot mount {ref} at {mountpoint}: InvalidReferenceError: {e}"
        ) from None


def _log_tail(path: Path, lines: int = 3) -> str:
    with contextlib.suppress(OSError):
        tail = path.read_text(errors="replace").strip().splitlines()[-lines:]
        return " | ".join(tail) or "no log"
    return "no log"


def run_foreground(
    ref: str,
    mountpoint: Path,
    config: MountConfig,
    on_ready: Callable[[dict[str, Any]], bool],
) -> int:
    """Serve a mount in this process (``snapshotter mount --foreground``, systemd units)
    until it is unmounted or signalled; ``on_ready`` gets the readiness document."""
    from snapshotter.mount import server as mount_server

    mountpoint = Path(os.path.abspath(mountpoint))
    # Relative paths are the command's, whatever directory the server ends up in.
    ref, config = _absolute(ref, mountpoint), config.absolute()
    directory = state.mount_dir(config.state_dir, mountpoint)
    record = state.MountRecord.load(directory)
    if record is not None:
        if record.alive:
            raise AlreadyMountedError(f"{mountpoint} is already mounted ({record.ref})")
        unmount(mountpoint, config)
    return mount_server.run(ref, mountpoint, config, on_ready)


def unmount(mountpoint: Path, config: MountConfig, *, lazy: bool = False) -> None:
    """Unmount the image at ``mountpoint`` and end its server; a no-op if nothing is there.

    A live mount that is busy raises ``MountBusyError`` unless ``lazy`` (then it is
    detached now and its server keeps serving the remaining users until they let go). The
    remains of a dead server are always cleaned up."""
    mountpoint = Path(os.path.abspath(mountpoint))
    directory = state.mount_dir(config.state_dir, mountpoint)
    record = state.MountRecord.load(directory)
    fuse_dir = directory / state.FUSE_DIR
    alive = record is not None and record.alive
    # Read before the unmount takes the loop device away (it clears itself with erofs).
    unrecorded = _unrecorded_copy(record)
    if record is not None and not alive:
        # The holder first, so that it starts no successor of the dead server.
        _stop_holder(record)
    if alive:
        try:
            kernel.unmount_path(mountpoint, lazy_fallback=lazy)
        except kernel.KernelMountError as e:
            if e.os_errno == errno.EBUSY:
                raise MountBusyError(f"{mountpoint} is busy (use a lazy unmount)") from None
            raise
        kernel.unmount_fuse(fuse_dir)
        assert record is not None
        if not lazy and not _wait_exit(record, 1.0):
            # Something still holds the file systems (a copy of the mount in another mount
            # namespace, say): end the FUSE connection, which ends the server.
            log.warning("%s is still referenced; aborting its FUSE connection", mountpoint)
            kernel.abort_fuse(fuse_dir, record.fuse_device)
        if not _wait_exit(record, SERVER_EXIT_TIMEOUT) and not lazy:
            log.warning("server %d of %s did not exit; killing it", record.pid, mountpoint)
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.pid, signal.SIGKILL)
            _wait_exit(record, SERVER_EXIT_TIMEOUT)
    else:
        # A dead server: its FUSE connection is gone, whatever reads erofs gets EIO.
        if _ours_at(mountpoint, directory):
            kernel.unmount_path(mountpoint, lazy_fallback=True)
        kernel.abort_fuse(fuse_dir, record.fuse_device if record else "")
        kernel.unmount_path(fuse_dir, lazy_fallback=True)
    if record is not None and not (alive and lazy):
        _stop_holder(record)  # its server told it already, unless it died meanwhile
    if record is not None and record.loop_device:
        _release_loop(record.loop_device, fuse_dir, record.local_copy, unrecorded)
    if record is not None and record.local_copy:
        _remove_copy(record, record.local_copy)
    if record is not None and unrecorded:
        log.warning("the loop device of %s read %s, a local copy it did not record; "
                    "removing it", record.mountpoint, unrecorded)  # fmt: skip
        _remove_copy(record, unrecorded)
    if directory.exists() and not (alive and lazy and record and record.alive):
        state.remove_mount_dir(directory)


def _stop_holder(record: state.MountRecord) -> None:
    """End the mount's holder (SIGTERM), if it lives."""
    if record.held:
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.holder_pid, signal.SIGTERM)
        deadline = time.monotonic() + SERVER_EXIT_TIMEOUT
        while record.held and time.monotonic() < deadline:
            time.sleep(0.01)


def _ours_at(mountpoint: Path, directory: Path) -> bool:
    """Whether the top mount at ``mountpoint`` is erofs on our FUSE file or a loop device
    (never unmount somebody else's file system on a stale record)."""
    stack = kernel.mounted_at(mountpoint)
    if not stack:
        return False
    top = stack[-1]
    return top.fstype == "erofs" and (
        top.source.startswith(str(directory)) or top.source.startswith("/dev/loop")
    )


def _release_loop(device: str, fuse_dir: Path, *copies: str) -> None:
    backing = kernel.loop_backing_file(device)
    if backing and (backing.startswith(str(fuse_dir)) or backing in [c for c in copies if c]):
        subprocess.run(["losetup", "--detach", device], capture_output=True)


def _unrecorded_copy(record: state.MountRecord | None) -> str:
    """The local copy the mount's loop device reads when its record names none: one its
    server switched the device to and died before recording (still in the cache's
    ``wip/``, or in ``local/`` after a rescan kept it). "" if none."""
    if record is None or not record.loop_device:
        return ""
    backing = kernel.loop_backing_file(record.loop_device) or ""
    if backing and backing != record.local_copy and sectors.is_copy(record.cache_dir, backing):
        return backing
    return ""


def _remove_copy(record: state.MountRecord, path: str) -> None:
    """Remove a local copy the mount's loop device read (recorded, or one
    ``_unrecorded_copy`` found), once that device is gone, and take it off the cache's
    count."""
    try:
        sectors.remove_copy(record.cache_dir, path)
    except (OSError, CacheError) as e:  # a rescan of the cache removes it
        log.warning("cannot remove the local copy %s: %s", path, e)


def _wait_exit(record: state.MountRecord, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while record.alive:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def list_mounts(config: MountConfig) -> list[MountInfo]:
    """Every mount recorded under ``config.state_dir``, live or dead (``alive`` says)."""
    out = []
    for directory in state.all_mount_dirs(config.state_dir):
        record = state.MountRecord.load(directory)
        if record is not None:
            out.append(MountInfo.from_record(record, directory))
    return out


def credentials(
    mountpoint: Path, config: MountConfig, timeout: float = 5.0
) -> tuple[str, str] | None:
    """The registry credentials the live mount at ``mountpoint`` was started with
    (``StoreOptions.credentials``), asked of its server; None if it has none."""
    _, directory = _live_record(mountpoint, config)
    answer = control.request(directory / state.CONTROL_SOCKET, "credentials", timeout)
    if answer is None:
        return None
    if not isinstance(answer, dict) or not all(
        isinstance(answer.get(k), str) for k in ("username", "password")
    ):
        raise control.ControlError(f"mount server at {mountpoint}: malformed credentials")
    return answer["username"], answer["password"]


def _live_record(mountpoint: Path, config: MountConfig) -> tuple[state.MountRecord, Path]:
    mountpoint = Path(os.path.abspath(mountpoint))
    directory = state.mount_dir(config.state_dir, mountpoint)
    record = state.MountRecord.load(directory)
    if record is None:
        raise NotMountedError(f"no lazyblock mount at {mountpoint}")
    if not record.alive:
        raise NotMountedError(f"the server of {mountpoint} is dead (run umount to clean up)")
    return record, directory


def stats(mountpoint: Path, config: MountConfig, timeout: float = 10.0) -> dict[str, Any]:
    """The mount's statistics (see ``snapshotter.mount.server.MountServer._stats``)."""
    _, directory = _live_record(mountpoint, config)
    return control.request(directory / state.CONTROL_SOCKET, "stats", timeout)


def profile(mountpoint: Path, config: MountConfig, timeout: float = 30.0) -> Profile:
    """The files read through the mount so far, in first-access order, with the byte ranges
    read of those read in part (a server that predates ranges: whole files)."""
    _, directory = _live_record(mountpoint, config)
    answer = control.request(directory / state.CONTROL_SOCKET, "profile", timeout)
    ranges = answer.get("ranges") or {}
    return Profile(
        tuple(
            ProfileEntry(p, tuple((s, e) for s, e in ranges[p]) if p in ranges else None)
            for p in answer["files"]
        )
    )
