"""The flattened root filesystem of an image: layers applied in order, in memory.

``flatten`` reads each layer's uncompressed tar stream once, front to back, and applies it to
a tree of ``Node`` objects: entries replace what lower layers had, ``.wh.NAME`` whiteouts
delete, ``.wh..wh..opq`` makes a directory opaque (hides everything lower layers put there),
hard links share one ``Node``. File contents are not kept in memory: they are appended to a
*spool* file and each node records where its bytes are (or, for verification, only their
sha256). Memory therefore grows with the number of entries, never with the image size.

Entries that would escape the root are refused with ``UnsafePathError``: absolute names, ``..``
components, and any path (or hard-link target) that goes *through* a symlink, since applying it
on a real filesystem would write outside the directory the layer is unpacked into.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import stat
import tarfile
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from imagetool.errors import InvalidSourceError, UnsafePathError

log = logging.getLogger(__name__)

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
COPY_CHUNK = 1 << 20
# Parent directories that a layer implies but does not list get these (as docker does).
IMPLICIT_DIR_MODE = 0o755

S_IFMT = stat.S_IFMT


@dataclass(eq=False, slots=True)
class Node:
    """One inode of the flattened tree. ``mode`` includes the file type bits."""

    mode: int
    uid: int = 0
    gid: int = 0
    mtime: int = 0
    mtime_nsec: int = 0
    xattrs: dict[str, bytes] = field(default_factory=dict)
    size: int = 0  # regular files: content length
    spool_offset: int = -1  # regular files: where the content starts in the spool
    sha256: str = ""  # regular files: content digest (hash mode)
    target: str = ""  # symlinks
    rdev: int = 0  # devices: os.makedev(major, minor)
    children: dict[str, Node] | None = None  # directories: name -> node

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def is_symlink(self) -> bool:
        return stat.S_ISLNK(self.mode)


def new_dir(mode: int = IMPLICIT_DIR_MODE) -> Node:
    return Node(mode=stat.S_IFDIR | mode, children={})


@dataclass
class Tree:
    root: Node = field(default_factory=new_dir)

    def lookup(self, path: str) -> Node | None:
        node = self.root
        for part in split_path(path.lstrip("/")):
            if node.children is None or part not in node.children:
                return None
            node = node.children[part]
        return node

    def walk(self) -> Iterator[tuple[str, Node]]:
        """Depth-first, names in byte order, root first as ``/``."""
        stack: list[tuple[str, Node]] = [("/", self.root)]
        while stack:
            path, node = stack.pop()
            yield path, node
            if node.children:
                prefix = path if path.endswith("/") else path + "/"
                for name in sorted(node.children, key=os.fsencode, reverse=True):
                    stack.append((prefix + name, node.children[name]))


class ContentSink:
    """Where regular file contents go while flattening."""

    def begin_layer(self, digest: str) -> None:  # noqa: B027 - optional hook
        """The files written from now on come from the source layer ``digest``."""

    def write_file(self, node: Node, stream: BinaryIO, size: int) -> None:
        raise NotImplementedError


@dataclass
class LayerFiles:
    """The regular files one source layer's tar holds, in tar order: the ones an upper layer
    replaced or deleted too (their bytes are still in the spool)."""

    digest: str
    nodes: list[Node] = field(default_factory=list)


class SpoolSink(ContentSink):
    """Append contents to a spool file; nodes remember offset and size. ``layers``: the
    files of each layer, in the order they were written."""

    def __init__(self, spool: BinaryIO) -> None:
        self.spool = spool
        self.offset = spool.seek(0, os.SEEK_END)
        self.layers: list[LayerFiles] = []

    def begin_layer(self, digest: str) -> None:
        self.layers.append(LayerFiles(digest))

    def write_file(self, node: Node, stream: BinaryIO, size: int) -> None:
        node.spool_offset = self.offset
        node.size = _copy(stream, size, self.spool.write)
        self.offset += node.size
        if self.layers:
            self.layers[-1].nodes.append(node)


class HashSink(ContentSink):
    """Keep only each file's sha256 (to verify a converted image against its source)."""

    def write_file(self, node: Node, stream: BinaryIO, size: int) -> None:
        h = hashlib.sha256()
        node.size = _copy(stream, size, h.update)
        node.sha256 = h.hexdigest()


