"""Layer streams: a stored layer blob in, its uncompressed tar bytes out, verified on the way.

``LayerStream`` reads the blob in small chunks (memory stays bounded however large the layer
is), finds its compression from the magic bytes, and hashes both the stored bytes and the
uncompressed bytes as they pass. When the consumer reaches the end it checks the blob digest
and size and the diff_id; a stored blob longer than its descriptor says is refused as soon as
the excess arrives. Corrupt or truncated gzip/zstd is an ``InvalidSourceError``.

zstd output goes through ``zstandard``'s stream reader, which bounds memory but does not
report a stream that ends mid-frame, so ``_ZstdFrames`` walks the frame structure of the
stored bytes alongside it (headers and block sizes only) to tell truncation from a clean end.
"""

from __future__ import annotations

import hashlib
import io
import logging
import zlib
from typing import BinaryIO

import zstandard

from imagetool.errors import DigestMismatchError, InvalidSourceError

log = logging.getLogger(__name__)

# Read size for stored bytes, and the most a single read() hands out: small enough that a
# 20 GB layer streams in bounded memory, big enough that per-call overhead is negligible.
CHUNK = 256 << 10
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
HASH_ALGORITHMS = ("sha256", "sha512")


def detect_compression(head: bytes) -> str | None:
    """ "gzip", "zstd" or None (anything else is taken to be a plain tar)."""
    if head.startswith(GZIP_MAGIC):
        return "gzip"
    if head.startswith(ZSTD_MAGIC):
        return "zstd"
    return None


def new_hasher(digest: str, what: str) -> hashlib._Hash:
    algo = digest.partition(":")[0]
    if algo not in HASH_ALGORITHMS:
        raise InvalidSourceError(f"{what}: unsupported digest algorithm in {digest!r}")
    return hashlib.new(algo)


def digest_of(hasher: hashlib._Hash) -> str:
    return f"{hasher.name}:{hasher.hexdigest()}"


class _ZstdFrames:
    """Follows zstd frame boundaries in a byte stream fed in arbitrary pieces.

    Only framing is read (RFC 8878 section 3.1): frame headers, block headers, optional
    checksums, skippable frames. ``complete`` is true between frames.
    """

    def __init__(self) -> None:
        self._skip = 0  # bytes to pass over (block content, header fields, checksum)
        self._need = 4  # bytes to collect into _buf before _step()
        self._buf = b""
        self._state = "magic"
        self._checksum = False
        self.frames = 0

    @property
    def complete(self) -> bool:
        return self._state == "magic" and not self._buf and self._skip == 0 and self.frames > 0

    def feed(self, data: bytes) -> None:
        pos, end = 0, len(data)
        while pos < end:
            if self._skip:
                n = min(self._skip, end - pos)
                self._skip -= n
                pos += n
                continue
            take = min(self._need - len(self._buf), end - pos)
            self._buf += data[pos : pos + take]
            pos += take
            if len(self._buf) == self._need:
                buf, self._buf = self._buf, b""
                self._step(buf)

    def _step(self, buf: bytes) -> None:
        if self._state == "magic":
            magic = int.from_bytes(buf, "little")
            if magic == 0xFD2FB528:
                self._state, self._need = "fhd", 1
            elif magic & 0xFFFFFFF0 == 0x184D2A50:
                self._state, self._need = "skippable", 4
            else:
                raise ValueError("not a zstd frame")
        elif self._state == "skippable":
            self._skip = int.from_bytes(buf, "little")
            self._state, self._need = "magic", 4
            self.frames += 1
        elif self._state == "fhd":
            fhd = buf[0]
            fcs_flag, single, dict_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
            self._checksum = bool((fhd >> 2) & 1)
            fcs = (1 if single else 0, 2, 4, 8)[fcs_flag]
            self._skip = (0 if single else 1) + (0, 1, 2, 4)[dict_flag] + fcs
            self._state, self._need = "block", 3
        elif self._state == "block":
            header = int.from_bytes(buf, "little")
            last, kind, size = header & 1, (header >> 1) & 3, header >> 3
            if kind == 3:
                raise ValueError("reserved zstd block type")
            self._skip = 1 if kind == 1 else size
            if last:
                self.frames += 1
                self._skip += 4 if self._checksum else 0
                self._state, self._need = "magic", 4


class _Source:
    """The stored blob: hashes, counts and size-checks every byte read from it."""

    def __init__(self, raw: BinaryIO, digest: str, size: int, what: str) -> None:
        self._raw = raw
        self._what = what
        self.size = size
        self.count = 0
        self.hasher = new_hasher(digest, what)
        self.frames: _ZstdFrames | None = None
        self._head = b""
        while len(self._head) < 4:
            data = self._read_raw(CHUNK)
            if not data:
                break
            self._head += data

    @property
    def head(self) -> bytes:
        return self._head

    def _read_raw(self, n: int) -> bytes:
        try:
            data = self._raw.read(n)
        except OSError as e:
            raise InvalidSourceError(f"{self._what}: cannot read blob: {e}") from e
        if data:
            self.count += len(data)
            if self.count > self.size:
                raise DigestMismatchError(
                    f"{self._what}: blob is larger than the {self.size} bytes its descriptor says"
                )
            self.hasher.update(data)
        return data

    def read(self, n: int = -1) -> bytes:
        if self._head:
            cut = len(self._head) if n is None or n < 0 else max(1, n)
            data, self._head = self._head[:cut], self._head[cut:]
        else:
            data = self._read_raw(CHUNK if n is None or n < 0 else max(1, n))
        if data and self.frames is not None:
            try:
                self.frames.feed(data)
            except ValueError as e:
                raise InvalidSourceError(f"{self._what}: corrupt zstd data ({e})") from None
        return data

    def readinto(self, b: memoryview) -> int:  # for zstandard's stream_reader
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


