"""Mounting block images from every store through real FUSE and the kernel's erofs."""

from __future__ import annotations

import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import mountimages as images
import pytest
from itool import imagetool, snapshot
from mounthelp import drop_caches, snapshotter, with_store_options
from support import require

from imagetool import profile as profiles
from imagetool.image import open_image
from snapshotter.cache.sectors import cache_usage
from snapshotter.datapath.reader import MIRRORED_ENTRIES
from snapshotter.mount import api, fuse, fusewire, kernel, state
from snapshotter.prometheus import exposition

pytestmark = [pytest.mark.root, pytest.mark.integration]


def _cli_args(cfg) -> list[str]:  # noqa: ANN001
    return ["--state-dir", str(cfg.state_dir), "--cache-dir", str(cfg.cache_dir)]


@pytest.mark.parametrize(
    ("backing", "reads"), [("file", "compiled"), ("loop", "compiled"), ("loop", "python")]
)
def test_mount_directory_store_matches_the_source_tree(
    backing, reads, config, umoci_source, umoci_dir_ref, tmp_path, monkeypatch
) -> None:  # noqa: ANN001
    # READs of sectors in memory answered by the compiled loop, or all of them in Python
    if reads == "compiled":
        require(fusewire.compiled_reads_wanted(), "snapshotter.mount._fastreads is not built")
    else:
        monkeypatch.setenv(fusewire.COMPILED_READS_ENV, "0")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = snapshotter("mount", umoci_dir_ref, str(mnt), "--backing", backing,
                      "--no-prefetch", *_cli_args(config))  # fmt: skip
    assert "backing=" + backing in res.stdout
    assert snapshot(mnt) == snapshot(umoci_source[1])

    status = json.loads(snapshotter("status", "--json", *_cli_args(config)).stdout)
    (m,) = status["mounts"]
    assert m["alive"] and m["backing"] == backing and m["ref"] == umoci_dir_ref
    # the kernel reads ahead as configured: a loop device's bdi, or a file-backed mount's own
    bdi = kernel.bdi_name(mnt)
    assert bdi is not None and bdi.startswith("erofs-" if backing == "file" else "7:"), bdi
    read_ahead = (Path(kernel.SYS_BDI) / bdi / "read_ahead_kb").read_text()
    assert int(read_ahead) == config.kernel_read_ahead_kb
    fetch = m["stats"]["fetch"]
    assert fetch["sectors_fetched"] > 0 and fetch["fetch_errors"] == 0
    compiled = m["stats"]["reads"]["compiled"]
    assert compiled > 0 if reads == "compiled" else compiled == 0, compiled
    assert fetch["reads"] >= compiled
    assert fetch["fetch_latency"]["p50"] is not None
    assert status["cache"]["entries"] == fetch["sectors_fetched"]

    text = exposition(config).decode()
    assert f'lazyblock_sectors_fetched_total{{image="{umoci_dir_ref}",mountpoint="{mnt}"}}' in text
    assert "lazyblock_fetch_latency_seconds_bucket" in text and "lazyblock_cache_bytes" in text
    assert f'lazyblock_cache_read_around_hits_total{{image="{umoci_dir_ref}"' in text

    profile = tmp_path / "profile.txt"
    snapshotter("profile", str(mnt), "-o", str(profile), *_cli_args(config))
    recorded = profiles.read(profile)
    assert "/data/big.bin" in recorded.paths and "/etc/hostname" in recorded.paths
    # every file was read to its end: whole files, no ranges
    assert all(e.ranges is None for e in recorded.entries)

    snapshotter("umount", str(mnt), *_cli_args(config))
    assert not kernel.is_mountpoint(mnt)
    assert api.list_mounts(config) == []
    assert not list((config.state_dir / "mounts").iterdir())
    if backing == "loop":
        assert (
            str(config.state_dir)
            not in subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
        )
    # idempotent
    snapshotter("umount", str(mnt), *_cli_args(config))


