"""SectorCache: content addressing, verification, LRU under a cap, pins, restarts, full disks."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import random
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import support
from datapath_support import entry_path, set_mtime, wait_until

from imagetool.format import checksum_and_blocks, sector_checksum
from snapshotter.cache.entry import ALIGN, VERIFY_BLOCK, EntryBuffer, entry_file_size
from snapshotter.cache.sectors import (
    LAYOUT_VERSION,
    READ_AROUND,
    READ_AROUND_MAX,
    READ_AROUND_WINDOWS,
    SectorCache,
    cache_entries,
    shared_usage,
    view_room,
)
from snapshotter.cache.usage import usage_bytes
from snapshotter.datapath.reader import scratch_memory

T = TypeVar("T")


def entry(data: bytes) -> tuple[str, bytes]:
    """(checksum, cache entry bytes) of a sector holding ``data``: the bytes themselves."""
    return sector_checksum(data), data


def random_entry(rng: random.Random, size: int = 10_000) -> tuple[str, bytes]:
    return entry(rng.randbytes(size))


def on_disk(stored: bytes) -> int:
    """The entry file's size: what an entry holding ``stored`` counts against the cap."""
    return entry_file_size(len(stored))


def test_put_get_roundtrip_and_miss(tmp_path: Path) -> None:
    cache = SectorCache(tmp_path, 1 << 20)
    key, stored = entry(b"hello" * 1000)
    assert cache.get(key) is None
    assert cache.put(key, stored)
    assert cache.get(key) == stored == b"hello" * 1000
    assert cache.read(key, 7, 11) == stored[7:18]
    path = entry_path(tmp_path, key)
    assert key in cache and len(cache) == 1 and cache.usage() == path.stat().st_size
    assert path.stat().st_size == on_disk(stored) and path.stat().st_size % 4096 == 0
    assert path.read_bytes()[: len(stored)] == stored  # the sector's bytes, then the trailer
    assert not list((tmp_path / LAYOUT_VERSION / "wip").iterdir())
    assert cache.metrics.hits.value == 2 and cache.metrics.misses.value == 1


def test_block_digests_hashed_by_the_caller_are_those_the_entry_keeps(tmp_path: Path) -> None:
    data = random.Random(3).randbytes(5 * VERIFY_BLOCK + 100)
    key, blocks = checksum_and_blocks(data, VERIFY_BLOCK)
    cache = SectorCache(tmp_path, 1 << 20)
    for bad in ({"verified": False, "digests": blocks}, {"verified": True, "digests": blocks[8:]}):
        with pytest.raises(ValueError):
            cache.put(key, data, **bad)  # type: ignore[arg-type]
    assert key not in cache
    assert cache.put(key, data, verified=True, digests=blocks)
    again = SectorCache(tmp_path, 1 << 20)  # a new process: checks blocks against the trailer
    assert (
        again.read(key, VERIFY_BLOCK - 10, 2 * VERIFY_BLOCK)
        == data[VERIFY_BLOCK - 10 :][: 2 * VERIFY_BLOCK]
    )
    assert again.get(key) == data


def test_rejects_keys_that_are_not_checksums(tmp_path: Path) -> None:
    cache = SectorCache(tmp_path, 1 << 20)
    for bad in ("../../etc/passwd", "ABCDEF" * 6, "00" * 15):
        with pytest.raises(ValueError):
            cache.put(bad, b"x")
        with pytest.raises(ValueError):
            cache.get(bad)


def test_corrupt_entry_is_a_logged_miss_and_deleted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = SectorCache(tmp_path, 1 << 20)
    key, stored = entry(b"payload" * 500)
    cache.put(key, stored)
    path = entry_path(tmp_path, key)
    path.write_bytes(stored[:-1] + bytes([stored[-1] ^ 1]))
    assert cache.get(key) is None
    assert "corrupt" in caplog.text
    assert not path.exists() and key not in cache and cache.usage() == 0
    assert cache.metrics.corrupt.value == 1
    # an entry whose bytes decode fine but to other content is just as corrupt
    other_key, _ = entry(b"other")
    cache.put(other_key, stored)
    assert cache.get(other_key) is None and other_key not in cache


def test_lru_eviction_under_the_cap(tmp_path: Path) -> None:
    rng = random.Random(1)
    entries = [random_entry(rng) for _ in range(4)]
    size = on_disk(entries[0][1])
    cache = SectorCache(tmp_path, 3 * size + 100)
    for key, stored in entries[:3]:
        assert cache.put(key, stored)
    assert cache.get(entries[0][0]) is not None  # 0 is now the most recently used
    assert cache.put(*entries[3])
    assert cache.entries() == [entries[2][0], entries[0][0], entries[3][0]]
    assert cache.get(entries[1][0]) is None  # the least recently used went
    assert not (entry_path(tmp_path, entries[1][0])).exists()
    assert cache.usage() <= cache.max_bytes
    assert cache.metrics.evictions.value == 1


def test_entry_bigger_than_the_cache_is_not_cached(tmp_path: Path) -> None:
    cache = SectorCache(tmp_path, 100)
    key, stored = random_entry(random.Random(2), 1000)
    assert not cache.put(key, stored)
    assert cache.get(key) is None and cache.usage() == 0


