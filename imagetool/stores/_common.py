"""Helpers shared by the store backends: argument checks and digest verification."""

from __future__ import annotations

import hashlib
from pathlib import Path

from imagetool.errors import DigestMismatchError, StoreError
from imagetool.format import PLATFORM_INDEX_MEDIA_TYPE, check_digest

# Read size when hashing or copying a local file.
COPY_CHUNK = 4 << 20


def check_range(where: str, offset: int, length: int, size: int | None = None) -> None:
    """Reject negative arguments, and (when the size is known) ranges past the end."""
    if offset < 0 or length < 0:
        raise StoreError(f"{where}: invalid range offset={offset} length={length}")
    if size is not None and offset + length > size:
        raise StoreError(
            f"{where}: range {offset}+{length} is past the end of the blob ({size} bytes)"
        )


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(COPY_CHUNK):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def verify_source(digest: str, source: Path | bytes, where: str) -> None:
    """Check that ``source`` hashes to ``digest`` before a backend makes it visible."""
    check_digest(digest)
    try:
        actual = (
            file_digest(source)
            if isinstance(source, Path)
            else "sha256:" + hashlib.sha256(source).hexdigest()
        )
    except OSError as e:
        raise StoreError(f"{where}: cannot read {source}: {e.strerror or e}") from None
    if actual != digest:
        raise DigestMismatchError(f"{where}: content hashes to {actual}, not {digest}")


def ref_line(digest: str, media_type: str = "") -> bytes:
    """A directory or S3 store's ref: the digest, then a platform index's media type."""
    return f"{digest} {media_type}\n".encode() if media_type else f"{digest}\n".encode()


def parse_ref_line(text: str, where: str) -> tuple[str, str]:
    """(digest, media type) of a ref (``ref_line``); ``StoreError`` if it is neither."""
    parts = text.split()
    try:
        digest = check_digest(parts[0] if parts else "")
    except ValueError:
        raise StoreError(f"{where} is corrupt") from None
    if len(parts) == 1:
        return digest, ""
    if len(parts) == 2 and parts[1] == PLATFORM_INDEX_MEDIA_TYPE:
        return digest, parts[1]
    raise StoreError(f"{where} is corrupt (or written by a newer imagetool)")
