"""A pre-imported parent for mount servers, so that a mount does not pay for Python's start.

Starting a mount server as a new interpreter (``python -m snapshotter.mount.server``) costs the
interpreter's start and the import of everything a server needs (httpx, the FUSE binding,
zstd, the store backends...) plus loading a TLS trust store: several tenths of a second, more
than the rest of a mount. The fork server pays that once: it imports it all, then waits on a
Unix socket and, for each mount, forks a child that runs the server
(``snapshotter.mount.server.serve_request``) with the caller's log file, readiness pipe,
environment and umask. ``snapshotter.mount.api.mount`` asks it first (``spawn``); when none is
running (or anything about it fails) it starts the server as a new interpreter, and then
starts the fork server in the background (``start``) for the mounts that follow. A daemon
that will mount (the containerd service) can have it ready beforehand: ``ensure_running``.

Safety:

* It forks only while it has exactly one thread (imports start none; it checks), and it
  creates nothing that a child could share by accident: no connections, no logging
  handlers. The child starts its own session, closes the server's sockets and leaves
  through ``os._exit``, never back into the server's loop.
* One fork server serves one *context*: the same interpreter, module search path
  (``PYTHONPATH``, installed packages) and lazyblock source files (a change to the code, or
  installing packages, means a new fork server), uid/gid, capabilities, seccomp and
  security label, mount, PID and user namespaces, cgroup and open-file limit. Its socket's
  name is derived from all of that (``context_key``), so a caller never gets a server from
  another context: a mount made in another mount namespace, or a server that would land in
  another cgroup. A fork server that would import lazyblock from elsewhere than its caller
  does refuses to start.
* The socket is an abstract Unix socket (no file to clean up); only processes of the same
  uid may use it (checked with ``SO_PEERCRED``).
* It exits after ``IDLE_TIMEOUT`` seconds without a request, and as soon as its context
  changes (the code was updated: no caller will find it again); the servers it started live
  on (they are in their own sessions; init adopts them).

Protocol (``SOCK_SEQPACKET``, one message each way): the caller sends a JSON object
``{"mount": <mount server request>, "env": {...}, "umask": N}`` with two file descriptors attached
(log file, readiness pipe); the fork server answers ``{"pid": N}`` after forking, or
``{"error": "..."}`` if it did not fork (the caller may then start the server itself).
"""

from __future__ import annotations

import array
import contextlib
import gc
import hashlib
import json
import logging
import os
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Seconds without a request after which the fork server exits (the next mount starts one).
IDLE_TIMEOUT = 600.0
# How often it checks that its context (above all the source files) is unchanged.
STALE_CHECK_INTERVAL = 5.0
# How long a caller waits for a fork server it started to listen, and for an answer.
CONNECT_TIMEOUT = 20.0
# Largest request (JSON: the mount request, the environment).
MAX_MESSAGE = 1 << 20
# Process names (what ps -o comm and top show; the command line stays the fork server's).
SERVER_NAME = b"lazyblock-fork"
CHILD_NAME = b"lazyblock-mount"
_PR_SET_NAME = 15
# The packages whose source files are part of the context (a change means a new server).
_PACKAGES = ("snapshotter", "imagetool", "lazyblock")
_PROC_CONTEXT = ("ns/mnt", "ns/pid", "ns/user", "cgroup", "attr/current")
# Lines of /proc/self/status that a forked server inherits.
_STATUS_CONTEXT = ("Cap", "NoNewPrivs", "Seccomp")
# Environment variables that decide which code a new interpreter runs.
_CODE_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONSAFEPATH")


class ForkServerError(Exception):
    """The fork server could not be reached or did not fork; nothing was started."""


class ForkServerUnavailable(ForkServerError):
    """No fork server of this context is listening (none runs, or it is still starting)."""


# --- the caller's side ---------------------------------------------------------------------