def test_pinned_entries_are_not_evicted(tmp_path: Path) -> None:
    rng = random.Random(3)
    a, b, c = (random_entry(rng) for _ in range(3))
    cache = SectorCache(tmp_path, 2 * on_disk(a[1]) + 100)
    cache.put(*a)
    with cache.pin([a[0], b[0]]):
        cache.put(*b)  # pinned before it was even there
        assert not cache.put(*c)  # no room: everything else is pinned
        assert cache.get(a[0]) is not None and cache.get(b[0]) is not None
        cache.clear()  # clear() spares pinned entries too
        assert len(cache) == 2
    assert cache.put(*c)  # once unpinned, the LRU one goes
    assert a[0] not in cache and b[0] in cache and c[0] in cache


def test_restart_reuses_entries_in_lru_order(tmp_path: Path) -> None:
    rng = random.Random(4)
    entries = [random_entry(rng) for _ in range(3)]
    cache = SectorCache(tmp_path, 1 << 20)
    for i, (key, stored) in enumerate(entries):
        cache.put(key, stored)
        set_mtime(entry_path(tmp_path, key), 1_000_000 + (2 - i))  # 0 newest
    (tmp_path / LAYOUT_VERSION / "wip" / "leftover").write_bytes(b"half a sector")  # from a crash
    set_mtime(tmp_path / LAYOUT_VERSION / "wip" / "leftover", 1_000_000)
    (tmp_path / LAYOUT_VERSION / "wip" / "busy").write_bytes(b"another process is writing this")
    (tmp_path / LAYOUT_VERSION / "ab").mkdir(exist_ok=True)
    (tmp_path / LAYOUT_VERSION / "ab" / "not-an-entry").write_bytes(b"?")

    reopened = SectorCache(tmp_path, 1 << 20)
    assert reopened.entries() == [entries[2][0], entries[1][0], entries[0][0]]
    assert reopened.usage() == sum(on_disk(s) for _, s in entries)
    assert reopened.get(entries[1][0]) == entries[1][1]
    assert [p.name for p in (tmp_path / LAYOUT_VERSION / "wip").iterdir()] == ["busy"]
    # the hit touched the file, so the order survives another restart
    again = SectorCache(tmp_path, 1 << 20)
    assert again.entries()[-1] == entries[1][0]


def test_restart_with_a_smaller_cap_evicts_down(tmp_path: Path) -> None:
    rng = random.Random(5)
    entries = [random_entry(rng) for _ in range(4)]
    cache = SectorCache(tmp_path, 1 << 20)
    for i, (key, stored) in enumerate(entries):
        cache.put(key, stored)
        set_mtime(entry_path(tmp_path, key), 1_000_000 + i)
    small = SectorCache(tmp_path, 2 * on_disk(entries[0][1]) + 10)
    assert small.entries() == [entries[2][0], entries[3][0]]


def test_processes_sharing_a_directory_see_each_others_entries(tmp_path: Path) -> None:
    rng = random.Random(10)
    a, b = random_entry(rng), random_entry(rng)
    one, two = SectorCache(tmp_path, 1 << 20), SectorCache(tmp_path, 1 << 20)
    one.put(*a)
    assert a[0] in two and two.get(a[0]) == a[1]  # found on disk, adopted
    assert two.usage() == on_disk(a[1])
    two.put(*b)
    assert one.get(b[0]) == b[1]
    two.discard(a[0])  # "evicted" by the other process
    assert one.get(a[0]) is None and a[0] not in one


def directory_bytes(root: Path) -> int:
    """Bytes of entry files in a cache directory, counted on disk."""
    return sum(size for _, size, _ in cache_entries(root))


def test_the_cap_holds_for_the_directory_whatever_process_writes(tmp_path: Path) -> None:
    # Two processes (two caches, sharing nothing but the directory) take turns writing
    # entries the other has never seen: the directory never holds more than the cap.
    # (Processes writing at once: the test after the next.)
    rng = random.Random(21)
    entries = [random_entry(rng, 60_000) for _ in range(40)]
    cap = 10 * on_disk(entries[0][1])
    one = SectorCache(tmp_path, cap)
    two = SectorCache(tmp_path, cap)
    for i, (key, stored) in enumerate(entries):
        assert (one if i % 2 else two).put(key, stored)
        assert directory_bytes(tmp_path) <= cap, i
    # The entries left are the latest ones, and either process finds them.
    latest = entries[-7:]
    assert all(key in one and key in two for key, _ in latest)
    assert all(one.get(key) == two.get(key) == stored for key, stored in latest)
    # A rescan takes in what the other process wrote and forgets what it deleted.
    one.reconcile()
    assert one.usage() == directory_bytes(tmp_path) and len(one) == len(cache_entries(tmp_path))


def test_a_counter_left_wrong_is_reset_when_the_cache_is_opened(tmp_path: Path) -> None:
    rng = random.Random(22)
    entries = [random_entry(rng) for _ in range(4)]
    cache = SectorCache(tmp_path, 1 << 20)
    for key, stored in entries[:3]:
        cache.put(key, stored)
    # What a process killed between writing an entry and counting it could leave behind.
    usage = tmp_path / LAYOUT_VERSION / "usage"
    usage.write_bytes(usage_bytes(50 << 30))
    assert shared_usage(tmp_path) == 50 << 30
    reopened = SectorCache(tmp_path, 1 << 20)
    assert reopened.put(*entries[3])
    assert all(key in reopened for key, _ in entries)  # nothing evicted for a wrong count
    assert shared_usage(tmp_path) == directory_bytes(tmp_path)


