"""The snapshotter exception tree. Every error the snapshotter raises derives from
``SnapshotterError``; each carries the errno the FUSE layer answers with.

    SnapshotterError                      errno EIO unless stated
    ├── FetchError                        sectors could not be fetched and verified
    │   ├── FetchTimeoutError             the read's total deadline passed first
    │   └── ClosedError                   the fetcher was closed while or before reading
    ├── CacheError                        the local sector cache directory is unusable
    ├── PullError                         ``snapshotter pull`` could not pull an image lazily
    └── InvalidReadError (ValueError)     a read with a negative offset or length (EINVAL)

Store and format errors (``imagetool.errors``) are caught at the fetcher and become
``FetchError`` with the original as ``__cause__``; errors become text (a log line, a status
field) only at the edges: the FUSE adapter and the CLI.
"""

from __future__ import annotations

import errno as _errno


class SnapshotterError(Exception):
    """Base class of every snapshotter error."""

    errno: int = _errno.EIO


class FetchError(SnapshotterError):
    """Sectors could not be fetched and verified (store down, refused, corrupt data)."""

    def __init__(self, message: str, sectors: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.sectors = sectors


class FetchTimeoutError(FetchError):
    """The read's total deadline passed before its sectors were fetched."""


class CacheError(SnapshotterError):
    """The local sector cache directory cannot be used."""


class PullError(SnapshotterError):
    """A lazy pull (``snapshotter pull``) failed: the image is not a block image, containerd
    is unreachable or refused a step, or the snapshotter did not mount a layer lazily."""


class InvalidReadError(SnapshotterError, ValueError):
    """A read with a negative offset or length."""

    errno = _errno.EINVAL


class ClosedError(FetchError):
    """The fetcher (or something built on it) has been closed."""
