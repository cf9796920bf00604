"""``mount.local_copy``: a mount on a loop device whose image is whole in the cache has the
loop device read a verified copy of the image, past FUSE (``snapshotter.mount.localcopy``).

Real mounts, real loop devices: the copy is made once the mount is quiet, the loop device's
backing file is the copy, every file reads back right with the mount server answering no
read, the cache's count holds the copy while it is used and drops it at unmount; with no
room under the cap there is no copy and the mount goes on through FUSE; a copy that no loop
device reads is removed by the next rescan."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import mountimages as images
import pytest
from mounthelp import drop_caches, snapshotter
from ocibuild import TarEntry, make_layer_tar

from imagetool.image import open_image
from snapshotter import prometheus
from snapshotter.cache.sectors import (
    LAYOUT_VERSION,
    LOCAL_DIR,
    SectorCache,
    is_copy,
    remove_copy,
    shared_usage,
)
from snapshotter.errors import CacheError
from snapshotter.mount import api, kernel, localcopy

pytestmark = [pytest.mark.root, pytest.mark.integration]

MIB = 1 << 20


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    """An image of incompressible files, 24 MiB in all: (ref, path -> sha256)."""
    rng = random.Random(7)
    files = {f"data/f{i}.bin": rng.randbytes(3 * MIB) for i in range(8)}
    layer = make_layer_tar(
        [TarEntry("data/", type="dir")] + [TarEntry(p, data=d) for p, d in files.items()],
        compression=None,
    )
    root = tmp_path_factory.mktemp("localcopy")
    layout = images.build_layout(root, [layer])
    ref = str(root / "store" / "img:v1")
    images.convert(layout, "v1", ref)
    return ref, {p: hashlib.sha256(d).hexdigest() for p, d in files.items()}


def _read_all(mnt: Path, expected: dict[str, str]) -> None:
    for path, digest in expected.items():
        assert hashlib.sha256((mnt / path).read_bytes()).hexdigest() == digest, path


def _wait_copy(mnt: Path, cfg: Any, until: str, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        stats = api.stats(mnt, cfg)
        if stats["local_copy"]["state"] == until:
            return stats
        assert time.monotonic() < deadline, f"local copy: {stats['local_copy']}"
        time.sleep(0.2)


def _whole_in_cache(ref: str, cfg: Any) -> tuple[Any, SectorCache]:
    """(index, cache) of a mount's image once its background fetch has put every sector in
    the node cache."""
    with open_image(ref) as img:
        index = img.index
    cache = SectorCache(cfg.cache_dir, cfg.cache_size)
    deadline = time.monotonic() + 30
    while not localcopy.whole_in_cache(index, cache):
        assert time.monotonic() < deadline, "the image is not whole in the cache"
        time.sleep(0.1)
    return index, cache


def _dead_makers_reservation(root: Path) -> str:
    """The path of an 8 MiB copy reserved in ``root``'s ``wip/`` by a process that has
    exited since (its lock gone with it)."""
    maker = subprocess.run(
        [sys.executable, "-c", f"""