@pytest.mark.parametrize("damage", ["cut", "flipped", "old-layout"])
def test_a_damaged_counter_is_rebuilt_by_the_next_put(tmp_path: Path, damage: str) -> None:
    # Damaged under running caches, the counter must not read as a small count (a counter
    # cut short once read as 0, and the directory could then pass its cap until the next
    # open or gc): the next put rescans and the directory ends at its cap.
    rng = random.Random(23)
    entries = [random_entry(rng, 60_000) for _ in range(12)]
    cap = 4 * on_disk(entries[0][1])
    one, two = SectorCache(tmp_path, cap), SectorCache(tmp_path, cap)
    for key, stored in entries[:4]:
        assert one.put(key, stored)
    usage = tmp_path / LAYOUT_VERSION / "usage"
    good = usage.read_bytes()
    usage.write_bytes(
        {"cut": b"", "flipped": good[:3] + bytes([good[3] ^ 1]) + good[4:],
         "old-layout": good[:8]}[damage]
    )  # fmt: skip
    assert shared_usage(tmp_path) is None
    for key, stored in entries[4:]:  # the other process, which knows none of one's entries
        assert two.put(key, stored)
        assert directory_bytes(tmp_path) <= cap
    assert shared_usage(tmp_path) == directory_bytes(tmp_path)


_WRITER = """
import random, sys
from pathlib import Path
from imagetool.format import sector_checksum
from snapshotter.cache.sectors import SectorCache

root, cap, seed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
cache = SectorCache(root, cap)
rng = random.Random(seed)
for _ in range(30):
    data = rng.randbytes(60_000)
    assert cache.put(sector_checksum(data), data)
    assert cache.get(sector_checksum(data)) in (data, None)
"""


def test_processes_writing_at_once_keep_the_directory_under_its_cap(tmp_path: Path) -> None:
    # Three mount servers' worth of writers at once, each with entries of its own. (The
    # peak is sampled by a scan that is not atomic: an entry deleted after the scan passed
    # it and one written before the scan reached it are both counted.)
    one = on_disk(bytes(60_000))
    cap = 10 * one
    SectorCache(tmp_path, cap)  # the layout, made once
    writers = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(cap), str(seed)])
        for seed in range(3)
    ]
    peak = 0
    while any(w.poll() is None for w in writers):
        peak = max(peak, directory_bytes(tmp_path))
    assert [w.wait() for w in writers] == [0, 0, 0]
    assert peak <= cap + 3 * one, (peak, cap)
    assert directory_bytes(tmp_path) <= cap
    assert shared_usage(tmp_path) == directory_bytes(tmp_path)


_PARALLEL_WRITER = """
import random, sys, threading
from pathlib import Path
from imagetool.format import sector_checksum
from snapshotter.cache.sectors import SectorCache

root, cap, seed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
cache = SectorCache(root, cap)

def write(n):
    rng = random.Random(seed * 100 + n)
    for _ in range(25):
        data = rng.randbytes(256 << 10)
        cache.put(sector_checksum(data), data)

threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


def all_bytes_on_disk(root: Path) -> int:
    """Every byte of a cache directory's entries, those being written included, counted
    while holding the directory's lock (what every process holds to install, delete or
    reserve an entry), so that the count is of one moment."""
    import fcntl

    layout = root / LAYOUT_VERSION
    with open(layout / "usage", "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return sum(
                f.stat().st_size for f in layout.rglob("*") if f.is_file() and f.name != "usage"
            )
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def test_the_cap_holds_with_the_entries_being_written(tmp_path: Path) -> None:
    """Two processes of 4 writer threads each, like mount servers with parallel fetches,
    on a cap of 6 entries: the directory, entries still being written included, never holds
    more than the cap (the entries in flight used to come on top of it: +6.7 % measured
    through a mount). Counted under the directory's lock: exact, not a racing scan."""
    cap = 6 * entry_file_size(256 << 10)
    SectorCache(tmp_path, cap)
    writers = [
        subprocess.Popen([sys.executable, "-c", _PARALLEL_WRITER, str(tmp_path), str(cap), str(s)])
        for s in range(2)
    ]
    peak = samples = 0
    while any(w.poll() is None for w in writers):
        peak = max(peak, all_bytes_on_disk(tmp_path))
        samples += 1
    assert [w.wait() for w in writers] == [0, 0]
    assert samples > 20 and 0 < peak <= cap, (peak, cap, samples)
    assert shared_usage(tmp_path) == directory_bytes(tmp_path) <= cap


_STALLED_WRITER = """
import sys, time
from pathlib import Path
from imagetool.format import sector_checksum
from snapshotter.cache.sectors import SectorCache

class Stalled(SectorCache):
    def _write_entry(self, fd, view):  # half the entry, then a writer that hangs (killed)
        import os
        os.pwrite(fd, bytes(view[: len(view) // 2]), 0)
        print("writing", flush=True)
        time.sleep(600)

root, cap = Path(sys.argv[1]), int(sys.argv[2])
data = b"w" * 60_000
Stalled(root, cap).put(sector_checksum(data), data)
"""


