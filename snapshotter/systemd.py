"""systemd's readiness protocol (``Type=notify``), for the daemon and foreground mounts."""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(state: str) -> None:
    """Tell systemd about ``state`` (``READY=1``, ``STOPPING=1``) on ``$NOTIFY_SOCKET``;
    nothing outside systemd. A socket name starting with ``@`` is an abstract one."""
    target = os.environ.get("NOTIFY_SOCKET")
    if not target:
        return
    if target.startswith("@"):
        target = "\0" + target[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(state.encode(), target)
        except OSError as e:
            log.warning("sd_notify(%s) failed: %s", state, e)