from snapshotter.cache.sectors import SectorCache
print(SectorCache({str(root)!r}, 64 << 20).reserve_copy(8 << 20).path)
"""],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return maker.stdout.strip()


def _mount(
    ref: str, config: Any, tmp_path: Path, **settings: Any
) -> tuple[Any, Path, api.MountInfo]:
    """Mount ``ref`` at ``tmp_path/mnt``, the whole image fetched in the background, with
    ``settings`` (default: on a loop device, with a local copy): (config, mountpoint, info)."""
    cfg = replace(
        config, **{"backing": "loop", "local_copy": True, "prefetch": True,
                   "background_fetch": True, **settings},
    )  # fmt: skip
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    return cfg, mnt, api.mount(ref, mnt, cfg)


def test_a_whole_image_is_read_from_its_local_copy(config, image, tmp_path) -> None:  # noqa: ANN001
    ref, expected = image
    cfg, mnt, info = _mount(ref, config, tmp_path)
    stats = _wait_copy(mnt, cfg, "done")
    copy = Path(stats["local_copy"]["path"])
    assert copy.parent == cfg.cache_dir / LAYOUT_VERSION / LOCAL_DIR
    assert copy.stat().st_size == stats["image"]["size"]
    assert kernel.loop_backing_file(info.loop_device) == str(copy)
    # The directory's count holds the entries and the copy, as the disk does.
    entries = sum(
        f.stat().st_size
        for f in (cfg.cache_dir / LAYOUT_VERSION).glob("??/*")
        if f.parent.name != LOCAL_DIR
    )
    assert shared_usage(cfg.cache_dir) == entries + copy.stat().st_size
    gauge = next(
        line.split()[1]
        for line in prometheus.exposition(cfg).decode().splitlines()
        if line.startswith("lazyblock_cache_local_copy_bytes ")
    )
    assert float(gauge) == copy.stat().st_size

    dirs = ["--state-dir", str(cfg.state_dir), "--cache-dir", str(cfg.cache_dir)]
    shown = snapshotter("status", *dirs).stdout
    assert f"local copy: done, {copy}" in shown and "1 local copy," in shown, shown
    listed = snapshotter("cache", "ls", "--cache-dir", str(cfg.cache_dir)).stdout.splitlines()
    assert [line.split()[0] for line in listed if line.startswith("local/")] == [
        f"local/{copy.name}"
    ], listed
    line = next(line for line in listed if line.startswith("local/")).split()
    assert int(line[1]) == copy.stat().st_size and line[-1] == info.loop_device
    assert sum(1 for line in listed if not line.startswith("local/")) == len(
        [f for f in (cfg.cache_dir / LAYOUT_VERSION).glob("??/*") if f.parent.name != LOCAL_DIR]
    )

    before = stats["fetch"]["read_bytes"]
    drop_caches()
    _read_all(mnt, expected)
    after = api.stats(mnt, cfg)
    assert after["fetch"]["read_bytes"] == before, "the mount server answered reads"
    assert api.list_mounts(cfg)[0].mountpoint == mnt

    api.unmount(mnt, cfg)
    assert not copy.exists()
    assert shared_usage(cfg.cache_dir) == entries


def test_a_server_stopped_by_a_signal_removes_its_copy(config, image, tmp_path) -> None:  # noqa: ANN001
    ref, expected = image
    cfg, mnt, info = _mount(ref, config, tmp_path)
    copy = Path(_wait_copy(mnt, cfg, "done")["local_copy"]["path"])
    _read_all(mnt, expected)
    os.kill(info.pid, signal.SIGTERM)  # the server unmounts erofs and FUSE itself
    deadline = time.monotonic() + 30
    while copy.exists() or kernel.is_mountpoint(mnt):
        assert time.monotonic() < deadline, "the copy outlived its mount"
        time.sleep(0.1)
    entries = sum(f.stat().st_size for f in (cfg.cache_dir / LAYOUT_VERSION).glob("??/*"))
    assert shared_usage(cfg.cache_dir) == entries


def test_a_successor_server_keeps_the_copy(config, image, tmp_path) -> None:  # noqa: ANN001
    """``snapshotter upgrade-mounts`` (``api.replace``): the new server takes the copy over
    from the mount's record; the loop device reads it throughout; unmount removes it."""
    ref, expected = image
    cfg, mnt, old = _mount(ref, config, tmp_path)
    copy = _wait_copy(mnt, cfg, "done")["local_copy"]["path"]
    new = api.replace(mnt, cfg)
    assert new.pid != old.pid
    stats = api.stats(mnt, cfg)
    assert (stats["pid"], stats["local_copy"]["state"]) == (new.pid, "done")
    assert stats["local_copy"]["path"] == copy
    assert kernel.loop_backing_file(new.loop_device) == copy
    drop_caches()
    _read_all(mnt, expected)
    assert api.stats(mnt, cfg)["fetch"]["read_bytes"] == stats["fetch"]["read_bytes"]
    api.unmount(mnt, cfg)
    assert not Path(copy).exists()


def test_no_room_for_a_copy_leaves_the_mount_on_fuse(config, image, tmp_path) -> None:  # noqa: ANN001
    ref, expected = image
    # Room for the image's entries (24 MiB of files in seven 4 MiB sectors and their
    # trailers), and the prefetch may fill it, but there is none for a copy as well.
    cfg, mnt, info = _mount(
        ref, config, tmp_path, cache_size=40 * MIB, prefetch_max_cache_fraction=1.0
    )
    stats = _wait_copy(mnt, cfg, "no room")
    assert stats["local_copy"]["path"] == ""
    assert not any((cfg.cache_dir / LAYOUT_VERSION / LOCAL_DIR).iterdir())
    assert kernel.loop_backing_file(info.loop_device).startswith(str(info.state_dir))
    # Pinned while the room was sought: none of the image's own entries was evicted for it.
    assert stats["cache"]["evictions"] == 0
    before = stats["fetch"]["read_bytes"]
    drop_caches()
    _read_all(mnt, expected)
    assert api.stats(mnt, cfg)["fetch"]["read_bytes"] > before


