"""The node's local sector cache: verified sectors on disk, shared by every mount and image.

An entry is one sector's *uncompressed* bytes, named by their xxh3-128 checksum. Naming by
content means two images (or two tags of one image) that share a sector share its cache entry.
Keeping sectors decoded makes a warm read one ``pread`` of the bytes asked for, not a
whole-sector decompression. An entry file (layout ``v3``) is the sector's bytes and a
trailer of block digests, laid out by ``snapshotter.cache.entry``; the directory's shared
byte count is ``snapshotter.cache.usage``'s.

Verification. No byte leaves the cache unverified, and an entry is never trusted because of
where it lies. ``put`` takes only bytes that hash to the entry's name (or that its caller
has just checked so, ``Index.decode_sector_into``) and records, in the trailer, the digest of each
``VERIFY_BLOCK`` (16 KiB) block of exactly those bytes. A process that first uses an entry
reads its footer (the last 4 KiB) and checks that the trailer hashes to what the footer says,
that it names this very entry and that the sizes agree with the file; every read then reads
the blocks that cover the range asked for and checks each against its digest, so a file
that was damaged, truncated, replaced or renamed is caught on the very read that would have
served it. A process never has to read a whole 4 MiB entry to serve 128 KiB of it (layout
``v2`` kept the digests in memory only, so each new mount server read every entry it touched
in full first: a random reader of a warm cache paid 32x its bytes). An entry that fails a
check is a logged miss and is deleted; it is never returned.

Direct I/O. Entries are written, and read for random reads, with ``O_DIRECT`` (through
reused page-aligned buffers, or an ``EntryBuffer`` the sector was decoded into, which is
written as it is) where the file system allows it (not tmpfs): the kernel caches
the image's pages once, in the erofs mount above the FUSE file; a second copy of the same
bytes in the page cache of the entry files would double the memory a warm image takes and
cost a page-cache fill per read (on a random read of a warm cache that fill was a fifth of
the mount server's CPU). Reads of a sequential stream (``read_view(..., sequential=True)``)
go through the page cache, which ``will_need`` has the kernel fill ahead of them: measured,
that beat reading whole entries ahead with direct I/O.

Layout under ``root`` (the version lets a later layout live beside this one)::

    v3/wip/r<pid>-<random>      entries being written, allocated at their full size and
                                counted against the cap; ``flock``ed by their writer until
                                installed, so a rescan removes one whose writer died
    v3/<cc>/<checksum>          one entry; <cc> is the checksum's first two hex digits
    v3/local/<name>             a whole image copied out of the cache, which a loop device
                                reads (``snapshotter.mount.localcopy``); counted against
                                the cap while a loop device holds it, removed by a rescan
                                once none does

Writes go to ``wip/`` and are renamed into place, so readers see a whole entry or none. They
are not fsynced: a crash can leave a renamed entry with lost or torn contents, which the
first read of it detects and refetches, so a sync per sector would only buy back a refetch.
The cache is bounded to ``max_bytes`` of entry files, those being written included (room is
made and counted, and the file allocated at its full size, before it is written), with
least-recently-used eviction. A reservation whose writer died (a mount server killed
mid-write) is found by its file's lock, which the kernel drops with the process: a rescan
removes its file and recounts the directory, and a put looks for such files every
``ORPHAN_CHECK_SECONDS`` and rescans when it finds one, so a crash costs the cap nothing
for longer than that. When the cap has no room left that can be made (every entry is pinned
by a read in progress: a cap smaller than what the reads in flight need at once), the sector
is not cached: the read is served from the verified bytes in memory, as always, and
``CacheMetrics.uncached`` counts it; nothing waits for room. The
recency clock is the entry file's mtime, set when an entry is used (at most every
``TOUCH_INTERVAL`` seconds per entry), so the order survives restarts: opening a cache
rebuilds its state from the directory. Entries *pinned* by an in-progress read are never
evicted. Caching is best effort: when the disk is full a put evicts and retries once, and if
the entry still cannot be written it is dropped (``put`` returns False) — the read that
produced it succeeds regardless.

Entries of the older layouts (``v2``: decoded bytes alone; ``v1``: zstd-compressed) are
taken over when first wanted (read in full, checked against their name, written as ``v3``,
the old file removed); ``gc()`` removes whatever of them is left.

Several processes may share one directory (the node runs a mount server per mount): an
entry another process wrote is found on disk and adopted, one it evicted is a miss. The cap
holds for the directory as a whole: every process adds what it writes to, and takes what it
deletes from, one counter in ``v3/usage`` (``SharedUsage``); each evicts its own least
recently used entries to stay under the cap, and making room, allocating the entry's file
and counting it happen as one against other processes (as do installing it, or giving the
room back when its write fails). One that cannot make room that way
(the directory is full of entries it does not know) rescans the directory (``reconcile``):
it takes in the others' entries and evicts the least recently used of all, by their files'
times. An entry another process is reading may be deleted: that read goes on from its open
file; the next one is a miss. Opening the cache and ``gc()`` rescan too. Within a process
every method is thread-safe.

Locks. A process's cache has its own lock (its entries, pins, open files) and shares the
directory's (the counter's ``flock``, which every process takes to install, delete or count
an entry). The directory's always comes first, so a thread that holds the process's lock
never waits for the directory: reads, which take only the process's lock, go on while a
rescan holds the directory for its scan (tenths of a second for 20,000 entries), and while
puts and evictions wait for it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import mmap
import os
import resource
import shutil
import threading
import time
from collections import Counter as _Multiset
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path

import xxhash

from imagetool.errors import ChecksumError
from imagetool.format import decode_stored as format_decode_stored
from snapshotter.cache.entry import (
    ALIGN,
    VERIFY_BLOCK,
    EntryBuffer,
    aligned,
    block_digests,
    check_checksum,
    entry_trailer,
    is_checksum,
    read_footer,
    trailer_digests,
)
from snapshotter.cache.usage import SharedUsage, read_usage
from snapshotter.errors import CacheError
from snapshotter.metrics import CacheMetrics

log = logging.getLogger(__name__)

LAYOUT_VERSION = "v3"
# Older layouts, taken over when first wanted: v2 held a sector's decoded bytes alone (block
# digests in memory only), v1 held them zstd-compressed.
OLD_LAYOUTS = ("v2", "v1")
# A miss looks for the sector in the older layouts whose directories exist; which exist is
# looked at again this often (a process of an older version may still make one).
OLD_LAYOUT_CHECK_SECONDS = 10.0
# On-disk recency is refreshed at most this often per entry: an mtime update per read would
# be a metadata write per FUSE request, and the restart order needs no finer clock.
TOUCH_INTERVAL = 10.0
# Entry files kept open for reads: reopening one per read would cost a path lookup. Random
# reads over an image touch every entry in turn, so the cap covers a 16 GiB image of 4 MiB
# sectors; it is lowered to an eighth of the process's descriptor limit (``open_file_cap``):
# an open entry holds up to two descriptors (direct and buffered reads), and the cache must
# never take more than a quarter of the process's.
OPEN_FILES = 4096
# Aligned buffers kept for reuse, in bytes: enough for the reads and writes a mount server
# has in flight at once (FUSE reads of up to 1 MiB, the fetcher's 4 MiB entries). Mapping and
# faulting in fresh memory per read would cost more than the read.
POOL_BYTES = 32 << 20
# Buffers come in sizes that are multiples of this, so that similar requests share them.
POOL_GRAIN = 64 << 10
# A small random read (its blocks ``READ_AROUND_MAX`` bytes at most) reads the aligned
# ``READ_AROUND`` window around it instead, verified and kept in memory
# (``READ_AROUND_WINDOWS`` of them per process, least recently used first): the small files
# an interpreter imports lie side by side in the image, and a warm start of a Python
# environment asked the disk for one 16 KiB block per file, each read a disk's latency
# (~0.1 ms here) on the start's critical path. 128 KiB is the kernel's own default
# read-ahead. Larger requests (a random reader of large files: 128 KiB reads reach the
# server whole, or in two pieces at a sector's edge) are read as they are, so read-around
# does not add to the bytes a large random read costs.
READ_AROUND = 128 << 10
READ_AROUND_MAX = 32 << 10
READ_AROUND_WINDOWS = 64
# A put that finds the disk full frees this much beyond its own size before retrying, so the
# next few puts do not each hit ENOSPC (and pay for a failed write) again.
ENOSPC_SLACK_BYTES = 8 << 20
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# Files in wip/ that their writer holds no lock on: this layout's (named ``r<pid>-...``) are
# orphans at once (the writer died); an older version's writers lock nothing, so theirs are
# removed once older than this (a put writes its file in milliseconds).
STALE_WIP_SECONDS = 60.0
WIP_PREFIX = "r"
# A put looks for orphaned reservations at most this often per process (a listing of wip/
# and a lock attempt per file there, the entries in flight on the node).
ORPHAN_CHECK_SECONDS = 5.0
# The directory's entry bytes, kept by every process that shares it (``SharedUsage``).
USAGE_FILE = "usage"
# Whole images copied out of the cache for a loop device to read (``reserve_copy``), beside
# the entries and counted against the same cap.
WIP_DIR = "wip"  # entries and copies being written (reservations)
LOCAL_DIR = "local"
SYS_BLOCK = "/sys/block"


def decode_stored(stored: bytes, checksum: str) -> bytes | None:
    """The uncompressed bytes of a stored sector, or None unless they hash to ``checksum``:
    a (v1) cache entry is checked against its own name."""
    try:
        return format_decode_stored(stored, checksum)
    except ChecksumError:
        return None


class _File:
    """An open entry file, closed when the last user lets go of it (never while one preads
    it, so its descriptor number cannot be reused under a reader): ``fd`` reads past the page
    cache where the file system allows it, ``buffered()`` through it (opened on first use)."""

    __slots__ = ("fd", "path", "_buffered")

    def __init__(self, path: Path | str, direct: bool) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))
        self._buffered = self.fd if not direct else -1

    def buffered(self) -> int:
        if self._buffered < 0:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            if os.fstat(fd).st_ino != os.fstat(self.fd).st_ino:  # replaced meanwhile
                os.close(fd)
                raise FileNotFoundError(errno.ENOENT, "entry replaced", str(self.path))
            if self._buffered < 0:
                self._buffered = fd
            else:  # another thread got there first
                os.close(fd)
        return self._buffered

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.close(self.fd)
            if self._buffered not in (-1, self.fd):
                os.close(self._buffered)


class Reservation:
    """Room taken for an entry being written: its file in ``wip/`` (allocated at the
    entry's size and counted), held open and ``flock``ed until it is installed or given
    back, so that a rescan can tell it from one whose writer died."""

    __slots__ = ("path", "fd", "total")

    def __init__(self, path: str, fd: int, total: int) -> None:
        self.path = path
        self.fd = fd
        self.total = total

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            self.close()


class _Verified:
    """What a process knows of an entry whose trailer it checked: its size and the digests
    of its blocks."""

    __slots__ = ("size", "block", "digests", "touched")

    def __init__(self, size: int, block: int, digests: bytes, touched: float) -> None:
        self.size = size
        self.block = block
        self.digests = digests
        self.touched = touched

    def covering(self, offset: int, end: int) -> tuple[int, int, bytes]:
        """The blocks that cover bytes ``[offset, end)``: their span ``[lo, hi)`` in the
        entry and their digests."""
        block = self.block
        lo = offset - offset % block
        hi = min(self.size, -(-end // block) * block)
        return lo, hi, self.digests[lo // block * 8 : -(-hi // block) * 8]


class _Buffers:
    """Page-aligned buffers (private anonymous mappings) for direct I/O, reused by whichever
    thread reads next (a thread-local pool would keep one set per FUSE thread)."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._kept = 0
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()

    def take(self, size: int) -> mmap.mmap:
        grain = -(-max(size, 1) // POOL_GRAIN) * POOL_GRAIN
        with self._lock:
            free = self._free.get(grain)
            if free:
                self._kept -= grain
                return free.pop()
        return mmap.mmap(-1, grain, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

    def give(self, buf: mmap.mmap) -> None:
        """Keep ``buf`` for reuse; over the cap, unmap buffers of the sizes that hold the
        most bytes first (the workload changed: a cold pass's 4 MiB writes must not keep
        the random reads that follow from reusing theirs), this size last."""
        grain = len(buf)
        unmapped = []
        with self._lock:
            self._free.setdefault(grain, []).append(buf)
            self._kept += grain
            while self._kept > self._keep:
                size = max(self._free, key=lambda g: (g != grain, g * len(self._free[g])))
                unmapped.append(self._free[size].pop())
                if not self._free[size]:
                    del self._free[size]
                self._kept -= size
        for old in unmapped:
            old.close()


class SectorCache:
    """Sectors' uncompressed bytes on disk, keyed by checksum, LRU-bounded to ``max_bytes``
    of entry files."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError("cache max_bytes must be positive")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.metrics = CacheMetrics()
        self._dir = self.root / LAYOUT_VERSION
        self._dir_str = str(self._dir)  # entry paths are made often: as strings, not Paths
        self._wip = self._dir / WIP_DIR
        self._local = self._dir / LOCAL_DIR
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, int] = OrderedDict()  # checksum -> file bytes, LRU first
        self._usage = 0
        self._reserved = 0  # bytes of entries this process is writing (counted in _usage)
        self._orphan_check_at = time.monotonic() + ORPHAN_CHECK_SECONDS  # opening rescans
        self._pins: _Multiset[str] = _Multiset()
        self._verified: dict[str, _Verified] = {}  # entries whose trailer this process checked
        self._files: OrderedDict[str, _File] = OrderedDict()  # open entries, LRU first
        self._open_cap = open_file_cap()
        # Direct I/O until the file system refuses it (tmpfs), separately for reads and
        # writes.
        self._direct_read = True
        self._direct_write = True
        self._buffers = _Buffers(POOL_BYTES)
        # (checksum, offset) -> a read-around window's verified bytes, LRU first
        self._windows: OrderedDict[tuple[str, int], mmap.mmap] = OrderedDict()
        self._old_layouts: list[str] = []  # of OLD_LAYOUTS, those with a directory here
        self._old_layouts_at = 0.0  # when to look again
        try:
            self._wip.mkdir(parents=True, exist_ok=True)
            self._local.mkdir(exist_ok=True)
            self._shared = SharedUsage(self._dir / USAGE_FILE)
            self._both = _BothLocks(self._shared, self._lock)
        except OSError as e:
            raise CacheError(f"cannot create sector cache at {self._dir}: {e}") from e
        self._load()

    # --- lookups --------------------------------------------------------------------------

    def get(self, checksum: str) -> bytes | None:
        """The entry's bytes (the sector's uncompressed bytes), verified; None on a miss (or
        a corrupt entry)."""
        return self.read(checksum, 0, None)

    def read(
        self, checksum: str, offset: int, length: int | None, size: int | None = None
    ) -> bytes | None:
        """Bytes ``[offset, offset+length)`` of the entry (to its end if ``length`` is
        None), verified; None on a miss, a corrupt entry, or an entry whose size is not
        ``size`` (when given). Short at the end of the entry."""
        check_checksum(checksum)
        if offset < 0 or (length is not None and length < 0):
            raise ValueError(f"invalid cache read: offset {offset}, length {length}")
        verified = self._lookup(checksum)
        if verified is None or (size is not None and verified.size != size):
            self.metrics.misses.inc()
            return None
        end = verified.size if length is None else min(verified.size, offset + length)
        if offset >= end:
            self._hit(checksum, verified)
            return b""
        data = self._read_checked(checksum, verified, offset, end)
        if data is None:
            return None
        self._hit(checksum, verified)
        return data

    def read_view(
        self,
        checksum: str,
        offset: int,
        length: int,
        scratch: memoryview,
        size: int | None = None,
        *,
        sequential: bool = False,
    ) -> tuple[memoryview, int] | None:
        """Bytes ``[offset, offset+length)`` of the entry, verified, read into ``scratch``
        (page-aligned): a view of them there, and how many bytes of ``scratch`` (whole
        pages) the read took. None on a miss, a corrupt entry, an entry whose size is not
        ``size`` (when given), one too short for the range, or a ``scratch`` too small for
        the blocks that cover it (``view_room``). The FUSE file answers with that view: no
        copy of the bytes in this process.

        ``sequential``: the read is part of a sequential stream, which ``will_need`` has
        had the kernel read ahead: read through the page cache. Otherwise the blocks are
        read past it, with direct I/O (a random read would only fill the page cache with a
        second copy of what the mount above caches)."""
        check_checksum(checksum)
        if offset < 0 or length <= 0:
            raise ValueError(f"invalid cache read: offset {offset}, length {length}")
        end = offset + length
        verified = self._lookup(checksum)
        if verified is None or (size is not None and verified.size != size) or end > verified.size:
            self.metrics.misses.inc()
            return None
        lo, hi, _ = verified.covering(offset, end)
        if (
            not sequential
            and hi - lo <= READ_AROUND_MAX
            and self._direct_read
            and READ_AROUND % verified.block == 0
            and offset // READ_AROUND == (end - 1) // READ_AROUND
        ):
            view = self._read_around(checksum, verified, offset, end)
            if view is None:
                return None
            self._hit(checksum, verified)
            return view, 0
        took = aligned(hi - lo)
        if took > len(scratch) or not self._fill(checksum, verified, offset, end, scratch,
                                                 sequential):  # fmt: skip
            return None
        self._hit(checksum, verified)
        return scratch[offset - lo : end - lo], took

    def direct_entry(
        self, checksum: str, size: int, check: bool = False
    ) -> tuple[str, bytes, int] | None:
        """For reading elsewhere (the compiled READ loop, ``snapshotter.mount._fastreads``):
        the entry's path, the digests of its blocks and their size, where this process has
        checked its trailer (``check``: checking it now if need be, as a first read does),
        it holds ``size`` sector bytes and direct reads work here; else None. Whoever reads
        it checks each block it reads against its digest."""
        if not self._direct_read:
            return None
        if check:
            verified = self._lookup(check_checksum(checksum))
        else:
            with self._lock:
                verified = self._verified.get(checksum)
        if verified is None or verified.size != size:
            return None
        return self._path(checksum), verified.digests, verified.block

    def note_read(self, checksum: str) -> None:
        """A read of the entry done elsewhere (``direct_entry``): it counts as a hit and
        makes the entry recently used, as a read through ``read_view`` does."""
        with self._lock:
            verified = self._verified.get(checksum)
        if verified is not None:
            self._hit(checksum, verified)

    def release_windows(self) -> int:
        """Forget the read-around windows (a mount server that has gone quiet gives their
        memory back); returns how many bytes they held."""
        with self._lock:
            freed = sum(len(w) for w in self._windows.values())
            self._windows.clear()
        return freed

    def will_need(self, checksum: str) -> None:
        """The entry will be read sequentially soon: have the kernel start reading it into
        the page cache (see ``read_view``'s ``sequential``)."""
        if self._lookup(check_checksum(checksum)) is None:
            return
        with contextlib.suppress(OSError):
            os.posix_fadvise(self._open(checksum).buffered(), 0, 0, os.POSIX_FADV_WILLNEED)

    def __contains__(self, checksum: object) -> bool:
        with self._lock:
            if checksum in self._entries:
                return True
        return isinstance(checksum, str) and self._adopt(checksum)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __bool__(self) -> bool:
        # A cache is a cache even while it holds nothing: ``if cache`` must not mean
        # "if it has entries" (``__len__`` would make an empty one false).
        return True

    def usage(self) -> int:
        """Bytes held by entry files."""
        with self._lock:
            return self._usage

    def entries(self) -> list[str]:
        """Checksums of all entries, least recently used first."""
        with self._lock:
            return list(self._entries)

    # --- writes ---------------------------------------------------------------------------

    def put(
        self,
        checksum: str,
        data: bytes | memoryview | EntryBuffer,
        verified: bool = False,
        digests: bytes | None = None,
    ) -> bool:
        """Store a sector's uncompressed bytes under its checksum. Bytes that do not hash
        to ``checksum`` are refused (this costs a hash, ~0.5 ms per 4 MiB, and keeps the
        block digests honest); ``verified``: the caller has just hashed these very bytes
        (``Index.decode_sector`` or ``decode_sector_into`` checked them), so they are not
        hashed again, and ``digests``, with ``verified`` only, their ``VERIFY_BLOCK``
        digests, hashed in the same pass (``decode_sector_into``'s ``block``). An
        ``EntryBuffer`` is written from where it is (its bytes must not change until this
        returns). Returns whether the entry is now cached; never raises for lack of room or
        a failing disk."""
        check_checksum(checksum)
        held = data
        if isinstance(data, EntryBuffer):
            data = data.data
        if digests is not None and (
            not verified or len(digests) != 8 * -(-len(data) // VERIFY_BLOCK)
        ):
            raise ValueError("digests are given with verified bytes, one per VERIFY_BLOCK")
        if not verified and xxhash.xxh3_128_hexdigest(data) != checksum:
            self.metrics.put_failures.inc()
            log.error("sector cache: bytes put as %s do not hash to it; not cached", checksum)
            return False
        if digests is None:
            digests = block_digests(data)
        trailer = entry_trailer(checksum, len(data), digests)
        total = aligned(len(data)) + len(trailer)
        # Room is made and the entry counted before its file is written (``_reserve``), so
        # the directory never holds more than the cap, entries being written included.
        self._check_orphans()
        for attempt in (1, 2):
            with self._changing():
                if checksum in self._entries:
                    self._touch(checksum)
                    return True
                try:
                    res = self._reserve(total)
                except OSError as e:
                    self.metrics.put_failures.inc()
                    log.warning("sector cache: cannot write %s: %s; not cached", checksum, e)
                    return False
            if res is not None or attempt == 2:
                break
            # Other processes' entries fill the directory, and this one knows too few of
            # them to make the room: learn them all, and evict the least recently used.
            self._reconcile_for_room()
        if res is None:
            # What is left is pinned by reads in progress (or the entry is larger than the
            # cap): the read goes on from memory.
            self.metrics.uncached.inc()
            log.debug("sector cache: no room for %s (%d bytes), not cached", checksum, total)
            return False
        try:
            self._write_tmp(res, held, trailer)
        except OSError as e:
            with self._changing():
                self._release(res)
            self.metrics.put_failures.inc()
            log.warning("sector cache: cannot write %s: %s; not cached", checksum, e)
            return False
        path = self._path(checksum)
        # Installing the entry and handing its reservation to it happen as one against
        # other processes.
        with self._changing():
            if checksum in self._entries:  # another thread won the race
                self._release(res)
                self._touch(checksum)
                return True
            try:
                replaced = os.path.exists(path)  # another process's copy: counted already
                try:
                    os.replace(res.path, path)
                except FileNotFoundError:  # the entry's subdirectory, made on first use
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    os.replace(res.path, path)
            except OSError as e:
                self._release(res)
                self.metrics.put_failures.inc()
                log.warning("sector cache: cannot install %s: %s; not cached", checksum, e)
                return False
            res.close()  # its lock: the file is an entry now, out of wip/
            self._reserved -= total
            if replaced:
                self._shared.add(-total)
            self._entries[checksum] = total
            self._verified[checksum] = _Verified(len(data), VERIFY_BLOCK, digests, time.monotonic())
        self.metrics.puts.inc()
        return True

    def _reserve(self, total: int) -> Reservation | None:
        """Make room for an entry of ``total`` bytes, create its file in ``wip/`` at its full
        size, lock it and count it, in this process and in the directory; None when there
        is no room among the entries this process knows. Under ``_changing``, so no rescan
        sees the file before its lock. A disk that is full although the count has room:
        evict a little more and try once more."""
        if not self._make_room(total):
            return None
        directory = self._shared.get()
        if directory is None or directory + total > self.max_bytes:
            return None
        for attempt in (1, 2):
            fd, name = self._new_wip_file()
            try:
                # Blocking: a check for orphans (``_orphaned``) may hold it for an instant.
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._allocate(fd, total)
                break
            except OSError as e:
                _unlink(name)
                os.close(fd)
                if e.errno not in _DISK_FULL or attempt == 2:
                    raise
                freed = self._evict(total + ENOSPC_SLACK_BYTES)
                log.info("sector cache: disk full, evicted %d bytes and retrying", freed)
        self._shared.add(total)
        self._usage += total
        self._reserved += total
        return Reservation(name, fd, total)

    def _new_wip_file(self) -> tuple[int, str]:
        """A new file in ``wip/``, named for this process (``WIP_PREFIX``, pid, a count)."""
        while True:
            name = f"{self._wip}/{WIP_PREFIX}{os.getpid()}-{next(_WIP_NAMES)}"
            try:
                return os.open(name, _WIP_FLAGS, 0o600), name
            except FileExistsError:  # left by a dead process of the same pid
                continue

    @staticmethod
    def _allocate(fd: int, size: int) -> None:
        """Give the new file ``fd`` its final ``size`` on disk now (the reservation a scan of
        the directory, or ``du``, sees), or at least that length where the file system
        cannot allocate ahead."""
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, size)

    def _release(self, res: Reservation) -> None:
        """Give up a reservation (``_reserve``): its file, its lock and its count. Under
        ``_changing``."""
        _unlink(res.path)
        res.close()
        self._shared.add(-res.total)
        self._usage -= res.total
        self._reserved -= res.total

    def _check_orphans(self) -> None:
        """At most every ``ORPHAN_CHECK_SECONDS``: if a reservation in ``wip/`` has lost its
        writer (a process killed mid-write; its lock went with it), rescan, which removes
        its file and takes its bytes off the directory's count."""
        now = time.monotonic()
        if now < self._orphan_check_at:
            return
        self._orphan_check_at = now + ORPHAN_CHECK_SECONDS
        try:
            names = os.listdir(self._wip)
        except OSError:
            return
        if any(_orphaned(self._wip / name) for name in names):
            log.info("sector cache %s: a writer died mid-write; rescanning", self._dir)
            self._reconcile_for_room()

    @contextlib.contextmanager
    def pin(self, checksums: Iterable[str]) -> Iterator[None]:
        """Keep these entries (present now or put while pinned) from being evicted."""
        keys = list(checksums)
        with self._lock:
            self._pins.update(keys)
        try:
            yield
        finally:
            with self._lock:
                self._pins.subtract(keys)
                for k in keys:
                    if self._pins[k] <= 0:
                        del self._pins[k]

    def discard(self, checksum: str) -> None:
        """Remove one entry, if present."""
        with self._changing():
            if checksum in self._entries:
                self._delete(checksum)

    def gc(self) -> int:
        """Reconcile with the directory (entries deleted or added behind our back, leftover
        temporary files, what is left of older layouts) and evict down to ``max_bytes``.
        Returns the bytes evicted."""
        freed = 0
        for layout in OLD_LAYOUTS:
            if (self.root / layout).is_dir():
                freed += sum(size for _, size, _ in cache_entries(self.root, layout))
                shutil.rmtree(self.root / layout, ignore_errors=True)
        return freed + self.reconcile()

    def clear(self) -> None:
        """Remove every unpinned entry."""
        with self._lock:
            checksums = list(self._entries)
        # One at a time: other processes' puts go on between the deletions.
        for checksum in checksums:
            with self._changing():
                if checksum in self._entries and checksum not in self._pins:
                    self._delete(checksum)

    # --- whole images copied out (``snapshotter.mount.localcopy``) ------------------------

    def reserve_copy(self, size: int) -> Reservation | None:
        """Room for a file of ``size`` bytes (a whole image's copy), made as for an entry:
        least recently used entries evicted, the file created in ``wip/`` at its full size,
        counted against the cap and locked by this process until ``install_copy`` or
        ``release_copy``. None when the cap has no room for it."""
        with self._changing():
            return self._reserve(size)

    def install_copy(self, res: Reservation, name: str) -> Path:
        """Move a reserved copy, which a loop device now reads, to ``local/<name>``. It stays
        counted in the directory's usage until ``remove_copy``, or until a rescan finds that
        no loop device holds it any more."""
        target = self._local / name
        with self._changing():
            os.replace(res.path, target)
            res.close()
            self._usage -= res.total
            self._reserved -= res.total
        return target

    def write_copy(self, res: Reservation, view: memoryview, offset: int) -> None:
        """Write ``view`` (page-aligned, whole pages) at ``offset`` of a reserved copy, as
        entries are written: with direct I/O where the file system takes it."""
        self._write_entry(res.fd, view, offset)

    def release_copy(self, res: Reservation) -> None:
        """Give up a reserved copy (it could not be made): its file and its room."""
        with self._changing():
            self._release(res)

    # --- internals: reads -----------------------------------------------------------------

    def _path(self, checksum: str) -> str:
        return f"{self._dir_str}/{checksum[:2]}/{checksum}"

    def _lookup(self, checksum: str) -> _Verified | None:
        """What this process knows of the entry, checking its trailer on first use (and
        taking in an entry another process or an older layout holds); None on a miss."""
        with self._lock:
            known = checksum in self._entries
            verified = self._verified.get(checksum)
        if known and verified is not None:
            return verified
        if not known and not self._adopt(checksum) and not self._migrate(checksum):
            return None
        with self._lock:
            verified = self._verified.get(checksum)
        return verified if verified is not None else self._check_trailer(checksum)

    def _check_trailer(self, checksum: str) -> _Verified | None:
        """Read and check the entry's trailer: the first use of an entry in this process."""
        try:
            file = self._open(checksum)
            file_size = os.fstat(file.fd).st_size
            if file_size < ALIGN or file_size % ALIGN:
                self._corrupt(checksum, file, f"size {file_size} is not whole pages")
                return None
            tail = self._pread(file, ALIGN, file_size - ALIGN)
            if len(tail) != ALIGN:
                self._corrupt(checksum, file, "short read of its trailer")
                return None
            footer = read_footer(tail)
            if footer is not None and footer.fits(file_size) and footer.length > ALIGN:
                tail = self._pread(file, footer.length, file_size - footer.length)
        except OSError as e:  # evicted meanwhile, or removed behind our back
            return self._lost(checksum, e)
        digests = (
            "no trailer"
            if footer is None
            else trailer_digests(footer, tail[-footer.length :], file_size, checksum)
        )
        if isinstance(digests, str):
            self._corrupt(checksum, file, digests)
            return None
        verified = _Verified(footer.size, footer.block, digests, 0.0)
        with self._lock:
            if checksum in self._entries:
                verified = self._verified.setdefault(checksum, verified)
        return verified

    def _pread(self, file: _File, length: int, offset: int) -> bytes:
        """``length`` bytes at ``offset`` (both ``ALIGN``-aligned) of an entry file."""
        buf = self._buffers.take(length)
        view = memoryview(buf)
        try:
            got = self._preadv(file, view[:length], offset)
            return view[:got].tobytes()
        finally:
            view.release()
            self._buffers.give(buf)

    def _preadv(self, file: _File, view: memoryview, offset: int) -> int:
        try:
            return os.preadv(file.fd, [view], offset)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            flags = fcntl.fcntl(file.fd, fcntl.F_GETFL)
            if not flags & os.O_DIRECT:
                raise
        # Direct I/O refused on read (some file systems take O_DIRECT at open only): the
        # page cache from now on.
        if self._direct_read:
            log.info("sector cache %s: direct reads refused; reading through the page cache",
                     self._dir)  # fmt: skip
            self._direct_read = False
        fcntl.fcntl(file.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        return os.preadv(file.fd, [view], offset)

    def _read_around(
        self, checksum: str, verified: _Verified, offset: int, end: int
    ) -> memoryview | None:
        """Bytes ``[offset, end)`` of the entry (within one ``READ_AROUND`` window) from
        that window: from memory if a read took it there, else read whole with direct I/O,
        checked block by block and kept. None if the entry is gone or damaged (then
        forgotten, as ``_fill`` says).

        A window is the entry's verified bytes, and an entry's bytes never change (its name
        is their checksum), so a window stays right after its entry is evicted or deleted.
        A window is never written again once kept: a view of it that a FUSE answer still
        holds keeps its memory alive when the window leaves the list."""
        start = offset - offset % READ_AROUND
        key = (checksum, start)
        with self._lock:
            window = self._windows.get(key)
            if window is not None:
                self._windows.move_to_end(key)
        if window is None:
            size = min(verified.size, start + READ_AROUND) - start
            window = mmap.mmap(-1, aligned(size), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if not self._fill(checksum, verified, start, start + size, memoryview(window),
                              False):  # fmt: skip
                return None
            with self._lock:
                self._windows[key] = window
                while len(self._windows) > READ_AROUND_WINDOWS:
                    self._windows.popitem(last=False)
        else:
            self.metrics.read_around_hits.inc()
        return memoryview(window)[offset - start : end - start]

    def _read_checked(
        self, checksum: str, verified: _Verified, offset: int, end: int
    ) -> bytes | None:
        """Bytes ``[offset, end)`` of the entry, checked (``_fill`` into a pooled buffer)."""
        lo, hi, _ = verified.covering(offset, end)
        buf = self._buffers.take(aligned(hi - lo))
        view = memoryview(buf)
        try:
            if not self._fill(checksum, verified, offset, end, view, False):
                return None
            return view[offset - lo : end - lo].tobytes()
        finally:
            view.release()
            self._buffers.give(buf)

    def _fill(
        self, checksum: str, verified: _Verified, offset: int, end: int, into: memoryview,
        sequential: bool,
    ) -> bool:  # fmt: skip
        """Read the blocks that cover ``[offset, end)`` into ``into`` (page-aligned, room
        for them in whole pages) and check each against its digest: through the page cache
        if ``sequential`` (or direct reads are refused), else with direct I/O. False if the
        entry is gone or damaged (then forgotten)."""
        lo, hi, expected = verified.covering(offset, end)
        try:
            file = self._open(checksum)
            if sequential or not self._direct_read:
                got = os.preadv(file.buffered(), [into[: hi - lo]], lo)
            else:
                got = self._preadv(file, into[: aligned(hi - lo)], lo)
        except OSError as e:  # evicted meanwhile, or removed behind our back
            self._lost(checksum, e)
            return False
        if got < hi - lo or block_digests(into[: hi - lo], verified.block) != expected:
            self._corrupt(checksum, file, f"blocks {lo}..{hi} do not match their digests")
            return False
        return True

    def _hit(self, checksum: str, verified: _Verified) -> None:
        now = time.monotonic()
        with self._lock:
            if checksum in self._entries:
                self._entries.move_to_end(checksum)
                if now - verified.touched >= TOUCH_INTERVAL:
                    verified.touched = now
                    with contextlib.suppress(OSError):
                        os.utime(self._path(checksum))
        self.metrics.hits.inc()

    def _lost(self, checksum: str, error: OSError) -> None:
        """The entry's file went away (evicted, removed behind our back): a miss."""
        with self._lock:
            self._forget(checksum)
        self.metrics.misses.inc()
        log.debug("sector cache: %s unreadable (%s), treated as a miss", checksum, error)
        return None

    def _open(self, checksum: str) -> _File:
        with self._lock:
            file = self._files.get(checksum)
            if file is not None:
                self._files.move_to_end(checksum)
                return file
        path = self._path(checksum)
        try:
            file = _File(path, self._direct_read)
        except OSError as e:
            if e.errno != errno.EINVAL or not self._direct_read:
                raise
            log.info("sector cache %s: no direct I/O (%s); reading through the page cache",
                     self._dir, e)  # fmt: skip
            self._direct_read = False
            file = _File(path, False)
        with self._lock:
            file = self._files.setdefault(checksum, file)
            while len(self._files) > self._open_cap:
                self._files.popitem(last=False)
        return file

    def _corrupt(self, checksum: str, file: _File, why: str) -> None:
        path = self._path(checksum)
        with self._changing():
            self.metrics.corrupt.inc()
            self.metrics.misses.inc()
            log.warning("sector cache: entry %s is corrupt (%s); deleted", path, why)
            # Delete only the file we read: a concurrent put may have replaced it.
            try:
                ours = os.stat(path).st_ino == os.fstat(file.fd).st_ino
            except OSError:
                ours = True  # already gone
            if ours:
                self._delete(checksum)
            else:
                self._verified.pop(checksum, None)
                self._files.pop(checksum, None)

    def _migrate(self, checksum: str) -> bool:
        """Take over an entry of an older layout: check it against its name, write it as
        this layout, remove the old file."""
        now = time.monotonic()
        if now >= self._old_layouts_at:  # which older layouts are there, looked at seldom
            self._old_layouts = [x for x in OLD_LAYOUTS if (self.root / x).is_dir()]
            self._old_layouts_at = now + OLD_LAYOUT_CHECK_SECONDS
        for layout in self._old_layouts:
            old = self.root / layout / checksum[:2] / checksum
            try:
                stored = old.read_bytes()
            except OSError:
                continue
            if layout == "v1":  # zstd-compressed
                data = decode_stored(stored, checksum)
            else:
                data = stored if xxhash.xxh3_128_hexdigest(stored) == checksum else None
            _unlink(old)
            if data is None:
                log.warning("sector cache: %s entry %s is corrupt; deleted", layout, old)
                continue
            return self.put(checksum, data, verified=True)
        return False

    def _adopt(self, checksum: str) -> bool:
        """Take in an entry that another process put since we loaded. Lock not held."""
        try:
            size = os.stat(self._path(check_checksum(checksum))).st_size
        except (OSError, ValueError):
            return False
        with self._lock:
            if checksum not in self._entries:
                self._entries[checksum] = size
                self._usage += size
        return True

    # --- internals: bookkeeping -----------------------------------------------------------

    def _touch(self, checksum: str) -> None:
        """Mark an entry most recently used (in memory and in its mtime). Lock held."""
        self._entries.move_to_end(checksum)
        with contextlib.suppress(OSError):
            os.utime(self._path(checksum))

    def _forget(self, checksum: str) -> None:
        self._usage -= self._entries.pop(checksum, 0)
        self._verified.pop(checksum, None)
        self._files.pop(checksum, None)

    def _changing(self) -> _BothLocks:
        """Both locks, the directory's first: held to install, delete or count an entry."""
        return self._both

    def _delete(self, checksum: str) -> int:
        """Forget an entry and delete its file; returns the bytes that freed (0 if another
        process had deleted it). Under ``_changing``: deleted and counted as one, as a rescan
        sees it."""
        assert self._shared.owned(), "the directory's lock comes first"
        size = self._entries.get(checksum, 0)
        self._forget(checksum)
        if not _unlink(self._path(checksum)):
            return 0
        self._shared.add(-size)
        return size

    def _make_room(self, size: int) -> bool:
        """Evict until ``size`` more bytes fit under the cap, in this process's count and in
        the directory's. Under ``_changing``."""
        if size > self.max_bytes:
            return False
        # The directory's count holds this process's entries too, unless it was damaged.
        directory = self._shared.get() or 0
        self._evict(max(self._usage, directory) + size - self.max_bytes)
        return self._usage + size <= self.max_bytes

    def _evict(self, need: int) -> int:
        """Evict unpinned entries, oldest first, until ``need`` bytes are freed or nothing
        unpinned is left. Under ``_changing``. Returns the bytes freed."""
        freed = 0
        if need <= 0:
            return 0
        for checksum in list(self._entries):
            if freed >= need:
                break
            if self._pins[checksum] > 0:
                continue
            freed += self._delete(checksum)
            self.metrics.evictions.inc()
        return freed

    # --- internals: writes ----------------------------------------------------------------

    def _write_tmp(
        self, res: Reservation, data: bytes | memoryview | EntryBuffer, trailer: bytes
    ) -> None:
        """Write an entry file (``data``, zeros to a page boundary, ``trailer``) into its
        reserved file in ``wip/``. Not fsynced: see the module's docstring."""
        fd = res.fd
        if isinstance(data, EntryBuffer):
            self._write_entry(fd, data.entry(trailer))
        else:
            size = len(data)
            start = aligned(size)
            total = start + len(trailer)
            buf = self._buffers.take(total)
            view = memoryview(buf)
            try:
                view[:size] = data
                view[size:start] = bytes(start - size)  # the buffer is reused: zero the gap
                view[start:total] = trailer
                self._write_entry(fd, view[:total])
            finally:
                view.release()
                self._buffers.give(buf)

    def _write_entry(self, fd: int, view: memoryview, offset: int = 0) -> None:
        """All of ``view`` (a whole entry, or a sector of a copy) to the reserved file ``fd``
        at ``offset``: with direct I/O where the file system takes it."""
        if not self._write_direct(fd, view, offset):
            _write_all(fd, view, offset)

    def _write_direct(self, fd: int, view: memoryview, offset: int) -> bool:
        """Write ``view`` (page-aligned, whole pages) to the reserved file ``fd`` at
        ``offset`` with O_DIRECT; False where the file system will not (then what it wrote
        is written again)."""
        if not self._direct_write:
            return False
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
            _write_all(fd, view, offset)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            log.info("sector cache %s: direct writes refused (%s); writing through the page "
                     "cache", self._dir, e)  # fmt: skip
            self._direct_write = False
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            return False
        return True

    def _load(self) -> None:
        freed = self.reconcile()
        log.info(
            "sector cache %s: %d entries, %d bytes (evicted %d bytes over the cap)",
            self._dir,
            len(self._entries),
            self._usage,
            freed,
        )

    def _scan(self) -> tuple[list[tuple[float, str, int]], int]:
        """(last use, checksum, bytes) of every entry file, least recently used first, and
        the bytes of the entries being written (reserved at their full size) and of the
        copies in ``local/`` that loop devices read; removes the files of writers that are
        gone, and the copies no loop device holds. Under the directory's lock, so every
        reservation it sees is locked by its writer if that writer lives."""
        now = time.time()
        writing = 0
        held = loop_backing_files()
        for f in self._wip.iterdir():
            with contextlib.suppress(OSError):
                st = f.stat()
                if str(f) in held and _orphaned(f):
                    # A copy a loop device was switched to, whose maker died before it
                    # moved it to local/ (``install_copy``): a copy like the others,
                    # counted while it is read, removed once it is not.
                    target = _keep_copy(f)
                    held[target] = held[str(f)]
                    log.info("sector cache: %s, which a loop device reads, kept as %s", f, target)
                elif _orphaned(f) or (
                    not f.name.startswith(WIP_PREFIX) and now - st.st_mtime >= STALE_WIP_SECONDS
                ):
                    f.unlink()
                    log.info("sector cache: removed %s, left by a writer that is gone", f)
                else:
                    writing += st.st_size
        for f in self._local.iterdir():
            with contextlib.suppress(OSError):
                if str(f) in held:
                    writing += f.stat().st_size
                else:
                    f.unlink()
                    log.info("sector cache: removed %s, a copy no loop device reads", f)
        found: list[tuple[float, str, int]] = []
        for sub in self._dir.iterdir():
            if sub.name in (WIP_DIR, LOCAL_DIR) or not sub.is_dir():
                continue
            for f in sub.iterdir():
                name = f.name
                if not is_checksum(name) or name[:2] != sub.name:
                    log.warning("sector cache: ignoring stray file %s", f)
                    continue
                try:
                    st = f.stat()
                except OSError:
                    continue
                found.append((max(st.st_mtime, st.st_atime), name, st.st_size))
        found.sort()
        return found, writing

    # --- internals: the directory's cap, over all processes -------------------------------

    def _reconcile_for_room(self) -> None:
        """``reconcile`` from ``put``, which never fails for want of room."""
        try:
            self.reconcile()
        except OSError as e:
            log.warning("sector cache: cannot rescan %s: %s", self._dir, e)

    def reconcile(self) -> int:
        """Rescan the directory, take in the entries other processes wrote, forget the ones
        they deleted, reset the directory's counter, and evict the least recently used
        entries of all down to the cap. Returns the bytes evicted."""
        # No process adds or deletes an entry while the scan holds the directory's lock, so
        # what it finds is the directory's exact count. It stats every entry: measured, 6 ms
        # for 500 entries, 0.14 s for 20,000 (an 80 GB cache of 4 MiB sectors; 0.4 s with
        # the dentries not cached). Reads go on meanwhile: they take only this process's
        # lock, which the scan does not hold, and a put or an eviction waiting for the
        # directory does not hold it either (the directory's lock always comes first). It
        # runs when the cache is opened, on gc, and when a put cannot make room among the
        # entries it knows.
        with self._shared.held():
            found, writing = self._scan()
            entries = OrderedDict((name, size) for _, name, size in found)
            usage = sum(entries.values())
            with self._lock:
                for name in [k for k in self._entries if k not in entries]:
                    self._verified.pop(name, None)  # deleted by another process
                    self._files.pop(name, None)
                self._entries = entries
                # Entries being written (this process's and others') count as written.
                self._usage = usage + self._reserved
                self._shared.set(usage + writing)
                freed = self._evict(usage + writing - self.max_bytes)
        if freed:
            log.info("sector cache %s: evicted %d bytes to keep the directory under its cap",
                     self._dir, freed)  # fmt: skip
        return freed


def _write_all(fd: int, view: memoryview, offset: int = 0) -> None:
    """Write all of ``view`` at ``offset`` of the file."""
    done = 0
    while done < len(view):
        written = os.pwrite(fd, view[done:], offset + done)
        if written <= 0:
            raise OSError(errno.EIO, f"short write ({written} bytes)")
        done += written


def open_file_cap() -> int:
    """How many entry files a cache keeps open: ``OPEN_FILES``, or an eighth of this
    process's descriptor limit if that is lower (two descriptors each at most)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return OPEN_FILES
    return max(16, min(OPEN_FILES, soft // 8))


def _orphaned(path: Path) -> bool:
    """Whether ``path`` is a reservation of this layout in ``wip/`` whose writer is gone:
    no process holds its lock (the kernel drops a ``flock`` with the last descriptor, so
    with the process that died). A file another version wrote, or one that went away, is
    not."""
    if not path.name.startswith(WIP_PREFIX):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # its writer holds it
    finally:
        os.close(fd)  # and with it the lock this took, if it took one
    return True


class _BothLocks:
    """A cache directory's lock and then a process's lock, as one ``with``."""

    __slots__ = ("_shared", "_lock")

    def __init__(self, shared: SharedUsage, lock: threading.Lock) -> None:
        self._shared = shared
        self._lock = lock

    def __enter__(self) -> None:
        self._shared.held().__enter__()  # (held() is the counter itself)
        try:
            self._lock.acquire()
        except BaseException:
            self._shared.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        self._shared.__exit__(None, None, None)


_WIP_NAMES = itertools.count()
_WIP_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


def _unlink(path: Path | str) -> bool:
    """Delete a file; whether this call deleted it."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def view_room(length: int, block: int = VERIFY_BLOCK) -> int:
    """The most ``scratch`` a ``read_view`` of ``length`` bytes takes: the blocks that cover
    them, in whole pages."""
    return aligned(length + 2 * block)


def cache_entries(
    root: os.PathLike[str] | str, layout: str = LAYOUT_VERSION
) -> list[tuple[str, int, float]]:
    """(checksum, bytes, last use) of every entry in a cache directory, least recently used
    first, read from disk without loading (or trimming) the cache."""
    out = []
    try:
        subs = list(os.scandir(os.path.join(root, layout)))
    except OSError:
        return []
    for sub in subs:
        if sub.name in (WIP_DIR, LOCAL_DIR) or not sub.is_dir():
            continue
        try:
            for entry in os.scandir(sub.path):
                try:
                    st = entry.stat()
                except OSError:
                    continue
                out.append((entry.name, st.st_size, max(st.st_mtime, st.st_atime)))
        except OSError:
            pass
    out.sort(key=lambda e: e[2])
    return out


def loop_backing_files() -> dict[str, str]:
    """The files that the node's loop devices read (their paths as the kernel shows them),
    each with the device that reads it (``/dev/loopN``)."""
    held = {}
    with contextlib.suppress(OSError):
        for dev in os.scandir(SYS_BLOCK):
            with contextlib.suppress(OSError):
                with open(os.path.join(dev.path, "loop", "backing_file")) as f:
                    held[f.read().strip()] = f"/dev/{dev.name}"
    return held


def local_copy_files(root: os.PathLike[str] | str) -> list[tuple[str, int, float, str]]:
    """The whole images copied out of a cache directory (``local/``): (path, bytes, when
    made, the loop device that reads it or ""), oldest first (``snapshotter cache ls``)."""
    held = loop_backing_files()
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(os.path.join(root, LAYOUT_VERSION, LOCAL_DIR)):
            with contextlib.suppress(OSError):
                st = entry.stat()
                found.append((entry.path, st.st_size, st.st_mtime, held.get(entry.path, "")))
    return sorted(found, key=lambda f: f[2])


def is_copy(root: os.PathLike[str] | str, path: os.PathLike[str] | str) -> bool:
    """Whether ``path`` (a loop device's backing file, say) is a whole image's copy of the
    cache directory ``root``: in ``local/``, or a reservation in ``wip/`` (one whose maker
    died after switching a loop device to it, before ``install_copy``)."""
    where = os.path.dirname(os.path.abspath(path))
    return where in (
        os.path.abspath(os.path.join(root, LAYOUT_VERSION, d)) for d in (LOCAL_DIR, WIP_DIR)
    )


def _keep_copy(path: os.PathLike[str] | str) -> str:
    """Move a copy left in ``wip/`` to ``local/`` beside it, where it is counted and removed
    as any copy; returns its new path."""
    target = os.path.join(os.path.dirname(os.path.dirname(path)), LOCAL_DIR, os.path.basename(path))
    os.replace(path, target)
    return target


def remove_copy(root: os.PathLike[str] | str, path: os.PathLike[str] | str) -> int:
    """Delete a whole image's copy (``is_copy``; its mount is gone) and take its bytes off
    the directory's count; returns them (0 if it was gone already). One still in ``wip/``
    is moved to ``local/`` first, as a rescan would. A loop device that still reads it
    keeps reading the deleted file until it is detached."""
    if not is_copy(root, path):
        raise CacheError(f"{path} is not a copy in {os.path.join(root, LAYOUT_VERSION)}")
    if os.path.basename(os.path.dirname(os.path.abspath(path))) == WIP_DIR:
        try:
            path = _keep_copy(path)
        except FileNotFoundError:  # a rescan kept it meanwhile
            path = os.path.join(root, LAYOUT_VERSION, LOCAL_DIR, os.path.basename(path))
    usage = SharedUsage(Path(root) / LAYOUT_VERSION / USAGE_FILE)
    with usage.held():
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            return 0
        usage.add(-size)
    return size


def shared_usage(root: os.PathLike[str] | str) -> int | None:
    """The directory-wide count of a cache's entry bytes, as its processes keep it (None:
    unknown until a cache opened on it rescans)."""
    return read_usage(os.path.join(root, LAYOUT_VERSION, USAGE_FILE))


def local_copies(root: os.PathLike[str] | str) -> tuple[int, int]:
    """(copies, bytes) of the whole images copied out of a cache directory (``local/``)."""
    files = local_copy_files(root)
    return len(files), sum(size for _, size, _, _ in files)


def cache_usage(root: os.PathLike[str] | str) -> tuple[int, int]:
    """(entries, bytes) in a cache directory, counted on disk (for status and metrics)."""
    entries = cache_entries(root)
    return len(entries), sum(size for _, size, _ in entries)
