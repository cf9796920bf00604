"""The node's local sector cache: verified sectors on disk, shared by every mount and image.

An entry is one sector's *uncompressed* bytes, named by their xxh3-128 checksum. Naming by
content means two images (or two tags of one image) that share a sector share its cache entry,
and an entry can be checked on its own: hash it, compare with the name. Keeping sectors
decoded (layout ``v2``; ``v1`` kept them zstd-compressed) makes a warm read one ``pread`` of
the bytes asked for, not a whole-sector decompression.

Verification. No byte leaves the cache unverified, and an entry is never trusted because of
where it lies:

* The first time a process uses an entry, it reads the whole entry and checks it against its
  name (xxh3-128, ~0.5 ms for 4 MiB). While it has the verified bytes it also records the
  xxh3-64 of every ``VERIFY_BLOCK`` (32 KiB) block, in memory (1 KiB per 4 MiB sector).
* Every later read (``read``, or ``read_into`` a caller's buffer) preads only the blocks that
  cover the range asked for and checks each against its recorded digest, so a file that was
  corrupted, truncated or replaced after the first check is still caught, on the very read
  that would have served it. ``read_into`` checks the bytes in the caller's buffer itself
  (the parts of the edge blocks outside the range go to scratch), so what is checked is
  exactly what is served.
* ``put`` records the digests from the bytes it is given (the caller verified them).

An entry that fails either check is a logged miss and is deleted; it is never returned.

Layout under ``root`` (the version lets a later layout live beside this one)::

    v2/wip/<random>             entries being written (removed on open)
    v2/<cc>/<checksum>          one entry; <cc> is the checksum's first two hex digits

Writes go to ``wip/`` and are renamed into place, so readers see a whole entry or none. An
entry whose size is a multiple of 4 KiB (every sector but perhaps an image's last) is written
with direct I/O from a page-aligned buffer: copying it into the page cache cost a third of a
cold read's CPU, and the bytes a read wants next are in the reader's memory anyway. They
are not fsynced: a crash can leave a renamed entry with lost or torn contents, which the first
read of it detects (every entry is checked in full before a process first uses it) and
refetches, so a sync per sector would only buy back a refetch. The cache is bounded to
``max_bytes`` of entry bytes with least-recently-used eviction; the recency clock is the
entry file's mtime, set when an entry is used (at most every ``TOUCH_INTERVAL`` seconds per
entry), so the order survives restarts: opening a cache rebuilds its state from the
directory. Entries *pinned* by an in-progress read are never evicted. Caching is best effort:
when the disk is full a put evicts and retries once, and if the entry still cannot be written
it is dropped (``put`` returns False) — the read that produced it succeeds regardless.

Entries of the ``v1`` layout are taken over when first wanted (decompressed, checked, written
as ``v2``, the ``v1`` file removed); ``gc()`` removes whatever of ``v1`` is left.

Several processes may share one directory (the node runs a mount server per mount): an
entry another process wrote is found on disk and adopted, one it evicted is a miss, and each
process enforces the cap over the entries it knows (``gc()``, and every open, trims the
directory as a whole). Within a process every method is thread-safe.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import resource
import shutil
import tempfile
import threading
import time
from collections import Counter as _Multiset
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path

import xxhash

from imagetool.errors import ChecksumError
from imagetool.format import decode_stored as format_decode_stored
from snapshotter.errors import CacheError
from snapshotter.metrics import CacheMetrics

log = logging.getLogger(__name__)

LAYOUT_VERSION = "v2"
OLD_LAYOUT_VERSION = "v1"  # zstd-compressed entries; migrated on first use
# Granularity of the checks of later reads of a verified entry: a read checks the 32 KiB
# blocks that cover it (at most 64 KiB more than asked for); digests cost 8 bytes a block.
VERIFY_BLOCK = 32 << 10
# On-disk recency is refreshed at most this often per entry: an mtime update per read would
# be a metadata write per FUSE request, and the restart order needs no finer clock.
TOUCH_INTERVAL = 10.0
# Entry files kept open for reads: reopening one per read would cost a path lookup and,
# worse, lose the kernel's read-ahead state, which lives in the open file. Random reads over
# an image touch every entry in turn, so the cap covers a 16 GiB image of 4 MiB sectors; it
# is lowered to a quarter of the process's descriptor limit (``open_file_cap``), so that the
# cache never starves the rest of the process of descriptors.
OPEN_FILES = 4096
# Entries are written with direct I/O (from a page-aligned buffer, one per writing thread)
# when their size is a multiple of this: no copy into the page cache, which on a cold read
# is a third of the mount server's CPU. Otherwise, or where the file system refuses
# O_DIRECT (tmpfs), they are written through the page cache.
DIRECT_IO_ALIGN = 4096
# A put that finds the disk full frees this much beyond its own size before retrying, so the
# next few puts do not each hit ENOSPC (and pay for a failed write) again.
ENOSPC_SLACK_BYTES = 8 << 20
_HEX = frozenset("0123456789abcdef")
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# Opening the cache and gc() remove temporary files older than this; younger ones may belong
# to a put running in this or another process (a put writes its file in milliseconds).
STALE_WIP_SECONDS = 60.0


def check_checksum(checksum: str) -> str:
    """Validate a sector checksum (32 lowercase hex digits) used as a cache key."""
    if not isinstance(checksum, str) or len(checksum) != 32 or not _HEX.issuperset(checksum):
        raise ValueError(f"invalid sector checksum {checksum!r}")
    return checksum


def decode_stored(stored: bytes, checksum: str) -> bytes | None:
    """The uncompressed bytes of a stored sector, or None unless they hash to ``checksum``:
    a (v1) cache entry is checked against its own name."""
    try:
        return format_decode_stored(stored, checksum)
    except ChecksumError:
        return None


def block_digests(data: bytes | memoryview) -> bytes:
    """xxh3-64 of each ``VERIFY_BLOCK`` block of ``data``, concatenated."""
    view = memoryview(data)
    return b"".join(
        xxhash.xxh3_64_digest(view[i : i + VERIFY_BLOCK]) for i in range(0, len(view), VERIFY_BLOCK)
    )


def parts_digests(parts: list[memoryview]) -> bytes:
    """``block_digests`` of the concatenation of ``parts``, without concatenating them: a
    block that spans parts is hashed incrementally."""
    out = []
    partial = None  # the hash of a block begun in an earlier part
    filled = 0  # its bytes so far
    for part in parts:
        pos, n = 0, len(part)
        if partial is not None:
            pos = min(VERIFY_BLOCK - filled, n)
            partial.update(part[:pos])
            filled += pos
            if filled == VERIFY_BLOCK:
                out.append(partial.digest())
                partial = None
        while n - pos >= VERIFY_BLOCK:
            out.append(xxhash.xxh3_64_digest(part[pos : pos + VERIFY_BLOCK]))
            pos += VERIFY_BLOCK
        if pos < n:
            partial = xxhash.xxh3_64()
            partial.update(part[pos:])
            filled = n - pos
    if partial is not None:
        out.append(partial.digest())
    return b"".join(out)


class _File:
    """An open entry file, closed when the last user lets go of it (never while one preads
    it, so its descriptor number cannot be reused under a reader)."""

    __slots__ = ("fd",)

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.close(self.fd)


class _Verified:
    """What a process knows of an entry it checked in full: its size and block digests."""

    __slots__ = ("size", "digests", "touched")

    def __init__(self, size: int, digests: bytes, touched: float) -> None:
        self.size = size
        self.digests = digests
        self.touched = touched


class SectorCache:
    """Sectors' uncompressed bytes on disk, keyed by checksum, LRU-bounded to ``max_bytes``."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError("cache max_bytes must be positive")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.metrics = CacheMetrics()
        self._dir = self.root / LAYOUT_VERSION
        self._old = self.root / OLD_LAYOUT_VERSION
        self._wip = self._dir / "wip"
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, int] = OrderedDict()  # checksum -> size, LRU first
        self._usage = 0
        self._pins: _Multiset[str] = _Multiset()
        self._verified: dict[str, _Verified] = {}  # entries checked in full by this process
        self._verifying: dict[str, threading.Event] = {}  # full checks in progress
        self._files: OrderedDict[str, _File] = OrderedDict()  # open entries, LRU first
        self._open_cap = open_file_cap()
        self._direct = True  # entries are written with O_DIRECT until the file system refuses
        self._buffers = threading.local()  # per writing thread: a page-aligned mmap
        try:
            self._wip.mkdir(parents=True, exist_ok=True)
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
        with self._lock:
            known = checksum in self._entries
            verified = self._verified.get(checksum)
        if not known and not self._adopt(checksum) and not self._migrate(checksum):
            self.metrics.misses.inc()
            return None
        if verified is None:
            return self._read_first(checksum, offset, length, size)
        if size is not None and verified.size != size:
            self.metrics.misses.inc()
            return None
        end = verified.size if length is None else min(verified.size, offset + length)
        if offset >= end:
            self._hit(checksum, verified)
            return b""
        lo = offset - offset % VERIFY_BLOCK
        hi = min(verified.size, -(-end // VERIFY_BLOCK) * VERIFY_BLOCK)
        try:
            file = self._open(checksum)
            data = os.pread(file.fd, hi - lo, lo)
        except OSError as e:  # evicted meanwhile, or removed behind our back
            return self._lost(checksum, e)
        expected = verified.digests[lo // VERIFY_BLOCK * 8 : -(-hi // VERIFY_BLOCK) * 8]
        if len(data) != hi - lo or block_digests(data) != expected:
            self._corrupt(checksum, file, f"blocks {lo}..{hi} changed since it was verified")
            return None
        self._hit(checksum, verified)
        if lo == offset and hi == end:
            return data
        return data[offset - lo : end - lo]

    def read_into(
        self, checksum: str, offset: int, out: memoryview, size: int | None = None
    ) -> bool:
        """Fill ``out`` with bytes ``[offset, offset+len(out))`` of the entry, verified: the
        FUSE file's read path, which hands in the buffer libfuse replies from, so that the
        bytes are read from disk straight into it and checked where they lie (no copy in
        between). Returns False on a miss, a corrupt entry, an entry whose size is not
        ``size`` (when given) or one too short for the range; ``out`` then holds garbage
        that must not be served."""
        check_checksum(checksum)
        length = len(out)
        if offset < 0:
            raise ValueError(f"invalid cache read: offset {offset}")
        with self._lock:
            known = checksum in self._entries
            verified = self._verified.get(checksum)
        if verified is None or not known:
            data = self.read(checksum, offset, length, size)
            if data is None or len(data) != length:
                return False
            out[:] = data
            return True
        end = offset + length
        if (size is not None and verified.size != size) or end > verified.size:
            self.metrics.misses.inc()
            return False
        if not length:
            self._hit(checksum, verified)
            return True
        # The 32 KiB blocks that cover the range are read in one preadv: the range itself
        # into ``out``, the parts of the first and last blocks outside it into scratch.
        lo = offset - offset % VERIFY_BLOCK
        hi = min(verified.size, -(-end // VERIFY_BLOCK) * VERIFY_BLOCK)
        parts: list[memoryview] = [out]
        if offset > lo:
            parts.insert(0, memoryview(bytearray(offset - lo)))
        if hi > end:
            parts.append(memoryview(bytearray(hi - end)))
        try:
            file = self._open(checksum)
            got = os.preadv(file.fd, parts, lo)
        except OSError as e:  # evicted meanwhile, or removed behind our back
            self._lost(checksum, e)
            return False
        expected = verified.digests[lo // VERIFY_BLOCK * 8 : -(-hi // VERIFY_BLOCK) * 8]
        if got != hi - lo or parts_digests(parts) != expected:
            self._corrupt(checksum, file, f"blocks {lo}..{hi} changed since it was verified")
            return False
        self._hit(checksum, verified)
        return True

    def will_need(self, checksum: str) -> None:
        """The entry will be read soon: verify it now if this process has not yet (which
        reads it all), else have the kernel start reading it from disk. Blocks for as long
        as that takes: call it off the data path."""
        with self._lock:
            verified = checksum in self._verified
        if not verified:
            self.read(checksum, 0, 0)
            return
        with contextlib.suppress(OSError, ValueError):
            file = self._open(check_checksum(checksum))
            os.posix_fadvise(file.fd, 0, 0, os.POSIX_FADV_WILLNEED)

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
        """Bytes held by entries."""
        with self._lock:
            return self._usage

    def entries(self) -> list[str]:
        """Checksums of all entries, least recently used first."""
        with self._lock:
            return list(self._entries)

    # --- writes ---------------------------------------------------------------------------

    def put(self, checksum: str, data: bytes, verified: bool = False) -> bool:
        """Store a sector's uncompressed bytes under its checksum. Bytes that do not hash
        to ``checksum`` are refused (this costs a hash, ~0.5 ms per 4 MiB, and keeps the
        block digests honest); ``verified``: the caller has just hashed these very bytes
        (``Index.decode_sector`` returned them), so they are not hashed again. Returns
        whether the entry is now cached; never raises for lack of room or a failing disk."""
        check_checksum(checksum)
        if not verified and xxhash.xxh3_128_hexdigest(data) != checksum:
            self.metrics.put_failures.inc()
            log.error("sector cache: bytes put as %s do not hash to it; not cached", checksum)
            return False
        size = len(data)
        with self._lock:
            if checksum in self._entries:
                self._touch(checksum)
                return True
            if not self._make_room(size):
                self.metrics.put_failures.inc()
                log.debug("sector cache: no room for %s (%d bytes), not cached", checksum, size)
                return False
        tmp = None
        for attempt in (1, 2):
            try:
                tmp = self._write_tmp(data)
                break
            except OSError as e:
                if e.errno not in _DISK_FULL or attempt == 2:
                    self.metrics.put_failures.inc()
                    log.warning("sector cache: cannot write %s: %s; not cached", checksum, e)
                    return False
                with self._lock:
                    freed = self._evict(size + ENOSPC_SLACK_BYTES)
                log.info("sector cache: disk full, evicted %d bytes and retrying", freed)
        assert tmp is not None
        digests = block_digests(data)
        path = self._path(checksum)
        with self._lock:
            if checksum in self._entries:  # another thread won the race
                _unlink(tmp)
                self._touch(checksum)
                return True
            try:
                path.parent.mkdir(exist_ok=True)
                os.replace(tmp, path)
            except OSError as e:
                _unlink(tmp)
                self.metrics.put_failures.inc()
                log.warning("sector cache: cannot install %s: %s; not cached", checksum, e)
                return False
            self._make_room(size)  # others may have filled the room since we checked
            self._entries[checksum] = size
            self._usage += size
            self._verified[checksum] = _Verified(size, digests, time.monotonic())
        self.metrics.puts.inc()
        return True

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
        with self._lock:
            if checksum in self._entries:
                self._forget(checksum)
                _unlink(self._path(checksum))

    def gc(self) -> int:
        """Reconcile with the directory (entries deleted or added behind our back, leftover
        temporary files, what is left of the ``v1`` layout) and evict down to
        ``max_bytes``. Returns the bytes evicted."""
        freed = 0
        if self._old.is_dir():
            freed += sum(size for _, size, _ in cache_entries(self.root, OLD_LAYOUT_VERSION))
            shutil.rmtree(self._old, ignore_errors=True)
        with self._lock:
            self._entries.clear()
            self._usage = 0
            self._load_locked()
            self._verified = {k: v for k, v in self._verified.items() if k in self._entries}
            return freed + self._evict(self._usage - self.max_bytes)

    def clear(self) -> None:
        """Remove every unpinned entry."""
        with self._lock:
            for checksum in [k for k in self._entries if k not in self._pins]:
                self._forget(checksum)
                _unlink(self._path(checksum))

    # --- internals ------------------------------------------------------------------------

    def _path(self, checksum: str) -> Path:
        return self._dir / checksum[:2] / checksum

    def _read_first(
        self, checksum: str, offset: int, length: int | None, size: int | None
    ) -> bytes | None:
        """A read of an entry this process has not verified yet: read all of it, check it
        against its name, record its block digests. One thread per entry does it; others
        wait for it and then read as usual."""
        while True:
            with self._lock:
                if checksum in self._verified:
                    break
                event = self._verifying.get(checksum)
                mine = event is None
                if mine:
                    event = self._verifying[checksum] = threading.Event()
            if mine:
                try:
                    return self._verify(checksum, offset, length, size)
                finally:
                    with self._lock:
                        self._verifying.pop(checksum).set()
            assert event is not None
            event.wait()  # then verified, or found corrupt or gone (and this one tries)
        return self.read(checksum, offset, length, size)

    def _verify(
        self, checksum: str, offset: int, length: int | None, want: int | None
    ) -> bytes | None:
        try:
            file = self._open(checksum)
            size = os.fstat(file.fd).st_size
            data = os.pread(file.fd, size, 0)
        except OSError as e:
            return self._lost(checksum, e)
        if xxhash.xxh3_128_hexdigest(data) != checksum:
            self._corrupt(checksum, file, "checksum mismatch")
            return None
        verified = _Verified(len(data), block_digests(data), 0.0)
        with self._lock:
            if checksum in self._entries:
                self._verified[checksum] = verified
        if want is not None and len(data) != want:
            self.metrics.misses.inc()
            return None
        self._hit(checksum, verified)
        end = len(data) if length is None else offset + length
        return data if offset == 0 and end >= len(data) else data[offset:end]

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
        file = _File(self._path(checksum))
        with self._lock:
            file = self._files.setdefault(checksum, file)
            while len(self._files) > self._open_cap:
                self._files.popitem(last=False)
        return file

    def _corrupt(self, checksum: str, file: _File, why: str) -> None:
        path = self._path(checksum)
        with self._lock:
            self.metrics.corrupt.inc()
            self.metrics.misses.inc()
            log.warning("sector cache: entry %s is corrupt (%s); deleted", path, why)
            # Delete only the file we read: a concurrent put may have replaced it.
            try:
                ours = os.stat(path).st_ino == os.fstat(file.fd).st_ino
            except OSError:
                ours = True  # already gone
            if ours:
                _unlink(path)
                self._forget(checksum)
            else:
                self._verified.pop(checksum, None)
                self._files.pop(checksum, None)

    def _migrate(self, checksum: str) -> bool:
        """Take over a ``v1`` (compressed) entry: check it, write it as ``v2``, remove it."""
        old = self._old / checksum[:2] / checksum
        try:
            stored = old.read_bytes()
        except OSError:
            return False
        data = decode_stored(stored, checksum)
        _unlink(old)
        if data is None:
            log.warning("sector cache: v1 entry %s is corrupt; deleted", old)
            return False
        return self.put(checksum, data)

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

    def _touch(self, checksum: str) -> None:
        """Mark an entry most recently used (in memory and in its mtime). Lock held."""
        self._entries.move_to_end(checksum)
        with contextlib.suppress(OSError):
            os.utime(self._path(checksum))

    def _forget(self, checksum: str) -> None:
        self._usage -= self._entries.pop(checksum, 0)
        self._verified.pop(checksum, None)
        self._files.pop(checksum, None)

    def _make_room(self, size: int) -> bool:
        """Evict until ``size`` more bytes fit under the cap. Lock held."""
        if size > self.max_bytes:
            return False
        self._evict(self._usage + size - self.max_bytes)
        return self._usage + size <= self.max_bytes

    def _evict(self, need: int) -> int:
        """Evict unpinned entries, oldest first, until ``need`` bytes are freed or nothing
        unpinned is left. Lock held. Returns the bytes freed."""
        freed = 0
        if need <= 0:
            return 0
        for checksum in list(self._entries):
            if freed >= need:
                break
            if self._pins[checksum] > 0:
                continue
            size = self._entries.pop(checksum)
            self._verified.pop(checksum, None)
            self._files.pop(checksum, None)
            self._usage -= size
            freed += size
            _unlink(self._path(checksum))
            self.metrics.evictions.inc()
        return freed

    def _write_tmp(self, data: bytes) -> Path:
        """Write ``data`` to a new file in ``wip/``; returns its path. Not fsynced: see the
        module's docstring."""
        fd, name = tempfile.mkstemp(dir=self._wip)
        try:
            if not self._write_direct(fd, data):
                with os.fdopen(fd, "wb", closefd=False) as f:
                    f.write(data)
        except BaseException:
            _unlink(Path(name))
            raise
        finally:
            os.close(fd)
        return Path(name)

    def _write_direct(self, fd: int, data: bytes) -> bool:
        """Write ``data`` to the new, empty file ``fd`` with O_DIRECT, through this thread's
        aligned buffer; False (nothing written) where that cannot be done."""
        size = len(data)
        if not self._direct or not size or size % DIRECT_IO_ALIGN:
            return False
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        except OSError as e:
            log.info("sector cache %s: no direct I/O (%s); writing through the page cache",
                     self._dir, e)  # fmt: skip
            self._direct = False
            return False
        buf: mmap.mmap | None = getattr(self._buffers, "buf", None)
        if buf is None or len(buf) < size:
            buf = self._buffers.buf = mmap.mmap(-1, size)
        view = memoryview(buf)
        try:
            view[:size] = data
            done = 0
            while done < size:
                written = os.write(fd, view[done:size])
                if written <= 0 or written % DIRECT_IO_ALIGN:
                    raise OSError(errno.EIO, f"short direct write ({written} bytes)")
                done += written
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            log.info("sector cache %s: direct write refused (%s); writing through the page "
                     "cache", self._dir, e)  # fmt: skip
            self._direct = False
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            return False
        finally:
            view.release()
        return True

    def _load(self) -> None:
        with self._lock:
            self._load_locked()
            freed = self._evict(self._usage - self.max_bytes)
        log.info(
            "sector cache %s: %d entries, %d bytes (evicted %d bytes over the cap)",
            self._dir,
            len(self._entries),
            self._usage,
            freed,
        )

    def _load_locked(self) -> None:
        """Rebuild the LRU state from the directory; remove stale temporary files. Lock
        held."""
        now = time.time()
        for f in self._wip.iterdir():
            with contextlib.suppress(OSError):
                if now - f.stat().st_mtime >= STALE_WIP_SECONDS:
                    f.unlink()
        found: list[tuple[float, str, int]] = []
        for sub in self._dir.iterdir():
            if sub.name == "wip" or not sub.is_dir():
                continue
            for f in sub.iterdir():
                name = f.name
                if len(name) != 32 or not _HEX.issuperset(name) or name[:2] != sub.name:
                    log.warning("sector cache: ignoring stray file %s", f)
                    continue
                try:
                    st = f.stat()
                except OSError:
                    continue
                found.append((max(st.st_mtime, st.st_atime), name, st.st_size))
        found.sort()
        for _, name, size in found:
            self._entries[name] = size
            self._usage += size


def open_file_cap() -> int:
    """How many entry files a cache keeps open: ``OPEN_FILES``, or a quarter of this
    process's descriptor limit if that is lower."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return OPEN_FILES
    return max(16, min(OPEN_FILES, soft // 4))


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


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
        if sub.name == "wip" or not sub.is_dir():
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


def cache_usage(root: os.PathLike[str] | str) -> tuple[int, int]:
    """(entries, bytes) in a cache directory, counted on disk (for status and metrics)."""
    entries = cache_entries(root)
    return len(entries), sum(size for _, size, _ in entries)
