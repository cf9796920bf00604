"""snapshotter.mount._fastreads: FUSE READs answered from sector memory in compiled code.

The loop reads requests from a descriptor and writes answers to it as it does on /dev/fuse;
here the descriptor is one end of a SOCK_SEQPACKET socket pair (one request per read, one
answer per write, as /dev/fuse has them), and the test is the kernel on the other end."""

from __future__ import annotations

import os
import random
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash
from support import require

from snapshotter.mount import fusewire

_fastreads = fusewire._fastreads

SECTOR = 64 << 10
IMAGE = 3 * SECTOR + 1000  # the last sector is short
IN_HEADER = fusewire.IN_HEADER
READ_IN = fusewire.READ_IN
OUT_HEADER = fusewire.OUT_HEADER


def sector_bytes(n: int) -> bytes:
    size = min(SECTOR, IMAGE - n * SECTOR)
    return bytes((n * 7 + i) % 251 for i in range(size))


IMAGE_BYTES = b"".join(sector_bytes(n) for n in range(4))


def request(opcode: int, unique: int, offset: int = 0, size: int = 0) -> bytes:
    body = READ_IN.pack(1, offset, size, 0, 0, 0, 0) if opcode == fusewire.READ else b""
    header = IN_HEADER.pack(IN_HEADER.size + len(body), opcode, unique, 2, 0, 0, 0, 0, 0)
    return header + body


class Loop:
    """A ``Memory`` serving one end of a socket pair on a thread; ``kernel`` is the other
    end. ``results`` receives what each ``serve`` call returned."""

    def __init__(self, memory: object) -> None:
        self.memory = memory
        self.kernel, self.server = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.results: list[tuple[int, int, bytes]] = []
        self.waited: list[float] = []  # what each serve() said its request waited
        self.buf = bytearray(fusewire.REQUEST_BUFFER)
        self._thread: threading.Thread | None = None

    def serve_once(self) -> None:
        """One ``serve`` call, in a thread (``wait`` for it)."""

        def run() -> None:
            status, n, waited = self.memory.serve(self.server.fileno(), self.buf)  # type: ignore[attr-defined]
            self.results.append((status, n, bytes(self.buf[:n]) if status == 0 else b""))
            self.waited.append(waited)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def wait(self) -> tuple[int, int, bytes]:
        assert self._thread is not None
        self._thread.join(10)
        assert not self._thread.is_alive(), "serve() did not return"
        return self.results[-1]

    def answer(self) -> tuple[int, int, bytes]:
        """(length, error, unique) of the next answer, and its bytes."""
        self.kernel.settimeout(10)
        data = self.kernel.recv(1 << 21)
        length, error, unique = OUT_HEADER.unpack_from(data)
        assert length == len(data)
        return error, unique, data[OUT_HEADER.size :]

    def close(self) -> None:
        self.kernel.close()
        if self._thread is not None:
            self._thread.join(10)
        self.server.close()


@pytest.fixture
def memory() -> object:
    require(_fastreads is not None, "snapshotter.mount._fastreads is not built (pip install -e .)")
    return _fastreads.Memory(SECTOR, IMAGE, drain_every=3, wait_seconds=2.0)


@pytest.fixture
def loop(memory: object) -> Iterator[Loop]:
    served = Loop(memory)
    yield served
    served.close()


def put_all(memory: object) -> None:
    for n in range(4):
        memory.put(n, memoryview(sector_bytes(n)))  # type: ignore[attr-defined]


def test_reads_of_sectors_in_memory_are_answered_and_logged(memory: object, loop: Loop) -> None:
    put_all(memory)
    loop.serve_once()
    reads = [(100, 4000), (SECTOR - 10, 20 + SECTOR), (3 * SECTOR, 1 << 20)]  # 1, 3, short end
    for unique, (offset, size) in enumerate(reads, start=10):
        loop.kernel.send(request(fusewire.READ, unique, offset, size))
        error, got_unique, data = loop.answer()
        assert (error, got_unique) == (0, unique)
        assert data == IMAGE_BYTES[offset : offset + size]
    # the third READ filled the log to drain_every: the call returns for a drain
    assert loop.wait()[:2] == (_fastreads.DRAIN, 0)
    assert memory.drain() == [(100, 4000), (SECTOR - 10, 20 + SECTOR), (3 * SECTOR, 1000)]
    assert memory.drain() == []
    assert (memory.served, memory.in_flight) == (3, 0)
    assert memory.served_bytes == 4000 + 20 + SECTOR + 1000


