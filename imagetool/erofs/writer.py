"""The EROFS writer: lay out a flattened tree as an uncompressed EROFS image.

The image is produced as a *plan* rather than written out: the metadata region (superblock,
inodes, xattrs, inline tails, directory and long-symlink blocks) as bytes in memory, followed
by a list of extents that say where each regular file's content lies in the content spool.
The packer turns the plan into sectors without ever materialising the whole image.

Layout (4096-byte blocks, all offsets deterministic for the same tree and order)::

    block 0      superblock at byte 1024; then the inode table starts at byte 1152
    inode table  extended (64-byte) inodes in depth-first order, root first, each followed by
                 its inline xattrs and, for directories and symlinks that fit, the tail of its
                 data (FLAT_INLINE); 32-byte aligned, a record never crosses a block boundary
    meta blocks  whole blocks of large directories and long symlinks (FLAT_PLAIN/INLINE heads)
    data area    regular files, each contiguous and block aligned (FLAT_PLAIN): for format
                 version 1 (``plan_erofs``) in layout order, the profile's paths first, then
                 depth-first order; for version 2 (``plan_erofs_regions``) in sector-aligned
                 regions per source layer, as ``imagetool.format`` specifies

All metadata therefore sits in the leading blocks, so the first sectors of a block image hold
every name, mode, owner and size; listing a tree never touches the data area.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from imagetool.erofs import layout as L
from imagetool.errors import InvalidSourceError
from imagetool.format import ROLE_DATA, ROLE_HOT, ROLE_LAYER, ROLE_METADATA, FileExtent
from imagetool.tree import LayerFiles, Node, Tree

log = logging.getLogger(__name__)

BLOCK_SIZE = L.DEFAULT_BLOCK_SIZE
INODE_TABLE_START = L.SUPERBLOCK_OFFSET + L.SUPERBLOCK_SIZE  # 1152, 32-byte aligned
INODE_SIZE = L.INODE_EXTENDED.size
VOLUME_NAME = b"lazyblock"


@dataclass(frozen=True, slots=True)
class DataExtent:
    """``length`` bytes of the image at ``image_offset`` come from ``spool_offset``."""

    image_offset: int
    spool_offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Region:
    """Image bytes ``[start, end)`` that are stored as one blob (``imagetool.format``): its
    role and, for a hot or layer region, the source layer's digest."""

    role: str
    layer: str
    start: int
    end: int


@dataclass(frozen=True)
class ErofsPlan:
    metadata: bytes | bytearray  # image bytes [0, len); a multiple of the block size; not to
    # be modified
    extents: tuple[DataExtent, ...]  # by image offset, all past the metadata
    size: int  # image size in bytes (multiple of the block size)
    files: tuple[FileExtent, ...]  # regular files with data, in layout order
    inode_count: int
    regions: tuple[Region, ...]  # in image order, covering [0, size)


class _Inode:
    __slots__ = (
        "node", "index", "nid", "nlink", "xattr_blob", "content", "layout",
        "inline_len", "blkaddr", "size", "entries",
    )  # fmt: skip

    def __init__(self, node: Node, index: int) -> None:
        self.node = node
        self.index = index
        self.nid = 0
        self.nlink = 0
        self.xattr_blob = b""
        self.content = b""  # symlinks: the target; directories: filled in when written
        self.layout = L.FLAT_PLAIN
        self.inline_len = 0
        self.blkaddr = 0
        self.size = 0
        self.entries: list[tuple[bytes, Node]] = []

    @property
    def meta_data_len(self) -> int:
        """Bytes of data kept in the metadata region: directories' and symlinks'."""
        return 0 if self.node.is_reg else self.size

    @property
    def record_size(self) -> int:
        return INODE_SIZE + len(self.xattr_blob) + self.inline_len


def plan_erofs(tree: Tree, order: Iterable[str] = ()) -> ErofsPlan:
    """Lay out ``tree`` as format version 1 does: metadata, then every file in layout order
    (``order``, a startup profile's paths, first; then depth-first), one region."""
    lay = _Layout(tree)
    for path in order:
        node = tree.lookup(path)
        if node is not None and node.is_reg:
            lay.place(node)
    for ino in lay.inodes:
        if ino.node.is_reg:
            lay.place(ino.node)
    size = lay.block * BLOCK_SIZE
    return lay.finish(size, (Region(ROLE_DATA, "", 0, size),))


