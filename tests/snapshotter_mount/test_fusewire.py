"""The FUSE protocol on /dev/fuse (snapshotter.mount.fusewire), through the real kernel: one
read-only file whose bytes come from a source, read as erofs and tools read it."""

from __future__ import annotations

import errno
import mmap
import os
import random
import stat
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from support import in_threads, require_fuse

from snapshotter.mount import kernel
from snapshotter.mount.fusewire import MAX_READ, FuseServer, ReadError


class _Bytes:
    """A source over ``data`` that answers in several parts (as the reader does: sector
    memory, scratch, fetched sectors) and fails reads that touch ``bad``."""

    def __init__(self, data: bytes, bad: range = range(0)) -> None:
        self.data = data
        self.bad = bad
        self.requests: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return len(self.data)

    def read_parts(
        self, offset: int, length: int, scratch: memoryview, waited: float = 0.0
    ) -> Sequence[object]:
        with self._lock:
            self.requests.append((offset, length))
        end = min(offset + length, len(self.data))
        if offset < self.bad.stop and end > self.bad.start:
            raise ReadError(errno.EIO)
        view = memoryview(self.data)
        middle = offset + (end - offset) // 3
        n = middle - offset
        scratch[:n] = view[offset:middle]  # one part from the scratch, one from "memory"
        return [scratch[:n], view[middle:end]]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, _Bytes]]:
    require_fuse()
    data = random.Random(1).randbytes(5 * MAX_READ + 12_345)
    source = _Bytes(data, bad=range(4 * MAX_READ, 4 * MAX_READ + 1))
    directory = tmp_path / "fuse"
    directory.mkdir()
    ready = threading.Event()
    server = FuseServer(source, directory, "lazyblock:test", "image", threads=4,
                        on_init=ready.set)  # fmt: skip
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    assert ready.wait(10), "the kernel's INIT was not answered"
    try:
        yield directory, source
    finally:
        kernel.unmount_fuse(directory)
        thread.join(10)
        assert not thread.is_alive(), "the FUSE threads did not end on unmount"


def test_the_file_reads_as_its_source(served: tuple[Path, _Bytes]) -> None:
    directory, source = served
    image = directory / "image"
    assert sorted(os.listdir(directory)) == ["image"]
    st = image.stat()
    assert stat.S_ISREG(st.st_mode) and st.st_mode & 0o777 == 0o444 and st.st_size == source.size
    assert stat.S_ISDIR(directory.stat().st_mode)
    assert os.statvfs(directory).f_namemax == 255
    with pytest.raises(FileNotFoundError):
        (directory / "other").stat()
    with pytest.raises(OSError) as e:
        open(image, "r+b")  # noqa: SIM115 - mounted read-only
    assert e.value.errno == errno.EROFS
    # Direct reads of every size and place (the loop device's way), past the end too.
    fd = os.open(image, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 2 * MAX_READ)
    try:
        rng = random.Random(2)
        for _ in range(50):
            offset = rng.randrange(0, 3 * MAX_READ + 1, 4096)  # before the bad byte
            length = rng.choice([4096, 128 << 10, MAX_READ])
            got = os.preadv(fd, [memoryview(buf)[:length]], offset)
            assert buf[:got] == source.data[offset : offset + length]
        tail = source.size - source.size % 4096
        got = os.preadv(fd, [memoryview(buf)[:MAX_READ]], tail)
        assert got == source.size - tail and buf[:got] == source.data[tail:]
        assert os.preadv(fd, [memoryview(buf)[:4096]], tail + 8192) == 0
    finally:
        os.close(fd)
    assert max(length for _, length in source.requests) == MAX_READ  # 1 MiB requests


def test_a_failed_read_is_an_error_for_that_range_only(served: tuple[Path, _Bytes]) -> None:
    directory, source = served
    fd = os.open(directory / "image", os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, MAX_READ)
    try:
        with pytest.raises(OSError) as e:
            os.preadv(fd, [buf], 4 * MAX_READ)
        assert e.value.errno == errno.EIO
        assert os.preadv(fd, [buf], 3 * MAX_READ) == MAX_READ  # the server goes on
        assert buf[:] == source.data[3 * MAX_READ : 4 * MAX_READ]
    finally:
        os.close(fd)


def test_buffered_reads_from_many_threads(served: tuple[Path, _Bytes]) -> None:
    directory, source = served

    def read(seed: int) -> None:
        rng = random.Random(seed)
        with open(directory / "image", "rb", buffering=0) as f:
            for _ in range(40):
                offset = rng.randrange(0, 4 * MAX_READ - 70_000)
                f.seek(offset)
                assert f.read(70_000) == source.data[offset : offset + 70_000]

    in_threads(read, 8)
