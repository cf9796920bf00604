"""A lean HTTP/1.1 GET over one kept-alive connection: the router's load-report scraper.

The router reads every backend's ``/metrics`` twice a second. Through aiohttp each read cost
about 1-2 ms of CPU on the benchmark machine (request and response objects, a task, timers),
some 10% of the router's CPU at 2,000 requests/s with 4 backends. This asks the same question
on a raw asyncio Protocol with :mod:`serving.wire.http1`'s framing: one write, the response head
parsed, the body collected (Content-Length, chunked or until close), the connection kept for
the next read. A failure closes the connection; the next read opens a new one.
"""

from __future__ import annotations

import asyncio

from serving.errors import ProtocolError
from serving.wire.http1 import MAX_HEAD, ChunkedScanner, parse_response_head

#: the largest body accepted (a vLLM /metrics page is tens of KiB)
MAX_BODY = 8 * 1024 * 1024


class FetchError(Exception):
    """The GET failed: connection, framing, size or timeout."""


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future | None = None
        self.buf = bytearray()
        self.status = 0
        self.head_done = False
        self.length: int | None = None
        self.until_close = False
        self.reusable = True
        self.scanner: ChunkedScanner | None = None
        self.lost = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def begin(self, msg: bytes) -> asyncio.Future:
        self.buf = bytearray()
        self.head_done = False
        self.scanner = None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(msg)
        return self.waiter

    def _finish(self, result) -> None:
        w, self.waiter = self.waiter, None
        if w is not None and not w.done():
            if isinstance(result, BaseException):
                w.set_exception(result)
            else:
                w.set_result(result)

    def data_received(self, data: bytes) -> None:
        if self.waiter is None:  # bytes nobody asked for: do not trust this connection
            self.transport.close()
            return
        self.buf += data
        try:
            if not self.head_done:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.buf) > MAX_HEAD:
                        raise FetchError("response head too large")
                    return
                resp = parse_response_head(bytes(self.buf[:end]))
                if resp.status < 200:
                    raise FetchError(f"unexpected interim response {resp.status}")
                self.status, self.length = resp.status, resp.length
                self.until_close, self.reusable = resp.until_close, resp.reusable
                del self.buf[: end + 4]
                self.head_done = True
                if resp.chunked:
                    self.scanner = ChunkedScanner(collect=True, status=502, limit=MAX_BODY)
            if self.scanner is not None:
                k = self.scanner.feed(bytes(self.buf))
                self.buf.clear()
                if k >= 0:
                    self._finish((self.status, bytes(self.scanner.body)))
            elif self.until_close:
                if len(self.buf) > MAX_BODY:
                    raise FetchError("response body too large")
            elif len(self.buf) >= self.length:
                if len(self.buf) > self.length:
                    raise FetchError("bytes after the response")
                self._finish((self.status, bytes(self.buf)))
        except (ProtocolError, FetchError) as e:
            self.transport.abort()
            self._finish(e if isinstance(e, FetchError) else FetchError(str(e)))

    def connection_lost(self, exc) -> None:
        self.lost = True
        if self.head_done and self.until_close:
            self._finish((self.status, bytes(self.buf)))
        else:
            self._finish(FetchError(f"connection lost: {exc or 'closed by the server'}"))


class Getter:
    """``await Getter(host, port, path).get(timeout)`` -> (status, body); one at a time."""

    def __init__(self, host: str, port: int, path: str, host_field: str) -> None:
        self.host = host
        self.port = port
        self.msg = f"GET {path} HTTP/1.1\r\nHost: {host_field}\r\nAccept: */*\r\n\r\n".encode()
        self.conn: _Conn | None = None

    async def get(self, timeout: float) -> tuple[int, bytes]:
        try:
            return await asyncio.wait_for(self._get(), timeout)
        except TimeoutError:
            self.close()
            raise FetchError(f"no answer in {timeout:g}s") from None
        except OSError as e:
            self.close()
            raise FetchError(str(e)) from e
        except FetchError:
            self.close()
            raise

    async def _get(self) -> tuple[int, bytes]:
        c = self.conn
        if c is None or c.lost or c.transport.is_closing():
            loop = asyncio.get_running_loop()
            _, c = await loop.create_connection(_Conn, self.host, self.port)
            self.conn = c
        status, body = await c.begin(self.msg)
        if not c.reusable:
            self.close()
        return status, body

    def close(self) -> None:
        if self.conn is not None:
            if self.conn.transport is not None:
                self.conn.transport.close()
            self.conn = None
