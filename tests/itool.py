"""imagetool test helpers (import as ``itool``): run the CLI, fill source trees, mount with
the kernel's erofs, snapshot a tree for comparison."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from support import require_root


@dataclass
class RunResult:
    code: int
    out: str
    err: str


def imagetool(*args: str, check: bool = True, input: bytes | None = None) -> RunResult:
    """Run the real CLI in a subprocess (what a user runs)."""
    proc = subprocess.run(
        [sys.executable, "-m", "imagetool.cli", *args], capture_output=True, input=input
    )
    res = RunResult(proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode())
    if check and proc.returncode != 0:
        raise AssertionError(f"imagetool {' '.join(args)} failed ({proc.returncode}): {res.err}")
    return res


def fill_base(root: Path) -> None:
    """Layer 1 content: every kind of entry the writer must carry."""
    (root / "etc").mkdir(parents=True)
    (root / "etc/hostname").write_text("lazyblock\n")
    (root / "etc/empty").write_bytes(b"")
    (root / "bin").mkdir()
    tool = root / "bin/tool"
    tool.write_bytes(b"#!/bin/sh\necho hello from lazyblock\n")
    tool.chmod(0o4755)
    os.setxattr(tool, "security.capability", b"\x01\x00\x00\x02\x00\x20\x00\x00" + bytes(12))
    os.setxattr(tool, "user.origin", b"test")
    (root / "bin/sh-link").symlink_to("tool")
    os.link(tool, root / "bin/tool-hardlink")
    (root / "tmp").mkdir(mode=0o1777)
    (root / "tmp").chmod(0o1777)
    (root / "srv").mkdir()
    (root / "srv/setgid").mkdir()
    (root / "srv/setgid").chmod(0o2775)
    os.chown(root / "srv", 70000, 70001)
    long = root / ("n" * 255)
    long.write_text("long name\n")
    (root / "ünïcødé-ファイル").write_text("utf-8 names\n")
    (root / "abs-link").symlink_to("/etc/" + "x" * 200)
    data = root / "data"
    data.mkdir()
    (data / "big.bin").write_bytes(os.urandom(300_000) + bytes(200_000) + b"tail")
    (data / "zeros.bin").write_bytes(bytes(1 << 20))
    many = root / "many"
    many.mkdir()
    for i in range(3000):
        (many / f"entry-{i:05d}").write_text(str(i))
    os.mkfifo(root / "fifo")
    os.mknod(root / "null", 0o666 | 0o020000, os.makedev(1, 3))
    os.mknod(root / "loopdev", 0o660 | 0o060000, os.makedev(7, 200))
    os.utime(root / "etc/hostname", ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))


def fill_update(root: Path) -> None:
    """Layer 2: changes, deletions (whiteouts) and an opaque-style replacement."""
    (root / "etc/hostname").write_text("changed\n")
    (root / "etc/empty").unlink()
    for i in range(0, 3000, 2):
        (root / f"many/entry-{i:05d}").unlink()
    (root / "etc/new.conf").write_text("k = v\n")
    (root / "data/zeros.bin").unlink()


@dataclass(frozen=True)
class SourceImage:
    layout: Path
    tag: str

    @property
    def spec(self) -> str:
        return f"oci:{self.layout}:{self.tag}"


@contextlib.contextmanager
def erofs_mount(image: Path, mountpoint: Path) -> Iterator[Path]:
    """Loop-mount a raw EROFS image with the kernel driver (read-only)."""
    require_root()
    mountpoint.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "erofs", "-o", "loop,ro", str(image), str(mountpoint)],
        check=True, capture_output=True,
    )  # fmt: skip
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=False)


def snapshot(root: Path) -> dict[str, tuple]:
    """Everything about a tree that an image must carry: type, mode, owner, size, content,
    link target, device number, xattrs, mtime (seconds) and which paths are hard links."""
    import hashlib

    out: dict[str, tuple] = {}
    inodes: dict[tuple[int, int], str] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            p = Path(dirpath) / name
            st = p.lstat()
            rel = "/" + p.relative_to(root).as_posix()
            xattrs = {k: os.getxattr(p, k, follow_symlinks=False)
                      for k in sorted(os.listxattr(p, follow_symlinks=False))}  # fmt: skip
            if stat.S_ISLNK(st.st_mode):
                extra = os.readlink(p)
            elif stat.S_ISREG(st.st_mode):
                extra = hashlib.sha256(p.read_bytes()).hexdigest()
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                extra = (os.major(st.st_rdev), os.minor(st.st_rdev))
            else:
                extra = None
            link_of = None
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                link_of = inodes.setdefault((st.st_dev, st.st_ino), rel)
            mtime = (
                None if stat.S_ISLNK(st.st_mode) or stat.S_ISDIR(st.st_mode) else int(st.st_mtime)
            )
            size = st.st_size if stat.S_ISREG(st.st_mode) else None
            out[rel] = (st.st_mode, st.st_uid, st.st_gid, size, extra, xattrs, mtime, link_of)
    return out
