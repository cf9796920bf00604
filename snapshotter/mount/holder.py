"""The holder: a tiny process that keeps a mount's FUSE connection alive across its servers.

The kernel ends a FUSE connection when the last open descriptor of its /dev/fuse file closes;
if only the mount server held it, a dead server would take every read of the running
containers with it (EIO until an unmount). So the first server of a mount starts a holder
(``start``) once the mount is ready: a process of its own session that does nothing but keep
a copy of that descriptor and, on its unix socket (``holder.sock`` in the mount's state
directory, root only), hand it to a successor server (``adopt``: SCM_RIGHTS), with what the
kernel's INIT settled (it comes once per connection) and what a successor needs to start.

It watches the server that serves now (a pidfd). When that one dies without saying it is
done (SIGKILL, a crash, the OOM killer), the holder starts a successor at once with the
command and request the last server left it: that process adopts the descriptor, rebuilds its
state from the node's cache and the index, asks the kernel to resend the requests the dead
one had read and not answered, and serves; the readers only waited. A successor that dies
before it adopted the connection is started again after a growing pause
(``RESTART_DELAYS``). An upgrade starts a successor itself (``snapshotter upgrade-mounts``,
``api.replace``), which adopts the descriptor first and then retires the old server
(``snapshotter.mount.handover``).

The holder ends when its server says the mount is done (``done``: unmounted), when the FUSE
connection is gone (checked each ``CHECK_INTERVAL`` seconds and whenever a server dies), or on
SIGTERM (``api.unmount`` of a mount whose server is dead). It imports only the standard
library and this package's ``state``: nothing of the data path, so it stays small (one
interpreter, ~10 MB) and its code never needs to change for a server's upgrade. Protocol
(one JSON line each way, on a connection of its own uid only):

* ``{"op": "adopt", "pid": N, "launch": {"argv": [...], "env": {...}}, "request": {...}}``:
  N serves from now on (its death starts a successor with ``launch`` and ``request``); the
  answer ``{"ok": true, "holder_pid": ..., "init": {...}}`` carries the descriptor;
* ``{"op": "request"}``: ``{"ok": true, "request": {...}}``, the last server's request (its
  configuration, credentials included: an upgrade keeps them without their being on disk);
* ``{"op": "done"}``: the mount is gone, exit;
* ``{"op": "status"}``: ``{"ok": true, "pid": <the server watched>, "restarts": N}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SOCKET_NAME = "holder.sock"
# How often the holder checks that the FUSE connection still exists.
CHECK_INTERVAL = 5.0
# Pauses before starting a successor again when the previous one died before it served.
RESTART_DELAYS = (0.0, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
MAX_MESSAGE = 1 << 20
# A unix socket's address holds 107 bytes of path (sun_path, with its NUL).
MAX_SOCKET_PATH = 107


class HolderError(OSError):
    """The mount's holder could not be reached or refused (no holder: a mount made before
    handovers existed, or one whose holder was killed)."""


# --- the server's side ------------------------------------------------------------------------


def socket_path(mount_dir: Path) -> Path:
    return Path(mount_dir) / SOCKET_NAME


def start(mount_dir: Path, fuse_fd: int, server_pid: int, hand: dict[str, Any], log_fd: int) -> int:
    """Start the holder of the connection ``fuse_fd`` for the server ``server_pid``; ``hand``
    is what successors get (``init``, ``launch``, ``request``). Returns its pid once it
    listens (the socket is bound here and handed to it)."""
    path = socket_path(mount_dir)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        with _address(path) as address:
            listener.bind(address)
        listener.listen(8)
    finally:
        os.umask(old)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "snapshotter.mount.holder", "--fuse-fd", str(fuse_fd),
             "--listen-fd", str(listener.fileno()), "--server-pid", str(server_pid)],
            stdin=subprocess.PIPE, stdout=log_fd, stderr=log_fd,
            pass_fds=(fuse_fd, listener.fileno()), start_new_session=True, cwd="/",
        )  # fmt: skip
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(hand).encode())
        proc.stdin.close()
    finally:
        listener.close()
    return proc.pid


def adopt(mount_dir: Path, pid: int, launch: dict[str, Any], request: dict[str, Any],
          timeout: float = 10.0) -> tuple[int, dict[str, Any]]:  # fmt: skip
    """Take the mount's connection over as server ``pid``: (a /dev/fuse descriptor of our
    own, the holder's answer: ``holder_pid``, ``init``). ``HolderError`` if none answers."""
    answer, fds = _ask(mount_dir, {"op": "adopt", "pid": pid, "launch": launch,
                                   "request": request}, timeout, want_fd=True)  # fmt: skip
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise HolderError(f"the holder of {mount_dir} sent {len(fds)} descriptors, not one")
    return fds[0], answer