def plan_erofs_regions(
    tree: Tree,
    layers: Sequence[LayerFiles],
    sector_size: int,
    order: Iterable[str] = (),
    hot_limit: int | None = None,
    align_limit: int | None = None,
) -> ErofsPlan:
    """Lay out ``tree`` in the regions of format version 2 (``imagetool.format``): metadata;
    a hot region per layer that holds files of ``order`` (a startup profile) smaller than
    ``hot_limit`` (default: a sector), copies of them in tar order; a region per layer of
    every file its tar holds (``layers``), in tar order, those of at least ``align_limit``
    (default: a sector) starting on a sector boundary. Every region starts on a sector
    boundary and depends on nothing but its layer (and, for a hot one, which of its files
    the profile names)."""
    hot_limit = sector_size if hot_limit is None else hot_limit
    align_limit = sector_size if align_limit is None else align_limit
    lay = _Layout(tree)
    lay.block = lay.align(lay.block, sector_size)
    regions = [Region(ROLE_METADATA, "", 0, lay.block * BLOCK_SIZE)]
    where = {id(node): (k, i) for k, lf in enumerate(layers) for i, node in enumerate(lf.nodes)}
    hot: list[dict[int, Node]] = [{} for _ in layers]
    for path in order:
        node = tree.lookup(path)
        if node is not None and node.is_reg and 0 < node.size < hot_limit and id(node) in where:
            k, i = where[id(node)]
            hot[k][i] = node
    for lf, chosen in zip(layers, hot, strict=True):
        start = lay.block
        for i in sorted(chosen):
            lay.place(chosen[i])
        lay.block = lay.align(lay.block, sector_size)
        if lay.block > start:
            regions.append(Region(ROLE_HOT, lf.digest, start * BLOCK_SIZE, lay.block * BLOCK_SIZE))
    for lf in layers:
        start = lay.block
        for node in lf.nodes:
            if node.size >= align_limit:
                lay.block = lay.align(lay.block, sector_size)
            lay.place(node, bytes_only=id(node) in lay.placed or id(node) not in lay.by_id)
        lay.block = lay.align(lay.block, sector_size)
        if lay.block > start:
            regions.append(
                Region(ROLE_LAYER, lf.digest, start * BLOCK_SIZE, lay.block * BLOCK_SIZE)
            )
    unplaced = [
        i.node for i in lay.inodes if i.node.is_reg and i.node.size and id(i.node) not in lay.placed
    ]
    if unplaced:
        raise AssertionError(f"{len(unplaced)} files of the tree are in no layer's file list")
    return lay.finish(lay.block * BLOCK_SIZE, tuple(regions))


