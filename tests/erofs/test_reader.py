"""The pure-Python EROFS reader against two oracles: mkfs.erofs's input tree, and the kernel.

A source tree covering the awkward cases (a 20,000-entry directory, block-boundary file
sizes, long symlinks, hard links, devices, special mode bits, big ids, nanosecond mtimes,
inline and shared xattrs, non-ASCII and 255-byte names) is built once per module, turned
into images by ``mkfs.erofs`` in several layouts, and read back with ``ErofsReader``; every
path, mode, owner, size, link count, mtime, device number, link target, xattr and byte must
match ``os.lstat`` of the source (and of the kernel's mount of the same image). Corruption
tests check that malformed images raise ``ErofsError`` and nothing else.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
import stat
import struct
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import require, require_root, require_tool

from imagetool.erofs import layout as L
from imagetool.erofs.reader import ErofsReader, Inode
from imagetool.errors import ErofsError

BIG_DIR_ENTRIES = 20_000
BUILD_TIME = 1_234_567_890  # -T for the compact variant: every mtime becomes this
FIXED_UUID = "3b2f6c1e-58a4-4d0e-9a51-2f7d0c1b9e42"
CAPABILITY = struct.pack("<IIIII", 0x02000001, 1 << 10, 0, 0, 0)  # v2, cap_net_bind_service+ep
NON_UTF8 = os.fsdecode(b"latin1-\xe9t\xe9")
LONG_NAME = "n" * 254  # mkfs.erofs 1.5 fails on 255-byte names ("No such file or directory")


# --- the source tree ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Tree:
    root: Path
    privileged: bool  # built as root: devices, foreign owners, trusted.* and security.* xattrs
    user_xattrs: bool


def _set_mtime(path: Path, ns: int) -> None:
    os.utime(path, ns=(ns, ns), follow_symlinks=False)


def _try_setxattr(path: Path, name: str, value: bytes) -> bool:
    try:
        os.setxattr(path, name, value, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EPERM, errno.EACCES):
            return False
        raise
    return True


def _build_tree(root: Path) -> Tree:
    privileged = os.geteuid() == 0
    rng = random.Random(1234)
    root.mkdir()
    (root / "a" / "b" / "c").mkdir(parents=True)
    (root / "a" / "b" / "c" / "deep.txt").write_bytes(b"deep\n")
    (root / "empty").write_bytes(b"")
    (root / "one").write_bytes(b"1")
    for n in (4095, 4096, 4097, 8192, 12289):
        (root / f"size-{n}").write_bytes(rng.randbytes(n))
    (root / "several-mb").write_bytes(rng.randbytes(3 * 1024 * 1024 + 123))
    with open(root / "sparse", "wb") as f:  # holes, if the writer keeps them
        f.write(b"head")
        f.seek(1 << 20)
        f.write(b"tail")
    (root / "short-link").symlink_to("one")
    (root / "long-link").symlink_to("x" * 70)
    (root / "very-long-link").symlink_to("/".join(["segment"] * 125))  # 999 bytes, dangling
    (root / "dir-link").symlink_to("a")
    (root / "hard1").write_bytes(b"linked content")
    os.link(root / "hard1", root / "hard2")
    os.link(root / "hard1", root / "a" / "hard3")
    os.mkfifo(root / "fifo")
    (root / "setuid").write_bytes(b"#!/bin/sh\n")
    os.chmod(root / "setuid", 0o4755)
    (root / "setgid-dir").mkdir()
    os.chmod(root / "setgid-dir", 0o2775)
    (root / "sticky-dir").mkdir()
    os.chmod(root / "sticky-dir", 0o1777)
    (root / "odd-mode").write_bytes(b"")
    os.chmod(root / "odd-mode", 0o6407)
    (root / "héllo-✓-ünïcødé").write_bytes("ü".encode())
    (root / LONG_NAME).write_bytes(b"long name")
    (root / NON_UTF8).write_bytes(b"latin-1 name")
    (root / "many").mkdir()
    for i in range(400):  # a directory of a few blocks in every variant
        (root / "many" / f"entry-{i:03d}-{'y' * (i % 23)}").write_bytes(b"%d" % i)

    user_xattrs = _try_setxattr(root / "one", "user.comment", b"hello")
    if user_xattrs:
        _try_setxattr(root / "a", "user.dir", b"on a directory")
        _try_setxattr(root / "size-4097", "user.empty", b"")
        _try_setxattr(root / "size-4097", "user.binary", bytes(range(256)))
        for i in range(6):  # the same xattr on many inodes becomes a shared xattr
            path = root / f"shared-{i}"
            path.write_bytes(b"s%d" % i)
            _try_setxattr(path, "user.shared", b"one value for all")
            _try_setxattr(path, "user.own", b"%d" % i)
    if privileged:
        os.mknod(root / "chr", 0o620 | stat.S_IFCHR, os.makedev(1, 3))
        os.mknod(root / "blk", 0o660 | stat.S_IFBLK, os.makedev(259, 70000))
        os.chown(root / "one", 70000, 80000)
        os.chown(root / "a", 123456, 654321)
        os.chown(root / "short-link", 65536, 65537, follow_symlinks=False)
        _try_setxattr(root / "setuid", "trusted.overlay.opaque", b"y")
        _try_setxattr(root / "setuid", "security.capability", CAPABILITY)

    _set_mtime(root / "one", 981_173_106_123_456_789)
    _set_mtime(root / "short-link", 1_500_000_000_000_000_001)
    _set_mtime(root / "a" / "b" / "c", 4_000_000_000_987_654_321)  # after 2038
    _set_mtime(root / "empty", 0)
    return Tree(root, privileged, user_xattrs)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Tree:
    return _build_tree(tmp_path_factory.mktemp("erofs-src") / "root")


def _big_dir_name(i: int) -> str:
    return f"f{i:05d}{'x' * (i % 40)}"


def _mkfs(src: Path, out: Path, *options: str) -> Path:
    require_tool("mkfs.erofs")
    proc = subprocess.run(
        ["mkfs.erofs", "--quiet", *options, str(out), str(src)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise AssertionError(f"mkfs.erofs {' '.join(options)} failed: {proc.stderr}")
    return out


def _scratch_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A fresh directory, on tmpfs when there is one: creating 20,000 files on a busy disk
    can take half a minute, on tmpfs about a second."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 256 << 20:
        return Path(tempfile.mkdtemp(prefix=f"lazyblock-{name}-", dir=shm))
    return tmp_path_factory.mktemp(name)


@pytest.fixture(scope="module")
def big_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An image of a tree whose one directory has 20,000 entries (spanning ~190 blocks)."""
    require_tool("mkfs.erofs")
    base = _scratch_dir(tmp_path_factory, "erofs-big")
    try:
        big = base / "src" / "big-dir"
        big.mkdir(parents=True)
        for i in range(BIG_DIR_ENTRIES):
            os.close(os.open(big / _big_dir_name(i), os.O_CREAT | os.O_WRONLY, 0o644))
        (big / "zz-subdir").mkdir()
        (big / "zz-subdir" / "inner").write_bytes(b"inner")
        yield _mkfs(base / "src", base / "big.erofs", "--preserve-mtime")
    finally:
        shutil.rmtree(base, ignore_errors=True)


