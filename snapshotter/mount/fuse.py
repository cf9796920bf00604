"""The FUSE file: a block image's uncompressed filesystem image as one read-only file.

The FUSE file system has a root directory holding one regular file, ``image``; the kernel's
erofs is mounted on that file (``snapshotter.mount.kernel``), so FUSE only ever sees large
reads of one immutable file, never a lookup storm of the image's own files.

``BlockFile`` is what the file holds: each read is one ``BlockReader.read_parts``, whose
views (sector memory, the thread's scratch the node cache was read into, sectors just
fetched) go to the kernel as they are, in one ``writev``
(``snapshotter.mount.fusewire``, the protocol on /dev/fuse). Where the compiled loop is
built (``snapshotter.mount._fastreads``), the reader mirrors the sectors it keeps in memory
into its table, and a READ of those alone is answered there, without the interpreter; its
log comes back through ``drain`` into the same bookkeeping. A ``SnapshotterError`` becomes
its errno (EIO for fetch failures); anything unexpected becomes EIO with the traceback
logged. It also keeps the startup profile: the byte ranges read, in first-access order.
The loop device's requests are cut at a multiple of ``fusewire.MAX_READ``
(``kernel.set_read_ahead``), so a sequential reader's requests are all 1 MiB.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from imagetool import profile as profiles
from imagetool.profile import Profile
from snapshotter.cache.sectors import READ_AROUND_MAX
from snapshotter.datapath.reader import BlockReader
from snapshotter.errors import SnapshotterError
from snapshotter.metrics import Counter
from snapshotter.mount.fusewire import MAX_READ, FuseServer, ReadError, compiled_memory

log = logging.getLogger(__name__)

IMAGE_NAME = "image"
# The filesystem block: the unit of the startup profile's "already read" map.
BLOCK = 4096
# Reads kept for the profile at most (block-aligned reads of new blocks only: a 10 GB image
# has 2.6 million blocks, a startup reads a few thousand times).
MAX_PROFILE_RANGES = 1 << 20


class BlockFile:
    """What the FUSE file of one mounted image holds (``fusewire.FileSource``)."""

    def __init__(self, reader: BlockReader, on_init: Callable[[], None] | None = None) -> None:
        self.reader = reader
        self.on_init = on_init
        self.read_errors = Counter()  # reads answered with an error
        # Startup profile: the byte ranges read, in first-access order (finer than the
        # reader's sector log), mapped to files only when a profile is asked for: the file
        # map is not needed to serve reads, and building it for a 200,000-file image costs
        # a tenth of a second. One byte per filesystem block says "already read" (blocks a
        # read covered whole), so the log holds only reads that touched something new.
        self._seen = bytearray(-(-reader.size // BLOCK))
        self._ranges: list[tuple[int, int]] = []
        self._touched_lock = threading.Lock()
        # The reader's sectors in memory, for the FUSE threads to answer READs from without
        # the interpreter (``fusewire.FileSource``); None where there is no such memory or
        # no compiled loop.
        self.fast = None
        if reader.memory_sectors:
            # Its log comes back every sector's worth of READs: read-ahead moves along as
            # often as when each READ was answered here.
            drain = max(2, reader.index.sector_size // MAX_READ)
            # Small reads of the cache are Python's: its read-around windows answer the
            # small reads that follow from memory.
            self.fast = compiled_memory(reader.index.sector_size, reader.size, drain,
                                        disk_min_read=READ_AROUND_MAX)  # fmt: skip
        if self.fast is not None:
            reader.mirror_memory(self.fast)
            # A READ of a sector being fetched waits there for it, not in Python.
            reader.fetcher.watch_flights(self.fast)

    @property
    def size(self) -> int:
        return self.reader.size

    def read_parts(
        self, offset: int, length: int, scratch: memoryview, waited: float = 0.0
    ) -> list[memoryview]:
        try:
            parts = self.reader.read_parts(offset, length, scratch, waited)
        except SnapshotterError as e:
            self.read_errors.inc()
            log.warning("read %d+%d: %s: %s", offset, length, type(e).__name__, e)
            raise ReadError(e.errno) from None
        except Exception:
            self.read_errors.inc()
            log.exception("read %d+%d failed", offset, length)
            raise ReadError(errno.EIO) from None
        self._record(offset, sum(len(p) for p in parts))
        return parts

    def drain(self) -> None:
        """Take the READs the compiled loop answered since the last drain into the
        bookkeeping a READ answered here gets: the profile and the reader's."""
        if self.fast is None:
            return
        reads = self.fast.drain()
        if not reads:
            return
        for offset, length in reads:
            self._record(offset, length)
        self.reader.account_served(reads)

    def _record(self, offset: int, length: int) -> None:
        if length <= 0:
            return
        end = offset + length
        first, last = -(-offset // BLOCK), end // BLOCK  # the blocks it covers whole
        seen = self._seen
        whole = offset % BLOCK == 0 and end % BLOCK == 0
        if whole and seen.find(0, first, last) < 0:
            return  # every block of it was read before
        with self._touched_lock:
            if len(self._ranges) >= MAX_PROFILE_RANGES:
                return  # long past any startup
            if last > first:
                seen[first:last] = b"\x01" * (last - first)
            self._ranges.append((offset, length))

    def touched_profile(self) -> Profile:
        """The files read so far, in first-access order, with the ranges of each read
        (``imagetool.profile.from_reads``)."""
        self.drain()
        with self._touched_lock:
            ranges = list(self._ranges)
        return profiles.from_reads(ranges, self.reader.index.files_in_range)


def serve_in_thread(
    operations: BlockFile,
    directory: Path,
    fsname: str,
    fd: int = -1,
    negotiated: dict[str, int] | None = None,
) -> tuple[FuseServer, threading.Thread, dict[str, BaseException]]:
    """Mount ``operations`` as a FUSE file system on ``directory`` and serve it on a thread
    (which ends when the file system is unmounted); the returned dict receives the
    exception it ended with. ``operations.on_init`` is called once the kernel's INIT is
    answered. With ``fd`` (and the ``negotiated`` INIT of whoever mounted it), serve that
    connection instead of mounting one (a handover, ``snapshotter.mount.holder``)."""
    outcome: dict[str, BaseException] = {}
    server = FuseServer(operations, directory, fsname, IMAGE_NAME, on_init=operations.on_init,
                        fd=fd, negotiated=negotiated)  # fmt: skip

    def run() -> None:
        try:
            server.serve()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            outcome["error"] = e

    thread = threading.Thread(target=run, name="lazyblock-fuse", daemon=True)
    thread.start()
    return server, thread, outcome