def last_request(mount_dir: Path, timeout: float = 5.0) -> dict[str, Any]:
    """The request (ref, mountpoint, config, log level) of the mount's last server."""
    return _ask(mount_dir, {"op": "request"}, timeout)[0]["request"]


def done(mount_dir: Path, timeout: float = 2.0) -> None:
    """Tell the holder that the mount is gone (it exits); quiet if there is none."""
    with contextlib.suppress(HolderError):
        _ask(mount_dir, {"op": "done"}, timeout)


def status(mount_dir: Path, timeout: float = 2.0) -> dict[str, Any]:
    return _ask(mount_dir, {"op": "status"}, timeout)[0]


def _ask(mount_dir: Path, message: dict[str, Any], timeout: float,
         want_fd: bool = False) -> tuple[dict[str, Any], list[int]]:  # fmt: skip
    path = socket_path(mount_dir)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            with _address(path) as address:
                s.connect(address)
            s.sendall(json.dumps(message).encode() + b"\n")
            data, fds = b"", []
            while not data.endswith(b"\n"):
                chunk, got, _, _ = socket.recv_fds(s, MAX_MESSAGE, 4 if want_fd else 0)
                fds.extend(got)
                if not chunk:
                    break
                data += chunk
    except OSError as e:
        raise HolderError(f"the holder of {mount_dir} does not answer: {e}") from None
    try:
        answer = json.loads(data)
    except ValueError:
        answer = {}
    if not answer.get("ok"):
        for fd in fds:
            os.close(fd)
        raise HolderError(f"the holder of {mount_dir} refused: {answer.get('error', 'no answer')}")
    return answer, fds


@contextlib.contextmanager
def _address(path: Path):  # noqa: ANN202 - a context manager of str
    """``path`` as a unix socket address (through ``/proc/self/fd`` when too long)."""
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


# --- the holder process -----------------------------------------------------------------------