def test_what_it_cannot_answer_goes_to_the_caller(memory: object, loop: Loop) -> None:
    memory.put(0, memoryview(sector_bytes(0)))
    for req in (
        request(fusewire.READ, 5, SECTOR - 1, 2),  # sector 1 is not in memory
        request(fusewire.GETATTR, 6),  # not a READ
        request(fusewire.READ, 7, IMAGE, 4096),  # past the end: Python answers it
    ):
        loop.serve_once()
        loop.kernel.send(req)
        status, n, data = loop.wait()
        assert (status, n, data) == (_fastreads.REQUEST, len(req), req)
        assert memory.in_flight == 1  # read here, not answered yet
        memory.handed()
        assert memory.in_flight == 0
    assert memory.served == 0 and memory.drain() == []


def test_a_read_of_a_sector_being_fetched_waits_for_it(memory: object, loop: Loop) -> None:
    memory.put(0, memoryview(sector_bytes(0)))
    memory.pending(1)
    loop.serve_once()
    loop.kernel.send(request(fusewire.READ, 9, 1000, SECTOR))
    time.sleep(0.2)
    assert loop.results == [] and memory.in_flight == 1  # waiting, not gone to Python
    memory.put(1, memoryview(sector_bytes(1)))
    error, unique, data = loop.answer()
    assert (error, unique, data) == (0, 9, IMAGE_BYTES[1000 : 1000 + SECTOR])
    assert memory.drain() == [(1000, SECTOR)]


def test_a_failed_fetch_or_a_long_wait_hands_the_read_to_the_caller(memory: object) -> None:
    short = _fastreads.Memory(SECTOR, IMAGE, wait_seconds=0.3)
    for mem, settle in ((memory, True), (short, False)):
        loop = Loop(mem)
        try:
            mem.pending(2)  # type: ignore[attr-defined]
            loop.serve_once()
            req = request(fusewire.READ, 3, 2 * SECTOR, 10)
            loop.kernel.send(req)
            if settle:
                time.sleep(0.1)
                mem.settled(2)  # type: ignore[attr-defined]  # the fetch failed: no put
            assert loop.wait() == (_fastreads.REQUEST, len(req), req)
            # how long it waited here, for the caller's deadline to count
            if settle:
                assert 0.1 <= loop.waited[-1] < 2.0, loop.waited
            else:
                assert loop.waited[-1] == pytest.approx(0.3)
            loop.serve_once()
            other = request(fusewire.GETATTR, 4, 0, 0)
            loop.kernel.send(other)
            assert loop.wait() == (_fastreads.REQUEST, len(other), other)
            assert loop.waited[-1] == 0.0  # nothing waited for
        finally:
            loop.close()


def test_a_read_of_two_sectors_being_fetched_waits_for_both(memory: object) -> None:
    """A READ across sectors 1 and 2, both being fetched, waits for the first missing one
    (its stripe of waiters), then for the next: the put of another sector, or of only one
    of its own, does not answer it; the put of the second does. And if the second's fetch
    fails while it waits for the first, it goes to the caller then, not at its deadline."""
    req_at, req_len = SECTOR - 100, 200  # the end of sector 1 and the start of sector 2
    for fail_second in (False, True):
        memory.clear()  # type: ignore[attr-defined]
        loop = Loop(memory)
        try:
            memory.pending(1)  # type: ignore[attr-defined]
            memory.pending(2)  # type: ignore[attr-defined]
            loop.serve_once()
            req = request(fusewire.READ, 5, SECTOR + req_at, req_len)
            loop.kernel.send(req)
            time.sleep(0.1)
            memory.put(0, memoryview(sector_bytes(0)))  # type: ignore[attr-defined]
            time.sleep(0.1)
            assert loop.results == []
            if fail_second:
                memory.settled(2)  # type: ignore[attr-defined]  # failed while 1 is awaited
                assert loop.wait() == (_fastreads.REQUEST, len(req), req)
                assert loop.waited[-1] < 1.0, loop.waited  # not its 2 s deadline
                continue
            memory.put(1, memoryview(sector_bytes(1)))  # type: ignore[attr-defined]
            time.sleep(0.1)
            assert loop.results == []  # now waiting for sector 2
            memory.put(2, memoryview(sector_bytes(2)))  # type: ignore[attr-defined]
            error, unique, data = loop.answer()
            start = SECTOR + req_at
            assert (error, unique, data) == (0, 5, IMAGE_BYTES[start : start + req_len])
        finally:
            loop.close()


