"""The sector cache's cap through real mounts: two images, four parallel readers, a cap of
a few entries. Sampled every 20 ms, the cache directory never holds more than the cap
(entries being written included), and every byte read is the image's.

What is sampled: every regular file under the sector cache's directory (``v3/``: entries,
reservations in ``wip/``), both as ``du --apparent-size`` counts them (``st_size``) and as
allocated blocks (``st_blocks``; a reservation is ``fallocate``d at its full size, so the
two agree up to the file system's block rounding). The sample is taken holding the
directory's lock (the ``flock`` on ``v3/usage`` every process takes to reserve, install or
delete an entry), so that it is of one moment: a walk that does not hold it can count a
reservation in ``wip/`` and then the same file renamed into place, or an entry evicted and
the reservation that replaced it, states the directory was never in. The counter file
itself (16 bytes) and the index cache beside ``v3/`` (``indexes/``, at most 256 indexes,
bounded by count) are outside the cap and reported apart."""

from __future__ import annotations

import fcntl
import hashlib
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import mountimages as images
import pytest
from mounthelp import drop_caches
from ocibuild import TarEntry, make_layer_tar

from snapshotter.cache.sectors import LAYOUT_VERSION, USAGE_FILE
from snapshotter.mount import api

pytestmark = [pytest.mark.root, pytest.mark.integration]

MIB = 1 << 20
FILES = 16  # per image, 3 MiB each of random bytes: 12 sectors of 4 MiB per image


def _files(seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {f"data/f{i:02d}.bin": rng.randbytes(3 * MIB) for i in range(FILES)}


@pytest.fixture(scope="module")
def two_images(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, dict[str, str]]]:
    """Two images of incompressible files (no sector shared): (ref, path -> sha256)."""
    out = []
    for seed in (1, 2):
        root = tmp_path_factory.mktemp(f"img{seed}")
        files = _files(seed)
        layer = make_layer_tar(
            [TarEntry("data/", type="dir")] + [TarEntry(p, data=d) for p, d in files.items()],
            compression=None,
        )
        layout = images.build_layout(root, [layer])
        ref = str(root / "store" / f"img{seed}:v1")
        images.convert(layout, "v1", ref)
        out.append((ref, {p: hashlib.sha256(d).hexdigest() for p, d in files.items()}))
    return out


def _sample(layout: Path) -> tuple[int, int, int]:
    """(apparent bytes, allocated bytes) of the entries and reservations under ``layout``,
    and the bytes of the other files there, counted holding the directory's lock."""
    with open(layout / USAGE_FILE, "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            apparent = allocated = other = 0
            for dirpath, _, names in os.walk(layout):
                for name in names:
                    try:
                        st = os.lstat(os.path.join(dirpath, name))
                    except FileNotFoundError:
                        continue
                    if name == USAGE_FILE and dirpath == str(layout):
                        other += st.st_size
                        continue
                    apparent += st.st_size
                    allocated += st.st_blocks * 512
            return apparent, allocated, other
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read_all(mnt: Path, expected: dict[str, str], order_seed: int) -> int:
    """Read every file of the image in a shuffled order; the count of wrong files."""
    paths = sorted(expected)
    random.Random(order_seed).shuffle(paths)
    wrong = 0
    for p in paths:
        h = hashlib.sha256()
        with open(mnt / p, "rb") as f:
            while chunk := f.read(1 * MIB):
                h.update(chunk)
        wrong += h.hexdigest() != expected[p]
    return wrong


@pytest.mark.parametrize("cap_mib", [24, 8])
def test_the_cap_holds_under_four_readers_of_two_images(
    config, two_images, tmp_path: Path, cap_mib: int
) -> None:  # noqa: ANN001
    """24 MiB: five entries for four readers and their read-ahead. 8 MiB: one entry, less
    than the readers need at once: sectors that find no room are served from memory and
    counted (``uncached``), never a wrong byte, never a wait."""
    cap = cap_mib * MIB
    cfg = replace(config, cache_size=cap)
    mounts = []
    for i, (ref, expected) in enumerate(two_images):
        mnt = tmp_path / f"mnt{i}"
        mnt.mkdir()
        api.mount(ref, mnt, cfg)
        mounts.append((mnt, expected))
    layout = cfg.cache_dir / LAYOUT_VERSION
    peak = [0, 0]
    samples = 0
    stop = threading.Event()

    def sampler() -> None:
        nonlocal samples
        while not stop.is_set():
            apparent, allocated, _ = _sample(layout)
            peak[0], peak[1] = max(peak[0], apparent), max(peak[1], allocated)
            samples += 1
            time.sleep(0.02)

    sampling = threading.Thread(target=sampler)
    sampling.start()
    try:
        wrong = 0
        for round_ in range(3):  # each round after the page cache is dropped
            drop_caches()
            with ThreadPoolExecutor(4) as pool:
                jobs = [
                    pool.submit(_read_all, mnt, expected, 10 * round_ + r)
                    for r, (mnt, expected) in enumerate(mounts * 2)
                ]
                wrong += sum(j.result() for j in jobs)
    finally:
        stop.set()
        sampling.join()
    stats = [api.stats(mnt, cfg) for mnt, _ in mounts]
    uncached = sum(s["cache"]["uncached"] for s in stats)
    fetched = sum(s["fetch"]["sectors_fetched"] for s in stats)
    indexes = sum(f.stat().st_size for f in (cfg.cache_dir / "indexes").iterdir())
    print(f"cap {cap}: peak {peak[0]} bytes apparent, {peak[1]} allocated, over {samples} "
          f"samples; {fetched} sectors fetched, {uncached} not cached for want of room; "
          f"outside the cap: usage file 16 bytes, indexes {indexes} bytes")  # fmt: skip
    assert wrong == 0
    assert samples > 20 and 0 < peak[0] <= cap and peak[1] <= cap, (peak, cap)
    assert all(s["reads"]["errors"] == 0 for s in stats)
    # More sectors than the cap holds went through it: the cap was under pressure.
    assert fetched * 4 * MIB > 2 * cap
    for mnt, _ in mounts:
        api.unmount(mnt, cfg)
