"""snapshotter.mount._fastreads: FUSE READs answered from sector memory in compiled code.

The loop reads requests from a descriptor and writes answers to it as it does on /dev/fuse;
here the descriptor is one end of a SOCK_SEQPACKET socket pair (one request per read, one
answer per write, as /dev/fuse has them), and the test is the kernel on the other end."""

from __future__ import annotations

import random
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
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
        self.buf = bytearray(fusewire.REQUEST_BUFFER)
        self._thread: threading.Thread | None = None

    def serve_once(self) -> None:
        """One ``serve`` call, in a thread (``wait`` for it)."""

        def run() -> None:
            status, n = self.memory.serve(self.server.fileno(), self.buf)  # type: ignore[attr-defined]
            self.results.append((status, n, bytes(self.buf[:n]) if status == 0 else b""))

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
    short = _fastreads.Memory(SECTOR, IMAGE, wait_seconds=0.1)
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


def test_many_threads_answer_right_while_sectors_come_and_go() -> None:
    """Four threads serve 2,000 READs while another puts, replaces and drops the sectors:
    every answer is the image's bytes, from the loop or (a sector out of memory) the
    caller, and no buffer is released while it is written from (the test would read
    garbage or crash)."""
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
            status, n = memory.serve(server.fileno(), buf)
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

    def churn() -> None:
        rng = random.Random(3)
        while not stop.is_set():
            n = rng.randrange(4)
            action = rng.random()
            if action < 0.5:
                memory.put(n, bytearray(sector_bytes(n)))  # a new buffer each time
            elif action < 0.8:
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
    assert memory.in_flight == 0