def test_a_switch_the_kernel_refuses_gives_the_room_back(config, image, tmp_path) -> None:  # noqa: ANN001
    """``LOOP_CHANGE_FD`` to a loop device of another size: the kernel refuses, the copy is
    given up for good (another try would copy the whole image again to the same end), its
    file and its room go back, the entries stay."""
    ref, expected = image
    cfg, mnt, _ = _mount(ref, config, tmp_path, backing=config.backing, local_copy=False)
    _read_all(mnt, expected)
    index, cache = _whole_in_cache(ref, cfg)
    before = shared_usage(cfg.cache_dir)
    other = tmp_path / "other.img"
    other.write_bytes(bytes(1 << 20))
    dev = subprocess.run(["losetup", "--find", "--show", "--read-only", str(other)],
                         check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    try:
        with pytest.raises(localcopy.LocalCopyError, match="LOOP_CHANGE_FD") as failed:
            localcopy.make(index, cache, dev, "refused")
        assert not failed.value.again
        assert kernel.loop_backing_file(dev) == str(other)
    finally:
        subprocess.run(["losetup", "--detach", dev], check=False)
    root = cfg.cache_dir / LAYOUT_VERSION
    assert not any((root / "wip").iterdir()) and not any((root / LOCAL_DIR).iterdir())
    assert shared_usage(cfg.cache_dir) == before
    assert localcopy.whole_in_cache(index, cache)


def test_a_rescan_removes_a_copy_that_no_loop_device_reads(tmp_path) -> None:  # noqa: ANN001
    cache = SectorCache(tmp_path / "cache", 64 * MIB)
    res = cache.reserve_copy(8 * MIB)
    assert res is not None
    assert shared_usage(tmp_path / "cache") == 8 * MIB
    left = cache.install_copy(res, "left-behind")
    assert left.exists() and shared_usage(tmp_path / "cache") == 8 * MIB
    # A crash left it: no loop device reads it, so the next cache opened there removes it.
    SectorCache(tmp_path / "cache", 64 * MIB)
    assert not left.exists()
    assert shared_usage(tmp_path / "cache") == 0


def test_a_copy_whose_maker_died_before_installing_it_is_kept_while_read(tmp_path) -> None:  # noqa: ANN001
    """The maker of a copy switched its loop device to it and died before moving it out of
    wip/: the next rescan does not delete a file a loop device reads (its bytes would stay
    on disk, counted nowhere, until the device is detached), it keeps it in local/ and
    counts it; once the device is detached, the rescan after removes it."""
    root = tmp_path / "cache"
    wip = Path(_dead_makers_reservation(root))
    assert wip.exists() and wip.parent.name == "wip"  # its maker is gone, its lock with it
    dev = subprocess.run(["losetup", "--find", "--show", "--read-only", str(wip)],
                         check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    try:
        SectorCache(root, 64 * MIB)  # a rescan
        kept = root / LAYOUT_VERSION / LOCAL_DIR / wip.name
        assert not wip.exists() and kept.exists()
        assert kernel.loop_backing_file(dev) == str(kept)
        assert shared_usage(root) == 8 * MIB
        SectorCache(root, 64 * MIB)  # still read: still kept, counted once
        assert kept.exists() and shared_usage(root) == 8 * MIB
    finally:
        subprocess.run(["losetup", "--detach", dev], check=False)
    SectorCache(root, 64 * MIB)
    assert not kept.exists() and shared_usage(root) == 0


def test_a_copy_left_in_wip_is_removed_and_uncounted_as_a_copy_in_local(tmp_path) -> None:  # noqa: ANN001
    """``remove_copy`` takes a copy wherever a dead maker left it: in ``wip/`` it is moved
    to ``local/`` first, as a rescan would, then deleted and taken off the count; anything
    outside the two is not a copy of this cache."""
    root = tmp_path / "cache"
    wip = Path(_dead_makers_reservation(root))
    assert shared_usage(root) == 8 * MIB
    assert is_copy(root, wip) and not is_copy(root, tmp_path / "elsewhere")
    assert remove_copy(root, wip) == 8 * MIB
    assert not wip.exists() and not any((root / LAYOUT_VERSION / LOCAL_DIR).iterdir())
    assert shared_usage(root) == 0
    with pytest.raises(CacheError, match="is not a copy"):
        remove_copy(root, tmp_path / "elsewhere")


def test_unmount_removes_a_copy_its_server_did_not_record(config, image, tmp_path) -> None:  # noqa: ANN001
    """A copy the mount's loop device was switched to by a server that died before it
    recorded it (made here from outside the server): ``umount`` still detaches the loop
    device and removes the copy, and the cache's count drops it."""
    ref, expected = image
    cfg, mnt, _ = _mount(ref, config, tmp_path, local_copy=False)
    _read_all(mnt, expected)
    index, cache = _whole_in_cache(ref, cfg)
    before = shared_usage(cfg.cache_dir)
    dev = api.stats(mnt, cfg)["loop_device"]
    made = localcopy.make(index, cache, dev, "unrecorded")
    assert made is not None and kernel.loop_backing_file(dev) == str(made.path)
    assert shared_usage(cfg.cache_dir) == before + made.bytes
    drop_caches()
    _read_all(mnt, expected)
    api.unmount(mnt, cfg)
    assert not made.path.exists() and kernel.loop_backing_file(dev) != str(made.path)
    assert shared_usage(cfg.cache_dir) == before


def test_no_copy_for_a_file_backed_mount(config, image, tmp_path) -> None:  # noqa: ANN001
    ref, _ = image
    cfg, mnt, _ = _mount(ref, config, tmp_path, backing="file")
    stats = _wait_copy(mnt, cfg, "not on a loop device")
    assert stats["local_copy"]["path"] == ""