class LayerStream(io.RawIOBase):
    """The uncompressed tar byte stream of one layer (see the module docstring)."""

    def __init__(
        self,
        raw: BinaryIO,
        *,
        digest: str,
        size: int,
        diff_id: str | None,
        compression: str | None,
        what: str,
    ) -> None:
        """``compression`` is what the media type announces; ``what`` names the layer in
        errors (one line, e.g. "layer 2/5 sha256:ab12... of oci:/srv/img")."""
        super().__init__()
        self._what = what
        self._digest = digest
        self._diff_id = diff_id
        self._src = _Source(raw, digest, size, what)
        found = detect_compression(self._src.head)
        if found != compression:
            raise InvalidSourceError(
                f"{what}: media type says {compression or 'uncompressed'} but the data is "
                f"{found or 'not gzip or zstd'}"
            )
        self.compression = found
        self._tar_hasher = new_hasher(diff_id, what) if diff_id else hashlib.sha256()
        # A plain tar's blob *is* the uncompressed stream: hash it once, not twice.
        self._tar_is_blob = found is None and self._tar_hasher.name == self._src.hasher.name
        self._eof = False
        self._gzip: zlib._Decompress | None = None
        self._gzip_full = False  # last gzip call stopped at max_length: output may be pending
        self._zstd = None
        if found == "gzip":
            self._gzip = zlib.decompressobj(wbits=31)
        elif found == "zstd":
            self._src.frames = _ZstdFrames()
            self._zstd = zstandard.ZstdDecompressor().stream_reader(
                self._src, read_size=CHUNK, read_across_frames=True
            )

    # --- io.RawIOBase ---------------------------------------------------------------------

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        data = self.read(len(b))
        n = len(data)
        memoryview(b).cast("B")[:n] = data
        return n

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` uncompressed bytes (all the rest when ``n < 0``); b"" at the end, once
        the digests have been checked."""
        if n is None or n < 0:
            return self.readall()
        if self._eof or n == 0:
            return b""
        if self._gzip is not None:
            data = self._read_gzip(n)
        elif self._zstd is not None:
            data = self._read_zstd(n)
        else:
            data = self._src.read(n)
        if data:
            if not self._tar_is_blob:
                self._tar_hasher.update(data)
        else:
            self._finish()
        return data

    def readall(self) -> bytes:
        parts = []
        while data := self.read(CHUNK):
            parts.append(data)
        return b"".join(parts)

    def drain(self) -> None:
        """Read (and verify) whatever the consumer left unread."""
        while self.read(CHUNK):
            pass

    @property
    def verified(self) -> bool:
        return self._eof

    # --- decompression --------------------------------------------------------------------

    def _read_gzip(self, n: int) -> bytes:
        dec = self._gzip
        assert dec is not None
        while True:
            if dec.eof:
                data = dec.unused_data
                while len(data) < 2:
                    more = self._src.read(CHUNK)
                    if not more:
                        break
                    data += more
                if not data:
                    return b""
                if not data.startswith(GZIP_MAGIC):
                    raise InvalidSourceError(f"{self._what}: unexpected data after gzip stream")
                dec = self._gzip = zlib.decompressobj(wbits=31)  # next gzip member
            elif dec.unconsumed_tail or self._gzip_full:
                data = dec.unconsumed_tail
            else:
                data = self._src.read(CHUNK)
                if not data:
                    raise InvalidSourceError(f"{self._what}: truncated gzip data")
            try:
                out = dec.decompress(data, n)
            except zlib.error as e:
                raise InvalidSourceError(f"{self._what}: corrupt gzip data ({e})") from None
            self._gzip_full = len(out) == n
            if out:
                return out

    def _read_zstd(self, n: int) -> bytes:
        assert self._zstd is not None and self._src.frames is not None
        try:
            out = self._zstd.read(n)
        except zstandard.ZstdError as e:
            raise InvalidSourceError(f"{self._what}: corrupt zstd data ({e})") from None
        if not out:
            if self._src.read(CHUNK):
                raise InvalidSourceError(f"{self._what}: unexpected data after zstd stream")
            if not self._src.frames.complete:
                raise InvalidSourceError(f"{self._what}: truncated zstd data")
        return out

    # --- verification ---------------------------------------------------------------------

    def _finish(self) -> None:
        # Whatever is left of the blob (a gzip trailer's neighbours, padding) must be read
        # for the digest; a decompressor at its end leaves nothing but this.
        while self._src.read(CHUNK):
            if self.compression is not None:
                raise InvalidSourceError(f"{self._what}: unexpected data after compressed stream")
        got = digest_of(self._src.hasher)
        if self._src.count != self._src.size or got != self._digest:
            raise DigestMismatchError(
                f"{self._what}: blob does not match its digest ({self._src.count} bytes, {got})"
            )
        if self._diff_id is not None:
            got = digest_of(self._src.hasher if self._tar_is_blob else self._tar_hasher)
            if got != self._diff_id:
                raise DigestMismatchError(
                    f"{self._what}: uncompressed content does not match diff_id {self._diff_id} "
                    f"(got {got})"
                )
        self._eof = True
        log.debug("%s: verified %d stored bytes", self._what, self._src.count)
