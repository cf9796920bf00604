"""Format version 2's layout, checked on converted images: each source layer's files in a
region of their own, so images that share layers share blobs and sector checksums; a changed
middle layer leaves the regions above it alone; a big file that changes size leaves the
sectors before it alone; incompressible sectors are stored raw."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from itool import imagetool
from ocibuild import TarEntry, make_layer_tar, whiteout, write_oci_layout

from imagetool.format import ROLE_HOT, ROLE_LAYER, ROLE_METADATA, Index
from imagetool.image import open_image

SECTOR = 64 << 10


def _files(seed: int, count: int, size: int, prefix: str) -> list[TarEntry]:
    rng = random.Random(seed)
    return [
        TarEntry(f"{prefix}/f{i:03d}.py", data=(f"# {seed} {i}\n".encode() * size)[:size])
        if i % 2
        else TarEntry(f"{prefix}/b{i:03d}.bin", data=rng.randbytes(size))
        for i in range(count)
    ]


BASE = make_layer_tar([TarEntry("usr/", type="dir"), *_files(1, 40, 9_000, "usr")])
LIBS = make_layer_tar([TarEntry("lib/", type="dir"), *_files(2, 30, 20_000, "lib")])


def _top(seed: int, weights: int) -> bytes:
    rng = random.Random(seed)
    return make_layer_tar(
        [
            TarEntry("model/", type="dir"),
            TarEntry("model/config.json", data=b'{"seed": %d}' % seed),
            TarEntry("model/weights.bin", data=rng.randbytes(weights)),
            whiteout("usr/f001.py"),
        ]
    )


def _convert(tmp: Path, name: str, layers: list[bytes], *extra: str) -> Index:
    layout = tmp / f"oci-{name}"
    write_oci_layout(layout, layers, tag="v1")
    ref = f"{tmp}/store/{name}:v1"
    imagetool("convert", "-q", "--sector-size", "64KiB", *extra, f"oci:{layout}:v1", ref)
    with open_image(ref) as img:
        return img.index


def _layer_blobs(index: Index) -> dict[str, str]:
    """source layer digest -> its region's blob digest."""
    return {b.layer: b.digest for b in index.blobs if b.role == ROLE_LAYER}


def _checksums(index: Index, role: str | None = None) -> set[str]:
    return {
        s.checksum
        for s in index.sectors
        if not s.is_zero and (role is None or index.blobs[s.blob].role == role)
    }


def _blobs_dir_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in (store / "blobs" / "sha256").iterdir())


def test_images_that_share_base_layers_share_their_blobs_and_sectors(tmp_path: Path) -> None:
    a = _convert(tmp_path, "a", [BASE, LIBS, _top(10, 300_000)])
    before = _blobs_dir_bytes(tmp_path / "store")
    b = _convert(tmp_path, "b", [BASE, LIBS, _top(11, 420_000)])  # another size
    grown = _blobs_dir_bytes(tmp_path / "store") - before
    assert a.version == b.version == 2
    assert [x.role for x in b.blobs] == [ROLE_METADATA, ROLE_LAYER, ROLE_LAYER, ROLE_LAYER]
    la, lb = _layer_blobs(a), _layer_blobs(b)
    shared = set(la) & set(lb)
    assert len(shared) == 2 and all(la[d] == lb[d] for d in shared)  # the base and libs
    unique = [x for x in b.blobs if x.digest not in {y.digest for y in a.blobs}]
    assert {x.role for x in unique} == {ROLE_METADATA, ROLE_LAYER}
    # The store grew by B's own blobs and its index, nothing of the base layers.
    index_bytes = len(b.to_blob())
    assert grown == sum(x.size for x in unique) + index_bytes
    # Every sector of a shared layer region has the same checksum in both images.
    shared_b = {s.checksum for s in b.sectors if not s.is_zero and b.blobs[s.blob].layer in la}
    assert shared_b and shared_b <= _checksums(a)


def test_a_changed_middle_layer_leaves_the_layers_above_it_shared(tmp_path: Path) -> None:
    top = _top(10, 300_000)
    a = _convert(tmp_path, "a", [BASE, LIBS, top])
    libs2 = make_layer_tar([TarEntry("lib/", type="dir"), *_files(3, 31, 20_500, "lib")])
    c = _convert(tmp_path, "c", [BASE, libs2, top])
    la, lc = _layer_blobs(a), _layer_blobs(c)
    assert len(set(la) & set(lc)) == 2  # base and top: same source layers...
    assert all(la[d] == lc[d] for d in set(la) & set(lc))  # ...same blobs
    assert len(set(lc) - set(la)) == 1  # the rebuilt middle layer


def test_a_big_file_that_changes_size_leaves_the_sectors_before_it_alone(
    tmp_path: Path,
) -> None:
    rng = random.Random(4)
    small = [TarEntry(f"app/s{i:02d}.txt", data=rng.randbytes(5_000)) for i in range(30)]
    after = [TarEntry(f"app/t{i:02d}.txt", data=rng.randbytes(5_000)) for i in range(10)]
    weights = rng.randbytes(5 * SECTOR + 123)

    def layer(extra: int) -> bytes:
        big = TarEntry("app/weights.bin", data=weights + bytes(extra) + b"x" * extra)
        return make_layer_tar([TarEntry("app/", type="dir"), *small, big, *after])

    a = _convert(tmp_path, "a", [BASE, layer(0)])
    b = _convert(tmp_path, "b", [BASE, layer(70_000)])  # a sector and more bigger
    (wa,) = [f for f in a.files if f.path == "/app/weights.bin"]
    (wb,) = [f for f in b.files if f.path == "/app/weights.bin"]
    assert wa.offset % SECTOR == 0 and wb.offset % SECTOR == 0
    # The small files before it: the same sectors; the weights' first five sectors too.
    before_a = {a.sectors[n].checksum for n in a.sectors_for_range(wa.offset - 150_000, 150_000)}
    before_b = {b.sectors[n].checksum for n in b.sectors_for_range(wb.offset - 150_000, 150_000)}
    assert before_a == before_b
    head = 5 * SECTOR
    assert [a.sectors[n].checksum for n in a.sectors_for_range(wa.offset, head)] == [
        b.sectors[n].checksum for n in b.sectors_for_range(wb.offset, head)
    ]