def test_a_writer_killed_mid_write_gives_its_room_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mount server killed while writing an entry leaves its reservation (its file in
    wip/, counted). While the writer lives, a rescan keeps it (its lock says so); once it
    is dead, the next put of another process finds it, removes it and recounts, so the cap
    loses nothing to the crash."""
    from snapshotter.cache import sectors

    monkeypatch.setattr(sectors, "ORPHAN_CHECK_SECONDS", 0.0)
    rng = random.Random(31)
    entries = [random_entry(rng, 60_000) for _ in range(4)]
    cap = 4 * on_disk(entries[0][1])
    cache = SectorCache(tmp_path, cap)
    writer = subprocess.Popen(
        [sys.executable, "-c", _STALLED_WRITER, str(tmp_path), str(cap)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "writing\n"
        wip = tmp_path / LAYOUT_VERSION / "wip"
        (reserved,) = wip.iterdir()
        assert reserved.stat().st_size == on_disk(entries[0][1])
        cache.reconcile()  # a live writer's reservation stays, and counts
        assert list(wip.iterdir()) == [reserved]
        assert shared_usage(tmp_path) == on_disk(entries[0][1])
        assert cache.put(*entries[0])
    finally:
        writer.kill()
        writer.wait()
    for key, stored in entries[1:]:
        assert cache.put(key, stored)
    assert not list(wip.iterdir())
    assert all(key in cache for key, _ in entries)  # the dead reservation took no room
    assert shared_usage(tmp_path) == directory_bytes(tmp_path) == cap


def test_gc_reconciles_with_the_directory(tmp_path: Path) -> None:
    rng = random.Random(6)
    a, b = random_entry(rng), random_entry(rng)
    cache = SectorCache(tmp_path, 1 << 20)
    cache.put(*a)
    cache.put(*b)
    (entry_path(tmp_path, a[0])).unlink()  # removed behind the cache's back
    assert cache.gc() == 0
    assert cache.entries() == [b[0]] and cache.usage() == on_disk(b[1])
    cache.clear()
    assert len(cache) == 0 and cache.usage() == 0


def test_reads_go_on_while_the_directory_is_rescanned(tmp_path: Path) -> None:
    # A rescan stats every entry (0.14-0.4 s for 20,000) holding the directory's lock. Reads
    # of this process must not wait for it, nor behind a put that waits for the directory.
    rng = random.Random(8)
    a, b = random_entry(rng), random_entry(rng)
    cache = SectorCache(tmp_path, 1 << 20)
    assert cache.put(*a)
    scanning, finish = threading.Event(), threading.Event()
    real_scan, real_held = cache._scan, cache._shared.held
    putter_waits = threading.Event()

    def slow_scan() -> list[tuple[float, str, int]]:
        scanning.set()
        assert finish.wait(30)
        return real_scan()

    def held():  # type: ignore[no-untyped-def]
        if threading.current_thread().name == "putter":
            putter_waits.set()  # about to wait for the directory, which the rescan holds
        return real_held()

    cache._scan = slow_scan  # type: ignore[method-assign]
    cache._shared.held = held  # type: ignore[method-assign]
    rescan = threading.Thread(target=cache.gc)
    putter = threading.Thread(target=cache.put, args=b, name="putter")
    try:
        rescan.start()
        assert scanning.wait(10)
        read = lambda: cache.get(a[0])  # noqa: E731
        assert returns_within(read, 10, "the read waited for the rescan") == a[1]
        putter.start()
        assert putter_waits.wait(10)  # and while a put waits for the directory:
        assert returns_within(read, 10, "the read waited behind the put") == a[1]
        assert putter.is_alive() and rescan.is_alive()
    finally:
        finish.set()
        for thread in (rescan, putter):
            if thread.ident is not None:  # started
                thread.join()
    assert cache.get(b[0]) == b[1]
    files = directory_bytes(tmp_path)
    assert cache.usage() == files == shared_usage(tmp_path) == on_disk(a[1]) + on_disk(b[1])


def returns_within(call: Callable[[], T], seconds: float, stuck: str) -> T:
    """``call()`` on another thread; fails with ``stuck`` if it has not returned within
    ``seconds`` (stuck behind a lock)."""
    got: list[T] = []
    thread = threading.Thread(target=lambda: got.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), stuck
    return got[0]


def test_clear_lets_other_processes_put_between_its_deletions(tmp_path: Path) -> None:
    # `snapshotter cache clear` on a live node: the mount servers' puts must not wait for
    # thousands of deletions at once.
    rng = random.Random(10)
    entries = [random_entry(rng) for _ in range(3)]
    cache = SectorCache(tmp_path, 1 << 20)
    for e in entries:
        assert cache.put(*e)
    other = SectorCache(tmp_path, 1 << 20)  # another process's (its own hold on the directory)
    between, go_on = threading.Event(), threading.Event()
    real_held = cache._shared.held
    outer = [0]

    def held():  # type: ignore[no-untyped-def]
        if threading.current_thread().name == "clear" and not cache._shared.owned():
            outer[0] += 1
            if outer[0] == 2:  # between the first deletion and the second
                between.set()
                assert go_on.wait(30)
        return real_held()

    cache._shared.held = held  # type: ignore[method-assign]
    clearing = threading.Thread(target=cache.clear, name="clear")
    clearing.start()
    try:
        assert between.wait(10), "clear held the directory across its deletions"
        new = random_entry(rng)
        assert returns_within(lambda: other.put(*new), 10, "the other process's put waited")
    finally:
        go_on.set()
        clearing.join()
    assert len(cache) == 0 and other.get(new[0]) == new[1]
    assert shared_usage(tmp_path) == directory_bytes(tmp_path) == on_disk(new[1])


def test_concurrent_puts_and_gets(tmp_path: Path) -> None:
    rng = random.Random(7)
    entries = [random_entry(rng, 5000) for _ in range(40)]
    cache = SectorCache(tmp_path, 20 * on_disk(entries[0][1]))
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        r = random.Random(seed)
        try:
            for _ in range(50):
                key, stored = r.choice(entries)
                got = cache.get(key)
                assert got is None or got == stored
                cache.put(key, stored)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cache.usage() <= cache.max_bytes
    files = sum(p.stat().st_size for p in (tmp_path / LAYOUT_VERSION).glob("??/*"))
    assert files == cache.usage()
    assert cache.metrics.corrupt.value == 0


class FlakyDiskCache(SectorCache):
    """Reports ENOSPC for the first ``fail`` entry files it allocates."""

    fail = 1

    def _allocate(self, fd: int, size: int) -> None:
        if self.fail:
            self.fail -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        super()._allocate(fd, size)


def test_disk_full_evicts_and_retries(tmp_path: Path) -> None:
    rng = random.Random(8)
    a, b, c = (random_entry(rng) for _ in range(3))
    cache = FlakyDiskCache(tmp_path, 1 << 20)
    cache.fail = 0
    cache.put(*a)
    cache.put(*b)
    cache.fail = 1
    assert cache.put(*c)  # evicted (all it could) and retried
    assert c[0] in cache and a[0] not in cache
    cache.fail = 2
    d = random_entry(rng)
    assert not cache.put(*d)  # still full after evicting: dropped, no exception
    assert cache.metrics.put_failures.value == 1


@pytest.fixture
def tiny_fs(tmp_path: Path):
    support.require_root()
    support.require_tool("mount", "umount")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.root
def test_real_full_filesystem_evicts_and_never_fails(tiny_fs: Path) -> None:
    rng = random.Random(9)
    cache = SectorCache(tiny_fs, 100 << 20)  # the cap is far above what the disk holds
    entries = [random_entry(rng, 100_000) for _ in range(30)]  # ~3 MB into 1 MB
    results = [cache.put(key, stored) for key, stored in entries]
    assert results[-1]  # eviction made room for the newest
    assert cache.metrics.evictions.value > 0
    assert cache.usage() < 1 << 20
    assert cache.get(entries[-1][0]) == entries[-1][1]
    assert not list((tiny_fs / LAYOUT_VERSION / "wip").iterdir())


def test_range_reads_are_checked_against_what_was_verified(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = random.Random(11).randbytes(300_000)
    key = sector_checksum(data)
    SectorCache(tmp_path, 1 << 20).put(key, data)
    cache = SectorCache(tmp_path, 1 << 20)  # another process: nothing verified yet
    assert cache.read(key, 100_000, 5000, size=len(data)) == data[100_000:105_000]
    assert cache.read(key, 299_990, 100) == data[299_990:]  # short at the end
    assert cache.read(key, 0, 10, size=len(data) + 1) is None  # not the sector asked for
    # damaged in place after the check (same size, same mtime): caught by the read that
    # would have served it, never returned
    path = entry_path(tmp_path, key)
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(200_000)
        f.write(b"\xff" * 3)
    set_mtime(path, st.st_mtime)
    assert cache.read(key, 0, 1000) == data[:1000]  # blocks that are intact still serve
    assert cache.read(key, 199_000, 2000) is None
    assert "corrupt" in caplog.text and not path.exists() and key not in cache
    assert cache.metrics.corrupt.value == 1


def _rchar() -> int:
    """Bytes this process has read through read(2)-like calls so far."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_first_use_in_a_process_checks_the_trailer_and_reads_only_what_it_serves(
    tmp_path: Path,
) -> None:
    data = random.Random(12).randbytes(1 << 20)
    key = sector_checksum(data)
    SectorCache(tmp_path, 4 << 20).put(key, data)
    path = entry_path(tmp_path, key)
    with open(path, "r+b") as f:  # damage far from the range read first
        f.seek(900_000)
        f.write(b"\x00\x01")
    cache = SectorCache(tmp_path, 4 << 20)  # another process: nothing checked yet
    before = _rchar()
    assert cache.read(key, 100, 1000, size=len(data)) == data[100:1100]
    # the footer page and one block (and this test's read of /proc), not 1 MiB
    assert _rchar() - before < 4096 + VERIFY_BLOCK + 1024
    assert cache.read(key, 899_000, 2000) is None  # the damaged block is never served
    assert not path.exists() and cache.metrics.corrupt.value == 1


