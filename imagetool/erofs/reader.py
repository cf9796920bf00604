"""A pure-Python EROFS reader: files, directories, links and xattrs without mounting.

The reader sees an image only through ``read_at(offset, length) -> bytes``, so it works over a
local file, a sector store or anything else that serves ranged reads. It reads uncompressed
images (``FLAT_PLAIN``, ``FLAT_INLINE`` with tail packing, and ``CHUNK_BASED``) with compact
and extended inodes, inline and shared xattrs. Compressed files, long xattr name prefixes,
48-bit layouts and data on extra devices are refused with ``ErofsError``.

It is strict: every offset is checked against the image size (the ``size`` given, or the
superblock's block count), and anything malformed raises ``ErofsError`` rather than an
``IndexError`` or ``struct.error``. Missing paths raise ``FileNotFoundError`` and paths through
a non-directory (symlinks included: they are never followed) raise ``NotADirectoryError``.

The on-disk format itself is defined in ``imagetool.erofs.layout``.
"""

from __future__ import annotations

import bisect
import errno
import functools
import itertools
import logging
import os
import stat
import struct
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imagetool.erofs import layout as L
from imagetool.errors import ErofsError

log = logging.getLogger(__name__)

ReadAt = Callable[[int, int], bytes]

# Incompatible features the reader can open. The compression ones only mean that some inodes
# are compressed; those inodes are refused when their data is read.
_SUPPORTED_INCOMPAT = (
    L.FEATURE_INCOMPAT_ZERO_PADDING
    | L.FEATURE_INCOMPAT_COMPR_CFGS
    | L.FEATURE_INCOMPAT_CHUNKED_FILE
    | L.FEATURE_INCOMPAT_DEVICE_TABLE
    | L.FEATURE_INCOMPAT_ZTAILPACKING
    | L.FEATURE_INCOMPAT_FRAGMENTS
    | L.FEATURE_INCOMPAT_XATTR_PREFIXES
)
PATH_MAX = 4096  # longest symlink target the kernel accepts
DEFAULT_INODE_CACHE = 65536  # decoded inodes kept; a few MB at most
DEFAULT_DIRBLOCK_CACHE = 1024  # parsed directory blocks kept for lookups
DEFAULT_EXTENTS_CACHE = 256  # extent lists kept: chunk tables of big files are long


@dataclass(frozen=True)
class Inode:
    """One decoded on-disk inode. ``rdev`` is a Linux userspace ``dev_t`` like ``st_rdev``."""

    nid: int
    mode: int
    uid: int
    gid: int
    size: int
    nlink: int
    mtime: int
    mtime_nsec: int
    rdev: int
    ino: int
    layout: int  # data layout: layout.FLAT_PLAIN, FLAT_INLINE, CHUNK_BASED, ...
    compact: bool = field(default=False, repr=False)  # 32-byte (True) or 64-byte inode
    _iloc: int = field(default=0, repr=False)  # image offset of the on-disk inode
    _isize: int = field(default=0, repr=False)  # 32 or 64
    _xattr_isize: int = field(default=0, repr=False)  # bytes of inline xattr area
    _i_u: int = field(default=0, repr=False)  # raw i_u: start block, rdev or chunk format

    @property
    def file_type(self) -> int:
        """The dirent file type (``layout.FT_*``) matching ``mode``."""
        return L.file_type_from_mode(self.mode)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def is_symlink(self) -> bool:
        return stat.S_ISLNK(self.mode)

    @property
    def is_device(self) -> bool:
        return stat.S_ISCHR(self.mode) or stat.S_ISBLK(self.mode)

    @property
    def rdev_major(self) -> int:
        return L.splitdev(self.rdev)[0]

    @property
    def rdev_minor(self) -> int:
        return L.splitdev(self.rdev)[1]

    @property
    def _tail_offset(self) -> int:
        """Image offset just past the inode and its inline xattrs."""
        return self._iloc + self._isize + self._xattr_isize


# (logical offset, image offset or None for a hole, length)
_Extent = tuple[int, int | None, int]