# name -> (mkfs options, whether per-file mtime and owners are kept)
VARIANTS: dict[str, tuple[tuple[str, ...], bool]] = {
    "inline": (("--preserve-mtime", f"-U{FIXED_UUID}"), True),
    "plain": (("--preserve-mtime", "-Enoinline_data"), True),
    "chunk-map": (("--preserve-mtime", "--chunksize=4096"), True),
    "chunk-index": (("--preserve-mtime", "--chunksize=65536", "-Eforce-chunk-indexes"), True),
    "compact": (("--all-root", "-Eforce-inode-compact", f"-T{BUILD_TIME}"), False),
}


@pytest.fixture(scope="module")
def images(tree: Tree, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    require_tool("mkfs.erofs")
    out = tmp_path_factory.mktemp("erofs-img")
    return {
        name: _mkfs(tree.root, out / f"{name}.erofs", *opts) for name, (opts, _) in VARIANTS.items()
    }


@pytest.fixture
def open_image() -> Iterator:
    readers: list[ErofsReader] = []

    def _open(path: Path) -> ErofsReader:
        reader = ErofsReader.open_file(path)
        readers.append(reader)
        return reader

    yield _open
    for reader in readers:
        reader.close()


def _memory_reader(data: bytes, size: int | None = -1) -> ErofsReader:
    view = bytes(data)
    return ErofsReader(lambda off, n: view[off : off + n], len(view) if size == -1 else size)


def _patched_reader(data: bytearray) -> ErofsReader:
    """A reader over a corrupted image whose superblock checksum was recomputed.

    The checksum covers all of block 0, which also holds the first inodes and directories;
    fixing it lets the corruption reach the parsers it is meant for.
    """
    _fix_checksum(data)
    return _memory_reader(data)


# --- comparison against the source tree --------------------------------------------------------


def _expected_walk(root: Path) -> list[str]:
    """Depth-first paths under ``root``, names in byte order, as the reader should walk."""
    out: list[str] = []

    def visit(rel: bytes) -> None:
        out.append(os.fsdecode(rel or b"/"))
        full = os.fsencode(root) + rel
        if stat.S_ISDIR(os.lstat(full).st_mode):
            for name in sorted(os.listdir(full)):
                visit(rel + b"/" + name)

    visit(b"")
    return out


def _xattrs_of(path: str) -> dict[str, bytes]:
    return {
        name: os.getxattr(path, name, follow_symlinks=False)
        for name in os.listxattr(path, follow_symlinks=False)
    }


def _content_digest(reader: ErofsReader, inode: Inode) -> str:
    h = hashlib.sha256()
    for piece in reader.iter_content(inode, chunk=256 * 1024):
        assert 0 < len(piece) <= 256 * 1024
        h.update(piece)
    return h.hexdigest()


def _file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _compare(
    reader: ErofsReader,
    root: Path,
    *,
    keeps_meta: bool,
    kernel: bool = False,
) -> None:
    """Everything the reader sees matches ``os.lstat`` & co. under ``root``.

    ``kernel`` means ``root`` is the kernel's mount of the same image, so directory sizes and
    every mtime and owner must match exactly; otherwise ``root`` is mkfs's source tree and
    ``keeps_meta`` says whether the image kept mtimes and owners.
    """
    walked = list(reader.walk())
    assert [p for p, _ in walked] == _expected_walk(root)
    nids_by_ino: dict[int, set[int]] = {}
    for path, inode in walked:
        full = os.fsdecode(os.fsencode(root) + os.fsencode(path if path != "/" else ""))
        st = os.lstat(full)
        assert inode.mode == st.st_mode, path
        if keeps_meta or kernel:
            assert (inode.uid, inode.gid) == (st.st_uid, st.st_gid), path
            mtime_ns = inode.mtime * 1_000_000_000 + inode.mtime_nsec
            assert mtime_ns == st.st_mtime_ns, path
        else:
            assert (inode.uid, inode.gid) == (0, 0), path
            assert inode.mtime == reader.build_time == BUILD_TIME, path
        if inode.is_dir:
            subdirs = sum(1 for _, _, ft in reader.listdir(inode) if ft == L.FT_DIR)
            assert inode.nlink == 2 + subdirs, path
            names = sorted(os.fsencode(n) for n in os.listdir(full))
            listed = reader.listdir(inode)
            assert [os.fsencode(n) for n, _, _ in listed] == names, path
            if kernel:
                assert inode.size == st.st_size, path
                assert [n for n, _, _ in listed] == os.listdir(full), path  # on-disk order
        else:
            assert inode.size == st.st_size, path
        if kernel or not inode.is_dir:
            assert inode.nlink == st.st_nlink, path
        if inode.is_reg and inode.size == 0:
            assert reader.read(inode) == b"" and reader.data_extents(inode) == []
        elif inode.is_reg:
            assert _content_digest(reader, inode) == _file_digest(full), path
            extents = reader.data_extents(inode)
            assert sum(n for _, n in extents) <= inode.size
        elif inode.is_symlink:
            assert reader.readlink(inode) == os.readlink(full), path
        if stat.S_ISCHR(inode.mode) or stat.S_ISBLK(inode.mode):
            assert inode.rdev == st.st_rdev, path
            assert (inode.rdev_major, inode.rdev_minor) == (
                os.major(st.st_rdev),
                os.minor(st.st_rdev),
            )
        else:
            assert inode.rdev == 0, path
        assert reader.xattrs(inode) == _xattrs_of(full), path
        nids_by_ino.setdefault(st.st_ino, set()).add(inode.nid)
        if len(walked) < 1000:  # test_big_directory_lookup covers the big one
            assert reader.lookup(path) == inode
    # hard links share one inode, and distinct files have distinct inodes
    assert all(len(nids) == 1 for nids in nids_by_ino.values())
    assert len({inode.nid for _, inode in walked}) == len(nids_by_ino)


@pytest.mark.integration
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_source_tree(variant: str, tree: Tree, images: dict[str, Path], open_image) -> None:
    reader = open_image(images[variant])
    assert reader.block_size == 4096
    assert reader.inodes == len({i.nid for _, i in reader.walk()})
    assert reader.blocks * reader.block_size == images[variant].stat().st_size
    _compare(reader, tree.root, keeps_meta=VARIANTS[variant][1])


@pytest.mark.integration
def test_layouts_are_the_ones_under_test(images: dict[str, Path], open_image) -> None:
    """Each variant really exercises the data layout and inode form it is named after."""
    layouts = {}
    for name, path in images.items():
        reader = open_image(path)
        layouts[name] = {
            i.layout for _, i in reader.walk() if i.is_reg and i.size > 4096 and i.size % 4096
        }
        compact = {i.compact for _, i in reader.walk()}
        if name == "compact":
            assert compact == {True}
        else:  # per-file mtimes and big ids need extended inodes
            assert False in compact, name
    assert layouts["inline"] == {L.FLAT_INLINE}
    assert layouts["plain"] == {L.FLAT_PLAIN}
    assert layouts["chunk-map"] == layouts["chunk-index"] == {L.CHUNK_BASED}
    reader = open_image(images["chunk-index"])
    assert reader.feature_incompat & L.FEATURE_INCOMPAT_CHUNKED_FILE


@pytest.mark.integration
def test_superblock_fields(images: dict[str, Path], open_image) -> None:
    reader = open_image(images["inline"])
    assert reader.uuid == uuid.UUID(FIXED_UUID)
    assert reader.volume_name == ""
    assert reader.inode(reader.root_nid).is_dir
    assert open_image(images["compact"]).build_time == BUILD_TIME


@pytest.mark.integration
def test_special_files(tree: Tree, images: dict[str, Path], open_image) -> None:
    require_root()
    reader = open_image(images["inline"])
    chr_ = reader.lookup("/chr")
    assert stat.S_ISCHR(chr_.mode) and (chr_.rdev_major, chr_.rdev_minor) == (1, 3)
    blk = reader.lookup("/blk")
    assert stat.S_ISBLK(blk.mode) and (blk.rdev_major, blk.rdev_minor) == (259, 70000)
    assert blk.file_type == L.FT_BLKDEV
    assert stat.S_ISFIFO(reader.lookup("/fifo").mode)
    assert reader.xattrs(reader.lookup("/setuid")) == {
        "trusted.overlay.opaque": b"y",
        "security.capability": CAPABILITY,
    }
    assert (reader.lookup("/one").uid, reader.lookup("/a").gid) == (70000, 654321)


@pytest.mark.integration
def test_shared_xattrs_are_read(tree: Tree, images: dict[str, Path], open_image) -> None:
    require(tree.user_xattrs, "the temporary file system has no user xattrs")
    reader = open_image(images["inline"])
    inode = reader.lookup("/shared-3")
    body = reader._read(inode._iloc + inode._isize, inode._xattr_isize, "test")
    _filter, shared_count, _ = L.XATTR_IBODY_HEADER.unpack_from(body)
    assert shared_count >= 1  # mkfs.erofs shares the common one
    assert reader.xattrs(inode) == {"user.shared": b"one value for all", "user.own": b"3"}


# --- API behaviour on one image ----------------------------------------------------------------


@pytest.mark.integration
def test_lookup_errors(images: dict[str, Path], open_image) -> None:
    reader = open_image(images["inline"])
    with pytest.raises(FileNotFoundError):
        reader.lookup("/nope")
    with pytest.raises(FileNotFoundError):
        reader.lookup("/a/b/c/nope")
    with pytest.raises(NotADirectoryError):
        reader.lookup("/one/x")
    with pytest.raises(NotADirectoryError):
        reader.lookup("/dir-link/b")  # intermediate symlinks are not followed
    assert reader.lookup("/dir-link").is_symlink  # a final one is returned as is
    assert reader.lookup("/") == reader.lookup("") == reader.inode(reader.root_nid)
    assert reader.lookup("//a/./b/") == reader.lookup("/a/b")
    assert reader.lookup("/a/b/..") == reader.lookup("/a")  # '..' is a real dirent
    with pytest.raises(NotADirectoryError):
        reader.listdir("/one")
    with pytest.raises(NotADirectoryError):
        reader.listdir("/dir-link")
    with pytest.raises(OSError) as exc:
        reader.readlink(reader.lookup("/one"))
    assert exc.value.errno == errno.EINVAL


@pytest.mark.integration
def test_big_directory_lookup(big_image: Path, open_image) -> None:
    reader = open_image(big_image)
    big = reader.lookup("/big-dir")
    assert big.size > 50 * reader.block_size  # spans many blocks
    listing = reader.listdir(big)
    assert len(listing) == BIG_DIR_ENTRIES + 1
    assert reader.listdir("/big-dir") == listing
    for name, nid, file_type in listing:  # binary search finds every entry
        inode = reader.lookup(f"/big-dir/{name}")
        assert (inode.nid, inode.file_type) == (nid, file_type)
    for missing in ("A", "f", "f00001", "f00000x", "f19999", "f20000", "zz", "zz-subdir0", "~"):
        with pytest.raises(FileNotFoundError):
            reader.lookup(f"/big-dir/{missing}")
    assert reader.read(reader.lookup("/big-dir/zz-subdir/inner")) == b"inner"
    want = sorted([_big_dir_name(i) for i in range(BIG_DIR_ENTRIES)] + ["zz-subdir"])
    assert [n for n, _, _ in listing] == want
    assert len(list(reader.walk())) == BIG_DIR_ENTRIES + 4


@pytest.mark.integration
def test_odd_names(images: dict[str, Path], open_image) -> None:
    reader = open_image(images["inline"])
    assert reader.read(reader.lookup("/héllo-✓-ünïcødé")) == "ü".encode()
    assert reader.read(reader.lookup("/" + LONG_NAME)) == b"long name"
    assert reader.read(reader.lookup("/" + NON_UTF8)) == b"latin-1 name"
    names = [n for n, _, _ in reader.listdir("/")]
    assert NON_UTF8 in names and LONG_NAME in names


@pytest.mark.integration
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_read_ranges_and_extents(
    variant: str, tree: Tree, images: dict[str, Path], open_image
) -> None:
    reader = open_image(images[variant])
    image = images[variant].read_bytes()
    for name in ("size-4095", "size-4096", "size-4097", "size-12289", "several-mb", "one"):
        want = (tree.root / name).read_bytes()
        inode = reader.lookup("/" + name)
        assert reader.read(inode) == want
        for offset, size in ((0, 1), (4095, 3), (4096, 4096), (1, -1), (len(want), 5), (9, 0)):
            assert reader.read(inode, offset, size) == want[offset:][: size if size >= 0 else None]
        assert reader.read(inode, len(want) + 100) == b""
        with pytest.raises(ValueError):
            reader.read(inode, -1)
        pieces = list(reader.iter_content(inode, chunk=1000))
        assert b"".join(pieces) == want and all(len(p) <= 1000 for p in pieces)
        # the extents locate exactly the file's bytes in the image (no holes in these files)
        extents = reader.data_extents(inode)
        assert b"".join(image[off : off + n] for off, n in extents) == want
    sparse = reader.lookup("/sparse")
    assert reader.read(sparse, 0, 4) == b"head"
    assert reader.read(sparse, (1 << 20) - 2) == b"\0\0tail"
    assert reader.data_extents(reader.lookup("/empty")) == []
    assert list(reader.iter_content(reader.lookup("/empty"))) == []


@pytest.mark.integration
def test_walk_subtree(images: dict[str, Path], open_image) -> None:
    reader = open_image(images["inline"])
    assert [p for p, _ in reader.walk("/a")] == [
        "/a",
        "/a/b",
        "/a/b/c",
        "/a/b/c/deep.txt",
        "/a/hard3",
    ]
    assert [p for p, _ in reader.walk("/one")] == ["/one"]
    assert [p for p, _ in reader.walk("/dir-link")] == ["/dir-link"]
    with pytest.raises(FileNotFoundError):
        list(reader.walk("/nope"))


@pytest.mark.integration
def test_compressed_files_are_refused(tmp_path: Path, open_image) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "text").write_bytes(b"compress me " * 10000)
    reader = open_image(_mkfs(src, tmp_path / "z.erofs", "-zlz4"))
    inode = reader.lookup("/text")
    assert inode.layout in L.COMPRESSED_LAYOUTS and inode.size == 120000
    with pytest.raises(ErofsError, match="compressed"):
        reader.read(inode)
    with pytest.raises(ErofsError, match="compressed"):
        reader.data_extents(inode)


