"""A whole image copied out of the node's cache, for its loop device to read past FUSE.

Once every sector of a mounted image is in the node's sector cache, reads no longer need the
network, but each still goes through FUSE: the loop device asks the FUSE file, the mount
server reads the cache entry, checks its blocks and answers. Measured on 2 vCPUs
(``benchmarks/mount/results/README.md``), that costs a warm image half the random-read rate
of local disk, and a Python environment's 20,849 small files read in 1.3-1.6x local disk's
time.

With ``mount.local_copy`` on, a mount on a loop device that has gone quiet (no read and no
fetch for ``QUIET_SECONDS``) with its image whole in the cache gets a copy:

1. room for the image is reserved in the cache (``SectorCache.reserve_copy``: counted
   against the cap, least recently used entries evicted for it; no room, no copy);
2. each sector is read from the cache, verified block by block as every cache read is, and
   written at its offset (all-zero sectors are left as the file's allocated zeros);
3. the file is synced and dropped from the page cache, then read back from disk and every
   sector checked against its checksum in the index: a byte the disk did not keep fails the
   copy;
4. the loop device is switched to it (``kernel.loop_change_fd``): the same bytes, so erofs
   and its cached pages stay as they are, and from then on the kernel reads local disk
   without the mount server;
5. it is moved to the cache's ``local/`` and the mount's record names it. ``umount`` deletes
   it; a cache rescan removes one that no loop device reads any more (after a crash).

Why the loop device and not FUSE passthrough (``FOPEN_PASSTHROUGH``, in this kernel). A
passthrough is chosen when a file is opened, and the loop device (or a file-backed erofs)
opens the FUSE file once, at the mount, when the image is not in the cache yet; the kernel
does not mix passthrough and cached opens of one inode, and nothing reopens the file later.
``LOOP_CHANGE_FD`` switches a live, read-only loop device to another file of the same size,
under a mounted file system. A file-backed erofs mount cannot be switched: it goes on
through FUSE.

What it trades, and why it is off by default. The copy's bytes were verified once, when they
were written and read back; after the switch the kernel reads them as it reads an unpacked
layer of a full pull, with no check per read (this kernel has no fs-verity, which would
check them per read). The cache's entries are checked on every read. And the copy takes disk:
as much again as the image, within the cache's cap, while the entries it was made from stay
until the cap evicts them. A failed or impossible copy changes nothing: the mount goes on
through FUSE.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

from imagetool.format import Index, sector_checksum
from snapshotter.cache.sectors import Reservation, SectorCache, view_room
from snapshotter.errors import SnapshotterError
from snapshotter.mount import kernel

log = logging.getLogger(__name__)

# A mount is copied once it has read and fetched nothing for this long (a start has ended).
QUIET_SECONDS = 3.0
# How often a quiet mount checks whether its image is whole in the cache.
CHECK_INTERVAL = 5.0


class LocalCopyError(SnapshotterError):
    """The copy could not be made (a sector left the cache, a read-back mismatch, the
    kernel refused the switch); the mount goes on as before. ``again``: worth another try
    once the image is whole in the cache again (a sector was evicted meanwhile); the other
    causes would fail every try, each a whole image's copy."""

    def __init__(self, message: str, again: bool = False) -> None:
        super().__init__(message)
        self.again = again


@dataclass(frozen=True)
class LocalCopy:
    path: Path
    bytes: int
    seconds: float


def whole_in_cache(index: Index, cache: SectorCache) -> bool:
    """Whether every sector of the image (but the all-zero ones) is in the cache."""
    return all(s.is_zero or s.checksum in cache for s in index.sectors)


def make(index: Index, cache: SectorCache, loop_device: str, name: str) -> LocalCopy | None:
    """Copy the image out of ``cache`` and switch ``loop_device`` to it (the module's steps
    1-5). None when the cache has no room for it; ``LocalCopyError`` when it failed (the
    reserved room is given back either way)."""
    started = time.monotonic()
    # Pinned: making room for the copy must not evict what it is to be made of.
    with cache.pin(s.checksum for s in index.sectors if not s.is_zero):
        return _make(index, cache, loop_device, name, started)


def _make(
    index: Index, cache: SectorCache, loop_device: str, name: str, started: float
) -> LocalCopy | None:
    res = cache.reserve_copy(index.image_size)
    if res is None:
        return None
    try:
        _write(index, cache, res)
        os.fdatasync(res.fd)
        with contextlib.suppress(OSError):
            os.posix_fadvise(res.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        _check(index, res.path)
        fd = os.open(res.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            kernel.loop_change_fd(loop_device, fd)
        finally:
            os.close(fd)
    except (OSError, kernel.KernelMountError) as e:
        cache.release_copy(res)
        raise LocalCopyError(f"local copy for {loop_device}: {e}") from e
    except BaseException:
        cache.release_copy(res)
        raise
    path = cache.install_copy(res, name)
    return LocalCopy(path, index.image_size, time.monotonic() - started)


def _write(index: Index, cache: SectorCache, res: Reservation) -> None:
    """Each sector from the cache (verified as every cache read is) to its offset in the
    copy: read past the page cache into one aligned buffer and written from it, with direct
    I/O where the file system allows it (a copy of every page through the page cache, and
    4 MiB of new memory per sector, cost a 2 GiB copy seconds of CPU more)."""
    buf = mmap.mmap(-1, view_room(index.sector_size), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        with memoryview(buf) as scratch:
            for number, sector in enumerate(index.sectors):
                if sector.is_zero:
                    continue
                offset, size = index.sector_span(number)
                got = cache.read_view(sector.checksum, 0, size, scratch, size=size)
                if got is None:
                    raise LocalCopyError(f"sector {number} is no longer in the cache", again=True)
                with got[0] as view:
                    cache.write_copy(res, view, offset)
    finally:
        buf.close()


def _check(index: Index, path: Path) -> None:
    """Read the copy back from disk (past the page cache where the file system allows it)
    and check every sector against the index."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    buf = mmap.mmap(-1, index.sector_size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(buf)
    try:
        for number, sector in enumerate(index.sectors):
            offset, size = index.sector_span(number)
            got = os.preadv(fd, [view[:size]], offset)
            if got != size or sector_checksum(view[:size]) != sector.checksum:
                raise LocalCopyError(f"sector {number} read back from {path} does not match")
    finally:
        view.release()
        buf.close()
        os.close(fd)