def context_key() -> str:
    """A digest of everything a forked server inherits from the fork server rather than
    from the caller (see the module docstring)."""
    h = hashlib.sha256()

    def add(*parts: object) -> None:
        for part in parts:
            h.update(repr(part).encode())
            h.update(b"\0")

    add(sys.executable, sys.version, os.getuid(), os.getgid())
    add([os.environ.get(name) for name in _CODE_ENV])
    add(resource.getrlimit(resource.RLIMIT_NOFILE))
    for name in _PROC_CONTEXT:
        path = f"/proc/self/{name}"
        with contextlib.suppress(OSError):
            add(name, os.readlink(path) if name.startswith("ns/") else Path(path).read_text())
    with contextlib.suppress(OSError):
        status = Path("/proc/self/status").read_text().splitlines()
        add([line for line in status if line.startswith(_STATUS_CONTEXT)])
    for entry in sys.path:  # installing or removing a package changes its directory
        if entry.endswith(("site-packages", "dist-packages")):
            with contextlib.suppress(OSError):
                add(entry, os.stat(entry).st_mtime_ns)
    for package in _PACKAGES:
        root = _package_root().parent / package
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if name.endswith(".py"):
                    st = os.stat(os.path.join(dirpath, name))
                    add(os.path.join(dirpath, name), st.st_mtime_ns, st.st_size)
    return h.hexdigest()[:24]


def _package_root() -> Path:
    """Where this process imports lazyblock's ``snapshotter`` package from (this module is
    ``snapshotter/mount/forkserver.py``)."""
    return Path(__file__).resolve().parents[1]


def socket_name(key: str) -> bytes:
    """The abstract socket address of the fork server of context ``key``."""
    return b"\0lazyblock-forkserver-" + key.encode()


def spawn(request: dict[str, Any], log_fd: int, ready_fd: int) -> int | None:
    """Have the fork server of this context start a mount server for ``request`` (what
    ``snapshotter.mount.server.serve_request`` takes); returns the server's pid.

    Raises ``ForkServerUnavailable`` if none is listening, ``ForkServerError`` if it could not
    be reached or declined to fork: then nothing was started. If the request was sent but no
    answer came, returns None: whatever the fork server did shows on ``ready_fd`` (a
    readiness line, or the pipe closed)."""
    sock = _connect(socket_name(context_key()))
    if sock is None:
        raise ForkServerUnavailable("no fork server is listening")
    with sock:
        message = json.dumps(
            {"mount": request, "env": dict(os.environ), "umask": _umask()}
        ).encode()
        fds = array.array("i", [log_fd, ready_fd])
        try:
            sock.settimeout(CONNECT_TIMEOUT)
            sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        except OSError as e:
            raise ForkServerError(f"cannot send the request: {e}") from None
        try:
            answer = json.loads(sock.recv(65536) or b"{}")
        except (OSError, ValueError) as e:
            answer = {"lost": str(e)}
    if "pid" in answer:
        return int(answer["pid"])
    if "error" in answer:
        raise ForkServerError(str(answer["error"]))
    # Sent, but no answer: the server may or may not have forked, so starting another one
    # could mount twice. Its readiness (or the closed pipe) tells the caller what happened.
    log.warning("no answer from the fork server (%s)", answer.get("lost", "closed"))
    return None


def _umask() -> int:
    """This process's umask, read without changing it (other threads may create files)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o22)  # kernels before 4.7 do not say
    os.umask(mask)
    return mask


def _connect(address: bytes) -> socket.socket | None:
    """A connection to a listening fork server, or None if none listens."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.connect(address)
    except (ConnectionRefusedError, FileNotFoundError):
        sock.close()
        return None
    except OSError as e:
        sock.close()
        raise ForkServerError(f"cannot connect to the fork server: {e}") from None
    return sock


def ensure_running(timeout: float = 0.0) -> bool:
    """Start the fork server of this context unless one runs; wait up to ``timeout``
    seconds for it to listen. Returns whether it listens."""
    key = context_key()
    address = socket_name(key)
    sock = _connect(address)
    if sock is None:
        exited = start(key)
        deadline = time.monotonic() + timeout
        while sock is None:
            gone = exited.is_set()  # before connecting: it may have lost the race to bind
            sock = _connect(address)
            if sock is not None or gone or time.monotonic() > deadline:
                break
            time.sleep(0.01)
    if sock is None:
        return False
    sock.close()
    return True