class ErofsReader:
    """Reads an EROFS image through ``read_at(offset, length)``.

    ``size`` is the image size when known; without it, the superblock's block count bounds
    every read. A reader may be shared between threads if ``read_at`` may be.
    """

    def __init__(self, read_at: ReadAt, size: int | None = None) -> None:
        self._read_at = read_at
        self._closer: Callable[[], None] | None = None
        if size is not None and size < L.SUPERBLOCK_OFFSET + L.SUPERBLOCK_SIZE:
            raise ErofsError(f"image of {size} bytes is too small to hold a superblock")
        self._limit = size if size is not None else L.SUPERBLOCK_OFFSET + L.SUPERBLOCK_SIZE
        head = self._read(L.SUPERBLOCK_OFFSET, L.SUPERBLOCK_SIZE, "superblock")
        sb = L.Superblock.unpack(head)
        if sb.magic != L.MAGIC:
            raise ErofsError(f"bad magic {sb.magic:#010x} (not an EROFS image)")
        if not L.MIN_BLKSZBITS <= sb.blkszbits <= L.MAX_BLKSZBITS:
            raise ErofsError(f"unsupported block size 2^{sb.blkszbits}")
        bs = 1 << sb.blkszbits
        if bs < L.SUPERBLOCK_OFFSET + L.SUPERBLOCK_SIZE + sb.sb_extslots * L.SB_EXTSLOT_SIZE:
            raise ErofsError(f"superblock does not fit in a {bs}-byte block")
        unknown = sb.feature_incompat & ~_SUPPORTED_INCOMPAT
        if unknown:
            raise ErofsError(f"unsupported incompatible features {unknown:#x}")
        if sb.dirblkbits:
            raise ErofsError(f"unsupported directory block bits {sb.dirblkbits}")
        image_blocks_bytes = sb.blocks * bs
        if size is None:
            self._limit = image_blocks_bytes
        elif size < image_blocks_bytes:
            raise ErofsError(
                f"image truncated: {size} bytes, superblock says {sb.blocks} blocks of {bs}"
            )
        if self._limit < bs:
            raise ErofsError(f"image smaller than one block ({self._limit} bytes)")
        if sb.feature_compat & L.FEATURE_COMPAT_SB_CHKSUM:
            block0 = self._read(0, bs, "block 0")
            want = L.superblock_checksum(block0, bs)
            if want != sb.checksum:
                raise ErofsError(
                    f"superblock checksum mismatch: stored {sb.checksum:#010x}, "
                    f"computed {want:#010x}"
                )
        self.superblock = sb
        self.block_size = bs
        self.blkszbits = sb.blkszbits
        self.root_nid = sb.root_nid
        self.inodes = sb.inos
        self.build_time = sb.build_time
        self.build_time_nsec = sb.build_time_nsec
        self.blocks = sb.blocks
        self.uuid = uuid.UUID(bytes=sb.uuid)
        self.volume_name = sb.volume_name.split(b"\0", 1)[0].decode("utf-8", "replace")
        self.feature_compat = sb.feature_compat
        self.feature_incompat = sb.feature_incompat
        self.image_size = self._limit
        self._meta_base = sb.meta_blkaddr * bs
        self._xattr_base = sb.xattr_blkaddr * bs
        self._inode_cached = functools.lru_cache(maxsize=DEFAULT_INODE_CACHE)(self._load_inode)
        self._dirblock_cached = functools.lru_cache(maxsize=DEFAULT_DIRBLOCK_CACHE)(
            self._load_dirblock
        )
        self._extents_cached = functools.lru_cache(maxsize=DEFAULT_EXTENTS_CACHE)(
            self._load_extents
        )
        root = self.inode(self.root_nid)
        if not root.is_dir:
            raise ErofsError(f"root inode {self.root_nid} is not a directory")

    # --- construction helpers ------------------------------------------------------------------

    @classmethod
    def open_file(cls, path: str | os.PathLike[str]) -> ErofsReader:
        """A reader over a local image file; close it with ``close()`` or a ``with`` block."""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            # a block device (a loop device, say) reports no st_size
            size = os.lseek(fd, 0, os.SEEK_END) if stat.S_ISBLK(st.st_mode) else st.st_size

            def read_at(offset: int, length: int) -> bytes:
                return os.pread(fd, length, offset)

            reader = cls(read_at, size)
        except BaseException:
            os.close(fd)
            raise
        reader._closer = functools.partial(os.close, fd)
        log.debug("opened EROFS image %s (%d bytes)", Path(path), size)
        return reader

    def close(self) -> None:
        if self._closer is not None:
            closer, self._closer = self._closer, None
            closer()

    def __enter__(self) -> ErofsReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- raw access ----------------------------------------------------------------------------

    def _read(self, offset: int, length: int, what: str) -> bytes:
        if offset < 0 or length < 0 or offset + length > self._limit:
            raise ErofsError(
                f"{what}: range {offset}+{length} is outside the image ({self._limit} bytes)"
            )
        if length == 0:
            return b""
        data = self._read_at(offset, length)
        if len(data) != length:
            raise ErofsError(f"{what}: short read at {offset} ({len(data)} of {length} bytes)")
        return bytes(data)

    # --- inodes --------------------------------------------------------------------------------

    def inode(self, nid: int) -> Inode:
        """Decode the inode numbered ``nid``."""
        if not isinstance(nid, int) or nid < 0:
            raise ErofsError(f"bad nid {nid!r}")
        return self._inode_cached(nid)

    def _load_inode(self, nid: int) -> Inode:
        iloc = self._meta_base + (nid << L.ISLOT_BITS)
        what = f"inode {nid}"
        if iloc + L.INODE_COMPACT.size > self._limit:
            raise ErofsError(f"{what}: offset {iloc} is outside the image ({self._limit} bytes)")
        # one read covers either form; an extended inode's tail is checked below
        raw = self._read(iloc, min(L.INODE_EXTENDED.size, self._limit - iloc), what)
        (i_format,) = L.INODE_FORMAT.unpack_from(raw)
        if i_format & ~L.I_ALL:
            raise ErofsError(f"{what}: unsupported i_format {i_format:#x}")
        version = L.inode_version(i_format)
        layout = L.inode_datalayout(i_format)
        if layout >= L.DATALAYOUT_MAX:
            raise ErofsError(f"{what}: unknown data layout {layout}")
        if version == L.INODE_LAYOUT_COMPACT:
            (
                _fmt,
                icount,
                mode,
                nlink,
                size,
                mtime_rel,
                i_u,
                ino,
                uid,
                gid,
                _reserved,
            ) = L.INODE_COMPACT.unpack_from(raw)
            isize = L.INODE_COMPACT.size
            mtime = self.build_time + mtime_rel
            mtime_nsec = self.build_time_nsec
            if not stat.S_ISDIR(mode) and i_format & (1 << L.I_NLINK_1_BIT):
                nlink = 1
        else:
            if len(raw) < L.INODE_EXTENDED.size:
                raise ErofsError(f"{what}: extended inode runs past the end of the image")
            (
                _fmt,
                icount,
                mode,
                _reserved,
                size,
                i_u,
                ino,
                uid,
                gid,
                mtime,
                mtime_nsec,
                nlink,
                _reserved2,
            ) = L.INODE_EXTENDED.unpack(raw)
            isize = L.INODE_EXTENDED.size
        if L.file_type_from_mode(mode) == L.FT_UNKNOWN:
            raise ErofsError(f"{what}: bad file mode {mode:#o}")
        xattr_isize = L.xattr_ibody_size(icount)
        if iloc + isize + xattr_isize > self._limit:
            raise ErofsError(f"{what}: inode and xattrs run past the end of the image")
        rdev = 0
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            rdev = L.makedev(*L.decode_rdev(i_u))
        return Inode(
            nid=nid,
            mode=mode,
            uid=uid,
            gid=gid,
            size=size,
            nlink=nlink,
            mtime=mtime,
            mtime_nsec=mtime_nsec,
            rdev=rdev,
            ino=ino,
            layout=layout,
            compact=version == L.INODE_LAYOUT_COMPACT,
            _iloc=iloc,
            _isize=isize,
            _xattr_isize=xattr_isize,
            _i_u=i_u,
        )

    # --- data ----------------------------------------------------------------------------------

    def _extents(self, inode: Inode) -> list[_Extent]:
        """The file's data as (logical offset, image offset or None for a hole, length)."""
        return self._extents_cached(inode.nid)[0]

    def _load_extents(self, nid: int) -> tuple[list[_Extent], list[int]]:
        """The extents and their logical starts (for bisecting)."""
        extents = self._map_extents(self.inode(nid))
        return extents, [logical for logical, _, _ in extents]

    def _map_extents(self, inode: Inode) -> list[_Extent]:
        size = inode.size
        if size == 0:
            return []
        what = f"inode {inode.nid}"
        if inode.layout in L.COMPRESSED_LAYOUTS:
            raise ErofsError(f"{what}: compressed data (layout {inode.layout}) is not supported")
        if stat.S_ISCHR(inode.mode) or stat.S_ISBLK(inode.mode):
            raise ErofsError(f"{what}: device inode with size {size}")
        bs = self.block_size
        extents: list[_Extent]
        if inode.layout == L.FLAT_PLAIN:
            extents = [(0, inode._i_u * bs, size)]
        elif inode.layout == L.FLAT_INLINE:
            whole = ((size - 1) >> self.blkszbits) << self.blkszbits
            tail = size - whole
            tail_off = inode._tail_offset
            if (tail_off % bs) + tail > bs:
                raise ErofsError(f"{what}: inline tail of {tail} bytes crosses a block boundary")
            extents = [(0, inode._i_u * bs, whole)] if whole else []
            extents.append((whole, tail_off, tail))
        elif inode.layout == L.CHUNK_BASED:
            extents = self._chunk_extents(inode)
        else:
            raise ErofsError(f"{what}: unsupported data layout {inode.layout}")
        for _, phys, length in extents:
            if phys is not None and phys + length > self._limit:
                raise ErofsError(
                    f"{what}: data at {phys}+{length} is outside the image ({self._limit} bytes)"
                )
        return extents

    def _chunk_extents(self, inode: Inode) -> list[_Extent]:
        what = f"inode {inode.nid}"
        fmt = inode._i_u & 0xFFFF
        if fmt & ~L.CHUNK_FORMAT_ALL or fmt & L.CHUNK_FORMAT_48BIT:
            raise ErofsError(f"{what}: unsupported chunk format {fmt:#x}")
        chunkbits = self.blkszbits + (fmt & L.CHUNK_FORMAT_BLKBITS_MASK)
        if chunkbits > 62:
            raise ErofsError(f"{what}: chunk size 2^{chunkbits} is too large")
        chunk_size = 1 << chunkbits
        nchunks = (inode.size + chunk_size - 1) >> chunkbits
        indexes = bool(fmt & L.CHUNK_FORMAT_INDEXES)
        unit = L.CHUNK_INDEX.size if indexes else L.BLOCK_MAP_ENTRY.size
        table_off = L.align(inode._tail_offset, unit)
        if nchunks * unit > self._limit:
            raise ErofsError(f"{what}: chunk table of {nchunks} entries is larger than the image")
        table = self._read(table_off, nchunks * unit, f"{what} chunk table")
        extents: list[_Extent] = []
        for i in range(nchunks):
            if indexes:
                _advise, device_id, blkaddr = L.CHUNK_INDEX.unpack_from(table, i * unit)
            else:
                device_id = 0
                (blkaddr,) = L.BLOCK_MAP_ENTRY.unpack_from(table, i * unit)
            logical = i << chunkbits
            length = min(chunk_size, inode.size - logical)
            if blkaddr == L.NULL_ADDR:
                extents.append((logical, None, length))
                continue
            if device_id:
                raise ErofsError(f"{what}: chunk {i} is on extra device {device_id}")
            phys = blkaddr * self.block_size
            if extents and extents[-1][1] is not None:
                plog, pphys, plen = extents[-1]
                if pphys is not None and pphys + plen == phys:
                    extents[-1] = (plog, pphys, plen + length)
                    continue
            extents.append((logical, phys, length))
        return extents

    def data_extents(self, inode: Inode) -> list[tuple[int, int]]:
        """(image offset, length) of the file's stored bytes, in file order; holes omitted.

        Physically adjacent pieces are merged. Chunks shared by deduplication appear once per
        use, so extents may repeat or overlap.
        """
        out: list[tuple[int, int]] = []
        for _, phys, length in self._extents(inode):
            if phys is None:
                continue
            if out and out[-1][0] + out[-1][1] == phys:
                out[-1] = (out[-1][0], out[-1][1] + length)
            else:
                out.append((phys, length))
        return out

    def _iter_range(self, inode: Inode, offset: int, size: int, chunk: int) -> Iterator[bytes]:
        if offset < 0:
            raise ValueError(f"negative offset {offset}")
        if chunk <= 0:
            raise ValueError(f"chunk must be positive, not {chunk}")
        end = inode.size if size < 0 else min(inode.size, offset + size)
        if offset >= end:
            return
        extents, starts = self._extents_cached(inode.nid)
        first = max(0, bisect.bisect_right(starts, offset) - 1)
        for logical, phys, length in itertools.islice(extents, first, None):
            if logical >= end:
                break
            lo = max(offset, logical)
            hi = min(end, logical + length)
            while lo < hi:
                n = min(chunk, hi - lo)
                if phys is None:
                    yield bytes(n)
                else:
                    yield self._read(phys + (lo - logical), n, f"inode {inode.nid} data")
                lo += n

    def read(self, inode: Inode, offset: int = 0, size: int = -1) -> bytes:
        """``size`` bytes of the file from ``offset`` (to the end when ``size`` < 0)."""
        return b"".join(self._iter_range(inode, offset, size, 1 << 62))

    def iter_content(self, inode: Inode, chunk: int = 1 << 20) -> Iterator[bytes]:
        """The file's bytes in pieces of at most ``chunk`` bytes."""
        return self._iter_range(inode, 0, -1, chunk)

    def readlink(self, inode: Inode) -> str:
        """The target of a symlink."""
        if not inode.is_symlink:
            raise OSError(errno.EINVAL, "not a symbolic link", f"nid {inode.nid}")
        if inode.size == 0 or inode.size > PATH_MAX:
            raise ErofsError(f"inode {inode.nid}: bad symlink length {inode.size}")
        target = self.read(inode)
        if b"\0" in target:
            raise ErofsError(f"inode {inode.nid}: symlink target contains NUL")
        return os.fsdecode(target)

    # --- directories ---------------------------------------------------------------------------

    def _load_dirblock(self, nid: int, blkno: int) -> tuple[list[bytes], list[tuple[int, int]]]:
        """Names and (nid, file type) of the dirents in logical block ``blkno`` of a directory."""
        inode = self.inode(nid)
        bs = self.block_size
        what = f"directory inode {inode.nid} block {blkno}"
        data = self.read(inode, blkno * bs, bs)
        if len(data) < L.DIRENT.size:
            raise ErofsError(f"{what}: {len(data)} bytes is too short for a dirent")
        first_nameoff = L.DIRENT.unpack_from(data, 0)[1]
        if (
            first_nameoff < L.DIRENT.size
            or first_nameoff % L.DIRENT.size
            or first_nameoff >= len(data)
        ):
            raise ErofsError(f"{what}: bad first name offset {first_nameoff}")
        count = first_nameoff // L.DIRENT.size
        raw = [L.DIRENT.unpack_from(data, i * L.DIRENT.size) for i in range(count)]
        names: list[bytes] = []
        entries: list[tuple[int, int]] = []
        for i, (nid, nameoff, file_type, _reserved) in enumerate(raw):
            end = raw[i + 1][1] if i + 1 < count else len(data)
            if not first_nameoff <= nameoff < end <= len(data):
                raise ErofsError(f"{what}: bad name offset {nameoff} for dirent {i}")
            name = data[nameoff:end]
            if i + 1 == count:
                name = name.split(b"\0", 1)[0]  # the last name may be NUL-padded
            if not name or len(name) > L.NAME_LEN or b"/" in name or b"\0" in name:
                raise ErofsError(f"{what}: bad name {name!r}")
            if file_type >= L.FT_MAX:
                raise ErofsError(f"{what}: bad file type {file_type} for {name!r}")
            if names and name <= names[-1]:
                raise ErofsError(f"{what}: names not sorted ({names[-1]!r} before {name!r})")
            names.append(name)
            entries.append((nid, file_type))
        return names, entries

    def _dir_nblocks(self, inode: Inode) -> int:
        return (inode.size + self.block_size - 1) >> self.blkszbits

    def _iter_dirents(self, inode: Inode) -> Iterator[tuple[bytes, int, int]]:
        """All dirents of a directory in on-disk order, '.' and '..' included."""
        last: bytes | None = None
        for blkno in range(self._dir_nblocks(inode)):
            names, entries = self._dirblock_cached(inode.nid, blkno)
            if last is not None and names[0] <= last:
                raise ErofsError(f"directory inode {inode.nid}: names not sorted across blocks")
            last = names[-1]
            for name, (nid, file_type) in zip(names, entries, strict=True):
                yield name, nid, file_type

    def _find(self, inode: Inode, name: bytes) -> tuple[int, int] | None:
        """(nid, file type) of ``name`` in a directory: binary search over blocks, then names."""
        lo, hi = 0, self._dir_nblocks(inode) - 1
        candidate = -1
        while lo <= hi:
            mid = (lo + hi) // 2
            names, entries = self._dirblock_cached(inode.nid, mid)
            if name == names[0]:
                return entries[0]
            if name > names[0]:
                candidate, lo = mid, mid + 1
            else:
                hi = mid - 1
        if candidate < 0:
            return None
        names, entries = self._dirblock_cached(inode.nid, candidate)
        i = bisect.bisect_left(names, name)
        if i < len(names) and names[i] == name:
            return entries[i]
        return None

    def _child(self, parent: Inode, name: bytes, path: str) -> Inode:
        found = self._find(parent, name)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        nid, file_type = found
        child = self.inode(nid)
        if file_type != L.FT_UNKNOWN and file_type != child.file_type:
            raise ErofsError(
                f"{path}: dirent type {file_type} does not match inode {nid} mode {child.mode:#o}"
            )
        return child

    def lookup(self, path: str) -> Inode:
        """The inode at ``path`` (absolute inside the image; relative paths start at the root).

        A final symlink is returned as is; a symlink or other non-directory in the middle of
        the path raises ``NotADirectoryError``.
        """
        node = self.inode(self.root_nid)
        parts = [p for p in path.split("/") if p and p != "."]
        for i, part in enumerate(parts):
            sofar = "/" + "/".join(parts[: i + 1])
            if not node.is_dir:
                kind = "a symlink (not followed)" if node.is_symlink else "not a directory"
                raise NotADirectoryError(
                    errno.ENOTDIR, f"{os.strerror(errno.ENOTDIR)}: is {kind}", sofar
                )
            node = self._child(node, os.fsencode(part), sofar)
        return node

    def _as_dir(self, dir: Inode | str) -> Inode:
        inode = self.lookup(dir) if isinstance(dir, str) else dir
        if not inode.is_dir:
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(dir))
        return inode

    def listdir(self, dir: Inode | str) -> list[tuple[str, int, int]]:
        """(name, nid, file type) of each entry, in on-disk (byte-sorted) order, no '.'/'..'."""
        inode = self._as_dir(dir)
        return [
            (os.fsdecode(name), nid, file_type)
            for name, nid, file_type in self._iter_dirents(inode)
            if name not in (b".", b"..")
        ]

    def walk(self, top: str = "/") -> Iterator[tuple[str, Inode]]:
        """Every (path, inode) under ``top``, depth-first, names in byte order, ``top`` first.

        Symlinks are not followed. A directory reachable twice (a loop or a directory hard
        link) raises ``ErofsError``.
        """
        node = self.lookup(top)
        top_path = "/" + "/".join(p for p in top.split("/") if p and p != ".")
        seen_dirs: set[int] = set()
        stack: list[tuple[str, Inode]] = [(top_path, node)]
        while stack:
            path, node = stack.pop()
            yield path, node
            if not node.is_dir:
                continue
            if node.nid in seen_dirs:
                raise ErofsError(f"{path}: directory inode {node.nid} is reachable twice")
            seen_dirs.add(node.nid)
            children = []
            prefix = path.rstrip("/") + "/"
            for name, nid, file_type in self._iter_dirents(node):
                if name in (b".", b".."):
                    continue
                child_path = prefix + os.fsdecode(name)
                child = self.inode(nid)
                if file_type != L.FT_UNKNOWN and file_type != child.file_type:
                    raise ErofsError(
                        f"{child_path}: dirent type {file_type} does not match inode {nid}"
                    )
                children.append((child_path, child))
            stack.extend(reversed(children))

    # --- xattrs --------------------------------------------------------------------------------

    def _xattr_entry(self, data: bytes, pos: int, what: str) -> tuple[str, bytes, int]:
        """Decode the entry at ``data[pos:]``: (full name, value, aligned entry size)."""
        if pos + L.XATTR_ENTRY.size > len(data):
            raise ErofsError(f"{what}: truncated xattr entry")
        name_len, index, value_size = L.XATTR_ENTRY.unpack_from(data, pos)
        size = L.xattr_entry_size(name_len, value_size)
        start = pos + L.XATTR_ENTRY.size
        if start + name_len + value_size > len(data):
            raise ErofsError(f"{what}: xattr entry runs past its area")
        suffix = data[start : start + name_len]
        value = data[start + name_len : start + name_len + value_size]
        if index & L.XATTR_LONG_PREFIX:
            raise ErofsError(f"{what}: long xattr name prefixes are not supported")
        prefix = L.XATTR_PREFIXES.get(index)
        if prefix is None:
            raise ErofsError(f"{what}: unknown xattr name index {index}")
        if b"\0" in suffix:
            raise ErofsError(f"{what}: xattr name contains NUL")
        return prefix + os.fsdecode(suffix), value, size

    def xattrs(self, inode: Inode) -> dict[str, bytes]:
        """All extended attributes (inline and shared) by full name."""
        if inode._xattr_isize == 0:
            return {}
        what = f"inode {inode.nid} xattrs"
        body = self._read(inode._iloc + inode._isize, inode._xattr_isize, what)
        _filter, shared_count, _reserved = L.XATTR_IBODY_HEADER.unpack_from(body)
        pos = L.XATTR_IBODY_HEADER.size + 4 * shared_count
        if pos > len(body):
            raise ErofsError(f"{what}: {shared_count} shared xattr ids overflow the xattr area")
        shared_ids = struct.unpack_from(f"<{shared_count}I", body, L.XATTR_IBODY_HEADER.size)
        out: dict[str, bytes] = {}
        while pos < len(body):
            name, value, size = self._xattr_entry(body, pos, what)
            out[name] = value
            pos += size
        for xid in shared_ids:
            off = self._xattr_base + xid * 4
            head = self._read(off, L.XATTR_ENTRY.size, f"{what}: shared xattr {xid}")
            name_len, _index, value_size = L.XATTR_ENTRY.unpack(head)
            data = self._read(
                off, L.XATTR_ENTRY.size + name_len + value_size, f"{what}: shared xattr {xid}"
            )
            name, value, _ = self._xattr_entry(data, 0, f"{what}: shared xattr {xid}")
            out[name] = value
        return out