def _copy(stream: BinaryIO, size: int, out: Callable[[bytes], object]) -> int:
    done = 0
    while done < size:
        chunk = stream.read(min(COPY_CHUNK, size - done))
        if not chunk:
            raise InvalidSourceError("layer tar is truncated inside a file")
        out(chunk)
        done += len(chunk)
    return done


def split_path(name: str) -> list[str]:
    """Normalise a tar member name into path components, refusing escapes."""
    if name.startswith("/"):
        raise UnsafePathError(f"absolute path in layer: {name!r}")
    parts = []
    for part in name.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            raise UnsafePathError(f"path escapes the image root: {name!r}")
        parts.append(part)
    return parts


class _LayerApplier:
    def __init__(self, tree: Tree, sink: ContentSink, layer_name: str) -> None:
        self.tree = tree
        self.sink = sink
        self.layer_name = layer_name
        # Directory entries created by this layer: a whiteout or opaque marker in the same
        # layer only hides what lower layers put there.
        self.added: dict[int, set[str]] = {}

    def parent_of(self, parts: list[str], name: str) -> Node:
        """The directory that will hold ``parts[-1]``, creating missing parents."""
        node = self.tree.root
        for part in parts[:-1]:
            assert node.children is not None
            child = node.children.get(part)
            if child is None:
                child = new_dir()
                node.children[part] = child
                self.added.setdefault(id(node), set()).add(part)
            elif child.is_symlink:
                raise UnsafePathError(f"layer entry {name!r} goes through symlink {part!r}")
            elif not child.is_dir:
                # A file where a directory is implied: the layer replaces it.
                child = new_dir()
                node.children[part] = child
                self.added.setdefault(id(node), set()).add(part)
            node = child
        return node

    def resolve_existing(self, name: str) -> Node:
        parts = split_path(name)
        node = self.tree.root
        for i, part in enumerate(parts):
            if node.children is None or part not in node.children:
                raise InvalidSourceError(f"hard link to missing file {name!r}")
            node = node.children[part]
            if node.is_symlink and i < len(parts) - 1:
                raise UnsafePathError(f"hard link target {name!r} goes through a symlink")
        return node

    def apply(self, member: tarfile.TarInfo, tar: tarfile.TarFile) -> None:
        name = member.name
        parts = split_path(name)
        if not parts:  # the "./" entry: root directory metadata
            if member.isdir():
                _set_meta(self.tree.root, member)
            return
        base = parts[-1]
        if base.startswith(WHITEOUT_PREFIX):
            parent = self.parent_of(parts, name)
            assert parent.children is not None
            mine = self.added.get(id(parent), set())
            if base == OPAQUE_MARKER:
                for child in list(parent.children):
                    if child not in mine:
                        del parent.children[child]
            elif base.startswith(WHITEOUT_PREFIX + WHITEOUT_PREFIX):
                log.debug("ignoring special whiteout %s in %s", name, self.layer_name)
            else:
                target = base[len(WHITEOUT_PREFIX) :]
                if target and target not in mine:
                    parent.children.pop(target, None)
            return
        if len(os.fsencode(base)) > 255:
            raise InvalidSourceError(f"file name longer than 255 bytes: {name!r}")
        parent = self.parent_of(parts, name)
        assert parent.children is not None
        existing = parent.children.get(base)
        if existing is not None and existing.is_dir and member.isdir():
            _set_meta(existing, member)  # directories merge: keep children, take new metadata
            self.added.setdefault(id(parent), set()).add(base)
            return
        if member.islnk():
            node = self.resolve_existing(member.linkname)
            if node.is_dir:
                raise InvalidSourceError(f"hard link to a directory: {name!r}")
        else:
            node = self.make_node(member, tar, name)
        parent.children[base] = node
        self.added.setdefault(id(parent), set()).add(base)

    def make_node(self, member: tarfile.TarInfo, tar: tarfile.TarFile, name: str) -> Node:
        if member.isreg():
            node = Node(mode=stat.S_IFREG)
            stream = tar.extractfile(member)
            assert stream is not None
            self.sink.write_file(node, stream, member.size)
        elif member.isdir():
            node = new_dir()
        elif member.issym():
            node = Node(mode=stat.S_IFLNK, target=member.linkname)
            if not member.linkname:
                raise InvalidSourceError(f"symlink without target: {name!r}")
            if len(os.fsencode(member.linkname)) > 4095:
                raise InvalidSourceError(f"symlink target too long: {name!r}")
        elif member.ischr() or member.isblk():
            kind = stat.S_IFCHR if member.ischr() else stat.S_IFBLK
            node = Node(mode=kind, rdev=os.makedev(member.devmajor, member.devminor))
        elif member.isfifo():
            node = Node(mode=stat.S_IFIFO)
        else:
            raise InvalidSourceError(f"unsupported tar entry type {member.type!r}: {name!r}")
        _set_meta(node, member)
        return node


