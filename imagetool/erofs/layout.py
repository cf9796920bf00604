"""The EROFS on-disk layout: constants, ``struct.Struct`` layouts and small codecs.

This module is the single definition of the EROFS on-disk format inside lazyblock; the writer
(``imagetool.erofs.writer``) and the reader (``imagetool.erofs.reader``) both import it. It
holds no reader or writer logic, only facts about the format (all integers little-endian):

* The superblock sits at byte ``SUPERBLOCK_OFFSET`` (1024) of block 0.
* Inodes live in the metadata area: inode ``nid`` is at ``meta_blkaddr * block_size + nid * 32``.
  A compact inode is 32 bytes, an extended one 64; both are followed by the inline xattrs
  (``xattr_ibody_size``) and, for ``FLAT_INLINE``, the tail of the data ("tail packing"), which
  must not cross a block boundary. ``CHUNK_BASED`` inodes are followed by a chunk table
  (4-byte block addresses, or 8-byte chunk indexes), aligned to its entry size.
* Directory data is a sequence of blocks; each block starts with an array of 12-byte dirents,
  then their names (not NUL-terminated; the last name of a block may be NUL-padded). The first
  dirent's ``nameoff`` divided by 12 is the number of dirents in the block. Entries are sorted
  by name bytes across the whole directory (``.`` and ``..`` included), so lookups can binary
  search.
* Shared xattrs are at ``xattr_blkaddr * block_size + id * 4``.

Facts were checked against Linux ``fs/erofs/erofs_fs.h`` and erofs-utils ``include/erofs_fs.h``.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

# --- superblock --------------------------------------------------------------------------------

SUPERBLOCK_OFFSET = 1024  # leaves room for x86 boot sectors and the like
MAGIC = 0xE0F5E1E2  # EROFS_SUPER_MAGIC_V1
SUPERBLOCK_SIZE = 128  # base size; sb_extslots adds 16 bytes each
SB_EXTSLOT_SIZE = 16

# The kernel mounts block sizes from 512 bytes up to its page size; lazyblock writes 4096.
MIN_BLKSZBITS = 9
MAX_BLKSZBITS = 16
DEFAULT_BLKSZBITS = 12
DEFAULT_BLOCK_SIZE = 1 << DEFAULT_BLKSZBITS

FEATURE_COMPAT_SB_CHKSUM = 0x0001  # crc32c of the superblock block, see superblock_checksum()
FEATURE_COMPAT_MTIME = 0x0002  # per-inode mtimes are meaningful
FEATURE_COMPAT_XATTR_FILTER = 0x0004  # xattr ibody header h_name_filter bloom filter
FEATURE_COMPAT_PLAIN_XATTR_PFX = 0x0010

FEATURE_INCOMPAT_ZERO_PADDING = 0x0001  # (compressed) lz4 0-padding
FEATURE_INCOMPAT_COMPR_CFGS = 0x0002
FEATURE_INCOMPAT_BIG_PCLUSTER = 0x0002
FEATURE_INCOMPAT_CHUNKED_FILE = 0x0004  # CHUNK_BASED inodes present
FEATURE_INCOMPAT_DEVICE_TABLE = 0x0008  # extra devices (blob devices)
FEATURE_INCOMPAT_COMPR_HEAD2 = 0x0008
FEATURE_INCOMPAT_ZTAILPACKING = 0x0010
FEATURE_INCOMPAT_FRAGMENTS = 0x0020
FEATURE_INCOMPAT_DEDUPE = 0x0020
FEATURE_INCOMPAT_XATTR_PREFIXES = 0x0040  # long xattr name prefixes
FEATURE_INCOMPAT_48BIT = 0x0080  # 48-bit block addresses; changes inode and superblock fields
FEATURE_INCOMPAT_METABOX = 0x0100

# erofs_super_block, first 128 bytes. Fields, in order:
#   magic, checksum, feature_compat, blkszbits, sb_extslots, root_nid (le16),
#   inos (le64), build_time (le64; "epoch" in newer headers: base seconds for compact inodes),
#   build_time_nsec (le32; "fixed_nsec"), blocks (le32), meta_blkaddr, xattr_blkaddr,
#   uuid[16], volume_name[16], feature_incompat, available_compr_algs / lz4_max_distance (le16),
#   extra_devices (le16), devt_slotoff (le16), dirblkbits (u8), xattr_prefix_count (u8),
#   xattr_prefix_start (le32), packed_nid (le64), xattr_filter_reserved (u8), reserved[23]
SUPERBLOCK = struct.Struct("<IIIBBHQQIIII16s16sIHHHBBIQB23s")
assert SUPERBLOCK.size == SUPERBLOCK_SIZE
SB_CHECKSUM_OFFSET = 4  # offset of the checksum field inside the superblock


class Superblock(NamedTuple):
    """The decoded 128-byte superblock; field order matches ``SUPERBLOCK``."""

    magic: int
    checksum: int
    feature_compat: int
    blkszbits: int
    sb_extslots: int
    root_nid: int
    inos: int
    build_time: int
    build_time_nsec: int
    blocks: int
    meta_blkaddr: int
    xattr_blkaddr: int
    uuid: bytes
    volume_name: bytes
    feature_incompat: int
    u1: int
    extra_devices: int
    devt_slotoff: int
    dirblkbits: int
    xattr_prefix_count: int
    xattr_prefix_start: int
    packed_nid: int
    xattr_filter_reserved: int
    reserved: bytes

    @classmethod
    def unpack(cls, data: bytes) -> Superblock:
        """Decode the first ``SUPERBLOCK_SIZE`` bytes of ``data``."""
        return cls(*SUPERBLOCK.unpack_from(data))

    def pack(self) -> bytes:
        return SUPERBLOCK.pack(*self)


# --- crc32c (Castagnoli), for the superblock checksum ------------------------------------------

_CRC32C_POLY = 0x82F63B78  # reflected Castagnoli polynomial


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ _CRC32C_POLY if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_CRC32C_TABLE = _crc32c_table()


def crc32c_raw(data: bytes, crc: int = 0xFFFFFFFF) -> int:
    """crc32c as Linux's ``crc32c(seed, data, len)``: no final inversion.

    Standard CRC-32C of ``data`` is ``crc32c_raw(data) ^ 0xFFFFFFFF``.
    """
    table = _CRC32C_TABLE
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc


def superblock_checksum(block0: bytes, block_size: int) -> int:
    """The value of the superblock ``checksum`` field (with ``FEATURE_COMPAT_SB_CHKSUM``).

    It is ``crc32c(~0, ...)`` over bytes ``SUPERBLOCK_OFFSET .. block_size`` of block 0 with the
    checksum field taken as zero.
    """
    area = bytearray(block0[SUPERBLOCK_OFFSET:block_size])
    if len(area) != block_size - SUPERBLOCK_OFFSET:
        raise ValueError("block 0 is shorter than the block size")
    area[SB_CHECKSUM_OFFSET : SB_CHECKSUM_OFFSET + 4] = b"\0\0\0\0"
    return crc32c_raw(bytes(area))


# --- inodes ------------------------------------------------------------------------------------

ISLOT_BITS = 5  # nids count 32-byte slots
ISLOT_SIZE = 1 << ISLOT_BITS

# i_format bits
I_VERSION_MASK = 0x01  # bit 0: 0 = compact (32 B), 1 = extended (64 B)
I_VERSION_BIT = 0
I_DATALAYOUT_MASK = 0x07
I_DATALAYOUT_BIT = 1  # bits 1-3: data layout
I_NLINK_1_BIT = 4  # (compact non-directories, newer kernels) nlink is 1; i_nb holds other data
I_DOT_OMITTED_BIT = 4  # (directories, newer kernels) the "." dirent is omitted
I_ALL = (1 << (I_NLINK_1_BIT + 1)) - 1  # every i_format bit defined so far

INODE_LAYOUT_COMPACT = 0
INODE_LAYOUT_EXTENDED = 1

# data layouts
FLAT_PLAIN = 0  # data in consecutive blocks from raw_blkaddr
COMPRESSED_FULL = 1
FLAT_INLINE = 2  # whole blocks from raw_blkaddr, tail packed right after inode + xattrs
COMPRESSED_COMPACT = 3
CHUNK_BASED = 4  # chunk table after inode + xattrs
DATALAYOUT_MAX = 5
COMPRESSED_LAYOUTS = frozenset({COMPRESSED_FULL, COMPRESSED_COMPACT})

# erofs_inode_compact (32 bytes):
#   i_format, i_xattr_icount, i_mode, i_nlink (le16), i_size (le32),
#   i_mtime (le32; seconds after build_time, zero in older writers where it was reserved),
#   i_u (le32: raw_blkaddr / rdev / compressed_blocks / chunk format), i_ino (le32),
#   i_uid (le16), i_gid (le16), i_reserved (le32)
INODE_COMPACT = struct.Struct("<HHHHIIIIHHI")
assert INODE_COMPACT.size == 32

# erofs_inode_extended (64 bytes):
#   i_format, i_xattr_icount, i_mode, i_reserved (le16), i_size (le64), i_u (le32),
#   i_ino (le32), i_uid (le32), i_gid (le32), i_mtime (le64), i_mtime_nsec (le32),
#   i_nlink (le32), i_reserved2[16]
INODE_EXTENDED = struct.Struct("<HHHHQIIIIQII16s")
assert INODE_EXTENDED.size == 64

INODE_FORMAT = struct.Struct("<H")  # peek i_format to tell the two layouts apart


def make_i_format(version: int, datalayout: int) -> int:
    return (version << I_VERSION_BIT) | (datalayout << I_DATALAYOUT_BIT)


def inode_version(i_format: int) -> int:
    return (i_format >> I_VERSION_BIT) & I_VERSION_MASK


def inode_datalayout(i_format: int) -> int:
    return (i_format >> I_DATALAYOUT_BIT) & I_DATALAYOUT_MASK


# chunk-based inodes: i_u is erofs_inode_chunk_info {le16 format, le16 reserved}
CHUNK_FORMAT_BLKBITS_MASK = 0x001F  # chunk size = block size << blkbits
CHUNK_FORMAT_INDEXES = 0x0020  # 8-byte chunk indexes instead of 4-byte block addresses
CHUNK_FORMAT_48BIT = 0x0040
CHUNK_FORMAT_ALL = (CHUNK_FORMAT_48BIT << 1) - 1
BLOCK_MAP_ENTRY = struct.Struct("<I")  # le32 block address per chunk
# erofs_inode_chunk_index: le16 advise (startblk_hi in 48-bit), le16 device_id, le32 blkaddr
CHUNK_INDEX = struct.Struct("<HHI")
assert CHUNK_INDEX.size == 8
NULL_ADDR = 0xFFFFFFFF  # a chunk that is a hole (EROFS_NULL_ADDR truncated to 32 bits)


# --- directories -------------------------------------------------------------------------------

# erofs_dirent: le64 nid, le16 nameoff, u8 file_type, u8 reserved
DIRENT = struct.Struct("<QHBB")
assert DIRENT.size == 12
NAME_LEN = 255  # EROFS_NAME_LEN

FT_UNKNOWN = 0
FT_REG_FILE = 1
FT_DIR = 2
FT_CHRDEV = 3
FT_BLKDEV = 4
FT_FIFO = 5
FT_SOCK = 6
FT_SYMLINK = 7
FT_MAX = 8

_S_IFMT = 0o170000
_FT_BY_IFMT = {
    0o100000: FT_REG_FILE,
    0o040000: FT_DIR,
    0o020000: FT_CHRDEV,
    0o060000: FT_BLKDEV,
    0o010000: FT_FIFO,
    0o140000: FT_SOCK,
    0o120000: FT_SYMLINK,
}
_IFMT_BY_FT = {ft: ifmt for ifmt, ft in _FT_BY_IFMT.items()}


def file_type_from_mode(mode: int) -> int:
    """The dirent ``file_type`` for an ``st_mode`` (``FT_UNKNOWN`` if the type is unknown)."""
    return _FT_BY_IFMT.get(mode & _S_IFMT, FT_UNKNOWN)


def ifmt_from_file_type(file_type: int) -> int:
    """The ``S_IFMT`` bits for a dirent ``file_type`` (0 for ``FT_UNKNOWN`` or invalid)."""
    return _IFMT_BY_FT.get(file_type, 0)


# --- xattrs ------------------------------------------------------------------------------------

# erofs_xattr_ibody_header: le32 h_name_filter (h_reserved in older writers), u8 h_shared_count,
# u8 h_reserved2[7]; followed by h_shared_count le32 shared xattr ids, then the inline entries.
XATTR_IBODY_HEADER = struct.Struct("<IB7s")
assert XATTR_IBODY_HEADER.size == 12
XATTR_SHARED_ID = struct.Struct("<I")
# erofs_xattr_entry: u8 e_name_len, u8 e_name_index, le16 e_value_size; then name, value
XATTR_ENTRY = struct.Struct("<BBH")
assert XATTR_ENTRY.size == 4
XATTR_ALIGN = 4  # entries (and shared xattr ids) are 4-byte aligned

XATTR_INDEX_USER = 1
XATTR_INDEX_POSIX_ACL_ACCESS = 2
XATTR_INDEX_POSIX_ACL_DEFAULT = 3
XATTR_INDEX_TRUSTED = 4
XATTR_INDEX_LUSTRE = 5
XATTR_INDEX_SECURITY = 6
XATTR_LONG_PREFIX = 0x80  # e_name_index bit 7: index into the long prefix table
XATTR_LONG_PREFIX_MASK = 0x7F

# Name prefix per index. The two POSIX ACL indexes name the whole attribute (empty suffix).
XATTR_PREFIXES: dict[int, str] = {
    XATTR_INDEX_USER: "user.",
    XATTR_INDEX_POSIX_ACL_ACCESS: "system.posix_acl_access",
    XATTR_INDEX_POSIX_ACL_DEFAULT: "system.posix_acl_default",
    XATTR_INDEX_TRUSTED: "trusted.",
    XATTR_INDEX_LUSTRE: "lustre.",
    XATTR_INDEX_SECURITY: "security.",
}


def xattr_ibody_size(icount: int) -> int:
    """Bytes of inline xattr area for ``i_xattr_icount`` (header + (icount - 1) * 4, or 0)."""
    if icount == 0:
        return 0
    return XATTR_IBODY_HEADER.size + 4 * (icount - 1)


def xattr_icount(ibody_size: int) -> int:
    """Inverse of ``xattr_ibody_size``: the ``i_xattr_icount`` for an inline area size."""
    if ibody_size == 0:
        return 0
    if ibody_size < XATTR_IBODY_HEADER.size or ibody_size % 4:
        raise ValueError(f"bad xattr ibody size {ibody_size}")
    return (ibody_size - XATTR_IBODY_HEADER.size) // 4 + 1


def xattr_entry_size(name_len: int, value_size: int) -> int:
    """Aligned size of one xattr entry (header, name suffix, value)."""
    return align(XATTR_ENTRY.size + name_len + value_size, XATTR_ALIGN)


def split_xattr_name(name: str) -> tuple[int, str] | None:
    """``(index, suffix)`` for a full xattr name, or None if no short prefix matches.

    POSIX ACL names match only exactly (their suffix is empty).
    """
    for index, prefix in XATTR_PREFIXES.items():
        if index in (XATTR_INDEX_POSIX_ACL_ACCESS, XATTR_INDEX_POSIX_ACL_DEFAULT):
            if name == prefix:
                return index, ""
        elif name.startswith(prefix) and len(name) > len(prefix):
            return index, name[len(prefix) :]
    return None


# --- device numbers ----------------------------------------------------------------------------


def encode_rdev(major: int, minor: int) -> int:
    """Linux ``new_encode_dev``: the 32-bit device number stored in ``i_u`` of special inodes."""
    return (minor & 0xFF) | ((major & 0xFFF) << 8) | ((minor & ~0xFF & 0xFFFFF) << 12)


def decode_rdev(raw: int) -> tuple[int, int]:
    """Linux ``new_decode_dev``: ``(major, minor)`` from the stored 32-bit device number."""
    major = (raw & 0xFFF00) >> 8
    minor = (raw & 0xFF) | ((raw >> 12) & 0xFFF00)
    return major, minor


def makedev(major: int, minor: int) -> int:
    """The Linux userspace ``dev_t`` (glibc ``makedev``), as in ``os.stat().st_rdev``."""
    return (
        ((major & 0xFFFFF000) << 32)
        | ((major & 0x00000FFF) << 8)
        | ((minor & 0xFFFFFF00) << 12)
        | (minor & 0x000000FF)
    )


def splitdev(dev: int) -> tuple[int, int]:
    """Inverse of ``makedev``: ``(major, minor)`` of a Linux userspace ``dev_t``."""
    major = ((dev >> 32) & 0xFFFFF000) | ((dev >> 8) & 0x00000FFF)
    minor = ((dev >> 12) & 0xFFFFFF00) | (dev & 0x000000FF)
    return major, minor


# --- helpers -----------------------------------------------------------------------------------


def align(value: int, alignment: int) -> int:
    """Round ``value`` up to a multiple of ``alignment`` (a power of two)."""
    return (value + alignment - 1) & ~(alignment - 1)