def test_a_dropped_sector_is_no_longer_answered_and_its_buffer_released(
    memory: object, loop: Loop
) -> None:
    buffer = bytearray(sector_bytes(1))
    memory.put(1, buffer)
    with pytest.raises(BufferError):
        buffer.append(0)  # held by the table
    assert memory.sectors == 1
    memory.drop(1)
    buffer.append(0)  # released
    assert memory.sectors == 0
    memory.put(2, memoryview(sector_bytes(2)))
    memory.clear()
    assert memory.sectors == 0
    loop.serve_once()
    req = request(fusewire.READ, 4, SECTOR, 10)
    loop.kernel.send(req)
    assert loop.wait()[0] == _fastreads.REQUEST


def test_a_resent_read_is_counted_and_the_end_of_the_connection_ends_the_call(
    memory: object, loop: Loop
) -> None:
    put_all(memory)
    loop.serve_once()
    loop.kernel.send(request(fusewire.READ, fusewire.UNIQUE_RESEND | 77, 0, 10))
    assert loop.answer()[:2] == (0, fusewire.UNIQUE_RESEND | 77)
    loop.kernel.shutdown(socket.SHUT_WR)
    assert loop.wait()[:2] == (_fastreads.ENDED, 0)
    assert memory.resent == 1


def test_bad_sectors_and_buffers_are_refused(memory: object) -> None:
    with pytest.raises(IndexError):
        memory.put(4, memoryview(bytes(SECTOR)))
    with pytest.raises(ValueError):
        memory.put(3, memoryview(bytes(999)))  # the last sector has 1000 bytes
    memory.put(3, memoryview(bytes(1000)))
    with pytest.raises(IndexError):
        memory.pending(9)
    with pytest.raises(ValueError):
        _fastreads.Memory(0, IMAGE)
    with pytest.raises(ValueError):
        _fastreads.Memory(SECTOR, IMAGE, wait_seconds=-1)
    assert struct.calcsize("<IiQ") == OUT_HEADER.size


def test_many_threads_answer_right_while_sectors_come_and_go(entries: Path) -> None:
    """Four threads serve 2,000 READs while another puts, replaces and drops the sectors,
    in memory and as cache entries: every answer is the image's bytes, from the loop or (a
    sector out of the table) the caller, and no buffer is released while it is written from
    (the test would read garbage or crash)."""
    require(_fastreads is not None, "snapshotter.mount._fastreads is not built (pip install -e .)")
    memory = _fastreads.Memory(SECTOR, IMAGE, drain_every=8, wait_seconds=0.05)
    kernel, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    stop = threading.Event()
    by_caller = 0
    lock = threading.Lock()

    def serve() -> None:
        nonlocal by_caller
        buf = bytearray(fusewire.REQUEST_BUFFER)
        while True:
            status, n, _ = memory.serve(server.fileno(), buf)
            if status == _fastreads.ENDED:
                return
            if status == _fastreads.DRAIN:
                memory.drain()
                continue
            assert status == _fastreads.REQUEST, status
            _, _, unique, *_ = IN_HEADER.unpack_from(buf)
            _, offset, size, *_ = READ_IN.unpack_from(buf, IN_HEADER.size)
            data = IMAGE_BYTES[offset : offset + size]
            memory.handed()
            server.send(OUT_HEADER.pack(OUT_HEADER.size + len(data), 0, unique) + data)
            with lock:
                by_caller += 1

    files = [entry_file(entries / f"e{n}", n) for n in range(4)]

    def churn() -> None:
        rng = random.Random(3)
        while not stop.is_set():
            n = rng.randrange(4)
            action = rng.random()
            if action < 0.4:
                memory.put(n, bytearray(sector_bytes(n)))  # a new buffer each time
            elif action < 0.55:
                memory.cached(n, *files[n], BLOCK)  # where nothing is held for it
            elif action < 0.7:
                memory.uncache(n)
            elif action < 0.85:
                memory.drop(n)
            else:
                memory.pending(n)
                memory.settled(n)
            time.sleep(0.0005)  # the interpreter's lock to the others too

    threads = [threading.Thread(target=serve) for _ in range(4)] + [threading.Thread(target=churn)]
    for t in threads:
        t.start()
    rng = random.Random(4)
    try:
        for unique in range(1, 2001):
            offset = rng.randrange(IMAGE)
            size = rng.randrange(1, 3 * SECTOR)
            kernel.send(request(fusewire.READ, unique, offset, size))
            data = kernel.recv(1 << 21)
            length, error, got = OUT_HEADER.unpack_from(data)
            assert (length, error, got) == (len(data), 0, unique)
            assert data[OUT_HEADER.size :] == IMAGE_BYTES[offset : offset + size], unique
    finally:
        stop.set()
        kernel.shutdown(socket.SHUT_WR)
        for t in threads:
            t.join(10)
        kernel.close()
        server.close()
    assert memory.served + by_caller == 2000 and memory.served > 0 and by_caller > 0
    assert memory.disk_reads > 0 and memory.disk_failures == 0
    assert memory.in_flight == 0


