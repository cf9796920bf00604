"""Test images for the mount tests (import as ``images``): built by hand with ``ocibuild``
and converted with the real imagetool CLI into a directory store."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

from itool import imagetool
from ocibuild import DEFAULT_MTIME, TarEntry, make_layer_tar, write_oci_layout

MIB = 1 << 20


def convert(layout: Path, tag: str, dest: str, *extra: str) -> str:
    """Convert ``oci:layout:tag`` into ``dest``; returns the index digest."""
    return imagetool("convert", "-q", *extra, f"oci:{layout}:{tag}", dest).out.strip()


def many_files_layer(count: int) -> bytes:
    """``count`` small files in 100 directories, each with a little distinct content."""
    entries = [TarEntry(f"d{d:03d}/", type="dir") for d in range(100)]
    for i in range(count):
        entries.append(TarEntry(f"d{i % 100:03d}/f{i:05d}.txt", data=f"file {i}\n".encode() * 40))
    return make_layer_tar(entries, compression=None)


def big_layer(total: int, file_size: int = 4 * MIB) -> bytes:
    """About ``total`` bytes of highly compressible (but not zero) data in ``file_size``
    files, plus a few small files; an uncompressed tar written without holding each file's
    content twice."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, DEFAULT_MTIME
            tar.addfile(info, io.BytesIO(data))

        for i in range(total // file_size):
            block = hashlib.sha256(str(i).encode()).digest() * 128  # 4 KiB pattern
            add(f"blobs/part-{i:04d}.bin", block * (file_size // len(block)))
        add("etc/small.conf", b"key = value\n" * 10)
        add("etc/other.conf", b"other = 1\n")
    return buf.getvalue()


def build_layout(root: Path, layers: list[bytes], tag: str = "v1") -> Path:
    layout = root / "oci"
    write_oci_layout(layout, layers, tag=tag)
    return layout