def test_incompressible_sectors_are_stored_raw(tmp_path: Path) -> None:
    index = _convert(tmp_path, "a", [BASE, _top(10, 400_000)])
    (w,) = [f for f in index.files if f.path == "/model/weights.bin"]
    inside = index.sectors_for_range(w.offset + SECTOR, 4 * SECTOR)  # random bytes only
    assert all(index.sectors[n].raw for n in inside[:-1])
    assert all(index.sectors[n].length == SECTOR for n in inside[:-1])
    assert not any(index.sectors[n].raw for n in range(index.metadata_sectors))  # compresses
    never = _convert(tmp_path, "b", [BASE, _top(10, 400_000)], "--raw-saving", "0")
    assert not any(s.raw for s in never.sectors)
    assert _checksums(never) == _checksums(index)  # the same bytes, stored otherwise
    ref = f"{tmp_path}/store/a:v1"
    verify = imagetool("verify", ref, "--against", f"oci:{tmp_path}/oci-a:v1").out
    assert " 0 bad" in verify and " 0 differ" in verify


def test_a_profile_copies_small_hot_files_and_leaves_the_layer_regions_shared(
    tmp_path: Path,
) -> None:
    profile = tmp_path / "profile"
    profile.write_text("/lib/f001.py\n/usr/f003.py\n/model/weights.bin\n/lib/b000.bin\n")
    plain = _convert(tmp_path, "plain", [BASE, LIBS, _top(10, 300_000)])
    hot = _convert(tmp_path, "hot", [BASE, LIBS, _top(10, 300_000)], "--profile", str(profile))
    assert _layer_blobs(plain) == _layer_blobs(hot)  # the profile changes no layer region
    hot_blobs = [b for b in hot.blobs if b.role == ROLE_HOT]
    assert [b.layer for b in hot_blobs] == list(_layer_blobs(hot))[:2]  # base, then libs
    by_path = {f.path: f for f in hot.files}
    for path in ("/lib/f001.py", "/usr/f003.py", "/lib/b000.bin"):
        (n,) = hot.sectors_for_range(by_path[path].offset, 1)
        assert hot.blob_of(n).role == ROLE_HOT
    (n,) = hot.sectors_for_range(by_path["/model/weights.bin"].offset, 1)
    assert hot.blob_of(n).role == ROLE_LAYER  # big files stay where they are
    first = hot.prefetch[0]
    assert first == hot.sectors_for_range(by_path["/lib/f001.py"].offset, 1)[0]


@pytest.mark.parametrize("version", ["1", "2"])
def test_whiteouts_and_replaced_files_read_back_as_the_tree_says(
    tmp_path: Path, version: str
) -> None:
    _convert(tmp_path, "w", [BASE, LIBS, _top(10, 300_000)], "--format-version", version)
    ref = f"{tmp_path}/store/w:v1"
    listing = imagetool("ls", ref, "/usr").out
    assert "f001.py" not in listing and "f003.py" in listing  # deleted by the top layer
    assert imagetool("cat", ref, "/model/config.json").out == '{"seed": 10}'
    verify = imagetool("verify", ref, "--against", f"oci:{tmp_path}/oci-w:v1").out
    assert " 0 bad" in verify and " 0 differ" in verify


def test_inspect_shows_each_blob_and_verify_checks_each(tmp_path: Path) -> None:
    index = _convert(tmp_path, "a", [BASE, LIBS, _top(10, 300_000)])
    ref = f"{tmp_path}/store/a:v1"
    info = json.loads(imagetool("inspect", ref).out)
    assert info["format_version"] == 2 and info["raw_sectors"] > 0
    assert [(b["digest"], b["size"], b["role"], b["source_layer"]) for b in info["blobs"]] == [
        (b.digest, b.size, b.role, b.layer or None) for b in index.blobs
    ]
    manifest = json.loads((tmp_path / "oci-a/index.json").read_text())["manifests"][0]
    layout = tmp_path / "oci-a" / "blobs" / "sha256"
    layers = json.loads((layout / manifest["digest"].split(":")[1]).read_text())["layers"]
    assert [b["source_layer"] for b in info["blobs"][1:]] == [d["digest"] for d in layers]
    assert info["stored_bytes"] == sum(b["size"] for b in info["blobs"])
    # Other bytes of the same size in the libs' blob: verify names the blob and its sectors.
    libs = index.blobs[2]
    path = tmp_path / "store/blobs/sha256" / libs.digest.split(":")[1]
    os.chmod(path, 0o644)
    path.write_bytes(random.Random(1).randbytes(libs.size))
    res = imagetool("verify", ref, check=False)
    assert res.code == 1
    assert f"FAIL blob {libs.digest}: its bytes do not match its digest" in res.err
    bad = sum(1 for s in index.sectors if s.blob == 2 and not s.is_zero)
    assert f"{bad} bad; {len(index.blobs)} blobs checked, 1 bad" in res.out
