"""Check a published block image: every sector and every data blob, and optionally every file
against its source."""

from __future__ import annotations

import hashlib
import logging
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field

from imagetool.convert import build_tree
from imagetool.erofs import layout as L
from imagetool.erofs.reader import ErofsReader, Inode
from imagetool.errors import ChecksumError
from imagetool.format import Index
from imagetool.image import BlockImage
from imagetool.sources import SourceImage
from imagetool.tree import HashSink, Node, Tree

log = logging.getLogger(__name__)


# Stored bytes read in one request while verifying a blob.
VERIFY_READ_BYTES = 64 << 20


@dataclass
class VerifyReport:
    sectors: int = 0
    bad_sectors: list[str] = field(default_factory=list)
    blobs: int = 0
    bad_blobs: list[str] = field(default_factory=list)
    files: int = 0
    differences: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad_sectors and not self.bad_blobs and not self.differences


def verify_sectors(image: BlockImage, report: VerifyReport) -> None:
    """Every sector against its checksum and every data blob against its digest: each blob
    read once, from its first byte to its last, in requests of ``VERIFY_READ_BYTES``."""
    index = image.index
    members: list[list[int]] = [[] for _ in index.blobs]
    for n, s in enumerate(index.sectors):
        if s.is_zero:
            _check(index, n, b"", report)
        else:
            members[s.blob].append(n)
    for number, blob in enumerate(index.blobs):
        digest = hashlib.sha256()
        part: list[int] = []
        for n in [*members[number], None]:
            if part and (n is None or _span(index, [part[0], n]) > VERIFY_READ_BYTES):
                offset = index.sectors[part[0]].offset
                stored = image.store.read_range(blob.digest, offset, _span(index, part))
                digest.update(stored)
                for m in part:
                    lo = index.sectors[m].offset - offset
                    _check(index, m, stored[lo : lo + index.sectors[m].length], report)
                part = []
            if n is not None:
                part.append(n)
        report.blobs += 1
        if "sha256:" + digest.hexdigest() != blob.digest:
            report.bad_blobs.append(f"blob {blob.digest}: its bytes do not match its digest")


def _span(index: Index, run: list[int]) -> int:
    first, last = index.sectors[run[0]], index.sectors[run[-1]]
    return last.offset + last.length - first.offset


def _check(index: Index, n: int, stored: bytes, report: VerifyReport) -> None:
    try:
        index.decode_sector(n, stored)
    except ChecksumError as e:
        report.bad_sectors.append(str(e))
    report.sectors += 1


def source_tree(source: SourceImage) -> Tree:
    """The source's flattened tree with content digests instead of contents."""
    return build_tree(source, HashSink())


def representable_xattrs(node: Node) -> dict[str, bytes]:
    return {k: v for k, v in node.xattrs.items() if L.split_xattr_name(k) is not None}


def compare_tree(fs: ErofsReader, tree: Tree, report: VerifyReport) -> None:
    """Compare every entry of ``tree`` with the filesystem, and the other way round."""
    expected = dict(tree.walk())
    for path, node in expected.items():
        report.files += 1
        try:
            inode = fs.lookup(path)
        except (FileNotFoundError, NotADirectoryError):
            report.differences.append(f"{path}: missing from the image")
            continue
        report.differences.extend(f"{path}: {d}" for d in _diff(fs, node, inode))
    for path, _ in fs.walk("/"):
        if path not in expected:
            report.differences.append(f"{path}: in the image but not in the source")


def _diff(fs: ErofsReader, node: Node, inode: Inode) -> Iterator[str]:
    if node.mode != inode.mode:
        yield f"mode {inode.mode:o} != {node.mode:o}"
        if stat.S_IFMT(node.mode) != stat.S_IFMT(inode.mode):
            return
    if (node.uid, node.gid) != (inode.uid, inode.gid):
        yield f"owner {inode.uid}:{inode.gid} != {node.uid}:{node.gid}"
    if (node.mtime, node.mtime_nsec) != (inode.mtime, inode.mtime_nsec):
        yield f"mtime {inode.mtime}.{inode.mtime_nsec} != {node.mtime}.{node.mtime_nsec}"
    if fs.xattrs(inode) != representable_xattrs(node):
        yield "xattrs differ"
    if node.is_reg:
        if inode.size != node.size:
            yield f"size {inode.size} != {node.size}"
        else:
            h = hashlib.sha256()
            for chunk in fs.iter_content(inode):
                h.update(chunk)
            if h.hexdigest() != node.sha256:
                yield "content differs"
    elif node.is_symlink:
        if fs.readlink(inode) != node.target:
            yield f"link target {fs.readlink(inode)!r} != {node.target!r}"
    elif stat.S_ISCHR(node.mode) or stat.S_ISBLK(node.mode):
        if inode.rdev != node.rdev:
            yield f"device {inode.rdev} != {node.rdev}"