def test_entries_written_with_another_block_size_are_read_and_checked_as_they_are(
    tmp_path: Path,
) -> None:
    # e.g. from a release with another VERIFY_BLOCK: 4 KiB blocks, as the trailer says
    from snapshotter.cache.entry import aligned, block_digests, entry_trailer

    data = random.Random(14).randbytes(300_000)
    key = sector_checksum(data)
    block = 4 << 10
    assert block != VERIFY_BLOCK
    trailer = entry_trailer(key, len(data), block_digests(data, block), block)
    path = entry_path(tmp_path, key)
    path.parent.mkdir(parents=True)
    path.write_bytes(data + bytes(aligned(len(data)) - len(data)) + trailer)
    cache = SectorCache(tmp_path, 4 << 20)
    assert cache.read(key, 20_000, 100_000, size=len(data)) == data[20_000:120_000]
    scratch = scratch_memory(view_room(5000, block))
    got = cache.read_view(key, 250_000, 5000, scratch, len(data), sequential=True)
    assert got is not None and got[0] == data[250_000:255_000]
    assert cache.get(key) == data
    with open(path, "r+b") as f:  # damage the middle of its second block
        f.seek(block + 2000)
        f.write(b"\xff")
    assert cache.read(key, block + 100, 10) is None
    assert cache.metrics.corrupt.value == 1


