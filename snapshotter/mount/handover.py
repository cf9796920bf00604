"""A successor server taking a live mount over from its predecessor.

The FUSE connection itself comes from the mount's holder (``snapshotter.mount.holder``);
this module is the rest of the sequence, run by the successor once it serves that
connection on its own threads (``snapshotter.mount.server.MountServer.adopt``):

1. ``lock``: one successor at a time per mount (a crash restart by the holder racing an
   upgrade would otherwise have two servers each retire the other);
2. ``retire``: the predecessor, if it still runs (an upgrade), is asked over its control
   socket to stop: it answers, lets the requests it has read finish (``RETIRE_DRAIN``) and
   exits without unmounting anything; one that does not exit in time is killed;
3. then the successor asks the kernel to resend whatever the predecessor read and never
   answered (``fusewire.FuseServer.resend``), takes the control socket and records itself.

Readers wait during the handover; none fails. Nothing here needs the store: the index comes
from the node's index cache, the sectors from the node's sector cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import select
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from snapshotter.errors import SnapshotterError
from snapshotter.mount import control, state

log = logging.getLogger(__name__)

# How long a retiring server lets the requests it has read finish before it exits.
RETIRE_DRAIN = 2.0
# How long a successor waits for its predecessor to exit before it kills it.
RETIRE_TIMEOUT = 10.0
# How long a successor waits for another handover of the same mount to finish.
LOCK_TIMEOUT = 60.0


class HandoverError(SnapshotterError):
    """A mount's server could not be taken over (no holder, no live mount, a stuck one)."""


@contextlib.contextmanager
def lock(mount_dir: Path, timeout: float = LOCK_TIMEOUT) -> Iterator[None]:
    """Held while one successor takes the mount at ``mount_dir`` over."""
    fd = os.open(Path(mount_dir) / state.HANDOVER_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                 0o600)  # fmt: skip
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise HandoverError(f"another handover of {mount_dir} is stuck") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def retire(mount_dir: Path, record: state.MountRecord, timeout: float = RETIRE_TIMEOUT) -> bool:
    """End the predecessor ``record`` names if it runs (and is not this process); True if
    there was one. It is asked first, killed if it does not exit within ``timeout``."""
    if record.pid == os.getpid() or not record.alive:
        return False
    try:
        pidfd = os.pidfd_open(record.pid)
    except ProcessLookupError:
        return False
    try:
        if not record.alive:  # the pid was reused between the check and pidfd_open
            return False
        try:
            control.request(Path(mount_dir) / state.CONTROL_SOCKET, "retire", timeout=5.0)
        except control.ControlError as e:
            log.warning("predecessor %d did not take the retire request (%s); killing it",
                        record.pid, e)  # fmt: skip
            os.kill(record.pid, signal.SIGKILL)
        if not select.select([pidfd], [], [], timeout)[0]:
            log.warning("predecessor %d did not exit in %.0fs; killing it", record.pid, timeout)
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.pid, signal.SIGKILL)
            select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    return True
