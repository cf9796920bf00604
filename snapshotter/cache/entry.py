"""One sector cache entry on disk: the file layout (``v3``), its trailer and its checks.

This module is the cache's own format; ``snapshotter.cache.sectors`` (the cache) and every
reader of entry files use it, nothing else lays them out. An entry file is::

    [sector bytes][zeros to a 4 KiB boundary][trailer, ending on a 4 KiB boundary]
    trailer = xxh3-64 of each VERIFY_BLOCK of the sector bytes, zeros, then the footer
    footer  = magic, layout version, block size, sector bytes, trailer bytes,
              the entry's checksum (its name), xxh3-64 of the trailer before this field

The sector bytes are uncompressed and hash (xxh3-128) to the entry's name. The trailer lets
a process that first uses an entry check one page (its footer and digests) instead of
hashing all 4 MiB, and then check each read against the digests of the blocks it covers.
Everything is laid out in ``ALIGN`` units, so entries are written and read with direct I/O.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import xxhash

from imagetool.format import block_digests as format_block_digests

# Granularity of the checks: a read checks the blocks that cover it, so it reads at most
# two blocks' worth more than it was asked for (a 128 KiB read ~140 KiB), and a digest costs
# 8 bytes a block, 2 KiB per 4 MiB sector in the trailer and in the memory of each process
# using the entry. Entries written with another block size (the trailer says which) are read
# as they are.
VERIFY_BLOCK = 16 << 10
# Entry files are laid out, written and read in units of this (the page size, a multiple of
# every disk's logical block size): direct I/O needs offsets, lengths and buffers aligned.
ALIGN = 4096
MAGIC = b"LZBKSECT"
TRAILER_VERSION = 3
# magic, version, block size, sector bytes, trailer bytes, checksum (raw), xxh3-64 of the rest
FOOTER = struct.Struct("<8sIIQQ16sQ")
_HEX = frozenset("0123456789abcdef")


def check_checksum(checksum: str) -> str:
    """Validate a sector checksum (32 lowercase hex digits) used as a cache key."""
    if not isinstance(checksum, str) or len(checksum) != 32 or not _HEX.issuperset(checksum):
        raise ValueError(f"invalid sector checksum {checksum!r}")
    return checksum


def is_checksum(name: str) -> bool:
    """Whether ``name`` is an entry's name (32 lowercase hex digits)."""
    return len(name) == 32 and _HEX.issuperset(name)


def block_digests(data: bytes | memoryview, block: int = VERIFY_BLOCK) -> bytes:
    """xxh3-64 of each ``block``-byte block of ``data``, concatenated."""
    return format_block_digests(data, block)


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def entry_trailer(checksum: str, size: int, digests: bytes, block: int = VERIFY_BLOCK) -> bytes:
    """The trailer of the entry ``checksum`` whose ``size`` sector bytes have these block
    digests: the digests, zeros, and the footer, ending on an ``ALIGN`` boundary."""
    length = aligned(len(digests) + FOOTER.size)
    head = digests + bytes(length - len(digests) - FOOTER.size)
    footer = FOOTER.pack(MAGIC, TRAILER_VERSION, block, size, length, bytes.fromhex(checksum), 0)
    body = head + footer[:-8]
    return body + xxhash.xxh3_64_digest(body)


def entry_file_size(size: int, block: int = VERIFY_BLOCK) -> int:
    """Bytes on disk of the entry of a ``size``-byte sector (what counts against the cap)."""
    return aligned(size) + aligned(-(-size // block) * 8 + FOOTER.size)


# A bytearray whose bytes are not zeroed first (``bytearray(n)`` writes n zeros; the sector
# bytes are about to be written over them anyway).
_new_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize
_new_bytearray.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
_new_bytearray.restype = ctypes.py_object


class EntryBuffer:
    """Memory laid out as a cache entry: ``data`` (``size`` sector bytes, to be filled by
    the caller) starts on an ``ALIGN`` boundary and the rest of the entry fits after it, so
    ``SectorCache.put`` writes the entry from here with direct I/O, where other bytes are
    first copied into an aligned buffer (a copy of every fetched sector). Freed with the
    last reference to ``data`` (or to a view of it)."""

    __slots__ = ("size", "data", "digests", "_entry")

    def __init__(self, size: int) -> None:
        total = entry_file_size(size)
        raw = _new_bytearray(None, total + ALIGN)
        start = -ctypes.addressof(ctypes.c_char.from_buffer(raw)) % ALIGN
        self.size = size
        # The ``VERIFY_BLOCK`` digests of ``data``, where whoever filled it hashed them.
        self.digests: bytes | None = None
        self._entry = memoryview(raw)[start : start + total]
        self.data = self._entry[:size]

    def entry(self, trailer: bytes) -> memoryview:
        """The whole entry: the sector bytes, zeros to an ``ALIGN`` boundary, ``trailer``."""
        start = aligned(self.size)
        total = start + len(trailer)
        if total != len(self._entry):
            raise ValueError(f"trailer of {len(trailer)} bytes for a {self.size}-byte entry")
        self._entry[self.size : start] = bytes(start - self.size)
        self._entry[start:total] = trailer
        return self._entry


@dataclass(frozen=True, slots=True)
class Footer:
    """An entry's footer, as read from the last ``ALIGN`` bytes of its file."""

    block: int  # bytes per verified block
    size: int  # sector bytes
    length: int  # trailer bytes, footer included
    name: str  # the checksum it says the entry has

    def fits(self, file_size: int) -> bool:
        """Whether the file's size is what this footer describes."""
        return self.length % ALIGN == 0 and aligned(self.size) + self.length == file_size


def read_footer(last_page: bytes) -> Footer | None:
    """The footer at the end of an entry file's last ``ALIGN`` bytes; None if there is no
    footer of this layout there."""
    magic, version, block, size, length, name, _ = FOOTER.unpack_from(
        last_page, len(last_page) - FOOTER.size
    )
    if magic != MAGIC or version != TRAILER_VERSION:
        return None
    return Footer(block, size, length, name.hex())


def trailer_digests(footer: Footer, trailer: bytes, file_size: int, checksum: str) -> bytes | str:
    """The block digests of the entry ``checksum`` from its whole ``trailer`` (the file's
    last ``footer.length`` bytes), or why the entry cannot be trusted."""
    block, size, length = footer.block, footer.size, footer.length
    count = -(-size // block) if block > 0 else -1
    if (
        not footer.fits(file_size)
        or block <= 0
        or block % ALIGN
        or count * 8 + FOOTER.size > length
    ):
        return f"trailer does not fit the file ({size} + {length} bytes of {file_size})"
    if len(trailer) != length or xxhash.xxh3_64_digest(trailer[:-8]) != trailer[-8:]:
        return "trailer checksum mismatch"
    if footer.name != checksum:
        return f"it is entry {footer.name}"
    return bytes(trailer[: count * 8])
