"""Format version 2 mounted: umoci-built images that share layers (tops of the same and of
another size, a changed middle layer, whiteouts of base files in the top layer), converted,
mounted through FUSE and the kernel's erofs as one tree each, identical to what umoci
unpacks; a node that ran one starts another fetching little more than what is new in it;
a store that lacks a blob, holds one of the wrong size or bytes, or an index whose sectors
cross a blob's end: a clear error at mount or EIO at read, nothing of it cached or served."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

import mountimages as images
import pytest
from itool import fill_base, imagetool, snapshot
from mounthelp import drop_caches
from ocibuild import add_image, build_with_umoci, layer_blobs, tag_descriptor, unpack_with_umoci
from support import require_root, require_tool

from imagetool.format import Index, sha256_digest
from imagetool.image import open_image
from snapshotter.cache.sectors import SectorCache, cache_usage
from snapshotter.mount import api, kernel

pytestmark = [pytest.mark.root, pytest.mark.integration]

SECTOR = "256KiB"
MIB = 1 << 20


def _text(seed: int, size: int) -> bytes:
    words = [f"name{seed}_{i}" for i in range(50)]
    rng = random.Random(seed)
    return " ".join(rng.choice(words) for _ in range(size // 5)).encode()[:size]


def _libs(root: Path, seed: int, grow: int = 0) -> None:
    """A 'pip install' layer: Python modules and a native library."""
    lib = root / "lib/python3/site-packages"
    lib.mkdir(parents=True)
    for i in range(40):
        (lib / f"mod{i:02d}.py").write_bytes(_text(seed + i, 6_000 + (grow if i == 7 else 0)))
    (lib / "native.so").write_bytes(random.Random(seed).randbytes(600_000))


def _model(root: Path, seed: int, size: int, delete: tuple[str, ...]) -> None:
    """A model layer: weights and a config; it deletes some base files (whiteouts)."""
    (root / "model").mkdir()
    (root / "model/config.json").write_text(json.dumps({"seed": seed, "size": size}))
    (root / "model/weights.bin").write_bytes(random.Random(seed).randbytes(size))
    for path in delete:
        (root / path).unlink()


def _whole_seconds(root: Path) -> None:
    """Every mtime in whole seconds, as umoci's layers keep them: a file it unpacked and we
    copy back with nanoseconds would be in the next layer again, changed or not."""
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            os.utime(p, (int(st.st_atime), int(st.st_mtime)), follow_symlinks=False)


@dataclass
class Pairs:
    store: Path
    refs: dict[str, str]  # name -> directory store reference
    rootfs: dict[str, Path]  # name -> what umoci unpacks
    layout: Path


@pytest.fixture(scope="session")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Pairs:
    """Images a, b (another top, bigger weights), d (same-size weights, other bytes) on the
    same two base layers; c: a's base and top around a rebuilt middle layer."""
    require_root()
    require_tool("umoci")
    work = tmp_path_factory.mktemp("pairs")
    trees = {n: work / n for n in ("l1", "l2", "l2c", "a", "b", "d")}
    fill_base(trees["l1"])
    for name, source in (("l2", "l1"), ("l2c", "l1")):
        subprocess.run(["cp", "-a", str(trees[source]), str(trees[name])], check=True)
    _libs(trees["l2"], 1)
    _libs(trees["l2c"], 1, grow=50_000)  # one module grew: the layer is rebuilt
    tops = {
        "a": (10, 3 * MIB, ("etc/hostname", "many/entry-00003")),
        "b": (11, 3 * MIB + 700_000, ("bin/tool-hardlink", "data/big.bin")),
        "d": (12, 3 * MIB, ("etc/hostname", "many/entry-00003")),
    }
    for name, (seed, size, delete) in tops.items():
        subprocess.run(["cp", "-a", str(trees["l2"]), str(trees[name])], check=True)
        _model(trees[name], seed, size, delete)
    for tree in trees.values():
        _whole_seconds(tree)
    layout = work / "oci"
    build_with_umoci(layout, "base1", [trees["l1"]])
    build_with_umoci(layout, "base", [trees["l2"]], base="base1")
    build_with_umoci(layout, "mid2", [trees["l2c"]], base="base1")
    for name in tops:
        build_with_umoci(layout, name, [trees[name]], base="base")
    # c: a's bottom and top layers (the same blobs) around the rebuilt middle one.
    a_layers, mid2 = layer_blobs(layout, "a"), layer_blobs(layout, "mid2")
    tag_descriptor(layout, add_image(layout, [a_layers[0], mid2[1], a_layers[2]]), "c")
    store = work / "store"
    refs, rootfs = {}, {}
    for name in ("a", "b", "c", "d"):
        rootfs[name] = unpack_with_umoci(layout, name, work / f"unpacked-{name}")
        refs[name] = f"{store}/app:{name}"
        images.convert(layout, name, refs[name], "--sector-size", SECTOR)
    return Pairs(store, refs, rootfs, layout)


