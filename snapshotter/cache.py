"""The node's local sector cache: verified sectors on disk, shared by every mount and image.

An entry is one sector's *stored* (zstd-compressed) bytes, exactly as they sit in a data
blob, named by the xxh3-128 checksum of the sector's *uncompressed* bytes. Naming by content
means two images (or two tags of one image) that share a sector share its cache entry, and an
entry can be checked on its own: decompress, hash, compare with the name. A cache entry that
fails that check is a logged miss and is deleted; it is never returned.

Layout under ``root`` (the version lets a later layout live beside this one)::

    v1/wip/<random>             entries being written (removed on open)
    v1/<cc>/<checksum>          one entry; <cc> is the checksum's first two hex digits

Writes go to ``wip/``, are fsynced, then renamed into place, so a crash leaves either the
whole entry or none (the directory is not fsynced: losing a fresh entry in a crash only costs
a refetch). The cache is bounded to ``max_bytes`` of entry bytes with least-recently-used
eviction; the recency clock is the entry file's mtime, set on every hit, so the order
survives restarts: opening a cache rebuilds its state from the directory. Entries *pinned*
by an in-progress read are never evicted. Caching is best effort: when the disk is full a put
evicts and retries once, and if the entry still cannot be written it is dropped (``put``
returns False) — the read that produced it succeeds regardless.

Several processes may share one directory (the node runs a mount server per mount): an
entry another process wrote is found on disk and adopted, one it evicted is a miss, and each
process enforces the cap over the entries it knows (``gc()``, and every open, trims the
directory as a whole). Within a process every method is thread-safe.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import tempfile
import threading
import time
from collections import Counter as _Multiset
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path

from imagetool.errors import ChecksumError
from imagetool.format import decode_stored as format_decode_stored
from snapshotter.errors import CacheError
from snapshotter.metrics import CacheMetrics

log = logging.getLogger(__name__)

LAYOUT_VERSION = "v1"
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
    a cache entry is checked against its own name."""
    try:
        return format_decode_stored(stored, checksum)
    except ChecksumError:
        return None


class SectorCache:
    """Sectors' stored bytes on disk, keyed by checksum, LRU-bounded to ``max_bytes``."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError("cache max_bytes must be positive")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.metrics = CacheMetrics()
        self._dir = self.root / LAYOUT_VERSION
        self._wip = self._dir / "wip"
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, int] = OrderedDict()  # checksum -> size, LRU first
        self._usage = 0
        self._pins: _Multiset[str] = _Multiset()
        try:
            self._wip.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheError(f"cannot create sector cache at {self._dir}: {e}") from e
        self._load()

    # --- lookups --------------------------------------------------------------------------

    def get(self, checksum: str) -> bytes | None:
        """The entry's stored bytes, verified; None on a miss (or a corrupt entry)."""
        found = self._read_verified(checksum)
        return found[0] if found else None

    def get_decoded(self, checksum: str) -> bytes | None:
        """The entry's *uncompressed* bytes, verified; None on a miss (or a corrupt entry).

        The verification already decompresses, so readers that want the sector's bytes use
        this and save a second decompression.
        """
        found = self._read_verified(checksum)
        return found[1] if found else None

    def __contains__(self, checksum: object) -> bool:
        with self._lock:
            if checksum in self._entries:
                return True
        return isinstance(checksum, str) and self._adopt(checksum)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def usage(self) -> int:
        """Bytes held by entries."""
        with self._lock:
            return self._usage

    def entries(self) -> list[str]:
        """Checksums of all entries, least recently used first."""
        with self._lock:
            return list(self._entries)

    # --- writes ---------------------------------------------------------------------------

    def put(self, checksum: str, stored: bytes) -> bool:
        """Store a sector's stored bytes under its checksum. The caller has verified them
        (``Index.decode_sector``). Returns whether the entry is now cached; never raises for
        lack of room or a failing disk."""
        check_checksum(checksum)
        size = len(stored)
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
                tmp = self._write_tmp(stored)
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
        temporary files) and evict down to ``max_bytes``. Returns the bytes evicted."""
        with self._lock:
            self._entries.clear()
            self._usage = 0
            self._load_locked()
            return self._evict(self._usage - self.max_bytes)

    def clear(self) -> None:
        """Remove every unpinned entry."""
        with self._lock:
            for checksum in [k for k in self._entries if k not in self._pins]:
                self._forget(checksum)
                _unlink(self._path(checksum))

    # --- internals ------------------------------------------------------------------------

    def _path(self, checksum: str) -> Path:
        return self._dir / checksum[:2] / checksum

    def _read_verified(self, checksum: str) -> tuple[bytes, bytes] | None:
        check_checksum(checksum)
        with self._lock:
            known = checksum in self._entries
        if not known and not self._adopt(checksum):
            self.metrics.misses.inc()
            return None
        path = self._path(checksum)
        try:
            with open(path, "rb") as f:
                stored = f.read()
                ino = os.fstat(f.fileno()).st_ino
        except OSError as e:  # evicted meanwhile, or removed behind our back
            with self._lock:
                self._forget(checksum)
            self.metrics.misses.inc()
            log.debug("sector cache: %s unreadable (%s), treated as a miss", checksum, e)
            return None
        data = decode_stored(stored, checksum)
        with self._lock:
            if data is None:
                self.metrics.corrupt.inc()
                self.metrics.misses.inc()
                log.warning("sector cache: entry %s is corrupt; deleted", path)
                # Delete only the file we read: a concurrent put may have replaced it.
                try:
                    ours = os.stat(path).st_ino == ino
                except OSError:
                    ours = True  # already gone
                if ours:
                    _unlink(path)
                    self._forget(checksum)
                return None
            if checksum in self._entries:
                self._touch(checksum)
        self.metrics.hits.inc()
        return stored, data

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
            self._usage -= size
            freed += size
            _unlink(self._path(checksum))
            self.metrics.evictions.inc()
        return freed

    def _write_tmp(self, stored: bytes) -> Path:
        """Write ``stored`` to a new file in ``wip/`` and fsync it; returns its path."""
        fd, name = tempfile.mkstemp(dir=self._wip)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(stored)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            _unlink(Path(name))
            raise
        return Path(name)

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


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def cache_entries(root: os.PathLike[str] | str) -> list[tuple[str, int, float]]:
    """(checksum, bytes, last use) of every entry in a cache directory, least recently used
    first, read from disk without loading (or trimming) the cache."""
    out = []
    try:
        subs = list(os.scandir(os.path.join(root, LAYOUT_VERSION)))
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
