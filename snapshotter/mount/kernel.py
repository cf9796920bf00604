"""The kernel side of a mount: erofs on top of the FUSE file, and taking it all down again.

Two ways to put the kernel's erofs on a regular file:

* **file-backed** (``mount -t erofs <file>``, kernel >= 6.12 with
  ``CONFIG_EROFS_FS_BACKED_BY_FILE``): erofs reads the file itself. No device to allocate or
  leak. Its read-ahead is that of a bdi of its own (``bdi_name``). Measured against the loop
  device (``benchmarks/mount/results/README.md``), it serves warm small files faster (one
  hop less per request) and warm random 128 KiB reads at about half the rate.
* **loop**: a read-only loop device with direct I/O (so the FUSE file's pages are not cached
  twice, once under the loop device and once under erofs), marked *autoclear* right after
  the mount so that it disappears with the last unmount, even when the server dies.

mount(2)/umount2(2) are called directly (ctypes) rather than through mount(8), which would
silently set up a loop device for a regular file. Everything here needs CAP_SYS_ADMIN.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from snapshotter.errors import SnapshotterError

log = logging.getLogger(__name__)

MS_RDONLY = 1
MNT_FORCE = 1
MNT_DETACH = 2

# Backing device infos (read-ahead) by name.
SYS_BDI = "/sys/class/bdi"
# ioctl FS_IOC_GETFSSYSFSPATH = _IOR(0x15, 1, struct fs_sysfs_path { __u8 len; __u8 name[128]; })
FS_SYSFS_PATH = struct.Struct("B128s")
FS_IOC_GETFSSYSFSPATH = (2 << 30) | (FS_SYSFS_PATH.size << 16) | (0x15 << 8) | 1
# ioctl LOOP_CHANGE_FD (linux/loop.h): a read-only loop device reads another file of the
# same size from now on.
LOOP_CHANGE_FD = 0x4C06
# The FUSE file's largest read (``snapshotter.mount.fusewire.MAX_READ``), in KiB.
FUSE_REQUEST_KIB = 1024

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class KernelMountError(SnapshotterError):
    """mount(2), umount2(2) or the loop device setup failed."""

    def __init__(self, message: str, err: int = errno.EIO) -> None:
        super().__init__(message)
        self.os_errno = err


def sys_mount(source: str, target: Path, fstype: str, flags: int = 0, data: str = "") -> None:
    if _libc.mount(source.encode(), os.fsencode(target), fstype.encode(), flags, data.encode()):
        err = ctypes.get_errno()
        raise KernelMountError(f"mount -t {fstype} {source} {target}: {os.strerror(err)}", err)


def sys_umount(target: Path, flags: int = 0) -> None:
    if _libc.umount2(os.fsencode(target), flags):
        err = ctypes.get_errno()
        raise KernelMountError(f"umount {target}: {os.strerror(err)}", err)


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo."""

    mount_id: int
    device: str  # "major:minor"
    mountpoint: str
    fstype: str
    source: str


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts() -> list[MountEntry]:
    entries = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            a, b = left.split(), right.split()
            entries.append(MountEntry(int(a[0]), a[2], _unescape(a[4]), b[0], _unescape(b[1])))
    return entries


def mounted_at(path: Path) -> list[MountEntry]:
    """Mounts stacked on ``path`` (bottom first)."""
    where = os.path.abspath(path)
    return [m for m in mounts() if m.mountpoint == where]


def is_mountpoint(path: Path) -> bool:
    return bool(mounted_at(path))


# --- erofs -------------------------------------------------------------------------------


def attach_erofs(image: Path, mountpoint: Path, backing: str) -> tuple[str, str | None]:
    """Mount the erofs image in the file ``image`` read-only on ``mountpoint``.

    ``backing``: "file", "loop" or "auto" (file-backed when the kernel can). Returns
    (backing used, loop device or None)."""
    if backing in ("auto", "file"):
        try:
            sys_mount(str(image), mountpoint, "erofs", MS_RDONLY)
            return "file", None
        except KernelMountError as e:
            # ENOTBLK: this kernel's erofs wants a block device (no file-backed mounts).
            if backing == "file" or e.os_errno not in (errno.ENOTBLK, errno.EINVAL):
                raise
            log.info("erofs file-backed mount unavailable (%s); using a loop device", e)
    device = _loop_attach(image)
    try:
        sys_mount(device, mountpoint, "erofs", MS_RDONLY)
    except BaseException:
        _loop_detach(device)
        raise
    # Detaching a busy loop device marks it autoclear: it goes away with the erofs mount.
    _loop_detach(device)
    return "loop", device