# --- the kernel as a second oracle -------------------------------------------------------------


@pytest.fixture
def mount_image(tmp_path: Path) -> Iterator:
    mounted: list[tuple[Path, Path]] = []

    def _mount(image: Path) -> Path:
        require_root()
        require_tool("mount", "umount", "losetup")
        require(os.path.exists("/dev/loop-control"), "needs loop devices")
        with open("/proc/filesystems") as f:
            require("erofs" in f.read(), "the kernel has no erofs")
        target = tmp_path / f"mnt{len(mounted)}"
        target.mkdir()
        subprocess.run(
            ["mount", "-t", "erofs", "-o", "loop,ro", str(image), str(target)],
            check=True,
            capture_output=True,
        )
        mounted.append((image, target))
        return target

    yield _mount
    for image, target in reversed(mounted):
        subprocess.run(["umount", str(target)], check=False, capture_output=True)
        loops = subprocess.run(["losetup", "-j", str(image)], capture_output=True, text=True).stdout
        for line in loops.splitlines():  # autoclear should have detached it already
            subprocess.run(["losetup", "-d", line.split(":", 1)[0]], check=False)


@pytest.mark.root
@pytest.mark.integration
@pytest.mark.parametrize("variant", ["inline", "chunk-index", "compact"])
def test_matches_kernel(variant: str, images: dict[str, Path], open_image, mount_image) -> None:
    reader = open_image(images[variant])
    mnt = mount_image(images[variant])
    _compare(reader, mnt, keeps_meta=True, kernel=True)


