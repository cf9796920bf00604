"""The node launcher: a fork server for mount servers that runs outside the daemon's pod.

A daemon run as a Kubernetes pod cannot keep the mount servers it starts: they are in the
pod's cgroup (and, without ``hostPID``, its PID namespace), and deleting or updating the pod
kills every process in it, so every running container whose image is lazily mounted gets
EIO. A process cannot create processes outside its own PID namespace or cgroup, so the mount
servers must be started by something that lives outside the pod: this launcher, a
long-lived node service (``snapshotter launcher``; ``systemd/lazyblock-launcher.service``)
listening on a filesystem Unix socket under the shared state directory (default
``<state_dir>/launcher.sock``). ``snapshotter.mount.api.mount`` asks it first when
``[mount] launcher`` names it (or, with ``auto``, the default, when that socket exists); the
mount servers it forks live in *its* namespaces and cgroup, so the pod's death does not
reach them, and a new pod finds them through the mount records as a restarted daemon does.

It is ``snapshotter.mount.forkserver`` with the context check relaxed, deliberately and for
this mode only:

* The caller may be in another PID namespace, cgroup or mount namespace (that is the point).
  What a forked server inherits from the launcher instead of from the caller is therefore
  checked, not assumed:

  - the code: the request carries the caller's ``code_version`` (a digest of the Python
    version and the *contents* of lazyblock's source files, so that the same release
    installed on the host and in the pod's image agree); a launcher running other code
    refuses (``LauncherError``) and the caller falls back (below). A launcher exits as soon
    as its own source files change on disk, so installing a new release on the host and
    letting the service manager restart it (``Restart=always``) replaces it; the mount
    servers it started live on (``KillMode=process``; they are in their own sessions).
  - the file system: the request carries the device and inode of the mountpoint, the state
    directory and the cache directory as the caller sees them; the launcher refuses unless
    it sees the very same directories at the same paths (a pod must share them with the host,
    as the DaemonSet does with hostPath volumes and Bidirectional propagation), so a mount it
    makes is where the caller will look for it.
* Only processes of the launcher's own uid (root) may use it: ``SO_PEERCRED``, and the socket
  is mode 0600 in a directory only root writes.
* The pid it answers is in its own PID namespace: callers must see it there (``hostPID`` for
  a pod; the tests keep the host's /proc visible), as the mount records' liveness check
  reads ``/proc``.

If the launcher cannot be reached or refuses, ``api.mount`` logs a warning, counts it
(``lazyblock_launcher_fallbacks_total{reason}``, a counts file under the state directory)
and starts the mount server the usual way, in the caller's context (it then dies with the
pod).

Protocol: as the fork server's (``SOCK_SEQPACKET``, one JSON message each way, the log file
and readiness pipe attached), with ``code`` and ``paths`` added; ``{"hello": true}`` alone
is answered ``{"pid", "code", "version"}``.
"""

from __future__ import annotations

import array
import contextlib
import gc
import hashlib
import json
import logging
import os
import select
import socket
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

from snapshotter.errors import SnapshotterError
from snapshotter.metrics import CountsFile
from snapshotter.mount import forkserver

log = logging.getLogger(__name__)

SOCKET_NAME = "launcher.sock"
# How long a caller waits for the launcher's answer.
TIMEOUT = 20.0
# How often the launcher checks that its source files are unchanged (and its socket is its).
STALE_CHECK_INTERVAL = 5.0
# The reasons a mount did not go through the launcher (the fallback counter's labels).
FALLBACK_REASONS = ("unreachable", "refused")
FALLBACKS_FILE = "launcher-fallbacks.json"
LAUNCHER_NAME = b"lazyblock-launch"


class LauncherError(SnapshotterError):
    """The node launcher could not be reached or refused the request (other code, other
    directories, another uid); it started nothing, and the mount server is started in the
    caller's context instead."""

    def __init__(self, message: str, reason: str = "unreachable") -> None:
        super().__init__(message)
        self.reason = reason  # one of FALLBACK_REASONS