def test_random_reads_of_the_cache_are_checked_and_right_in_compiled_code(
    config, umoci_dir_ref, tmp_path
) -> None:  # noqa: ANN001
    """Random reads of the node cache straight from the FUSE file, answered by the compiled
    loop from the entries (block by block against their digests): of a server that fetched
    the sectors, and of a new server, which checks the entries the node cache holds in the
    background and gives them to the loop, so that even the first reads skip Python."""
    require(fusewire.compiled_reads_wanted(), "snapshotter.mount._fastreads is not built")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    # No read-ahead: every read here is a random one, whatever its neighbours.
    cfg = replace(config, readahead_bytes=0)
    api.mount(umoci_dir_ref, mnt, cfg)
    image = open_image(umoci_dir_ref)
    expected = image.image.read_at(0, image.index.image_size)
    image.store.close()
    index = image.index
    fuse_file = state.mount_dir(cfg.state_dir, mnt) / state.FUSE_DIR / fuse.IMAGE_NAME
    with open(fuse_file, "rb") as f:
        f.read()  # every sector in the node cache
    size = len(expected)
    # Reads of stored sectors only: one that touches a zero sector goes to Python, or, once
    # that sector is in memory, to the loop from memory and the entry at once.
    spots = [
        o
        for o in ((i * 1_000_003) % (size - 65_536) // 4096 * 4096 for i in range(64))
        if not any(index.sectors[n].is_zero for n in index.sectors_for_range(o, 65_536))
    ]
    assert len(spots) >= 24
    buf = mmap.mmap(-1, 65_536)

    def read_spots() -> None:
        fd = os.open(fuse_file, os.O_RDONLY | os.O_DIRECT)
        try:
            for offset in spots:
                assert os.preadv(fd, [buf], offset) == 65_536
                assert buf[:] == expected[offset : offset + 65_536], offset
        finally:
            os.close(fd)

    for _ in range(2):
        read_spots()
    stats = api.stats(mnt, cfg)["reads"]
    assert stats["compiled_from_cache"] >= len(spots), stats
    api.unmount(mnt, cfg)

    api.mount(umoci_dir_ref, mnt, cfg)
    stored = sum(1 for s in index.sectors if not s.is_zero)
    assert stored <= MIRRORED_ENTRIES
    deadline = time.monotonic() + 10
    while api.stats(mnt, cfg)["reads"]["compiled_entries"] < stored:
        assert time.monotonic() < deadline, api.stats(mnt, cfg)["reads"]
        time.sleep(0.05)
    read_spots()
    stats = api.stats(mnt, cfg)["reads"]
    assert stats["compiled_from_cache"] == len(spots), stats
    api.unmount(mnt, cfg)


def test_cli_paths_are_relative_to_where_it_runs(
    config, umoci_source, umoci_dir_ref, tmp_path
) -> None:  # noqa: ANN001
    """A relative REF, cache and state directory mean what they do where the command runs,
    though a mount's server runs elsewhere (the second mount's comes from the fork server,
    which works in /)."""
    work = tmp_path / "work"
    for name in ("a", "b"):
        (work / name).mkdir(parents=True)
    ref = os.path.relpath(umoci_dir_ref, work)
    args = ["--state-dir", "state", "--cache-dir", "cache"]
    local = replace(config, state_dir=work / "state", cache_dir=work / "cache")
    try:
        for name in ("a", "b"):
            snapshotter("mount", ref, name, "--no-prefetch", *args, cwd=work)
            assert snapshot(work / name) == snapshot(umoci_source[1])
        status = json.loads(snapshotter("status", "--json", *args, cwd=work).stdout)
        assert sorted(m["mountpoint"] for m in status["mounts"]) == [
            str(work / "a"),
            str(work / "b"),
        ]
        assert {m["ref"] for m in status["mounts"]} == {umoci_dir_ref}
        assert status["cache"]["dir"] == "cache" and status["cache"]["entries"] > 0
        assert len(list((work / "cache").rglob("*"))) >= status["cache"]["entries"]
        for name in ("a", "b"):
            snapshotter("umount", name, *args, cwd=work)
        assert api.list_mounts(local) == []
    finally:
        for info in api.list_mounts(local):
            api.unmount(info.mountpoint, local, lazy=True)


def test_foreground_mount_runs_as_its_systemd_unit_expects(
    config, umoci_source, umoci_dir_ref, tmp_path
) -> None:  # noqa: ANN001
    """``mount --foreground`` (the ExecStart of ``lazyblock-mount@.service``, Type=notify):
    READY=1 on $NOTIFY_SOCKET once the tree is browsable, served from that very process, which
    SIGTERM unmounts and ends with status 0. Relative paths are the command's."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    name = f"lazyblock-test-{uuid.uuid4().hex[:12]}"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind("\0" + name)
    notify.settimeout(60)
    ref = os.path.relpath(umoci_dir_ref, tmp_path)
    relative = ["--state-dir", os.path.relpath(config.state_dir, tmp_path),
                "--cache-dir", os.path.relpath(config.cache_dir, tmp_path)]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "snapshotter.cli", "mount", "--foreground", ref, "mnt",
         "--no-prefetch", *relative],
        cwd=tmp_path, env={**os.environ, "NOTIFY_SOCKET": "@" + name},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert notify.recv(64) == b"READY=1"
        assert kernel.is_mountpoint(mnt)
        assert snapshot(mnt) == snapshot(umoci_source[1])
        (info,) = api.list_mounts(config)
        assert info.pid == proc.pid and info.alive and info.ref == umoci_dir_ref
        stats = api.stats(mnt, config)["fetch"]
        assert stats["sectors_fetched"] > 0 and stats["fetch_errors"] == 0
        assert cache_usage(config.cache_dir)[0] == stats["sectors_fetched"]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert f"mounted {ref} at mnt" in out
        assert not kernel.is_mountpoint(mnt)
        assert api.list_mounts(config) == []
    finally:
        notify.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_mount_from_s3(config, umoci_source, s3_bucket, tmp_path) -> None:  # noqa: ANN001
    ref = f"s3://{s3_bucket}/images/app:v1"
    images.convert(umoci_source[0], "v1", ref, "--sector-size", "256KiB")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    info = api.mount(ref, mnt, config)
    assert info.alive and info.phase == "ready"
    assert snapshot(mnt) == snapshot(umoci_source[1])


def test_mount_from_registry(config, umoci_source, registry, tmp_path) -> None:  # noqa: ANN001
    ref = f"docker://{registry.host}/lazyblock/app-{uuid.uuid4().hex[:8]}:v1"
    imagetool("--plain-http", "convert", "-q", f"oci:{umoci_source[0]}:v1", ref)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    api.mount(ref, mnt, with_store_options(config, plain_http=True))
    assert snapshot(mnt) == snapshot(umoci_source[1])


def test_ls_of_20000_files_fetches_no_data_sector(config, many_files_ref, tmp_path) -> None:  # noqa: ANN001
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    api.mount(many_files_ref, mnt, config)
    listing = subprocess.run(["ls", "-lR", str(mnt)], capture_output=True, text=True, check=True)
    assert listing.stdout.count(".txt\n") == 20_000
    stats = api.stats(mnt, config)
    assert stats["reads"]["touched_data_sectors"] == 0
    metadata = stats["image"]["metadata_sectors"]
    assert 0 < stats["fetch"]["sectors_fetched"] <= metadata
    assert stats["image"]["sectors"] > metadata  # there are data sectors to not fetch
    # and the data is there when asked for
    assert (mnt / "d007/f12307.txt").read_text() == "file 12307\n" * 40


def test_one_small_file_of_a_1gb_image_fetches_only_its_sectors(config, big_ref, tmp_path) -> None:  # noqa: ANN001
    with open_image(big_ref) as img:
        index = img.index
    assert index.image_size >= 1 << 30
    (target,) = [f for f in index.files if f.path == "/etc/small.conf"]
    allowed = set(range(index.metadata_sectors)) | set(
        index.sectors_for_range(target.offset, target.length)
    )
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    info = api.mount(big_ref, mnt, config)
    assert (mnt / "etc/small.conf").read_bytes() == b"key = value\n" * 10
    stats = api.stats(mnt, config)
    stored_allowed = [n for n in allowed if not index.sectors[n].is_zero]
    assert stats["fetch"]["sectors_fetched"] <= len(stored_allowed)
    touched = api.control.request(info.state_dir / "control.sock", "profile", sectors=True)
    assert set(touched["sectors"]) <= allowed
    # a big file reads back right, sector by sector
    part = (mnt / "blobs/part-0100.bin").read_bytes()
    assert len(part) == 4 << 20 and part[:4096] == part[-4096:]


def test_mounts_sharing_a_small_cache_keep_it_under_its_cap(config, umoci_source, tmp_path) -> None:  # noqa: ANN001
    # Two images with no sector in common (the same tree cut into 64 KiB and 128 KiB
    # sectors), mounted at once with one cache of 1 MiB, a fraction of either: each mount
    # server evicts the other's entries as well as its own, so the directory stays at the
    # cap, and both trees read back whole.
    from snapshotter.cache.sectors import cache_usage

    cfg = replace(config, cache_size=1 << 20)
    mounts = []
    for sector in ("64KiB", "128KiB"):
        ref = str(tmp_path / f"store-{sector}" / "app:v1")
        images.convert(umoci_source[0], "v1", ref, "--sector-size", sector)
        mnt = tmp_path / f"mnt-{sector}"
        mnt.mkdir()
        api.mount(ref, mnt, cfg)
        mounts.append(mnt)
    want = snapshot(umoci_source[1])
    for round_ in range(2):
        drop_caches()
        for mnt in mounts if round_ == 0 else reversed(mounts):
            assert snapshot(mnt) == want
            _, cached = cache_usage(cfg.cache_dir)
            assert cached <= cfg.cache_size + 2 * (128 << 10), (mnt, cached)
    fetched = sum(api.stats(mnt, cfg)["fetch"]["sectors_fetched"] for mnt in mounts)
    evicted = sum(api.stats(mnt, cfg)["cache"]["evictions"] for mnt in mounts)
    assert fetched > 0 and evicted > 0


def test_store_going_away_fails_uncached_reads_within_the_deadline(
    config, tmp_path, umoci_source
) -> None:  # noqa: ANN001
    import time

    store = tmp_path / "store"
    ref = str(store / "app:v1")
    images.convert(umoci_source[0], "v1", ref, "--sector-size", "64KiB")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cfg = replace(config, fetch=replace(config.fetch, deadline=3.0, request_timeout=1.0))
    api.mount(ref, mnt, cfg)
    want = (mnt / "etc/hostname").read_bytes()
    gone = tmp_path / "store-gone"
    store.rename(gone)
    try:
        drop_caches()
        assert (mnt / "etc/hostname").read_bytes() == want  # from the sector cache
        started = time.monotonic()
        with pytest.raises(OSError) as err:
            (mnt / "data/big.bin").read_bytes()
        assert err.value.errno == 5  # EIO
        assert time.monotonic() - started < 3.0 + 10.0  # the deadline, generously
    finally:
        gone.rename(store)
    data = (mnt / "data/big.bin").read_bytes()
    assert len(data) == 500_004 and data.endswith(b"tail")
    stats = api.stats(mnt, cfg)
    assert stats["reads"]["errors"] >= 1 and stats["fetch"]["fetch_errors"] >= 1


def test_store_serving_corrupt_bytes_is_never_served(config, tmp_path, umoci_source) -> None:  # noqa: ANN001
    store = tmp_path / "store"
    ref = str(store / "app:v1")
    images.convert(umoci_source[0], "v1", ref, "--sector-size", "64KiB")
    with open_image(ref) as img:
        index = img.index
    (big,) = [f for f in index.files if f.path == "/data/big.bin"]
    n = index.sectors_for_range(big.offset + 250_000, 1)[0]  # in its random part
    assert n >= index.metadata_sectors and not index.sectors[n].is_zero
    blob = store / "blobs" / "sha256" / index.blob_of(n).digest.removeprefix("sha256:")
    original = blob.read_bytes()
    at = index.sectors[n].offset + index.sectors[n].length // 2
    corrupted = bytearray(original)
    corrupted[at] ^= 0xFF
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    api.mount(ref, mnt, config)
    os.chmod(blob, 0o644)
    blob.write_bytes(bytes(corrupted))
    try:
        with pytest.raises(OSError) as err:
            (mnt / "data/big.bin").read_bytes()
        assert err.value.errno == 5
        stats = api.stats(mnt, config)
        assert stats["fetch"]["checksum_errors"] >= 1
    finally:
        blob.write_bytes(original)
    data = (mnt / "data/big.bin").read_bytes()
    assert data[300_000:500_000] == bytes(200_000) and data.endswith(b"tail")


@pytest.mark.parametrize("backing", ["file", "loop"])
def test_sigkilled_server_is_cleaned_up_and_the_cache_reused(
    backing, config, umoci_dir_ref, tmp_path
) -> None:  # noqa: ANN001
    import signal

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cfg = replace(config, backing=backing)
    info = api.mount(umoci_dir_ref, mnt, cfg)
    want = (mnt / "data/big.bin").read_bytes()
    fetched = api.stats(mnt, cfg)["fetch"]["sectors_fetched"]
    # Server and holder killed (the holder first, or it starts a successor: as when a whole
    # pod's processes are killed): the FUSE connection ends, reads fail.
    os.kill(info.holder_pid, signal.SIGKILL)
    os.kill(info.pid, signal.SIGKILL)
    drop_caches()
    with pytest.raises(OSError):
        (mnt / "data/big.bin").read_bytes()
    (m,) = api.list_mounts(cfg)
    assert not m.alive
    assert "DEAD" in snapshotter("status", *_cli_args(cfg)).stdout

    snapshotter("umount", str(mnt), *_cli_args(cfg))
    assert not kernel.is_mountpoint(mnt)
    assert not kernel.is_mountpoint(m.state_dir / "fuse")
    assert api.list_mounts(cfg) == []
    if info.loop_device:
        assert kernel.loop_backing_file(info.loop_device) in (None, "")

    api.mount(umoci_dir_ref, mnt, cfg)
    assert (mnt / "data/big.bin").read_bytes() == want
    stats = api.stats(mnt, cfg)
    assert stats["fetch"]["sectors_fetched"] == 0  # everything came from the cache
    assert stats["fetch"]["cache_hits"] >= fetched


def test_errors_are_one_line_with_exit_code(config, tmp_path) -> None:  # noqa: ANN001
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = snapshotter("mount", str(tmp_path / "nostore" / "img:v1"), str(mnt),
                      *_cli_args(config), check=False)  # fmt: skip
    assert res.returncode == 3
    assert res.stderr.startswith("snapshotter: error: MountError:") and res.stderr.count("\n") == 1
    assert not kernel.is_mountpoint(mnt) and api.list_mounts(config) == []
    res = snapshotter("status", str(mnt), *_cli_args(config))
    assert "no mounts" in res.stdout
    res = snapshotter("profile", str(mnt), "-o", str(tmp_path / "p"), *_cli_args(config),
                      check=False)  # fmt: skip
    assert res.returncode == 3 and "NotMountedError" in res.stderr