@pytest.mark.parametrize("damage", ["trailer", "truncated", "renamed", "no-trailer"])
def test_an_entry_whose_trailer_does_not_check_out_is_corrupt(tmp_path: Path, damage: str) -> None:
    data = random.Random(13).randbytes(100_000)
    key = sector_checksum(data)
    SectorCache(tmp_path, 1 << 20).put(key, data)
    path = entry_path(tmp_path, key)
    raw = path.read_bytes()
    if damage == "trailer":  # one digest changed
        spot = entry_file_size(len(data)) - 4096
        path.write_bytes(raw[:spot] + bytes([raw[spot] ^ 1]) + raw[spot + 1 :])
    elif damage == "truncated":
        path.write_bytes(raw[:65536])
    elif damage == "renamed":  # another entry's whole file under this name
        other = random.Random(14).randbytes(100_000)
        okey = sector_checksum(other)
        SectorCache(tmp_path, 1 << 20).put(okey, other)
        os.replace(entry_path(tmp_path, okey), path)
    else:  # a sector's bytes alone, as layout v2 kept them
        path.write_bytes(data)
    cache = SectorCache(tmp_path, 1 << 20)
    assert cache.read(key, 0, 100) is None
    assert not path.exists() and cache.metrics.corrupt.value == 1
    assert key not in cache


def test_put_refuses_bytes_that_are_not_the_named_sector(tmp_path: Path) -> None:
    cache = SectorCache(tmp_path, 1 << 20)
    key, _ = entry(b"right")
    assert not cache.put(key, b"wrong")
    assert key not in cache and cache.get(key) is None


def test_v1_entries_are_taken_over(tmp_path: Path) -> None:
    import zstandard

    data = random.Random(14).randbytes(50_000)
    key = sector_checksum(data)
    old = tmp_path / "v1" / key[:2] / key
    old.parent.mkdir(parents=True)
    old.write_bytes(zstandard.ZstdCompressor().compress(data))
    bad = random.Random(15).randbytes(1000)
    bad_key = sector_checksum(bad)
    (tmp_path / "v1" / bad_key[:2]).mkdir(exist_ok=True)
    (tmp_path / "v1" / bad_key[:2] / bad_key).write_bytes(zstandard.ZstdCompressor().compress(b"x"))
    cache = SectorCache(tmp_path, 1 << 20)
    assert cache.read(key, 10, 20) == data[10:30]
    assert not old.exists() and entry_path(tmp_path, key).read_bytes()[: len(data)] == data
    assert cache.get(bad_key) is None  # a v1 entry that does not check out is dropped
    assert not (tmp_path / "v1" / bad_key[:2] / bad_key).exists()
    cache.gc()
    assert not (tmp_path / "v1").exists()


def test_v2_entries_are_taken_over(tmp_path: Path) -> None:
    data = random.Random(16).randbytes(70_000)
    key = sector_checksum(data)
    old = tmp_path / "v2" / key[:2] / key
    old.parent.mkdir(parents=True)
    old.write_bytes(data)  # layout v2: the sector's bytes alone
    bad_key = sector_checksum(b"something else")
    (tmp_path / "v2" / bad_key[:2]).mkdir(exist_ok=True)
    (tmp_path / "v2" / bad_key[:2] / bad_key).write_bytes(data)  # not what its name says
    cache = SectorCache(tmp_path, 1 << 20)
    assert cache.read(key, 10, 20) == data[10:30]
    assert not old.exists() and entry_path(tmp_path, key).read_bytes()[: len(data)] == data
    assert cache.get(bad_key) is None and not (tmp_path / "v2" / bad_key[:2] / bad_key).exists()
    assert SectorCache(tmp_path, 1 << 20).get(key) == data  # a v3 entry now
    cache.gc()
    assert not (tmp_path / "v2").exists()


