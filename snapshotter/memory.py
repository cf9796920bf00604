"""Giving memory back after a burst of reads (glibc's allocator; a no-op elsewhere).

A cold read of an image allocates and frees hundreds of megabytes of sector buffers
(responses, decoded sectors) on many threads, and glibc keeps what they free in per-thread
arenas: a mount server that had streamed a 2 GiB image held ~250 MB where it used ~140 (its
memory of decoded sectors, its aligned buffers, the interpreter). So a mount server
(``snapshotter.mountd``) limits glibc to ``ARENAS`` arenas (~200 MB left, no slower) and,
once its reads have been quiet for ``QUIET_SECONDS`` after a burst, drops the fetcher's
transfer buffers and has glibc return the pages nothing uses (``malloc_trim``). ``Trimmer``
is the policy, a pure function of a counter of work done and the clock.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# malloc arenas a mount server may use: its threads mostly wait on the network, the disk or
# the kernel, so contention on two is cheap, and every arena keeps freed memory of its own.
ARENAS = 2
# Seconds without reads or fetches after which a burst counts as over.
QUIET_SECONDS = 2.0
_M_ARENA_MAX = -8  # glibc's mallopt parameter


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt  # noqa: B018 - glibc has both; musl has neither
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas for this process; whether it took."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(_M_ARENA_MAX, arenas))


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
