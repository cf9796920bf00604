"""The mount server's control socket: a tiny request/answer protocol over a unix socket.

One JSON object per line each way: ``{"op": "stats"}`` -> the mount's statistics,
``{"op": "profile"}`` -> ``{"files": [paths in first-access order], "ranges": {path:
[[start, end], ...] for a file read in part}}``. Answers are
``{"ok": true, "result": ...}`` or ``{"ok": false, "error": "..."}``. The socket is
root-only (mode 0600 inside the state directory).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import socketserver
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from snapshotter.errors import SnapshotterError

log = logging.getLogger(__name__)

MAX_MESSAGE = 64 << 20  # a profile of a huge image is a few MB of paths
# A unix socket's address holds 107 bytes of path (sun_path, with its NUL).
MAX_SOCKET_PATH = 107


class ControlError(SnapshotterError):
    """The mount server did not answer (dead, stuck) or answered with an error."""


Handler = Callable[[dict[str, Any]], Any]


class ControlServer:
    """Answers requests on ``path`` with ``handlers[op](request)`` on a thread per client."""

    def __init__(self, path: Path, handlers: dict[str, Handler]) -> None:
        self.path = path
        handlers = dict(handlers)

        class _Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline(MAX_MESSAGE)
                try:
                    request = json.loads(line)
                    op = handlers[request["op"]]
                    answer: dict[str, Any] = {"ok": True, "result": op(request)}
                except Exception as e:  # answered, not raised: the server goes on
                    log.warning("control request %r failed: %s", line[:200], e)
                    answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                self.wfile.write(json.dumps(answer).encode() + b"\n")

        if path.exists() or path.is_symlink():
            path.unlink()
        old = os.umask(0o177)
        try:
            with _address(path) as address:
                self._server = socketserver.ThreadingUnixStreamServer(address, _Handler)
        finally:
            os.umask(old)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="lazyblock-control", daemon=True
        )

    def start(self) -> ControlServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def request(path: Path, op: str, timeout: float = 10.0, **args: Any) -> Any:
    """Send one request to the server at ``path``; its result, or ``ControlError``."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            with _address(path) as address:
                s.connect(address)
            s.sendall(json.dumps({"op": op, **args}).encode() + b"\n")
            with s.makefile("rb") as f:
                line = f.readline(MAX_MESSAGE)
    except OSError as e:
        raise ControlError(f"mount server at {path} does not answer: {e}") from None
    try:
        answer = json.loads(line)
    except ValueError:
        raise ControlError(f"mount server at {path} sent a malformed answer") from None
    if not answer.get("ok"):
        raise ControlError(f"mount server: {answer.get('error', 'unknown error')}")
    return answer.get("result")


@contextlib.contextmanager
def _address(path: Path) -> Iterator[str]:
    """``path`` as a unix socket address: itself where it fits, else the socket's name in
    an open descriptor of its directory (``/proc/self/fd/N/NAME``), so that a state
    directory deeper than a socket address allows still works."""
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)