def _loop_attach(image: Path) -> str:
    proc = subprocess.run(
        ["losetup", "--find", "--show", "--read-only", "--direct-io=on", str(image)],
        capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        raise KernelMountError(f"losetup {image}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def _loop_detach(device: str) -> None:
    proc = subprocess.run(["losetup", "--detach", device], capture_output=True, text=True)
    if proc.returncode != 0 and "No such device" not in proc.stderr:
        log.warning("losetup --detach %s: %s", device, proc.stderr.strip())


def loop_backing_file(device: str) -> str | None:
    """The file a loop device is attached to, or None if it is free."""
    name = os.path.basename(device)
    with contextlib.suppress(OSError):
        return Path(f"/sys/block/{name}/loop/backing_file").read_text().strip()
    return None


def loop_change_fd(device: str, fd: int) -> None:
    """Have the read-only loop device ``device`` read the open file ``fd`` (the same bytes,
    of the same size) instead of the file it reads now; the file systems on it stay mounted
    and their cached pages valid. The kernel refuses (EINVAL) a device that is not bound or
    not read-only, or a file of another size."""
    dev = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(dev, LOOP_CHANGE_FD, fd)
    except OSError as e:
        raise KernelMountError(f"LOOP_CHANGE_FD on {device}: {e.strerror}", e.errno) from None
    finally:
        os.close(dev)


def bdi_name(path: Path) -> str | None:
    """The name, under ``/sys/class/bdi``, of the backing device info of the file system
    mounted at ``path``; None if it has none there.

    On a block device (erofs on a loop device) it is the device's ``major:minor``. A
    file-backed erofs mount has a bdi of its own, named like its superblock in sysfs
    (``erofs-14``), which ``FS_IOC_GETFSSYSFSPATH`` (kernel 6.10+) gives as
    ``erofs/erofs-14``; its ``st_dev`` is an anonymous device with no bdi of that name."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        dev = os.fstat(fd).st_dev
        buf = bytearray(FS_SYSFS_PATH.size)
        try:
            fcntl.ioctl(fd, FS_IOC_GETFSSYSFSPATH, buf, True)
            length, name = FS_SYSFS_PATH.unpack(buf)
            sysfs = name[:length].decode(errors="replace").rpartition("/")[2]
        except OSError:  # before 6.10, or a file system with no sysfs name
            sysfs = ""
    finally:
        os.close(fd)
    for candidate in (sysfs, f"{os.major(dev)}:{os.minor(dev)}"):
        if candidate and os.path.isdir(f"{SYS_BDI}/{candidate}"):
            return candidate
    return None


def set_read_ahead(path: Path, kib: int, request_kib: int = FUSE_REQUEST_KIB) -> int | None:
    """Set the read-ahead (KiB) of the backing device info of the file system mounted at
    ``path`` (``bdi_name``: a loop device's, or a file-backed erofs mount's own). The kernel
    reads a file a read-ahead window at a time, and erofs passes each window down to the
    FUSE file: the default 128 KiB means 32 FUSE round trips per 4 MiB. Returns the value it
    had, or None when the mount has no such setting (a kernel that does not say which bdi
    a file-backed mount has); then nothing changed.

    On a block device (the loop device) it also caps the device's requests at a multiple
    of ``request_kib``, the FUSE file's largest read: a loop device splits a window into
    requests of ``max_sectors_kb`` (1280 KiB by default), and FUSE splits each of those
    into 1 MiB reads, so every other FUSE read would be a 256 KiB one."""
    name = bdi_name(path)
    if name is None:
        log.info("cannot set the read-ahead of %s: no backing device info found", path)
        return None
    knob = Path(f"{SYS_BDI}/{name}/read_ahead_kb")
    try:
        old = int(knob.read_text())
        if old != kib:
            knob.write_text(str(kib))
    except (OSError, ValueError) as e:
        log.info("cannot set the read-ahead of %s (%s): %s", path, knob, e)
        return None
    dev = os.stat(path).st_dev
    _align_requests(os.major(dev), os.minor(dev), request_kib)
    return old


def _align_requests(major: int, minor: int, request_kib: int) -> None:
    queue = Path(f"/sys/dev/block/{major}:{minor}/queue")
    try:
        limit = int((queue / "max_hw_sectors_kb").read_text())
        current = int((queue / "max_sectors_kb").read_text())
        want = limit // request_kib * request_kib
        if want and current % request_kib:
            (queue / "max_sectors_kb").write_text(str(want))
    except (OSError, ValueError) as e:  # not a block device (file-backed mount): nothing to do
        log.debug("request size of %d:%d left alone: %s", major, minor, e)


def unmount_path(path: Path, lazy_fallback: bool = True) -> bool:
    """Unmount everything stacked on ``path``. A busy mount is detached lazily when
    ``lazy_fallback`` (its users keep it until they let go), else ``KernelMountError``
    (EBUSY). Returns whether something was mounted."""
    found = False
    while mounted_at(path):
        found = True
        try:
            sys_umount(path)
        except KernelMountError as e:
            if e.os_errno == errno.EINVAL:  # not a mountpoint (raced with another umount)
                continue
            if e.os_errno != errno.EBUSY or not lazy_fallback:
                raise
            log.warning("%s is busy; detaching it lazily", path)
            sys_umount(path, MNT_DETACH)
    return found


def abort_fuse(path: Path, device: str = "") -> None:
    """Abort the FUSE connection mounted at ``path``, or with ``device`` ("major:minor",
    for one already detached), so that its server's loop ends and whatever still uses it
    gets ENOTCONN instead of hanging."""
    devices = {m.device for m in mounted_at(path) if m.fstype.startswith("fuse")}
    if device:
        devices.add(device)
    for dev in devices:
        minor = dev.split(":")[1]
        with contextlib.suppress(OSError):
            Path(f"/sys/fs/fuse/connections/{minor}/abort").write_text("1")


def unmount_fuse(path: Path, attempts: int = 10, pause: float = 0.05) -> None:
    """Unmount a FUSE file system, retrying briefly while it is busy (the kernel lets go of
    the erofs mount's reference asynchronously), then detaching it lazily."""
    for _ in range(attempts):
        try:
            unmount_path(path, lazy_fallback=False)
            return
        except KernelMountError as e:
            if e.os_errno != errno.EBUSY:
                raise
            time.sleep(pause)
    unmount_path(path, lazy_fallback=True)