def _fs_type(path: Path) -> str:
    return subprocess.run(
        ["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_entries_are_written_and_read_past_the_page_cache(tmp_path: Path) -> None:
    rng = random.Random(10)
    cache = SectorCache(tmp_path, 16 << 20)
    aligned = random_entry(rng, 1 << 20)
    odd = random_entry(rng, 10_000)  # padded to whole pages on disk
    assert cache.put(*aligned) and cache.put(*odd)
    for key, stored in (aligned, odd):
        assert SectorCache(tmp_path, 16 << 20).get(key) == stored  # a new process reads it
        assert cache.read(key, 5000, 3000) == stored[5000:8000]
        if _fs_type(tmp_path) not in ("tmpfs", "ramfs"):  # all of it is page cache there
            fd = os.open(entry_path(tmp_path, key), os.O_RDONLY)
            try:
                assert not _cached(fd, 0)  # not in the page cache
            finally:
                os.close(fd)
        assert entry_path(tmp_path, key).read_bytes()[: len(stored)] == stored


@pytest.mark.root
def test_direct_writes_on_a_full_filesystem_evict_and_never_fail(tiny_fs: Path) -> None:
    rng = random.Random(11)
    cache = SectorCache(tiny_fs, 100 << 20)
    entries = [random_entry(rng, 64 << 10) for _ in range(40)]  # 2.5 MB of 64 KiB entries
    results = [cache.put(key, stored) for key, stored in entries]
    assert results[-1] and cache.metrics.evictions.value > 0
    assert cache.get(entries[-1][0]) == entries[-1][1]
    assert not list((tiny_fs / LAYOUT_VERSION / "wip").iterdir())


def _entry_buffer(data: bytes) -> EntryBuffer:
    buf = EntryBuffer(len(data))
    buf.data[:] = data
    return buf


@pytest.mark.parametrize("size", [1 << 20, 10_000], ids=["whole-pages", "odd"])
def test_an_entry_buffer_is_written_as_the_same_entry_from_where_it_is(
    tmp_path: Path, size: int
) -> None:
    rng = random.Random(12)
    data = rng.randbytes(size)
    key = sector_checksum(data)
    buf = EntryBuffer(size)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf.data))
    assert address % ALIGN == 0  # direct I/O can write it as it is
    buf.data[:] = rng.randbytes(size)  # memory that held other bytes before (not zeroed)
    buf.data[:] = data
    as_bytes, as_buffer = (
        SectorCache(tmp_path / "a", 16 << 20),
        SectorCache(tmp_path / "b", 16 << 20),
    )
    assert as_bytes.put(key, data) and as_buffer.put(key, buf, verified=True)
    assert buf.data == data  # left as it was
    written = entry_path(tmp_path / "b", key).read_bytes()
    assert written == entry_path(tmp_path / "a", key).read_bytes()  # zeros, trailer and all
    assert len(written) == entry_file_size(size)
    assert SectorCache(tmp_path / "b", 16 << 20).get(key) == data  # and it checks out


def test_an_entry_buffer_that_is_not_the_named_sector_is_refused(tmp_path: Path) -> None:
    cache = SectorCache(tmp_path, 16 << 20)
    buf = _entry_buffer(b"x" * 5000)
    assert not cache.put(sector_checksum(b"y" * 5000), buf)
    assert len(cache) == 0 and cache.metrics.put_failures.value == 1


@pytest.mark.root
def test_entry_buffers_on_a_full_filesystem_evict_and_never_fail(tiny_fs: Path) -> None:
    rng = random.Random(13)
    cache = SectorCache(tiny_fs, 100 << 20)
    datas = [rng.randbytes(64 << 10) for _ in range(40)]  # 2.5 MB of 64 KiB entries
    results = [cache.put(sector_checksum(d), _entry_buffer(d), verified=True) for d in datas]
    assert results[-1] and cache.metrics.evictions.value > 0
    assert cache.get(sector_checksum(datas[-1])) == datas[-1]
    assert not list((tiny_fs / LAYOUT_VERSION / "wip").iterdir())


def test_aligned_buffers_are_reused_and_the_sizes_in_use_keep_their_room() -> None:
    from snapshotter.cache.sectors import POOL_GRAIN, _Buffers

    pool = _Buffers(1 << 20)
    big = [pool.take(400 << 10) for _ in range(3)]  # e.g. a cold pass's entry writes
    for buf in big:
        pool.give(buf)
    again = pool.take(400 << 10)
    assert again in big and len(again) % POOL_GRAIN == 0
    pool.give(again)
    small = [pool.take(100 << 10) for _ in range(4)]  # then random reads
    for buf in small:
        assert memoryview(buf).nbytes >= 100 << 10
        pool.give(buf)
    # over the cap, the big ones were unmapped first: all four small ones are kept
    assert [pool.take(100 << 10) for _ in range(4)] == small[::-1]


def test_will_need_has_the_kernel_read_an_entry_ahead(tmp_path: Path) -> None:
    data = random.Random(17).randbytes(1 << 20)
    key = sector_checksum(data)
    cache = SectorCache(tmp_path, 4 << 20)
    cache.put(key, data)  # written past the page cache
    if _fs_type(tmp_path) not in ("tmpfs", "ramfs"):  # all of it is page cache there
        fd = os.open(entry_path(tmp_path, key), os.O_RDONLY)
        try:
            assert not _cached(fd, 512 << 10)
            cache.will_need(key)
            wait_until(lambda: _cached(fd, 512 << 10), timeout=10)
        finally:
            os.close(fd)
    else:
        cache.will_need(key)
    got = cache.read_view(key, 0, len(data), scratch_memory(view_room(len(data))), sequential=True)
    assert got is not None and got[0] == data


