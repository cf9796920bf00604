"""Read a stream ahead on a background thread.

Reading a layer costs decompression (zlib/zstd) and two sha256 digests, all of which release
the GIL; parsing the tar does not. Running the first on a producer thread and the second on
the caller's thread keeps two cores busy instead of one. The buffer is bounded (a few MiB),
so memory stays flat whatever the layer size.
"""

from __future__ import annotations

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
        while not self._buf and not self._eof:
            self._next()
        out = bytes(self._buf[:n])
        self._buf = self._buf[n:]
        return out

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