class _Layout:
    """An image being laid out: its inodes and metadata blocks are placed when it is made;
    ``place`` then puts file data at ``block``, which only moves forward."""

    def __init__(self, tree: Tree) -> None:
        self.inodes, self.by_id, self.reg_paths = _collect(tree)
        for ino in self.inodes:
            _prepare(ino, self.by_id)

        # Inode table.
        pos = INODE_TABLE_START
        for ino in self.inodes:
            pos = L.align(pos, L.ISLOT_SIZE)
            rec = ino.record_size
            room = BLOCK_SIZE - pos % BLOCK_SIZE
            if (rec <= BLOCK_SIZE and rec > room) or (rec > BLOCK_SIZE and INODE_SIZE > room):
                pos = L.align(pos, BLOCK_SIZE)
            ino.nid = pos >> L.ISLOT_BITS
            pos += rec
        if self.inodes[0].nid > 0xFFFF:
            raise AssertionError("root nid must fit 16 bits")

        # Whole blocks of directories and long symlinks, still in the metadata region.
        block = L.align(pos, BLOCK_SIZE) // BLOCK_SIZE
        for ino in self.inodes:
            head = ino.meta_data_len - ino.inline_len
            if head:
                ino.blkaddr = block
                block += -(-head // BLOCK_SIZE)
        self.meta_end = block * BLOCK_SIZE
        self.block = block  # where the next file's data goes
        self.extents: list[DataExtent] = []
        self.files: list[FileExtent] = []
        self.placed: set[int] = set()  # nodes whose inode points at their data

    @staticmethod
    def align(block: int, boundary: int) -> int:
        """``block`` rounded up to a multiple of ``boundary`` bytes."""
        per = boundary // BLOCK_SIZE
        return -(-block // per) * per

    def place(self, node: Node, bytes_only: bool = False) -> None:
        """Put ``node``'s data at ``block``: its inode points there (once per node), or,
        ``bytes_only``, the bytes alone (a copy nothing points at)."""
        if node.size == 0 or (not bytes_only and id(node) in self.placed):
            return
        offset = self.block * BLOCK_SIZE
        self.extents.append(DataExtent(offset, node.spool_offset, node.size))
        if not bytes_only:
            self.placed.add(id(node))
            self.by_id[id(node)].blkaddr = self.block
            for path in self.reg_paths[id(node)]:
                self.files.append(FileExtent(path, offset, node.size))
        self.block += -(-node.size // BLOCK_SIZE)

    def finish(self, size: int, regions: tuple[Region, ...]) -> ErofsPlan:
        """The plan of an image of ``size`` bytes: every inode and the superblock written."""
        inodes, meta_end = self.inodes, self.meta_end
        meta = bytearray(meta_end)
        for ino in inodes:
            _write_inode(meta, ino, self.by_id)
        build_time = max((ino.node.mtime for ino in inodes), default=0)
        uuid = hashlib.sha256(meta).digest()[:16]
        sb = L.Superblock(
            magic=L.MAGIC, checksum=0, feature_compat=L.FEATURE_COMPAT_MTIME,
            blkszbits=L.DEFAULT_BLKSZBITS, sb_extslots=0, root_nid=inodes[0].nid,
            inos=len(inodes), build_time=build_time, build_time_nsec=0,
            blocks=size // BLOCK_SIZE, meta_blkaddr=0, xattr_blkaddr=0, uuid=uuid,
            volume_name=VOLUME_NAME, feature_incompat=0, u1=0, extra_devices=0,
            devt_slotoff=0, dirblkbits=0, xattr_prefix_count=0, xattr_prefix_start=0,
            packed_nid=0, xattr_filter_reserved=0, reserved=bytes(23),
        )  # fmt: skip
        meta[L.SUPERBLOCK_OFFSET : L.SUPERBLOCK_OFFSET + L.SUPERBLOCK_SIZE] = sb.pack()
        log.debug(
            "erofs: %d inodes, metadata %d bytes, image %d bytes in %d regions",
            len(inodes), meta_end, size, len(regions),
        )  # fmt: skip
        return ErofsPlan(meta, tuple(self.extents), size, tuple(self.files), len(inodes), regions)


def _collect(tree: Tree) -> tuple[list[_Inode], dict[int, _Inode], dict[int, list[str]]]:
    """Inodes in depth-first order (names in byte order), root first; link counts."""
    inodes: list[_Inode] = []
    by_id: dict[int, _Inode] = {}
    reg_paths: dict[int, list[str]] = {}
    parent_of: dict[int, Node] = {id(tree.root): tree.root}
    for path, node in tree.walk():
        ino = by_id.get(id(node))
        if ino is None:
            ino = _Inode(node, len(inodes))
            inodes.append(ino)
            by_id[id(node)] = ino
        if node.is_dir:
            ino.nlink = 2
            assert node.children is not None
            entries = [(os.fsencode(n), c) for n, c in node.children.items()]
            entries += [(b".", node), (b"..", parent_of[id(node)])]
            entries.sort(key=lambda e: e[0])
            ino.entries = entries
            for child in node.children.values():
                if child.is_dir:
                    ino.nlink += 1
                    parent_of[id(child)] = node
        else:
            ino.nlink += 1
            if node.is_reg:
                reg_paths.setdefault(id(node), []).append(path)
    return inodes, by_id, reg_paths


def _prepare(ino: _Inode, by_id: dict[int, _Inode]) -> None:
    node = ino.node
    ino.xattr_blob = _xattr_blob(node)
    if node.is_dir:
        ino.size = _dir_size(ino.entries)  # the bytes come once every nid is known
    elif node.is_symlink:
        ino.content = os.fsencode(node.target)
        ino.size = len(ino.content)
    elif node.is_reg:
        ino.size = node.size
    if ino.meta_data_len:
        tail = ino.meta_data_len % BLOCK_SIZE
        if tail and INODE_SIZE + len(ino.xattr_blob) + tail <= BLOCK_SIZE:
            ino.layout = L.FLAT_INLINE
            ino.inline_len = tail


def _dir_size(entries: Sequence[tuple[bytes, Node]]) -> int:
    """Length of the directory data ``_dir_blocks`` will produce, without building it."""
    size, used = 0, 0
    for name, _ in entries:
        need = L.DIRENT.size + len(name)
        if used + need > BLOCK_SIZE:
            size += BLOCK_SIZE
            used = 0
        used += need
    return size + used


def _dir_blocks(entries: Sequence[tuple[bytes, Node]], nid_of: dict[int, _Inode] | None) -> bytes:
    """Directory data: blocks of dirents + names; the last block is not padded."""
    out = bytearray()
    i = 0
    while i < len(entries):
        n, used = 0, 0
        while i + n < len(entries):
            need = L.DIRENT.size + len(entries[i + n][0])
            if used + need > BLOCK_SIZE:
                break
            used += need
            n += 1
        chunk = entries[i : i + n]
        nameoff = L.DIRENT.size * n
        heads, names = bytearray(), bytearray()
        for name, child in chunk:
            nid = nid_of[id(child)].nid if nid_of is not None else 0
            ftype = L.file_type_from_mode(child.mode)
            heads += L.DIRENT.pack(nid, nameoff + len(names), ftype, 0)
            names += name
        blk = heads + names
        i += n
        if i < len(entries):
            blk += bytes(BLOCK_SIZE - len(blk))
        out += blk
    return bytes(out)


def _xattr_blob(node: Node) -> bytes:
    if not node.xattrs:
        return b""
    entries = []
    for name, value in node.xattrs.items():
        split = L.split_xattr_name(name)
        if split is None:
            log.warning("dropping xattr %r: EROFS has no prefix for it", name)
            continue
        index, suffix = split
        suffix_b = os.fsencode(suffix)
        if len(suffix_b) > 255 or len(value) > 0xFFFF:
            raise InvalidSourceError(f"xattr {name!r} is too large for EROFS")
        entries.append((index, suffix_b, value))
    if not entries:
        return b""
    blob = bytearray(L.XATTR_IBODY_HEADER.pack(0, 0, bytes(7)))
    for index, suffix_b, value in sorted(entries):
        entry = L.XATTR_ENTRY.pack(len(suffix_b), index, len(value)) + suffix_b + value
        blob += entry + bytes(L.align(len(entry), L.XATTR_ALIGN) - len(entry))
    if L.xattr_icount(len(blob)) > 0xFFFF:
        raise InvalidSourceError("too many xattrs on one file for EROFS")
    return bytes(blob)


def _write_inode(meta: bytearray, ino: _Inode, by_id: dict[int, _Inode]) -> None:
    node = ino.node
    if node.is_dir:  # now that every nid is known
        ino.content = _dir_blocks(ino.entries, nid_of=by_id)
        assert len(ino.content) == ino.size, "directory size changed between passes"
    fmt = stat.S_IFMT(node.mode)
    if fmt in (stat.S_IFCHR, stat.S_IFBLK):
        i_u = L.encode_rdev(os.major(node.rdev), os.minor(node.rdev))
    elif ino.layout == L.FLAT_INLINE and ino.size < BLOCK_SIZE:
        i_u = 0  # all data is inline; no block is addressed
    else:
        i_u = ino.blkaddr
    raw = L.INODE_EXTENDED.pack(
        L.make_i_format(L.INODE_LAYOUT_EXTENDED, ino.layout),
        L.xattr_icount(len(ino.xattr_blob)),
        node.mode & 0xFFFF,
        0,
        ino.size,
        i_u,
        ino.index + 1,
        node.uid,
        node.gid,
        node.mtime,
        node.mtime_nsec,
        ino.nlink,
        bytes(16),
    )
    pos = ino.nid << L.ISLOT_BITS
    record = raw + ino.xattr_blob
    if ino.inline_len:
        record += ino.content[len(ino.content) - ino.inline_len :]
    meta[pos : pos + len(record)] = record
    head = ino.meta_data_len - ino.inline_len
    if head:
        start = ino.blkaddr * BLOCK_SIZE
        meta[start : start + head] = ino.content[:head]
    ino.entries = []  # written: free what only the writing needed
    ino.content = b""
