"""The bytes a cache directory holds, counted once for every process that shares it.

A node runs a mount server per mount, each with its own ``SectorCache`` on the same
directory, and the cap holds for the directory as a whole: every process adds what it
writes to, and takes what it deletes from, one counter kept in a file (``SharedUsage``)
under ``flock``. Holding that lock is also how a process makes "make room, install, count"
one step against the others.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
from pathlib import Path

import xxhash

_RECORD = struct.Struct("<qQ")  # count, xxh3-64 of the count's 8 bytes


class SharedUsage:
    """The bytes of entry files in a cache directory, as one counter in a file that every
    process sharing the directory updates under ``flock``. A process that dies between a
    write and its update, or counts an entry another one also counted, leaves it off by that
    much until the next rescan (``set``).

    The file holds the count and a hash of it. One that does not (cut short, damaged, just
    created, or written by an older version) reads as unknown (None): updates leave it
    unknown, and the cache rescans the directory, which sets it again."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._lock = threading.RLock()  # flock excludes other processes, not other threads
        self._depth = 0
        self._owner: int | None = None  # the thread holding it

    def add(self, delta: int) -> int | None:
        """Add ``delta`` (negative: bytes deleted); returns the new total (None: unknown)."""
        with self.held():
            total = self._read()
            if total is None:
                return None
            total = max(0, total + delta)
            self._write(total)
            return total

    def set(self, total: int) -> None:
        with self.held():
            self._write(total)

    def get(self) -> int | None:
        with self.held():
            return self._read()

    def _read(self) -> int | None:
        # One byte more than a record: a longer file is damaged too (as ``shared_usage``).
        return usage_record(os.pread(self._fd, _RECORD.size + 1, 0))

    def _write(self, total: int) -> None:
        os.pwrite(self._fd, usage_bytes(total), 0)

    def held(self) -> SharedUsage:
        """Hold the counter against every other process and thread (re-entrant): what is
        checked against it and counted in it within stays consistent. A ``with``."""
        return self

    def __enter__(self) -> SharedUsage:
        self._lock.acquire()
        if self._depth == 0:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            except BaseException:
                self._lock.release()
                raise
            self._owner = threading.get_ident()
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        try:
            if self._depth == 0:
                self._owner = None
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._lock.release()

    def owned(self) -> bool:
        """Whether the calling thread holds the counter."""
        return self._owner == threading.get_ident()

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.close(self._fd)


def usage_bytes(total: int) -> bytes:
    """A usage counter file's bytes for ``total`` (what ``usage_record`` reads)."""
    check = xxhash.xxh3_64_intdigest(struct.pack("<q", total))
    return _RECORD.pack(total, check)


def usage_record(raw: bytes) -> int | None:
    """The count in a usage counter file's bytes; None if they are not a whole, intact
    record."""
    if len(raw) != _RECORD.size:
        return None
    total, check = _RECORD.unpack(raw)
    return total if check == xxhash.xxh3_64_intdigest(raw[:8]) and total >= 0 else None


def read_usage(path: os.PathLike[str] | str) -> int | None:
    """The count in the counter file ``path``, read without taking its lock (for status and
    metrics); None when it is unknown or the file cannot be read."""
    try:
        with open(path, "rb") as f:
            return usage_record(f.read(_RECORD.size + 1))
    except OSError:
        return None