class Holder:
    def __init__(self, fuse_fd: int, listener: socket.socket, server_pid: int,
                 hand: dict[str, Any]) -> None:  # fmt: skip
        self.fuse_fd = fuse_fd
        self.listener = listener
        self.init: dict[str, Any] = hand.get("init", {})
        self.launch: dict[str, Any] = hand["launch"]
        self.request: dict[str, Any] = hand["request"]
        self.mount_dir = Path(hand["mount_dir"])
        self.pid = 0
        self.pidfd = -1
        self.restarts = 0
        self.failures = 0  # successors in a row that died before they adopted
        self.adopted = True  # the watched server has the connection
        self._watch(server_pid)

    def _watch(self, pid: int) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
        self.pid = pid
        try:
            self.pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.pidfd = -1  # already gone: the loop starts a successor

    def connection_alive(self) -> bool:
        """Whether the FUSE connection still exists (an unmount aborts it: POLLERR)."""
        poller = select.poll()
        poller.register(self.fuse_fd, 0)
        return not any(ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL)
                       for _, ev in poller.poll(0))  # fmt: skip

    def run(self) -> int:
        next_check = time.monotonic() + CHECK_INTERVAL
        while True:
            _reap()
            if self.pidfd < 0:
                if not self.connection_alive():
                    log.info("holder: the FUSE connection is gone; exiting")
                    return 0
                self._start_successor()
                continue
            poller = select.poll()
            poller.register(self.pidfd, select.POLLIN)
            poller.register(self.listener.fileno(), select.POLLIN)
            events = dict(poller.poll(max(0.0, next_check - time.monotonic()) * 1000))
            if self.listener.fileno() in events:
                with contextlib.suppress(OSError):
                    if self._serve_one() == "done":
                        log.info("holder: the mount is done; exiting")
                        return 0
            if self.pidfd in events:
                log.warning("holder: server %d died; starting a successor", self.pid)
                os.close(self.pidfd)
                self.pidfd = -1
                self.failures = 0 if self.adopted else self.failures + 1
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + CHECK_INTERVAL
                if not self.connection_alive():
                    log.info("holder: the FUSE connection is gone; exiting")
                    return 0

    def _start_successor(self) -> None:
        delay = RESTART_DELAYS[min(self.failures, len(RESTART_DELAYS) - 1)]
        if delay:
            log.warning("holder: %d successors in a row died early; waiting %.1fs",
                        self.failures, delay)  # fmt: skip
            time.sleep(delay)
        request = dict(self.request, adopt=True, sent_at=time.time())
        try:
            proc = subprocess.Popen(
                self.launch["argv"], env=self.launch.get("env"), stdin=subprocess.PIPE,
                stdout=sys.stderr.fileno(), stderr=sys.stderr.fileno(),
                start_new_session=True, cwd="/",
            )  # fmt: skip
        except OSError as e:
            log.error("holder: cannot start a successor: %s", e)
            self.failures += 1
            return
        assert proc.stdin is not None
        with contextlib.suppress(OSError):
            proc.stdin.write(json.dumps(request).encode())
            proc.stdin.close()
        self.restarts += 1
        log.info("holder: started successor %d", proc.pid)
        self.adopted = False
        self._watch(proc.pid)

    def _serve_one(self) -> str:
        conn, _ = self.listener.accept()
        with conn:
            conn.settimeout(5.0)
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _, uid, _ = struct.unpack("3i", creds)
            if uid not in (0, os.getuid()):
                return ""
            data = b""
            while not data.endswith(b"\n") and len(data) < MAX_MESSAGE:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
            try:
                message = json.loads(data)
                op = message["op"]
            except (ValueError, KeyError, TypeError):
                conn.sendall(b'{"ok": false, "error": "malformed request"}\n')
                return ""
            if op == "adopt":
                pid = int(message["pid"])
                self.launch = message.get("launch") or self.launch
                self.request = message.get("request") or self.request
                answer = {"ok": True, "holder_pid": os.getpid(), "init": self.init}
                socket.send_fds(conn, [json.dumps(answer).encode() + b"\n"], [self.fuse_fd])
                log.info("holder: server %d adopts the connection (was %d)", pid, self.pid)
                if pid != self.pid:
                    self._watch(pid)
                self.adopted = True
                return op
            if op == "done":
                conn.sendall(b'{"ok": true}\n')
                return op
            if op == "request":
                conn.sendall(json.dumps({"ok": True, "request": self.request}).encode() + b"\n")
                return op
            if op == "status":
                answer = {"ok": True, "pid": self.pid, "restarts": self.restarts,
                          "holder_pid": os.getpid()}  # fmt: skip
                conn.sendall(json.dumps(answer).encode() + b"\n")
                return op
            conn.sendall(json.dumps({"ok": False, "error": f"unknown op {op!r}"}).encode() + b"\n")
            return ""


def _reap() -> None:
    """Collect the successors this holder started that have exited since."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lazyblock-holder")
    parser.add_argument("--fuse-fd", type=int, required=True)
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--server-pid", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    hand = json.loads(sys.stdin.read())
    os.close(0)
    # Its own name in ps/top, and SIGTERM as a plain exit (the default would do too).
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text("lazyblock-hold")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    listener = socket.socket(fileno=args.listen_fd)
    os.set_inheritable(args.fuse_fd, False)
    holder = Holder(args.fuse_fd, listener, args.server_pid, hand)
    log.info("holder of %s: serving pid %d", hand.get("mount_dir"), args.server_pid)
    return holder.run()


if __name__ == "__main__":
    sys.exit(main())
