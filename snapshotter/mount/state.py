"""Mount records: what is mounted where, and by which server process, on disk.

Each mount has a directory under ``<state_dir>/mounts/<id>/`` (``id``: a hash of the
mountpoint's absolute path), so any process can find, inspect and clean up a mount, also
after its server died::

    state.json      the MountRecord (written atomically: temp file + rename)
    control.sock    the server's control socket (stats, profile, retire)
    holder.sock     the holder's socket: the FUSE connection for a successor server
    handover.lock   held by a successor while it takes the mount over
    fuse/           where the server's FUSE file system (one file, ``image``) is mounted
    server.log      the server's log

A server is alive when its pid exists *and* has the start time recorded (so a recycled pid
does not pass for it); the same goes for the mount's holder (``snapshotter.mount.holder``):
while it lives, a mount whose server died is being taken over, not dead.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"
CONTROL_SOCKET = "control.sock"
HOLDER_SOCKET = "holder.sock"
HANDOVER_LOCK = "handover.lock"
FUSE_DIR = "fuse"
LOG_FILE = "server.log"


def mount_id(mountpoint: Path) -> str:
    return hashlib.sha256(os.fsencode(os.path.abspath(mountpoint))).hexdigest()[:16]


def mount_dir(state_dir: Path, mountpoint: Path) -> Path:
    return Path(state_dir) / "mounts" / mount_id(mountpoint)


def all_mount_dirs(state_dir: Path) -> list[Path]:
    root = Path(state_dir) / "mounts"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir())


@dataclass(frozen=True)
class MountRecord:
    mountpoint: str
    ref: str
    pid: int
    pid_start: int  # the pid's start time (clock ticks after boot), against pid reuse
    phase: str  # "starting" until the tree is browsable, then "ready"
    started_at: float  # time.time()
    cache_dir: str
    index_digest: str = ""
    backing: str = ""  # "file" or "loop"
    loop_device: str = ""
    fuse_device: str = ""  # "major:minor" of the FUSE connection (for aborting it)
    image_size: int = 0
    sector_count: int = 0
    metadata_sectors: int = 0
    holder_pid: int = 0  # the process that keeps the FUSE connection for successors
    holder_start: int = 0
    fuse_init: dict[str, int] = field(default_factory=dict)  # what the kernel's INIT settled
    servers: int = 1  # the servers this mount has had (1 + handovers)
    local_copy: str = ""  # the image's copy its loop device reads (snapshotter.mount.localcopy)

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".state.")
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f, indent=1)
        os.replace(tmp, directory / STATE_FILE)

    @classmethod
    def load(cls, directory: Path) -> MountRecord | None:
        try:
            doc: dict[str, Any] = json.loads((directory / STATE_FILE).read_text())
        except (OSError, ValueError):
            return None
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in doc.items() if k in known})
        except TypeError:
            return None

    @property
    def alive(self) -> bool:
        return process_start(self.pid) == self.pid_start

    @property
    def held(self) -> bool:
        """Whether the mount's holder lives (its FUSE connection survives the server)."""
        return bool(self.holder_pid) and process_start(self.holder_pid) == self.holder_start


def process_start(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot, None if there is none (or it
    is a zombie: a dead server its parent has not reaped yet)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'
    rest = text[text.rindex(")") + 2 :].split()
    if rest[0] in ("Z", "X"):
        return None
    return int(rest[19])


def remove_mount_dir(directory: Path) -> None:
    """Remove a mount's state directory (its FUSE directory must be unmounted)."""
    for name in (STATE_FILE, CONTROL_SOCKET, HOLDER_SOCKET, HANDOVER_LOCK):
        with contextlib.suppress(FileNotFoundError):
            (directory / name).unlink()
    with contextlib.suppress(OSError):
        (directory / FUSE_DIR).rmdir()
    for leftover in directory.glob(".state.*"):
        with contextlib.suppress(OSError):
            leftover.unlink()
    # The log is kept beside the directory's removal only if something else is left.
    with contextlib.suppress(FileNotFoundError):
        (directory / LOG_FILE).unlink()
    with contextlib.suppress(OSError):
        directory.rmdir()