BLOCK = 16 << 10


def entry_file(path: Path, n: int) -> tuple[str, bytes]:
    """Sector n's bytes in a file as a cache entry lays them out (from offset 0, zeros to a
    page); (its path, its block digests)."""
    data = sector_bytes(n)
    path.write_bytes(data + bytes(-len(data) % 4096))
    digests = b"".join(
        xxhash.xxh3_64_digest(data[i : i + BLOCK]) for i in range(0, len(data), BLOCK)
    )
    return str(path), digests


@pytest.fixture
def entries() -> Iterator[Path]:
    # direct I/O wants a disk's file system (/tmp may be tmpfs)
    where = Path(tempfile.mkdtemp(prefix="lazyblock-fastreads-", dir="/var/tmp"))
    yield where
    shutil.rmtree(where, ignore_errors=True)


def test_reads_of_cache_entries_are_read_checked_and_answered(
    memory: object, loop: Loop, entries: Path
) -> None:
    memory.put(0, memoryview(sector_bytes(0)))
    for n in (1, 3):
        path, digests = entry_file(entries / f"e{n}", n)
        assert memory.cached(n, path, digests, BLOCK) is True
    path, digests = entry_file(entries / "e0", 0)
    assert memory.cached(0, path, digests, BLOCK) is False  # memory holds sector 0: it stays
    loop.serve_once()
    # a READ across memory and an entry; one within an entry; the short last sector
    reads = [(SECTOR - 5000, 9000 + BLOCK), (SECTOR + 3 * BLOCK + 7, 100), (3 * SECTOR + 10, 990)]
    for unique, (offset, size) in enumerate(reads, start=20):
        loop.kernel.send(request(fusewire.READ, unique, offset, size))
        assert loop.answer() == (0, unique, IMAGE_BYTES[offset : offset + size])
    assert loop.wait()[0] == _fastreads.DRAIN
    assert memory.disk_reads == 3 and memory.disk_failures == 0
    assert [r for r, _ in memory.drain()] == [r for r, _ in reads]