def start(key: str | None = None) -> threading.Event:
    """Start a fork server for context ``key`` (default: this one) in the background; one
    that loses the race for the socket's name exits at once. The event is set once the
    process has exited."""
    key = key or context_key()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "snapshotter.mount.forkserver", "--key", key,
             "--package-dir", str(_package_root())],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, cwd="/",
        )  # fmt: skip
    except OSError as e:
        raise ForkServerError(f"cannot start the fork server: {e}") from None
    exited = threading.Event()

    def reap() -> None:  # whenever it exits, so that a long-lived caller collects no zombie
        proc.wait()
        exited.set()

    threading.Thread(target=reap, name="lazyblock-forkserver-reap", daemon=True).start()
    return exited


# --- the fork server -----------------------------------------------------------------------


def preload() -> None:
    """Import what a mount server needs and build what is slow to build, before forking."""
    from imagetool.registry.client import RegistryClient
    from imagetool.stores import dir as _dir  # noqa: F401
    from imagetool.stores import registry as _registry  # noqa: F401
    from imagetool.stores.base import StoreOptions
    from snapshotter.mount import server as _server  # noqa: F401

    # A client imports its HTTP stack when it is built, and host names go through IDNA on
    # the first request: have both done (no connection is made).
    RegistryClient("localhost", "preload", StoreOptions()).close()
    "localhost".encode("idna")


def serve(key: str, package_dir: Path, idle_timeout: float = IDLE_TIMEOUT) -> int:
    """Run the fork server of context ``key`` until it has been idle ``idle_timeout`` s;
    ``package_dir`` is where the caller imports ``snapshotter`` from."""
    if _package_root() != package_dir.resolve():
        return 2  # it would run other code than its caller expects
    # Callers name it by their context; if this process sees the same one, it can tell when
    # that changes (otherwise it only has the idle timeout).
    watch = context_key() == key
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        listener.bind(socket_name(key))
    except OSError:  # another one runs (or is starting): it serves this context
        return 0
    # Bound (so no second one starts) but not listening until everything is imported:
    # meanwhile callers are refused and start their servers themselves.
    try:
        preload()
    except Exception:  # noqa: BLE001 - keep the name, so that callers do not keep retrying
        traceback.print_exc()
        time.sleep(idle_timeout)
        return 1
    gc.collect()
    gc.freeze()  # keep the imported objects' pages shared with the children
    listener.listen(64)
    _set_name(SERVER_NAME)
    last = checked = time.monotonic()
    s3_ready = False
    while True:
        _reap()
        ready, _, _ = select.select([listener], [], [], 1.0)
        if not ready:
            now = time.monotonic()
            if now - last > idle_timeout:
                return 0
            if watch and now - checked > STALE_CHECK_INTERVAL:
                checked = now
                if context_key() != key:
                    return 0
            continue
        try:
            conn, _ = listener.accept()
        except OSError:
            continue
        last = time.monotonic()
        with conn:
            ref = _handle(listener, conn)
        if not s3_ready and ref and ref.startswith("s3://"):
            s3_ready = _preload_s3()


