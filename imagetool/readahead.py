"""Read a stream ahead on a background thread.

Reading a layer costs decompression (zlib/zstd) and two sha256 digests, all of which release
the GIL; parsing the tar does not. Running the first on a producer thread and the second on
the caller's thread keeps two cores busy instead of one. The buffer is bounded (a few MiB),
so memory stays flat whatever the layer size.
"""

from __future__ import annotations

import io
import queue
import threading
from collections.abc import Callable
from typing import BinaryIO

CHUNK = 1 << 20
DEPTH = 8  # chunks buffered ahead


class ReadAhead:
    """A read-only stream over ``source`` that reads ahead on a thread.

    Use as a context manager: leaving it stops and joins the thread before the caller closes
    ``source``. Errors raised by ``source.read`` are re-raised to the reader, in order.
    """

    def __init__(self, source: BinaryIO, on_read: Callable[[int], object] | None = None) -> None:
        self._source = source
        self._on_read = on_read
        self._queue: queue.Queue[bytes | BaseException] = queue.Queue(DEPTH)
        self._stop = threading.Event()
        self._buf = memoryview(b"")
        self._eof = False
        self._pos = 0
        self._thread = threading.Thread(target=self._produce, name="readahead", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                chunk = self._source.read(CHUNK)
                self._put(chunk)
                if not chunk:
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            self._put(e)

    def _put(self, item: bytes | BaseException) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _next(self) -> None:
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._eof = True
            raise item
        if not item:
            self._eof = True
        elif self._on_read is not None:
            self._on_read(len(item))
        self._buf = memoryview(item)

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            parts = []
            while True:
                chunk = self.read(CHUNK)
                if not chunk:
                    return b"".join(parts)
                parts.append(chunk)
        # Exactly n bytes unless the stream ends: tarfile reads headers with plain read(512)
        # calls and takes a short one for the end of the archive.
        parts = []
        want = n
        while want > 0:
            while not self._buf and not self._eof:
                self._next()
            if not self._buf:
                break
            piece = self._buf[:want]
            self._buf = self._buf[len(piece) :]
            parts.append(piece)
            want -= len(piece)
        out = b"".join(parts)
        self._pos += len(out)
        return out

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return False

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Forward only (by reading and dropping): enough for tarfile's sequential reads."""
        target = offset if whence == io.SEEK_SET else self._pos + offset
        if whence not in (io.SEEK_SET, io.SEEK_CUR) or target < self._pos:
            raise io.UnsupportedOperation("ReadAhead can only seek forward")
        while self._pos < target:
            if not self.read(min(CHUNK, target - self._pos)):
                break
        return self._pos

    def close(self) -> None:
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join()

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