def _index(ref: str) -> Index:
    with open_image(ref) as img:
        return img.index


def _read_all(root: Path) -> int:
    """The workload: read every regular file; returns the bytes read."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            if p.is_file() and not p.is_symlink():
                total += len(p.read_bytes())
    return total


def _new_bytes_read(after: Index, before: Index) -> int:
    """Bytes of ``after``'s files (all of them are read) that no blob of ``before`` holds
    (a file of zeros is in no blob at all)."""
    known = {b.digest for b in before.blobs}
    total = 0
    for f in after.files:
        stored = [n for n in after.sectors_for_range(f.offset, f.length)
                  if not after.sectors[n].is_zero]  # fmt: skip
        if stored and after.blob_of(stored[0]).digest not in known:
            total += f.length
    return total


@pytest.mark.parametrize("name", ["a", "b", "c", "d"])
def test_each_image_mounts_as_umoci_unpacks_it(pairs: Pairs, config, tmp_path, name) -> None:  # noqa: ANN001
    index = _index(pairs.refs[name])
    assert index.version == 2 and len(index.blobs) == 4  # metadata and three layers
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    api.mount(pairs.refs[name], mnt, config)
    got = snapshot(mnt)
    assert got == snapshot(pairs.rootfs[name])
    assert "/etc/hostname" not in got or name in ("b", "c")  # whiteouts in the top layer
    api.unmount(mnt, config)


def test_the_images_share_the_blobs_of_the_layers_they_share(pairs: Pairs) -> None:
    idx = {n: _index(r) for n, r in pairs.refs.items()}

    def layers(n: str) -> list[tuple[str, str]]:
        return [(b.layer, b.digest) for b in idx[n].blobs if b.role == "layer"]

    a, b, c, d = (layers(n) for n in "abcd")
    assert a[:2] == b[:2] == d[:2]  # same base layers, same blobs
    assert a[2] != b[2] and a[2] != d[2]  # other tops
    assert c[0] == a[0] and c[2] == a[2] and c[1] != a[1]  # only the middle one differs


@pytest.mark.parametrize("after", ["b", "c", "d"])
def test_a_node_that_ran_a_fetches_only_what_is_new_in_the_next_image(
    pairs: Pairs, config, tmp_path, after
) -> None:  # noqa: ANN001
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    api.mount(pairs.refs["a"], mnt, config)
    _read_all(mnt)
    api.unmount(mnt, config)
    drop_caches()
    api.mount(pairs.refs[after], mnt, config)
    read = _read_all(mnt)
    fetch = api.stats(mnt, config)["fetch"]
    api.unmount(mnt, config)
    new = _new_bytes_read(_index(pairs.refs[after]), _index(pairs.refs["a"]))
    assert new > 0 and read - new > MIB  # the node has the base and the libraries
    assert fetch["cache_hits"] > 0
    assert fetch["bytes_fetched"] <= 1.1 * new, (fetch["bytes_fetched"], new)


def _registry_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "data").rglob("*") if p.is_file())


def test_a_registry_keeps_shared_blobs_once_and_the_image_mounts_from_it(
    pairs: Pairs, registry, config, tmp_path
) -> None:  # noqa: ANN001
    repo = f"{registry.host}/shared{os.getpid()}/app"
    spec = f"oci:{pairs.layout}"
    imagetool("--plain-http", "convert", "-q", "--sector-size", SECTOR, f"{spec}:a",
              f"docker://{repo}:a")  # fmt: skip
    before = _registry_bytes(registry.root)
    imagetool("--plain-http", "convert", "-q", "--sector-size", SECTOR, f"{spec}:b",
              f"docker://{repo}:b")  # fmt: skip
    grown = _registry_bytes(registry.root) - before
    a, b = _index(pairs.refs["a"]), _index(pairs.refs["b"])
    unique = sum(x.size for x in b.blobs if x.digest not in {y.digest for y in a.blobs})
    # B's new blobs, its index, config and manifest (a few KiB): not the base layers again.
    assert unique <= grown <= unique + len(b.to_blob()) + (16 << 10)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cfg = replace(config, store=replace(config.store, plain_http=True))
    api.mount(f"docker://{repo}:b", mnt, cfg)
    assert snapshot(mnt) == snapshot(pairs.rootfs["b"])
    api.unmount(mnt, cfg)


# --- bad stores and indexes ------------------------------------------------------------------


def _own_store(pairs: Pairs, tmp_path: Path) -> tuple[str, Index, Path]:
    """Image a in a store of its own, to break."""
    store = tmp_path / "store"
    shutil.copytree(pairs.store, store)
    ref = f"{store}/app:a"
    return ref, _index(ref), store


def _blob_path(store: Path, digest: str) -> Path:
    return store / "blobs" / "sha256" / digest.removeprefix("sha256:")


def _cached(config, index: Index, blob: int) -> list[str]:  # noqa: ANN001
    """Checksums of blob number ``blob``'s sectors that the node's cache holds."""
    cache = SectorCache(config.cache_dir, config.cache_size)
    return [s.checksum for s in index.sectors if s.blob == blob and not s.is_zero and
            s.checksum in cache]  # fmt: skip


def test_a_missing_layer_blob_fails_the_mount(pairs: Pairs, config, tmp_path) -> None:  # noqa: ANN001
    ref, index, store = _own_store(pairs, tmp_path)
    top = index.blobs[-1]
    _blob_path(store, top.digest).unlink()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with pytest.raises(api.MountError, match=f"blob {top.digest} not found"):
        api.mount(ref, mnt, config)
    assert not kernel.is_mountpoint(mnt) and api.list_mounts(config) == []
    assert _cached(config, index, len(index.blobs) - 1) == []


def test_a_blob_with_other_bytes_of_its_size_fails_its_reads_only(
    pairs: Pairs, config, tmp_path
) -> None:  # noqa: ANN001
    ref, index, store = _own_store(pairs, tmp_path)
    number = len(index.blobs) - 1  # the top layer: the model
    path = _blob_path(store, index.blobs[number].digest)
    os.chmod(path, 0o644)
    path.write_bytes(random.Random(0).randbytes(index.blobs[number].size))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    api.mount(ref, mnt, config)  # the size is right: found when read
    try:
        with pytest.raises(OSError) as err:
            (mnt / "model/weights.bin").read_bytes()
        assert err.value.errno == errno.EIO
        assert api.stats(mnt, config)["fetch"]["checksum_errors"] >= 1
        assert (mnt / "lib/python3/site-packages/mod03.py").read_bytes()  # other blobs
    finally:
        api.unmount(mnt, config)
    assert _cached(config, index, number) == []
    assert sha256_digest(path.read_bytes()) != index.blobs[number].digest


def test_an_index_whose_sectors_cross_a_blobs_end_is_refused_at_mount(
    pairs: Pairs, config, tmp_path
) -> None:  # noqa: ANN001
    ref, index, store = _own_store(pairs, tmp_path)
    doc = index.to_dict()
    doc["blobs"][1]["size"] -= 1000  # its last sector now runs past the blob's end
    data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    digest = sha256_digest(data)
    _blob_path(store, digest).write_bytes(data)  # by hand: publish() would refuse it
    (store / "refs/app/bad").write_text(digest + "\n")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with pytest.raises(api.MountError, match="sectors cover .* which has"):
        api.mount(f"{store}/app:bad", mnt, config)
    assert not kernel.is_mountpoint(mnt) and api.list_mounts(config) == []
    assert cache_usage(config.cache_dir)[0] == 0