def _set_name(name: bytes) -> None:
    """Name this process (best effort: only a label for operators)."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def _preload_s3() -> bool:
    """This node mounts from S3: have its client's models parsed here once, for the next
    mount servers (the one just forked pays for its own). Not at start: boto3 costs ~0.3 s
    and tens of MB to import, which a node that never uses S3 need not pay."""
    try:
        from imagetool.stores import s3

        s3.preload()
    except Exception:  # noqa: BLE001 - an optimisation; each mount server builds its own
        traceback.print_exc()
        return False
    gc.collect()
    gc.freeze()
    return True


def _handle(listener: socket.socket, conn: socket.socket) -> str | None:
    """Fork a mount server for the request on ``conn``; returns the ref it mounts (None if
    nothing was forked)."""
    pid, request, _ = fork_for(
        listener, conn, "fork", "fork server", CONNECT_TIMEOUT, ForkServerError
    )
    if pid <= 0:
        return None
    mount = request.get("mount")
    ref = mount.get("ref") if isinstance(mount, dict) else None
    return ref if isinstance(ref, str) else None


def fork_for(
    listener: socket.socket, conn: socket.socket, launch: str, name: str, timeout: float,
    error: type[Exception], check: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
) -> tuple[int, dict[str, Any], int]:  # fmt: skip
    """Serve one request on ``conn``, for the fork server and the node's launcher alike:
    receive it (a JSON message and two descriptors, the server's log file and readiness
    pipe) from a process of this uid; ``check(request)`` may refuse it (raises) or answer it
    without a fork (returns the answer); fork the mount server (``launch`` says how it was
    started) and tell the caller its pid, or why nothing was forked (a refusal is an
    ``error`` that calls this server ``name``). Returns the server's pid (<= 0 when none),
    the request and the caller's pid; never returns in the server."""
    fds: list[int] = []
    pid, peer = -1, -1
    request: dict[str, Any] = {}
    try:
        conn.settimeout(timeout)
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        peer, uid, _ = struct.unpack("3i", creds)
        message, ancdata, _, _ = conn.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(2 * 4))
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
        if uid != os.getuid():
            raise error(f"uid {uid} may not use this {name}")
        got = json.loads(message)
        if not isinstance(got, dict):
            raise error("the request is not a JSON object")
        request = got
        if check is not None and (answer := check(request)) is not None:
            conn.send(json.dumps(answer).encode())
            return -1, request, peer
        if len(fds) != 2:
            raise error("expected a log file and a readiness pipe")
        if threading.active_count() != 1:
            raise error(f"the {name} has threads; it will not fork")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
    except Exception as e:  # noqa: BLE001 - nothing forked: the caller starts it itself
        with contextlib.suppress(OSError):
            conn.send(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
    try:
        if pid == 0:
            _become_server(
                request["mount"], fds[0], fds[1], launch, close=(listener, conn),
                env=request["env"], umask=int(request["umask"]),
            )  # fmt: skip  # never returns
        if pid > 0:
            with contextlib.suppress(OSError):  # the caller then goes by the readiness pipe
                conn.send(json.dumps({"pid": pid}).encode())
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    return pid, request, peer


def fork_self(request: dict[str, Any], log_fd: int, ready_fd: int, close: tuple[int, ...]) -> int:
    """Fork this process into the mount server for ``request`` (what the fork server does for
    a caller, done by the caller itself): for a caller that has no threads and runs the code
    it imported, the ``snapshotter`` command above all, which has then imported much of what
    a server needs and spares it a new interpreter's start. ``close``: descriptors the server
    must not keep. Returns the server's pid (a child of this process, in its own session);
    raises ``ForkServerError`` if this process has threads (nothing forked)."""
    if threading.active_count() != 1:
        raise ForkServerError("this process has threads; it will not fork itself")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _become_server(request, log_fd, ready_fd, "self", close=close)  # never returns
    return pid


def _become_server(
    request: dict[str, Any], log_fd: int, ready_fd: int, launch: str, *,
    close: tuple[socket.socket | int, ...] = (), env: dict[str, str] | None = None,
    umask: int | None = None,
) -> None:  # fmt: skip
    """In a child just forked: detach (own session, stdio on the log, ``/`` as working
    directory, default signal handling), take on ``env`` and ``umask`` if given, serve the
    mount ``request`` and leave through ``os._exit``, never back into the caller's code."""
    code = 1
    try:
        os.setsid()
        _set_name(CHILD_NAME)
        for item in close:
            with contextlib.suppress(OSError):
                if isinstance(item, socket.socket):
                    item.close()
                else:
                    os.close(item)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.chdir("/")
        if umask is not None:
            os.umask(umask)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        from snapshotter.mount import server

        code = server.serve_request(request, ready_fd, launch=launch)
    except BaseException:  # noqa: BLE001 - report and leave; never back into the caller
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def main(argv: list[str] | None = None) -> int:
    import argparse  # here: callers of spawn() need not import it

    parser = argparse.ArgumentParser(prog="snapshotter-forkserver")
    parser.add_argument("--key", required=True)
    parser.add_argument("--package-dir", type=Path, required=True)
    parser.add_argument("--idle-timeout", type=float, default=IDLE_TIMEOUT)
    args = parser.parse_args(argv)
    from snapshotter.startup import skip_unused_imports

    skip_unused_imports()
    return serve(args.key, args.package_dir, args.idle_timeout)


if __name__ == "__main__":
    sys.exit(main())