def default_socket(state_dir: Path) -> Path:
    return Path(state_dir) / SOCKET_NAME


def resolve(setting: str, state_dir: Path) -> Path | None:
    """The launcher socket a mount should use: ``setting`` is ``[mount] launcher``: ``auto``
    (the default socket if one exists there), ``off`` (never), or a path (always: a missing
    one is a fallback, counted)."""
    if setting in ("", "off"):
        return None
    if setting == "auto":
        path = default_socket(state_dir)
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.stat(path).st_mode):
                return path
        return None
    return Path(setting)


# --- the code a process runs ---------------------------------------------------------------

_version_cache: tuple[tuple[Any, ...], str] | None = None
_version_lock = threading.Lock()


def _sources() -> list[Path]:
    root = forkserver._package_root().parent
    files = []
    for package in forkserver._PACKAGES:
        for dirpath, dirnames, filenames in os.walk(root / package):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            files.extend(Path(dirpath, n) for n in sorted(filenames) if n.endswith(".py"))
    return files


def _stamp(files: list[Path]) -> tuple[Any, ...]:
    out = []
    for path in files:
        with contextlib.suppress(OSError):
            st = path.stat()
            out.append((str(path), st.st_mtime_ns, st.st_size))
    return tuple(out)


def code_version() -> str:
    """A digest of the Python version and the contents of lazyblock's source files (paths
    relative to the install), so that one release installed twice (host, pod image) agrees.
    Cached while the files' times and sizes are unchanged."""
    global _version_cache
    files = _sources()
    stamp = _stamp(files)
    with _version_lock:
        if _version_cache is not None and _version_cache[0] == stamp:
            return _version_cache[1]
    root = forkserver._package_root().parent
    h = hashlib.sha256(repr(sys.version_info[:2]).encode())
    for path in files:
        with contextlib.suppress(OSError):
            data = path.read_bytes()
            h.update(str(path.relative_to(root)).encode() + b"\0")
            h.update(hashlib.sha256(data).digest())
    digest = h.hexdigest()[:24]
    with _version_lock:
        _version_cache = (stamp, digest)
    return digest


def _identity(path: str | Path) -> list[int] | None:
    """Device and inode of ``path``, or of its nearest existing ancestor (a cache directory
    not made yet) with how many levels up that is."""
    path = Path(os.path.abspath(path))
    for up, candidate in enumerate([path, *path.parents]):
        try:
            st = os.stat(candidate)
        except OSError:
            continue
        return [st.st_dev, st.st_ino, up]
    return None


def _checked_paths(request: dict[str, Any]) -> list[str]:
    config = request.get("config") or {}
    return [str(p) for p in (request.get("mountpoint"), request.get("mount_dir"),
                             config.get("state_dir"), config.get("cache_dir")) if p]  # fmt: skip


# --- the caller's side ---------------------------------------------------------------------


def _call(path: Path, message: dict[str, Any], fds: list[int]) -> dict[str, Any]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    with sock:
        sock.settimeout(TIMEOUT)
        try:
            sock.connect(str(path))
        except OSError as e:
            raise LauncherError(f"cannot reach the node launcher at {path}: {e}") from None
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        try:
            sock.sendmsg([json.dumps(message).encode()], ancillary)
        except OSError as e:
            raise LauncherError(f"cannot send to the node launcher at {path}: {e}") from None
        try:
            return json.loads(sock.recv(65536) or b"{}")
        except (OSError, ValueError) as e:
            return {"lost": str(e)}


def hello(path: Path) -> dict[str, Any]:
    """The launcher's pid, code version and release; ``LauncherError`` if none answers."""
    answer = _call(path, {"hello": True}, [])
    if "pid" not in answer:
        raise LauncherError(f"the node launcher at {path} did not answer")
    return answer


