"""A mount server's use of glibc's allocator: reuse memory during a burst of reads, give it
back after (a no-op elsewhere).

A cold read of an image allocates and frees hundreds of megabytes of sector-sized blocks
(decoded sectors, the FUSE threads' scratch) on many threads. glibc's defaults hand such
blocks fresh pages again and again: a block of 4 MiB is first a mapping of its own, and
later ones come from the heap, whose top is given back to the kernel whenever more than
twice the block size is free there. A cold sequential pass over a 2 GiB image so faulted in
~100,000 new pages (~400 MB), each zeroed by the kernel and, on a VM whose host takes back
free guest memory (free page reporting), first faulted in by the host. So a mount server
(``snapshotter.mount.server``, ``tune``):

* uses ``ARENAS`` arenas (each keeps freed memory of its own; ~200 MB left after a pass
  instead of ~250, no slower);
* takes blocks of up to ``ARENA_BLOCK`` from the arenas, never a mapping of their own;
* keeps up to ``KEEP_FREED`` freed at an arena's top, for the next blocks to reuse;

and, once its reads have been quiet for ``QUIET_SECONDS`` after a burst, drops the fetcher's
transfer buffers and has glibc return the pages nothing uses (``malloc_trim``). Measured on
the 2 GiB benchmark image: ~40,000 page faults per cold pass instead of 70,000-111,000 (the
rest is the pass's working set, touched once); cold sequential reads gained 0-5 % in
interleaved comparisons (within their noise).
``Trimmer`` is the policy, a pure function of a counter of work done and the clock.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# malloc arenas a mount server may use: its threads mostly wait on the network, the disk or
# the kernel, so contention on two is cheap, and every arena keeps freed memory of its own.
ARENAS = 2
# Blocks up to this size come from the arenas: glibc's largest setting, above a 4 MiB sector.
ARENA_BLOCK = 32 << 20
# Freed memory an arena keeps at its top during a burst: above a cold read's working set
# (~130 MB with the default 4 MiB sectors and 16 sectors in memory), so it is not given back.
KEEP_FREED = 256 << 20
# Seconds without reads or fetches after which a burst counts as over.
QUIET_SECONDS = 2.0
# glibc's mallopt parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt  # noqa: B018 - glibc has both; musl has neither
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def tune(arenas: int = ARENAS, block: int = ARENA_BLOCK, keep: int = KEEP_FREED) -> bool:
    """Set glibc's malloc up for a mount server (see the module's docstring); whether every
    setting took. Fixing the two thresholds turns off glibc's own adjustment of them."""
    libc = _libc()
    if libc is None:
        return False
    settings = ((_M_ARENA_MAX, arenas), (_M_MMAP_THRESHOLD, block), (_M_TRIM_THRESHOLD, keep))
    return all([libc.mallopt(param, value) for param, value in settings])


def trim() -> bool:
    """Return the pages of freed memory to the kernel; whether any were."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))


class Trimmer:
    """When to trim: once per burst of work, after ``quiet`` seconds without any."""

    def __init__(self, quiet: float = QUIET_SECONDS) -> None:
        self.quiet = quiet
        self._work: int | None = None
        self._busy_at: float | None = None  # last time work was seen, since the last trim

    def due(self, work: int, now: float) -> bool:
        """``work``: a counter that grows with work done (bytes read and fetched)."""
        if work != self._work:
            first = self._work is None
            self._work = work
            if not first:
                self._busy_at = now
            return False
        if self._busy_at is not None and now - self._busy_at >= self.quiet:
            self._busy_at = None
            return True
        return False
