"""The directory store, lazyblock's embedded default.

    ROOT/blobs/sha256/<hex>      content-addressed blobs (index and data blobs)
    ROOT/refs/<name>/<tag>       one line: the index digest that name:tag points to, or
                                 "<digest> <media type>" for a multi-platform image's
                                 platform index (``imagetool.format``)

Every file is written under a temporary name (``.tmp-*``) in its final directory, fsynced,
moved into place with ``os.replace`` and its directory fsynced, so a reader sees either
nothing or the complete file, and a crash leaves at most a stray temporary file. Blobs are
checked against their digest before they become visible. Ranged reads use ``os.pread``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from imagetool.errors import NotFoundError, StoreError
from imagetool.format import check_digest, index_media_type, sha256_digest
from imagetool.stores._common import (
    check_range,
    parse_ref_line,
    ref_line,
    verify_source,
)
from imagetool.stores.base import RangeBody, Store, check_publishable
from imagetool.stores.refs import check_name_component, check_tag

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"


class DirStore(Store):
    """One image name in a store directory (created on first write)."""

    def __init__(self, root: Path | str, name: str) -> None:
        self.root = Path(root)
        self.name = check_name_component(name)
        self.url = str(self.root)

    # --- paths ----------------------------------------------------------------------------

    def _blob_path(self, digest: str) -> Path:
        return self.root / "blobs" / "sha256" / check_digest(digest).removeprefix("sha256:")

    def _ref_dir(self) -> Path:
        return self.root / "refs" / self.name

    # --- blobs ----------------------------------------------------------------------------

    def has_blob(self, digest: str) -> bool:
        return self._blob_path(digest).is_file()

    def blob_size(self, digest: str) -> int:
        try:
            return self._blob_path(digest).stat().st_size
        except FileNotFoundError:
            raise NotFoundError(f"blob {digest} not found in {self.url}") from None
        except OSError as e:
            raise StoreError(f"{self.url}: cannot stat blob {digest}: {e.strerror}") from None

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        where = f"{self.url}: blob {digest}"
        fd = self._blob_fd(digest, where, offset, length)
        try:
            parts: list[bytes] = []
            done = 0
            while done < length:
                chunk = os.pread(fd, length - done, offset + done)
                if not chunk:
                    raise StoreError(f"{where}: short read at {offset + done}")
                parts.append(chunk)
                done += len(chunk)
            return b"".join(parts)
        except OSError as e:
            raise StoreError(f"{where}: read failed: {e.strerror}") from None
        finally:
            os.close(fd)

    def open_range(self, digest: str, offset: int, length: int) -> RangeBody:
        where = f"{self.url}: blob {digest}"
        return _FileBody(where, self._blob_fd(digest, where, offset, length), offset, length)

    def _blob_fd(self, digest: str, where: str, offset: int, length: int) -> int:
        """A descriptor of the blob, checked to hold ``[offset, offset+length)``."""
        check_range(where, offset, length)
        path = self._blob_path(digest)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise NotFoundError(f"blob {digest} not found in {self.url}") from None
        except OSError as e:
            raise StoreError(f"{where}: cannot open: {e.strerror}") from None
        try:
            check_range(where, offset, length, os.fstat(fd).st_size)
        except OSError as e:
            os.close(fd)
            raise StoreError(f"{where}: cannot stat: {e.strerror}") from None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def put_blob(self, digest: str, source: Path | bytes, media_type: str) -> None:
        final = self._blob_path(digest)
        if final.is_file():
            return
        where = f"{self.url}: blob {digest}"
        verify_source(digest, source, where)
        _mkdirs(final.parent, where)
        tmp = _tmp_name(final)
        try:
            if isinstance(source, Path):
                _link_or_copy(source, tmp)
            else:
                with open(tmp, "xb") as f:
                    f.write(source)
            # Hard links keep the source's mode; a copy gets a shareable one.
            if not isinstance(source, Path) or os.stat(tmp).st_nlink == 1:
                os.chmod(tmp, 0o644)
            _fsync_path(tmp)
            os.replace(tmp, final)
            _fsync_path(final.parent)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StoreError(f"{where}: write failed: {e.strerror or e}") from None
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        log.debug("stored blob %s (%s) in %s", digest, media_type, self.url)

    # --- tags -----------------------------------------------------------------------------

    def resolve(self, tag: str) -> str:
        return self.resolve_tag(tag)[0]

    def resolve_tag(self, tag: str) -> tuple[str, str]:
        check_tag(tag)
        path = self._ref_dir() / tag
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise NotFoundError(f"{self.name}:{tag} not found in {self.url}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise StoreError(
                f"{self.url}: cannot read ref {self.name}:{tag}: {getattr(e, 'strerror', e)}"
            ) from None
        return parse_ref_line(text, f"{self.url}: ref {self.name}:{tag}")

    def publish(self, tag: str, index_bytes: bytes) -> str:
        check_publishable(self, tag, index_bytes)
        digest = sha256_digest(index_bytes)
        self.put_blob(digest, index_bytes, index_media_type(index_bytes))
        self._write_ref(tag, digest, "")
        log.info("published %s:%s -> %s in %s", self.name, tag, digest, self.url)
        return digest

    def _write_ref(self, tag: str, digest: str, media_type: str) -> None:
        _atomic_write(self._ref_dir() / check_tag(tag), ref_line(digest, media_type),
                      f"{self.url}: ref")  # fmt: skip

    def list_tags(self) -> list[str]:
        try:
            names = os.listdir(self._ref_dir())
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StoreError(f"{self.url}: cannot list tags of {self.name}: {e.strerror}") from None
        return sorted(n for n in names if not n.startswith(TMP_PREFIX))


def _tmp_name(final: Path) -> Path:
    fd, name = tempfile.mkstemp(prefix=TMP_PREFIX, dir=final.parent)
    os.close(fd)
    os.unlink(name)  # only reserve a fresh name; the writer creates it exclusively
    return Path(name)


def _mkdirs(path: Path, where: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreError(f"{where}: cannot create {path}: {e.strerror}") from None


def _link_or_copy(source: Path, tmp: Path) -> None:
    """Hard-link ``source`` to ``tmp`` when on the same filesystem (no data copied, the source
    stays where it is); otherwise copy it."""
    try:
        os.link(source, tmp)
        return
    except OSError:
        pass
    with open(source, "rb") as src, open(tmp, "xb") as dst:
        shutil.copyfileobj(src, dst, 4 << 20)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(final: Path, data: bytes, where: str) -> None:
    _mkdirs(final.parent, where)
    tmp = _tmp_name(final)
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, final)
        _fsync_path(final.parent)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise StoreError(f"{where}: write of {final.name} failed: {e.strerror or e}") from None


class _FileBody(RangeBody):
    """A range of a blob file, read with ``preadv`` straight into the caller's buffers."""

    def __init__(self, where: str, fd: int, offset: int, length: int) -> None:
        super().__init__(where, length)
        self._fd = fd
        self._offset = offset

    def _read_some(self, out: memoryview) -> int:
        try:
            return os.preadv(self._fd, [out], self._offset + self.position)
        except OSError as e:
            raise StoreError(f"{self.where}: read failed: {e.strerror}") from None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