@pytest.mark.root
@pytest.mark.integration
def test_big_directory_matches_kernel(big_image: Path, open_image, mount_image) -> None:
    reader = open_image(big_image)
    mnt = mount_image(big_image)
    _compare(reader, mnt, keeps_meta=True, kernel=True)


# --- malformed images --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_image(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A small image: a 3-block directory 'd', a subdirectory, files, a link, xattrs."""
    require_tool("mkfs.erofs")
    base = tmp_path_factory.mktemp("erofs-small")
    src = base / "src"
    (src / "d").mkdir(parents=True)
    for i in range(500):
        (src / "d" / f"entry-{i:04d}").write_bytes(b"%d" % i)
    (src / "sub" / "inner").mkdir(parents=True)
    (src / "file").write_bytes(b"x" * 10000)
    (src / "link").symlink_to("file")
    _try_setxattr(src / "file", "user.a", b"b")
    return _mkfs(src, base / "small.erofs", "-Enoinline_data").read_bytes()


def _fix_checksum(data: bytearray) -> None:
    struct.pack_into("<I", data, L.SUPERBLOCK_OFFSET + 4, L.superblock_checksum(data, 4096))


def _phys(reader: ErofsReader, inode: Inode, logical: int) -> int:
    """Image offset of byte ``logical`` of a file."""
    for start, phys, length in reader._extents(inode):
        if start <= logical < start + length and phys is not None:
            return phys + logical - start
    raise AssertionError(f"offset {logical} is not stored")


