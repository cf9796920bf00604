"""End to end: convert real images with the CLI, read them back, and let the kernel judge.

The oracle is third-party: the source image is unpacked by umoci, the converted filesystem is
checked by fsck.erofs and mounted by the kernel's erofs driver, and both trees must match.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from itool import erofs_mount, imagetool, snapshot
from ocibuild import push_to_registry, to_docker_archive, unpack_with_umoci
from support import require_tool

from imagetool.format import Index


def check_against_kernel(ref: str, source, work: Path) -> None:  # noqa: ANN001
    """raw -> fsck.erofs -> loop mount -> compare with the umoci-unpacked source."""
    require_tool("fsck.erofs")
    raw = work / "image.erofs"
    imagetool("raw", ref, str(raw))
    fsck = subprocess.run(["fsck.erofs", str(raw)], capture_output=True, text=True)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    expected_root = work / "unpacked"
    if not expected_root.exists():
        unpack_with_umoci(source.layout, source.tag, work / "bundle")
        expected_root = work / "bundle" / "rootfs"
    with erofs_mount(raw, work / "mnt") as mnt:
        got = snapshot(mnt)
    want = snapshot(expected_root)
    assert got.keys() == want.keys()
    diffs = {p: (got[p], want[p]) for p in want if got[p] != want[p]}
    assert not diffs


def test_convert_oci_layout_to_directory_store(umoci_image, tmp_path):
    store = tmp_path / "store"
    ref = f"{store}/app:v1"
    digest = imagetool("convert", "-q", umoci_image.spec, ref).out.strip()
    assert digest.startswith("sha256:")

    info = json.loads(imagetool("inspect", ref).out)
    assert info["index_digest"] == digest
    assert info["sector_size"] == 4 << 20
    assert info["config"]["Entrypoint"] == ["/bin/sh"]
    assert info["config"]["WorkingDir"] == "/app"
    assert info["config"]["Env"][-1] == "MODE=test"

    listing = imagetool("ls", ref, "/bin").out
    assert "-rwsr-xr-x" in listing and "sh-link -> tool" in listing
    assert imagetool("cat", ref, "/etc/hostname").out == "changed\n"
    assert imagetool("cat", ref, "/bin/sh-link").out.startswith("#!/bin/sh")
    assert "entry-00001" in imagetool("ls", ref, "/many").out
    assert "entry-00000" not in imagetool("ls", ref, "/many").out

    verify = imagetool("verify", ref, "--against", umoci_image.spec)
    assert " 0 differ" in verify.out and " 0 bad" in verify.out
    check_against_kernel(ref, umoci_image, tmp_path)


def test_conversion_is_deterministic(umoci_image, tmp_path):
    a = imagetool("convert", "-q", umoci_image.spec, f"{tmp_path}/a/img:x").out
    b = imagetool("convert", "-q", "--workers", "1", umoci_image.spec, f"{tmp_path}/b/img:x").out
    assert a == b
    blobs_a = sorted(p.name for p in (tmp_path / "a/blobs/sha256").iterdir())
    blobs_b = sorted(p.name for p in (tmp_path / "b/blobs/sha256").iterdir())
    assert blobs_a == blobs_b


@pytest.mark.parametrize("version", ["1", "2"])
def test_small_sectors_and_profile_layout(umoci_image, tmp_path, version):
    profile = tmp_path / "profile.txt"
    profile.write_text("/app/run.sh\n/data/big.bin\n/etc/hostname\n")
    ref = f"{tmp_path}/store/app:prof"
    imagetool("convert", "-q", "--sector-size", "64KiB", "--profile", str(profile),
              "--format-version", version, umoci_image.spec, ref)  # fmt: skip
    store = tmp_path / "store"
    digest = (store / "refs/app/prof").read_text().strip()
    stored = (store / "blobs/sha256" / digest.split(":")[1]).read_bytes()
    doc = json.loads(imagetool("inspect", "--index", ref).out)
    index = Index.from_dict(doc)
    assert index.to_blob() == stored  # the index as stored: compressed
    assert index.version == int(version)
    offsets = [f.offset for f in index.files]
    assert offsets == sorted(offsets)  # contiguous data in layout order
    extent = {f.path: f for f in index.files}
    run, big, hostname = extent["/app/run.sh"], extent["/data/big.bin"], extent["/etc/hostname"]
    if version == "1":
        assert [f.path for f in index.files[:3]] == ["/app/run.sh", "/data/big.bin",
                                                     "/etc/hostname"]  # fmt: skip
    else:
        # The small profile files are copies in the hot regions of their layers, ahead of the
        # layer regions; the big one stays where its layer has it, on a sector boundary.
        assert {f.path for f in index.files[:2]} == {"/etc/hostname", "/app/run.sh"}
        first = index.sectors_for_range
        assert index.blob_of(first(hostname.offset, 1)[0]).role == "hot"
        assert index.blob_of(first(run.offset, 1)[0]).role == "hot"
        assert index.blob_of(first(big.offset, 1)[0]).role == "layer"
        assert big.offset % (64 << 10) == 0
    # The profile's sectors in first-access order: run.sh's, the big file's, hostname's (but
    # the metadata sectors, which a mount fetches first anyway).
    sectors = [index.sectors_for_range(f.offset, f.length) for f in (run, big, hostname)]
    want = list(dict.fromkeys(n for r in sectors for n in r if n >= index.metadata_sectors))
    want = [n for n in want if not index.sectors[n].is_zero]
    assert [n for n in index.prefetch if n in want] == want
    assert len(index.prefetch) >= 500_004 // (64 << 10)
    imagetool("verify", ref, "--against", umoci_image.spec)
    check_against_kernel(ref, umoci_image, tmp_path)


def test_a_profile_with_ranges_prefetches_only_the_sectors_of_what_was_read(umoci_image, tmp_path):
    """A file the start read in part (a mapped library) brings only the sectors that hold
    the bytes read into the prefetch order; a whole file, all of its sectors."""
    sector = 64 << 10
    profile = tmp_path / "profile.txt"
    profile.write_text(f"/app/run.sh\n/data/big.bin\t{2 * sector + 10}-{3 * sector}\n")
    ref = f"{tmp_path}/store/app:ranges"
    imagetool("convert", "-q", "--sector-size", "64KiB", "--profile", str(profile),
              umoci_image.spec, ref)  # fmt: skip
    index = Index.from_dict(json.loads(imagetool("inspect", "--index", ref).out))
    extent = {f.path: f for f in index.files}
    run, big = extent["/app/run.sh"], extent["/data/big.bin"]
    assert big.length > 6 * sector and big.offset % sector == 0
    data = [n for n in index.prefetch if n >= index.metadata_sectors]
    want_run = [n for n in index.sectors_for_range(run.offset, run.length)
                if n >= index.metadata_sectors]  # fmt: skip
    assert data == [*want_run, big.offset // sector + 2]
    imagetool("verify", ref, "--against", umoci_image.spec)


@pytest.mark.parametrize("store_kind", ["dir", "s3", "registry"])
@pytest.mark.parametrize("source_kind", ["oci", "docker-archive", "registry"])
def test_every_source_into_every_store(
    source_kind, store_kind, umoci_image, tmp_path, request, registry
):
    if source_kind == "oci":
        source = umoci_image.spec
    elif source_kind == "docker-archive":
        archive = tmp_path / "image.tar"
        to_docker_archive(umoci_image.layout, umoci_image.tag, archive)
        source = f"docker-archive:{archive}"
    else:
        push_to_registry(umoci_image.layout, umoci_image.tag, registry.host, "src/app")
        source = f"docker://{registry.host}/src/app:{umoci_image.tag}"
    if store_kind == "dir":
        dest = f"{tmp_path}/store/app:v1"
    elif store_kind == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        dest = f"s3://{bucket}/images/app:v1"
    else:
        dest = f"docker://{registry.host}/converted/{source_kind}:v1"
    digest = imagetool("--plain-http", "convert", "-q", source, dest).out.strip()
    assert digest.startswith("sha256:")
    info = json.loads(imagetool("--plain-http", "inspect", dest).out)
    assert info["index_digest"] == digest
    check_against_kernel_remote(dest, umoci_image, tmp_path)


def check_against_kernel_remote(ref: str, source, work: Path) -> None:  # noqa: ANN001
    raw = work / "remote.erofs"
    imagetool("--plain-http", "raw", ref, str(raw))
    fsck = subprocess.run(["fsck.erofs", str(raw)], capture_output=True, text=True)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    unpack_with_umoci(source.layout, source.tag, work / "bundle")
    with erofs_mount(raw, work / "mnt") as mnt:
        got = snapshot(mnt)
    assert got == snapshot(work / "bundle" / "rootfs")


def test_huge_directory_and_layer_semantics_through_the_kernel(tmp_path):
    """30,000 entries in one directory, whiteouts, opaque dirs and hard links across layers,
    checked by fsck.erofs and the kernel (no third-party unpacker needed)."""
    import os

    from ocibuild import TarEntry, make_layer_tar, opaque, whiteout, write_oci_layout

    require_tool("fsck.erofs")
    big = [TarEntry(f"huge/f{i:05d}-{'ü' if i % 7 == 0 else 'x'}", data=str(i).encode())
           for i in range(30_000)]  # fmt: skip
    l1 = make_layer_tar(
        [*big, TarEntry("keep/a", data=b"a"), TarEntry("gone/b", data=b"b"),
         TarEntry("opq/old", data=b"old"), TarEntry("hl/orig", data=b"shared")],
        compression="zstd",
    )  # fmt: skip
    l2 = make_layer_tar(
        [whiteout("gone"), opaque("opq"), TarEntry("opq/new", data=b"new"),
         TarEntry("hl/link", "hardlink", link="hl/orig"), whiteout("huge/f00000-ü")],
        compression=None,
    )  # fmt: skip
    write_oci_layout(tmp_path / "oci", [l1, l2])
    ref = f"{tmp_path}/store/tricky:t"
    imagetool("convert", "-q", f"oci:{tmp_path}/oci:latest", ref)
    raw = tmp_path / "t.erofs"
    imagetool("raw", ref, str(raw))
    fsck = subprocess.run(["fsck.erofs", str(raw)], capture_output=True, text=True)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    with erofs_mount(raw, tmp_path / "mnt") as mnt:
        names = os.listdir(mnt / "huge")
        assert len(names) == 29_999 and "f00000-ü" not in names
        assert (mnt / "huge/f29999-x").read_text() == "29999"
        assert (mnt / "huge/f00007-ü").read_text() == "7"
        assert sorted(os.listdir(mnt)) == ["hl", "huge", "keep", "opq"]
        assert os.listdir(mnt / "opq") == ["new"]
        a, b = (mnt / "hl/orig").stat(), (mnt / "hl/link").stat()
        assert a.st_ino == b.st_ino and a.st_nlink == 2
        assert (mnt / "hl/link").read_bytes() == b"shared"


def test_a_profile_of_another_image_is_ignored_with_one_warning(umoci_image, tmp_path):
    # Paths of another image (or an older version of this one): nothing to lay out first,
    # one warning, and the image is the one converted without a profile.
    profile = tmp_path / "foreign.txt"
    profile.write_text("# recorded elsewhere\n/usr/lib/python3/torch.so\n/models/w.bin\n")
    plain = imagetool("convert", "-q", umoci_image.spec, f"{tmp_path}/a/app:x")
    res = imagetool("convert", "-q", "--profile", str(profile), umoci_image.spec,
                    f"{tmp_path}/b/app:x")  # fmt: skip
    warnings = [line for line in res.err.splitlines() if "profile" in line]
    assert len(warnings) == 1, res.err
    assert "2 of its 2 paths are not files with data in this image" in warnings[0]
    assert "/usr/lib/python3/torch.so" in warnings[0]
    assert res.out == plain.out  # the same index digest


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", "is not a UTF-8 text file"),
        (b"/app/run.sh\n/etc/\x00passwd\n", "line 2: not a path"),
        (b"/" + b"a" * 5000 + b"\n", "line 1: not a path"),
        (b"/app/run.sh\n/data/big.bin\t4096-100\n", "line 2: not a byte range"),
    ],
)
def test_a_broken_profile_is_refused_before_anything_is_written(
    umoci_image, tmp_path, content, message
):
    profile = tmp_path / "broken.profile"
    profile.write_bytes(content)
    res = imagetool("convert", "-q", "--profile", str(profile), umoci_image.spec,
                    f"{tmp_path}/store/app:x", check=False)  # fmt: skip
    assert res.code != 0
    lines = res.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "ProfileError" in lines[0], res.err
    assert not (tmp_path / "store").exists()  # nothing published, nothing half-written