def spawn(path: Path, request: dict[str, Any], log_fd: int, ready_fd: int) -> int | None:
    """Have the launcher at ``path`` start the mount server for ``request`` (as
    ``forkserver.spawn``); returns its pid (in the launcher's PID namespace), or None when
    the request went out but no answer came (the readiness pipe then tells). Raises
    ``LauncherError`` when nothing was started."""
    message = {
        "mount": request,
        "env": dict(os.environ),
        "umask": forkserver._umask(),
        "code": code_version(),
        "paths": {p: _identity(p) for p in _checked_paths(request)},
    }
    answer = _call(path, message, [log_fd, ready_fd])
    if "pid" in answer:
        return int(answer["pid"])
    if "error" in answer:
        raise LauncherError(f"the node launcher refused: {answer['error']}", "refused")
    log.warning("no answer from the node launcher (%s)", answer.get("lost", "closed"))
    return None


# --- the launcher --------------------------------------------------------------------------


def serve(path: Path) -> int:
    """Run the launcher on ``path`` until its source files change (exit 0: the service
    manager starts the new code) or its socket is taken over by another launcher."""
    path = Path(os.path.abspath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(LauncherError):
        other = hello(path)
        log.error("a launcher (pid %s) already listens on %s", other.get("pid"), path)
        return 1
    forkserver.preload()
    version = code_version()
    files = _sources()
    stamp = _stamp(files)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    old = os.umask(0o177)
    try:
        listener.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    ours = os.stat(path).st_ino
    gc.collect()
    gc.freeze()
    listener.listen(64)
    forkserver._set_name(LAUNCHER_NAME)
    log.info("node launcher listening on %s (pid %d, code %s)", path, os.getpid(), version)
    checked = time.monotonic()
    while True:
        forkserver._reap()
        ready, _, _ = select.select([listener], [], [], 1.0)
        if not ready:
            if time.monotonic() - checked > STALE_CHECK_INTERVAL:
                checked = time.monotonic()
                if _stamp(files) != stamp or _stamp(_sources()) != stamp:
                    log.info("lazyblock's code changed on disk; exiting for the new one")
                    return 0
                if _identity(path) is None or os.stat(path).st_ino != ours:
                    log.info("%s is no longer this launcher's socket; exiting", path)
                    return 0
            continue
        try:
            conn, _ = listener.accept()
        except OSError:
            continue
        with conn:
            _handle(listener, conn, version)


def _handle(listener: socket.socket, conn: socket.socket, version: str) -> None:
    """Fork a mount server for the request on ``conn``, as the fork server does, once the
    request is checked against this launcher's code and view of the file system."""

    def check(request: dict[str, Any]) -> dict[str, Any] | None:
        if request.get("hello"):
            return {"pid": os.getpid(), "code": version, "version": _release()}
        if request.get("code") != version:
            raise LauncherError(
                f"it runs lazyblock code {version}, the caller {request.get('code')} "
                "(install the same release on the node, then restart the launcher)"
            )
        paths = request.get("paths") or {}
        for p in _checked_paths(request.get("mount") or {}):
            if paths.get(p) is None or paths.get(p) != _identity(p):
                raise LauncherError(f"{p} is not the same directory for the launcher and "
                                    "the caller (share it with the host)")  # fmt: skip
        return None

    pid, request, peer = forkserver.fork_for(
        listener, conn, "launcher", "launcher", TIMEOUT, LauncherError, check
    )
    if pid > 0:
        log.info("started the mount server of %s for pid %d: pid %d",
                 request["mount"].get("mountpoint"), peer, pid)  # fmt: skip


def _release() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lazyblock")
    except PackageNotFoundError:
        return "unknown"


def count_fallback(state_dir: Path, reason: str) -> None:
    """Count a mount that could not go through the launcher (for the metrics exporter)."""
    with _version_lock:  # one writer at a time in this process (read, add, replace)
        CountsFile(Path(state_dir) / FALLBACKS_FILE).add(reason)