def _dirent(reader: ErofsReader, dir_path: str, name: str) -> tuple[int, int]:
    """Image offsets of the dirent called ``name`` and of its name."""
    inode = reader.lookup(dir_path)
    for blk in range((inode.size + 4095) // 4096):
        block = reader.read(inode, blk * 4096, 4096)
        count = L.DIRENT.unpack_from(block)[1] // 12
        for i in range(count):
            nameoff = L.DIRENT.unpack_from(block, i * 12)[1]
            if block[nameoff : nameoff + len(name)] == name.encode():
                base = blk * 4096
                return _phys(reader, inode, base + i * 12), _phys(reader, inode, base + nameoff)
    raise AssertionError(f"{name} not found")


def test_good_small_image(small_image: bytes) -> None:
    reader = _memory_reader(small_image)
    assert len(reader.listdir("/d")) == 500
    assert reader.lookup("/d").size > 2 * 4096


def test_bad_magic(small_image: bytes) -> None:
    data = bytearray(small_image)
    data[L.SUPERBLOCK_OFFSET] ^= 0xFF
    with pytest.raises(ErofsError, match="magic"):
        _memory_reader(data)
    with pytest.raises(ErofsError, match="magic"):
        _memory_reader(bytes(8192))


def test_unsupported_block_size(small_image: bytes) -> None:
    for bits in (8, 17, 40):
        data = bytearray(small_image)
        data[L.SUPERBLOCK_OFFSET + 12] = bits
        with pytest.raises(ErofsError, match="block size"):
            _memory_reader(data)


def test_bad_superblock_checksum(small_image: bytes) -> None:
    data = bytearray(small_image)
    data[L.SUPERBLOCK_OFFSET + 64] = ord("v")  # volume name
    with pytest.raises(ErofsError, match="checksum"):
        _memory_reader(data)
    _fix_checksum(data)
    assert _memory_reader(data).volume_name == "v"


def test_unknown_incompat_feature(small_image: bytes) -> None:
    data = bytearray(small_image)
    struct.pack_into("<I", data, L.SUPERBLOCK_OFFSET + 80, L.FEATURE_INCOMPAT_48BIT)
    _fix_checksum(data)
    with pytest.raises(ErofsError, match="incompatible"):
        _memory_reader(data)


def test_truncated_image(small_image: bytes) -> None:
    with pytest.raises(ErofsError):
        _memory_reader(small_image[:1100])
    with pytest.raises(ErofsError, match="truncated"):
        _memory_reader(small_image[: len(small_image) - 4096])
    # without a size, the reader trusts the superblock and finds out at the short read
    reader = _memory_reader(small_image[: len(small_image) - 4096], size=None)
    with pytest.raises(ErofsError, match="short read"):
        for _, inode in reader.walk():
            reader.read(inode)


@pytest.mark.parametrize("fill", ["random", "ones", "zeros"])
def test_garbage_directory_block(small_image: bytes, fill: str) -> None:
    reader = _memory_reader(small_image)
    middle = _phys(reader, reader.lookup("/d"), 4096)  # logical block 1 of 3
    data = bytearray(small_image)
    garbage = {
        "random": random.Random(7).randbytes(4096),
        "ones": b"\xff" * 4096,
        "zeros": bytes(4096),
    }[fill]
    data[middle : middle + 4096] = garbage
    reader = _patched_reader(data)
    with pytest.raises(ErofsError):
        reader.listdir("/d")
    with pytest.raises(ErofsError):
        reader.lookup("/d/entry-0150")
    with pytest.raises(ErofsError):
        list(reader.walk())


def test_name_with_slash(small_image: bytes) -> None:
    reader = _memory_reader(small_image)
    _, name_at = _dirent(reader, "/d", "entry-0005")
    data = bytearray(small_image)
    data[name_at + 9] = ord("/")  # entry-000/
    with pytest.raises(ErofsError, match="bad name"):
        _patched_reader(data).listdir("/d")


def test_unsorted_names(small_image: bytes) -> None:
    reader = _memory_reader(small_image)
    _, name_at = _dirent(reader, "/d", "entry-0005")
    data = bytearray(small_image)
    data[name_at + 9] = ord("9")  # entry-0009 before entry-0006
    with pytest.raises(ErofsError, match="sorted"):
        _patched_reader(data).listdir("/d")


def test_nid_past_the_end(small_image: bytes) -> None:
    reader = _memory_reader(small_image)
    off, _ = _dirent(reader, "/d", "entry-0005")
    data = bytearray(small_image)
    struct.pack_into("<Q", data, off, 1 << 40)
    reader = _patched_reader(data)
    with pytest.raises(ErofsError, match="outside the image"):
        reader.lookup("/d/entry-0005")
    with pytest.raises(ErofsError):
        list(reader.walk())


def test_directory_loop(small_image: bytes) -> None:
    reader = _memory_reader(small_image)
    off, _ = _dirent(reader, "/sub", "inner")
    data = bytearray(small_image)
    struct.pack_into("<Q", data, off, reader.root_nid)  # /sub/inner is the root again
    reader = _patched_reader(data)
    assert reader.lookup("/sub/inner/sub/inner/file").size == 10000  # lookups still end
    with pytest.raises(ErofsError, match="reachable twice"):
        list(reader.walk())


def test_dirent_type_mismatch(small_image: bytes) -> None:
    reader = _memory_reader(small_image)
    off, _ = _dirent(reader, "/", "file")
    data = bytearray(small_image)
    data[off + 10] = L.FT_DIR
    with pytest.raises(ErofsError, match="does not match"):
        _patched_reader(data).lookup("/file")


@pytest.fixture(scope="module")
def tiny_image(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """An image small enough to corrupt hundreds of times: a bit of everything."""
    require_tool("mkfs.erofs")
    base = tmp_path_factory.mktemp("erofs-tiny")
    src = base / "src"
    (src / "d" / "e").mkdir(parents=True)
    for i in range(12):
        (src / "d" / f"f{i}").write_bytes(b"z" * (i * 700))
        _try_setxattr(src / "d" / f"f{i}", "user.same", b"shared value")
    (src / "d" / "e" / "big").write_bytes(b"q" * 9000)
    (src / "link").symlink_to("d/e/big")
    _try_setxattr(src / "d", "user.inline", b"v")
    return _mkfs(src, base / "tiny.erofs", "--chunksize=4096").read_bytes()


def test_random_corruption_raises_only_erofs_errors(tiny_image: bytes) -> None:
    """Overwrite metadata bytes (keeping the superblock checksum valid): never a crash."""
    rng = random.Random(2024)
    meta_end = 4096 * 2
    outcomes = {"ok": 0, "error": 0}
    for _ in range(300):
        data = bytearray(tiny_image)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(L.SUPERBLOCK_OFFSET + 16, meta_end)] = rng.randrange(256)
        try:
            reader = _patched_reader(data)
            for _, inode in reader.walk():
                reader.xattrs(inode)
                reader.data_extents(inode)
                if inode.is_symlink:
                    reader.readlink(inode)
                elif inode.size < (1 << 24):
                    reader.read(inode)
            outcomes["ok"] += 1
        except (ErofsError, FileNotFoundError, NotADirectoryError):
            outcomes["error"] += 1
    assert outcomes["error"] > 0


@pytest.mark.integration
def test_chunk_holes(tree: Tree, images: dict[str, Path]) -> None:
    """NULL_ADDR chunks read as zeros and have no extent (mkfs.erofs 1.5 never writes them)."""
    image = bytearray(images["chunk-map"].read_bytes())
    reader = _memory_reader(image)
    sparse = reader.lookup("/sparse")
    assert sparse.layout == L.CHUNK_BASED and sparse.size == (1 << 20) + 4
    table = L.align(sparse._tail_offset, L.BLOCK_MAP_ENTRY.size)
    for i in range(1, 256):  # every chunk but the first ("head") and the last ("tail")
        struct.pack_into("<I", image, table + 4 * i, L.NULL_ADDR)
    reader = _patched_reader(image)
    sparse = reader.lookup("/sparse")
    assert reader.read(sparse) == (tree.root / "sparse").read_bytes()
    assert reader.read(sparse, 5000, 10) == bytes(10)
    extents = reader.data_extents(sparse)
    assert sum(n for _, n in extents) == 4096 + 4  # the first chunk and the 4-byte last one
    pieces = list(reader.iter_content(sparse, chunk=3000))
    assert all(len(p) <= 3000 for p in pieces)


def test_layout_codecs() -> None:
    assert L.crc32c_raw(b"123456789") ^ 0xFFFFFFFF == 0xE3069283  # the CRC-32C check value
    for major, minor in ((0, 0), (1, 3), (259, 70000), (4095, (1 << 20) - 1)):
        raw = L.encode_rdev(major, minor)
        assert raw < 1 << 32 and L.decode_rdev(raw) == (major, minor)
        assert L.makedev(major, minor) == os.makedev(major, minor)
        assert L.splitdev(os.makedev(major, minor)) == (major, minor)
    assert L.encode_rdev(1, 3) == 0x103  # old-style numbers keep their 16-bit encoding
    assert L.split_xattr_name("security.capability") == (L.XATTR_INDEX_SECURITY, "capability")
    assert L.split_xattr_name("system.posix_acl_access") == (L.XATTR_INDEX_POSIX_ACL_ACCESS, "")
    assert L.split_xattr_name("user.") is None
    assert L.split_xattr_name("system.other") is None
    assert [L.xattr_ibody_size(n) for n in (0, 1, 2, 5)] == [0, 12, 16, 28]
    assert all(L.xattr_icount(L.xattr_ibody_size(n)) == n for n in range(50))
    assert L.xattr_entry_size(len("capability"), 20) == 36
    assert L.make_i_format(L.INODE_LAYOUT_EXTENDED, L.FLAT_INLINE) == 0x5
    assert L.inode_datalayout(0x5) == L.FLAT_INLINE and L.inode_version(0x5) == 1
    for mode, ft in ((0o100644, L.FT_REG_FILE), (0o40755, L.FT_DIR), (0o120777, L.FT_SYMLINK)):
        assert L.file_type_from_mode(mode) == ft and L.ifmt_from_file_type(ft) == mode & 0o170000
    sb = L.Superblock.unpack(bytes(L.SUPERBLOCK_SIZE))
    assert sb.pack() == bytes(L.SUPERBLOCK_SIZE)