def _set_meta(node: Node, member: tarfile.TarInfo) -> None:
    node.mode = S_IFMT(node.mode) | (member.mode & 0o7777)
    node.uid = member.uid
    node.gid = member.gid
    mtime = member.pax_headers.get("mtime")
    if mtime is not None:
        sec, _, frac = mtime.partition(".")
        try:
            node.mtime = int(sec)
            node.mtime_nsec = int((frac + "000000000")[:9]) if frac else 0
        except ValueError:
            node.mtime = int(member.mtime)
    else:
        node.mtime = int(member.mtime)
    node.mtime = max(0, node.mtime)
    node.xattrs = _xattrs(member)


_NO_XATTRS: dict[str, bytes] = {}  # shared by every node without xattrs; never mutated


def _xattrs(member: tarfile.TarInfo) -> dict[str, bytes]:
    if not member.pax_headers:
        return _NO_XATTRS
    out: dict[str, bytes] = {}
    for key, value in member.pax_headers.items():
        if key.startswith("SCHILY.xattr."):
            out[key[len("SCHILY.xattr.") :]] = value.encode("utf-8", "surrogateescape")
        elif key.startswith("LIBARCHIVE.xattr."):
            xname = urllib.parse.unquote(key[len("LIBARCHIVE.xattr.") :])
            try:
                out[xname] = base64.b64decode(value + "=" * (-len(value) % 4))
            except ValueError:
                raise InvalidSourceError(f"bad xattr encoding on {member.name!r}") from None
    return out or _NO_XATTRS


def apply_layer(tree: Tree, stream: BinaryIO, sink: ContentSink, layer_name: str) -> None:
    """Apply one uncompressed layer tar stream to ``tree``; reads ``stream`` to its end."""
    applier = _LayerApplier(tree, sink, layer_name)
    try:
        # "r:" reads headers and data straight from the stream, which only ever moves forward
        # (ReadAhead seeks forward by reading); "r|" would copy its buffer on every header.
        with tarfile.open(fileobj=stream, mode="r:", errorlevel=2) as tar:
            for member in tar:
                applier.apply(member, tar)
                tar.members.clear()  # TarFile keeps every member otherwise
            # tarfile ends quietly on a missing or short header; a real end of archive is a
            # whole zero block, which it has just read.
            if stream.tell() < tar.offset + tarfile.BLOCKSIZE:
                raise InvalidSourceError(f"layer {layer_name}: truncated tar (no end marker)")
        # Read the rest (tar padding) so the source can check digests at end of stream.
        while stream.read(COPY_CHUNK):
            pass
    except tarfile.TarError as e:
        raise InvalidSourceError(f"layer {layer_name}: corrupt tar: {e}") from None
    except EOFError as e:
        raise InvalidSourceError(f"layer {layer_name}: truncated: {e}") from None
    except InvalidSourceError as e:
        if layer_name in str(e):
            raise
        raise type(e)(f"layer {layer_name}: {e}") from None
