"""Image indexes kept on the node by digest, so that mounting an image again fetches no index.

An index is content-addressed (the store names it by the sha256 of its bytes), so a copy is
as good as the original *once its bytes are checked against the digest*, which ``load``
does every time: a damaged, truncated or replaced entry is a logged miss, deleted, and the
index is fetched again. Nothing here is trusted for being on disk.

Layout, beside the sector cache's (``snapshotter.cache.sectors``) in the node's cache directory::

    indexes/sha256-<hex>     the index bytes
    indexes/.tmp-*           being written (renamed into place, so readers see all or none)

At most ``MAX_ENTRIES`` indexes are kept; saving one more removes the least recently used
(an entry's mtime is refreshed when it is used). Caching is best effort: a failure to read or
write an entry costs a fetch, never a mount.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

DIRECTORY = "indexes"
# Indexes kept: a node runs some tens of images; an index is kilobytes to a few megabytes.
MAX_ENTRIES = 256


def _path(cache_dir: Path, digest: str) -> Path | None:
    algorithm, _, hexdigest = digest.partition(":")
    if algorithm != "sha256" or len(hexdigest) != 64 or not _is_hex(hexdigest):
        return None
    return Path(cache_dir) / DIRECTORY / f"sha256-{hexdigest}"


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def load(cache_dir: Path, digest: str) -> bytes | None:
    """The index with ``digest`` if a copy on disk hashes to it, else None."""
    path = _path(cache_dir, digest)
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("cannot read cached index %s: %s", path, e)
        return None
    if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
        log.warning("cached index %s does not match its digest; removing it", path)
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    with contextlib.suppress(OSError):
        os.utime(path)
    return data


def save(cache_dir: Path, digest: str, data: bytes) -> None:
    """Keep ``data`` (which the caller verified hashes to ``digest``) for later mounts."""
    path = _path(cache_dir, digest)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _trim(path.parent)
    except OSError as e:
        log.warning("cannot keep index %s in %s: %s", digest, cache_dir, e)


def _trim(directory: Path) -> None:
    entries = []
    for entry in os.scandir(directory):
        if entry.name.startswith("sha256-"):
            with contextlib.suppress(OSError):
                entries.append((entry.stat().st_mtime_ns, entry.path))
    entries.sort()
    for _, path in entries[: max(0, len(entries) - MAX_ENTRIES)]:
        with contextlib.suppress(OSError):
            os.unlink(path)