def _resident(path: str) -> int:
    """Bytes of the file in the page cache."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "-o", "RES", path],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return int(out.stdout.strip())


def test_buffered_entries_are_read_through_the_page_cache_and_checked(
    memory: object, loop: Loop, entries: Path
) -> None:
    require(shutil.which("fincore") is not None, "fincore (util-linux) is not installed")
    paths = {}
    for n in (0, 1, 2):  # 1 and 2 read through the page cache, 0 with direct I/O
        path, digests = entry_file(entries / f"e{n}", n)
        paths[n] = path
        assert memory.cached(n, path, digests, BLOCK, n != 0) is True
    with open(paths[2], "r+b") as f:  # a damaged block
        f.seek(BLOCK + 5)
        f.write(b"\xff")
    for path in paths.values():  # none of them in the page cache
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        assert _resident(path) == 0
    loop.serve_once()
    for unique, n in ((7, 1), (8, 0)):
        offset, size = n * SECTOR + BLOCK + 7, BLOCK
        loop.kernel.send(request(fusewire.READ, unique, offset, size))
        assert loop.answer() == (0, unique, IMAGE_BYTES[offset : offset + size])
    assert _resident(paths[1]) > 0 and _resident(paths[0]) == 0
    assert memory.disk_reads == 2 and memory.disk_failures == 0
    req = request(fusewire.READ, 9, 2 * SECTOR + BLOCK, BLOCK)  # checked: to the caller
    loop.kernel.send(req)
    assert loop.wait() == (_fastreads.REQUEST, len(req), req)
    assert memory.disk_failures == 1


def test_a_damaged_entry_goes_to_the_caller_and_is_read_here_no_more(
    memory: object, loop: Loop, entries: Path
) -> None:
    path = entries / "e1"
    memory.cached(1, *entry_file(path, 1), BLOCK)
    with open(path, "r+b") as f:  # a byte of its third block flipped on disk
        f.seek(2 * BLOCK + 5)
        byte = f.read(1)
        f.seek(2 * BLOCK + 5)
        f.write(bytes([byte[0] ^ 1]))
    dropped = os.open(path, os.O_RDONLY)  # (direct reads go past the page cache anyway)
    os.posix_fadvise(dropped, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(dropped)
    assert memory.sectors == 1
    req = request(fusewire.READ, 8, SECTOR + 2 * BLOCK, 100)
    loop.serve_once()
    loop.kernel.send(req)
    assert loop.wait() == (_fastreads.REQUEST, len(req), req)  # never the damaged bytes
    assert memory.disk_failures == 1 and memory.sectors == 0
    memory.handed()
    loop.serve_once()
    loop.kernel.send(request(fusewire.READ, 9, SECTOR, 100))  # another block: not read here
    assert loop.wait()[0] == _fastreads.REQUEST
    memory.handed()
    memory.uncache(1)  # nothing to drop


def test_bad_digests_are_refused(memory: object, entries: Path) -> None:
    path, digests = entry_file(entries / "e2", 2)
    with pytest.raises(ValueError):
        memory.cached(2, path, digests[:-8], BLOCK)
    with pytest.raises(ValueError):
        memory.cached(2, path, digests, 1000)  # not whole pages


def test_an_entry_gone_from_disk_goes_to_the_caller(
    memory: object, loop: Loop, entries: Path
) -> None:
    path = entries / "e3"
    memory.cached(3, *entry_file(path, 3), BLOCK)
    path.unlink()  # evicted
    req = request(fusewire.READ, 5, 3 * SECTOR, 100)
    loop.serve_once()
    loop.kernel.send(req)
    assert loop.wait() == (_fastreads.REQUEST, len(req), req)
    assert memory.sectors == 0


def test_small_reads_of_entries_go_to_the_caller(entries: Path) -> None:
    """Python keeps the 128 KiB around a small read of the cache in memory (read-around),
    where the small reads that follow find it: those are its."""
    require(_fastreads is not None, "snapshotter.mount._fastreads is not built (pip install -e .)")
    memory = _fastreads.Memory(SECTOR, IMAGE, disk_min_read=4096)
    memory.cached(1, *entry_file(entries / "e1", 1), BLOCK)
    memory.put(2, memoryview(sector_bytes(2)))
    loop = Loop(memory)
    try:
        small = request(fusewire.READ, 1, SECTOR + 10, 4096)
        loop.serve_once()
        loop.kernel.send(small)
        assert loop.wait() == (_fastreads.REQUEST, len(small), small)
        memory.handed()
        loop.serve_once()
        for unique, (offset, size) in enumerate([(2 * SECTOR, 100), (SECTOR + 10, 4097)], 2):
            loop.kernel.send(request(fusewire.READ, unique, offset, size))  # memory: any size
            assert loop.answer() == (0, unique, IMAGE_BYTES[offset : offset + size])
        assert memory.disk_reads == 1
    finally:
        loop.close()