def _cached(fd: int, offset: int) -> bool:
    """Whether the file's page at ``offset`` is in the page cache, asked with mincore(2),
    which reads nothing: a RWF_NOWAIT read may start a readahead of the page and, when the
    disk answers at once, return it."""
    with mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) as m:
        view = ctypes.c_char.from_buffer(m)  # a private mapping, never written
        try:
            vec = (ctypes.c_ubyte * 1)()
            if _libc.mincore(ctypes.c_void_p(ctypes.addressof(view) + offset), 4096, vec):
                raise OSError(ctypes.get_errno(), "mincore failed")
            return bool(vec[0] & 1)
        finally:
            del view


_libc = ctypes.CDLL(None, use_errno=True)


def test_small_random_reads_are_served_from_the_window_read_around_them(tmp_path: Path) -> None:
    data = random.Random(15).randbytes(1 << 20)
    key = sector_checksum(data)
    SectorCache(tmp_path, 4 << 20).put(key, data)
    cache = SectorCache(tmp_path, 4 << 20)  # another process: nothing read yet
    scratch = scratch_memory(view_room(2 * READ_AROUND))
    size = len(data)
    start = 300_000 - 300_000 % READ_AROUND
    got = cache.read_view(key, 300_000, 4096, scratch, size)
    assert got is not None and got[0] == data[300_000:304_096]
    assert got[1] == 0  # a view of the window, none of the caller's scratch
    # every other small read in that window: from memory, not one byte read from the disk
    offsets = range(start, start + READ_AROUND - 4096, 8192)
    before = _rchar()
    views = [cache.read_view(key, off, 4096, scratch, size) for off in offsets]
    assert _rchar() - before < 1024  # this test's read of /proc/self/io
    assert [v[0] if v else None for v in views] == [data[o : o + 4096] for o in offsets]
    assert cache.metrics.read_around_hits.value == len(offsets)
    # a larger read, a sequential one and one across two windows are read as they are
    # (into the caller's scratch), never a window's worth more
    for off, length, sequential in ((600_000, READ_AROUND_MAX + 1, False), (700_000, 4096, True),
                                    (2 * READ_AROUND - 100, 200, False)):  # fmt: skip
        before = _rchar()
        got = cache.read_view(key, off, length, scratch, size, sequential=sequential)
        assert got is not None and got[0] == data[off : off + length] and got[1] > 0
        assert _rchar() - before < length + 2 * VERIFY_BLOCK + 1024
    assert cache.metrics.read_around_hits.value == len(offsets)


def test_a_window_with_a_damaged_block_is_never_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = random.Random(16).randbytes(1 << 20)
    key = sector_checksum(data)
    SectorCache(tmp_path, 4 << 20).put(key, data)
    path = entry_path(tmp_path, key)
    with open(path, "r+b") as f:  # a block of the window, not of the range asked for
        f.seek(READ_AROUND + VERIFY_BLOCK * 5 + 10)
        f.write(b"\xff")
    cache = SectorCache(tmp_path, 4 << 20)
    scratch = scratch_memory(view_room(READ_AROUND))
    assert cache.read_view(key, READ_AROUND + 100, 4096, scratch, len(data)) is None
    assert "corrupt" in caplog.text and not path.exists() and key not in cache
    assert cache.metrics.corrupt.value == 1 and cache.metrics.read_around_hits.value == 0


def test_a_window_outlives_its_entry_and_its_place_in_memory(tmp_path: Path) -> None:
    rng = random.Random(17)
    data = rng.randbytes(1 << 20)
    key = sector_checksum(data)
    cache = SectorCache(tmp_path, 64 << 20)
    cache.put(key, data)
    scratch = scratch_memory(view_room(READ_AROUND))
    view = cache.read_view(key, 5000, 3000, scratch, len(data))
    assert view is not None
    # the entry goes (evicted, deleted behind the cache's back): the window in memory holds
    # its verified bytes, which a name that is their checksum never lets change
    entry_path(tmp_path, key).unlink()
    again = cache.read_view(key, 9000, 3000, scratch, len(data))
    assert again is not None and again[0] == data[9000:12_000]
    # other windows push it out of memory: a view an answer still holds stays valid
    others = [random_entry(rng, READ_AROUND) for _ in range(READ_AROUND_WINDOWS + 1)]
    for other, stored in others:
        cache.put(other, stored)
        got = cache.read_view(other, 100, 100, scratch, len(stored))
        assert got is not None and got[0] == stored[100:200]
    assert view[0] == data[5000:8000]
    assert cache.metrics.read_around_hits.value == 1
    # a quiet server gives the windows' memory back; a view still held stays valid
    assert cache.release_windows() == READ_AROUND_WINDOWS * READ_AROUND
    assert cache.release_windows() == 0 and view[0] == data[5000:8000]


def test_an_older_layout_made_after_the_cache_opened_is_looked_in(tmp_path: Path) -> None:
    data = random.Random(17).randbytes(30_000)
    key = sector_checksum(data)
    cache = SectorCache(tmp_path, 1 << 20)
    assert cache.get(key) is None  # no older layout here: not looked for
    old = tmp_path / "v2" / key[:2] / key
    old.parent.mkdir(parents=True)
    old.write_bytes(data)  # by a process of an older version, still running
    assert cache.get(key) is None  # which layouts exist is looked at again only later...
    cache._old_layouts_at = 0.0  # ...such as now
    assert cache.get(key) == data and not old.exists()
