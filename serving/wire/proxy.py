"""The router's data path: asyncio Protocols for client and backend connections, and pools.

This module owns the bytes of a proxied exchange; the router (:mod:`serving.router`) owns the
decisions around it (which backend, what counts as a failure, metrics), reached through the
small :class:`Dispatcher` interface. Message framing is :mod:`serving.wire.http1`'s.

One exchange, step by step
    1. :class:`ClientConn` reads a request head and its body (Content-Length or chunked) into
       memory. Prompts are small, and a buffered request can be sent again: that is what
       makes the retry after a connection failure possible. ``Expect: 100-continue`` is
       answered at once.
    2. The dispatcher picks a backend. The request is re-framed (``Host`` and
       ``Content-Length`` of its own, hop-by-hop fields dropped) and written in one call on
       an idle keep-alive connection from that backend's :class:`Pool`, or on a new one.
    3. :class:`UpstreamConn` parses the response head, hands it to the dispatcher (status,
       timing), and then copies the body to the client *as it arrives*, unchanged: chunked
       bodies (server-sent-event streams) are scanned for their end, not decoded. When the
       client reads slower than the backend writes, reading from the backend pauses.
    4. At the end of the body the backend connection goes back to its pool (unless either
       side said ``close``) and the client connection reads its next request.

Failures
    A connection that could not be established never carried a byte: the dispatcher may
    retry elsewhere (:meth:`Dispatcher.connect_failed`). A *pooled* connection that the
    backend closes before any byte of the answer is, almost always, one whose idle timeout
    crossed our request (the backend closed it without reading it): the request is sent
    again, once, on a new connection to the same backend, and this is not a failure. (A
    backend that died while working on it gets the request again too, and then refuses the
    connection, which is a connect failure; completion requests are safe to run twice.) Any
    other connection lost before the response head, a malformed head, or a timeout may have
    reached the backend: the client gets 502 (504 for a timeout), and the dispatcher counts a
    failure. A backend that breaks off mid-body is a failure too; the client's connection is
    then closed, so it sees a truncated answer rather than a wrong one. A client that goes
    away aborts its backend connection (the backend sees the disconnect, as vLLM expects to
    cancel generation).

Per request the data path allocates a request head, the re-framed request bytes and a response
head: no tasks, futures or timers (timeouts are enforced by the router's periodic sweep).
"""

from __future__ import annotations

import asyncio
import socket
from http import HTTPStatus
from time import monotonic

from serving.errors import ProtocolError
from serving.wire.http1 import (
    MAX_HEAD,
    ChunkedScanner,
    RequestHead,
    ResponseHead,
    parse_request_head,
    parse_response_head,
)

#: request bodies larger than this are refused (413)
MAX_BODY = 16 * 1024 * 1024
# Unread client bytes (a pipelined next request) above which reading pauses until the current
# exchange ends.
MAX_PENDING = 256 * 1024
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CLOSE = b"Connection: close\r\n\r\n"


def local_response(
    status: int,
    body: bytes = b"",
    *,
    ctype: bytes = b"text/plain; charset=utf-8",
    close: bool = False,
    head_only: bool = False,
) -> bytes:
    """A complete response the router answers itself."""
    try:
        reason = HTTPStatus(status).phrase.encode()
    except ValueError:
        reason = b"Error"
    out = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s" % (
        status,
        reason,
        ctype,
        len(body),
        _CLOSE if close else b"\r\n",
    )
    return out if head_only else out + body


def _nodelay(transport: asyncio.Transport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Dispatcher:
    """What the data path asks of the router (see :class:`serving.router.Router`)."""

    loop: asyncio.AbstractEventLoop
    #: every open client connection (the router sweeps them for timeouts)
    conns: set[ClientConn]
    #: answer with ``Connection: close`` and close once idle (shutting down)
    draining: bool = False
    connect_timeout_s: float = 1.0

    def dispatch(self, conn: ClientConn, req: RequestHead, body: bytes) -> None:
        """Handle a complete request: proxy it (:meth:`ClientConn.send`) or answer it."""
        raise NotImplementedError

    def connect_failed(self, conn: ClientConn, backend, exc: BaseException) -> None:
        """The connection to ``backend`` could not be made (it is already released)."""
        raise NotImplementedError

    def on_head(self, conn: ClientConn, resp: ResponseHead, now: float) -> None:
        """The response head from ``conn.backend`` arrived."""

    def on_error(self, conn: ClientConn, kind: str, now: float) -> None:
        """The exchange with ``conn.backend`` failed after connecting (before release)."""

    def on_resend(self, conn: ClientConn) -> None:
        """``conn``'s request goes again to ``conn.backend``: a pooled connection was stale."""

    def release(self, conn: ClientConn) -> None:
        """``conn.backend`` no longer carries ``conn``'s request."""

    def conn_closed(self, conn: ClientConn) -> None:
        """A client connection is gone."""


class Pool:
    """Idle keep-alive connections to one backend, most recently used first."""

    __slots__ = ("host", "port", "host_field", "idle", "closed")

    def __init__(self, url: str) -> None:
        netloc = url.split("://", 1)[-1].rstrip("/")
        host, _, port = netloc.rpartition(":")
        self.host = host.strip("[]")
        self.port = int(port)
        #: the Host field sent with every request
        self.host_field = b"Host: " + netloc.encode() + b"\r\n"
        self.idle: list[UpstreamConn] = []
        self.closed = False

    def get(self) -> UpstreamConn | None:
        idle = self.idle
        while idle:
            c = idle.pop()
            if not c.transport.is_closing():
                return c
        return None

    def put(self, c: UpstreamConn, now: float) -> None:
        if self.closed:
            c.transport.close()
            return
        c.idle_since = now
        c.reused = True
        self.idle.append(c)

    def discard(self, c: UpstreamConn) -> None:
        try:
            self.idle.remove(c)
        except ValueError:
            pass

    def expire(self, older_than: float) -> None:
        """Close connections idle since before ``older_than``."""
        keep = []
        for c in self.idle:
            if c.idle_since < older_than:
                c.transport.close()
            else:
                keep.append(c)
        self.idle = keep

    def close(self) -> None:
        self.closed = True
        for c in self.idle:
            c.transport.close()
        self.idle = []


# UpstreamConn states
_IDLE, _HEAD, _BODY = range(3)


class UpstreamConn(asyncio.Protocol):
    """One keep-alive connection to a backend; carries one exchange at a time."""

    __slots__ = (
        "pool",
        "transport",
        "client",
        "state",
        "buf",
        "head_request",
        "reuse",
        "remaining",
        "scanner",
        "until_close",
        "idle_since",
        "paused",
        "reused",
        "got",
    )

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.client: ClientConn | None = None
        self.state = _IDLE
        self.buf = b""
        self.head_request = False
        self.reuse = True
        self.remaining = 0
        self.scanner: ChunkedScanner | None = None
        self.until_close = False
        self.idle_since = 0.0
        self.paused = False
        #: the current exchange is not the connection's first (it came from the pool)
        self.reused = False
        #: a byte of the current exchange's response arrived
        self.got = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        _nodelay(transport)

    def start(self, client: ClientConn, msg: bytes, *, head_request: bool, reuse: bool) -> None:
        self.client = client
        client.upstream = self
        self.got = False
        self.state = _HEAD
        self.buf = b""
        self.head_request = head_request
        self.reuse = reuse
        self.scanner = None
        self.until_close = False
        self.remaining = 0
        if client.write_paused:
            self.pause()
        self.transport.write(msg)

    def pause(self) -> None:
        if not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        """Drop the exchange and the connection (the client went away, or a timeout)."""
        self.client = None
        self.state = _IDLE
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is None:  # bytes on an idle connection: the backend is confused
            self.transport.close()
            return
        self.got = True
        if self.state == _BODY:
            self._body(client, data)
            return
        buf = self.buf + data if self.buf else data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    self._fail(client, "error")
                    return
                self.buf = buf
                return
            try:
                resp = parse_response_head(buf[:end], head_request=self.head_request)
            except ProtocolError:
                self._fail(client, "error")
                return
            if resp.status < 200:  # interim (100 Continue, 103 Early Hints): skip
                if resp.status == 101:
                    self._fail(client, "error")
                    return
                buf = buf[end + 4 :]
                continue
            break
        self.buf = b""
        client.on_head(resp)
        if self.client is None:  # the client went away meanwhile
            return
        if not resp.reusable:
            self.reuse = False
        if resp.until_close:  # the client can only tell the end by our closing too
            client.keep_alive = False
        if resp.chunked:
            self.scanner = ChunkedScanner(status=502)
        elif resp.until_close:
            self.until_close = True
        else:
            self.remaining = resp.length
        self.state = _BODY
        if resp.rewritten or not client.keep_alive:
            out = resp.out if client.keep_alive else resp.out[:-2] + _CLOSE
            self._body(client, buf, end + 4, end + 4, out)
        else:  # the head goes out as it came, in the same write as the body
            self._body(client, buf, end + 4)

    def _body(
        self, client: ClientConn, data: bytes, pos: int = 0, wstart: int = 0, prefix: bytes = b""
    ) -> None:
        """Pass on body bytes ``data[pos:]``, preceded by ``data[wstart:pos]`` and ``prefix``.

        One write per call: a response that arrives in one piece leaves in one piece.
        """
        n = len(data)
        if self.scanner is not None:
            try:
                k = self.scanner.feed(data, pos)
            except ProtocolError:
                self._fail(client, "error")
                return
            done = k >= 0
            if not done:
                k = n
        elif self.until_close:
            k, done = n, False
        else:
            avail = n - pos
            if avail < self.remaining:
                self.remaining -= avail
                k, done = n, False
            else:
                k, done = pos + self.remaining, True
                self.remaining = 0
        chunk = data if wstart == 0 and k == n else data[wstart:k]
        if prefix:
            chunk = prefix + chunk
        if chunk:
            client.transport.write(chunk)
        if done:
            self.scanner = None
            self._done(client, k == n)

    def _done(self, client: ClientConn, clean: bool) -> None:
        """The response is complete; ``clean``: nothing came after its end."""
        self.client = None
        self.state = _IDLE
        self.resume()
        if clean and self.reuse and not self.transport.is_closing():
            self.pool.put(self, monotonic())
        else:
            self.transport.close()
        client.exchange_done()

    def _fail(self, client: ClientConn, kind: str) -> None:
        self.client = None
        self.state = _IDLE
        self.transport.abort()
        client.upstream_failed(kind)

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc) -> None:
        client = self.client
        if client is None:
            self.pool.discard(self)
            return
        self.client = None
        if self.state == _BODY and self.until_close:
            self.state = _IDLE
            client.exchange_done()
            return
        stale = self.reused and not self.got
        self.state = _IDLE
        if stale:
            # a pooled connection the backend closed as we sent on it: its idle timeout and
            # our request crossed, so it never read the request; send it again, once, on a new
            # connection
            client.upstream_stale(self.pool)
        else:
            client.upstream_failed("error")


class ClientConn(asyncio.Protocol):
    """One client connection: reads requests, hands them to the dispatcher, writes answers."""

    __slots__ = (
        "router",
        "admin",
        "transport",
        "buf",
        "req",
        "scanner",
        "busy",
        "closed",
        "eof",
        "keep_alive",
        "read_paused",
        "write_paused",
        "idle_since",
        "upstream",
        "backend",
        "msg",
        "head_request",
        "connecting",
        "retried",
        "resent",
        "answered",
        "t0",
        "t1",
    )

    def __init__(self, router: Dispatcher, *, admin: bool = False) -> None:
        self.router = router
        #: an admin-port connection: metrics and health only, no proxying
        self.admin = admin
        self.transport: asyncio.Transport | None = None
        self.buf: bytes | bytearray = b""
        self.req: RequestHead | None = None
        self.scanner: ChunkedScanner | None = None
        #: an exchange is under way (requests that arrive meanwhile wait in buf)
        self.busy = False
        self.closed = False
        self.eof = False
        self.keep_alive = True
        self.read_paused = False
        self.write_paused = False
        self.idle_since = 0.0
        self.upstream: UpstreamConn | None = None
        #: the backend carrying the current request (counted in its in-flight), or None
        self.backend = None
        #: the re-framed request without its Host field: (before, after)
        self.msg: tuple[bytes, bytes] = (b"", b"")
        self.head_request = False
        #: the task connecting to the backend (held here: a running task needs a reference)
        self.connecting: asyncio.Task | None = None
        self.retried = False
        #: the request was sent again after a stale pooled connection
        self.resent = False
        #: response bytes went to the client for the current exchange
        self.answered = False
        self.t0 = 0.0
        self.t1 = 0.0

    # -- asyncio callbacks -------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        _nodelay(transport)
        self.idle_since = monotonic()
        self.router.conns.add(self)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        if buf:
            if type(buf) is bytes:
                buf = bytearray(buf)
            buf += data
            self.buf = buf
        else:
            self.buf = data
        if self.busy:
            if len(self.buf) > MAX_PENDING and not self.read_paused:
                self.read_paused = True
                self.transport.pause_reading()
            return
        self._process()

    def eof_received(self) -> bool:
        self.eof = True
        self.keep_alive = False
        return self.busy  # half-closed while answering: keep the write side open

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.keep_alive = False
        up = self.upstream
        if up is not None:
            self.upstream = None
            up.abort()
        if self.backend is not None and self.connecting is None:
            self.router.release(self)
        self.router.conn_closed(self)

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.upstream is not None:
            self.upstream.pause()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.upstream is not None:
            self.upstream.resume()

    # -- requests ----------------------------------------------------------------------------

    def _process(self) -> None:
        while not self.busy and not self.closed and self.buf:
            buf = self.buf
            req = self.req
            if req is None:
                end = buf.find(b"\r\n\r\n")
                if end < 0 or end > MAX_HEAD:
                    if len(buf) > MAX_HEAD:
                        self.reply_error(431, "request head too large")
                    return
                try:
                    req = parse_request_head(bytes(buf[:end]))
                    if req.length is not None and req.length > MAX_BODY:
                        raise ProtocolError(413, "request body too large")
                except ProtocolError as e:
                    self.reply_error(e.status, str(e))
                    return
                self.req = req
                buf = self.buf = buf[end + 4 :]
                if req.chunked:
                    self.scanner = ChunkedScanner(collect=True, limit=MAX_BODY)
                if req.expect_continue and (req.chunked or len(buf) < (req.length or 0)):
                    self.transport.write(_CONTINUE)
            if req.chunked:
                try:
                    end = self.scanner.feed(buf)
                except ProtocolError as e:
                    self.reply_error(e.status, str(e))
                    return
                if end < 0:
                    self.buf = b""
                    return
                body = bytes(self.scanner.body)
                self.scanner = None
                self.buf = buf[end:]
            else:
                n = req.length or 0
                if len(buf) < n:
                    return
                if len(buf) == n:
                    body = bytes(buf) if type(buf) is not bytes else buf
                    self.buf = b""
                else:
                    body = bytes(buf[:n])
                    self.buf = buf[n:]
            self.req = None
            self.busy = True
            self.answered = False
            self.keep_alive = req.keep_alive and req.http11 and not self.eof
            self.head_request = req.method == b"HEAD"
            self.router.dispatch(self, req, body)

    def reply(self, data: bytes) -> None:
        """Answer the current request with a complete response of the router's own."""
        self.answered = True
        self.transport.write(data)
        self.exchange_done()

    def reply_error(self, status: int, message: str) -> None:
        """Answer a malformed request and close: what follows it cannot be trusted."""
        self.keep_alive = False
        self.busy = True
        self.buf = b""
        self.transport.write(local_response(status, message.encode() + b"\n", close=True))
        self.exchange_done()

    # -- proxying ----------------------------------------------------------------------------

    def prepare(self, req: RequestHead, body: bytes) -> None:
        """Re-frame ``req`` for the backends (the Host field goes in between)."""
        line = b"%s %s %s\r\n" % (
            req.method,
            req.target,
            b"HTTP/1.1" if req.http11 else b"HTTP/1.0",
        )
        if body or req.length is not None or req.chunked:
            tail = req.fields + b"Content-Length: %d\r\n\r\n" % len(body) + body
        else:
            tail = req.fields + b"\r\n"
        self.msg = (line, tail)
        self.retried = False
        self.resent = False

    def send(self, backend, pool: Pool) -> None:
        """Send the prepared request to ``backend`` (already counted in flight)."""
        self.backend = backend
        self.t1 = monotonic()
        up = pool.get()
        line, tail = self.msg
        msg = line + pool.host_field + tail
        # a backend answering an HTTP/1.0 request may close without saying so: never reuse
        reuse = line[-3] == 0x31  # "HTTP/1.1"
        if up is not None:
            up.start(self, msg, head_request=self.head_request, reuse=reuse)
            return
        self.connecting = self.router.loop.create_task(self._connect(pool, msg, reuse))

    async def _connect(self, pool: Pool, msg: bytes, reuse: bool) -> None:
        router = self.router
        me = asyncio.current_task()
        try:
            _, up = await asyncio.wait_for(
                router.loop.create_connection(lambda: UpstreamConn(pool), pool.host, pool.port),
                router.connect_timeout_s,
            )
        except (OSError, TimeoutError) as e:
            if self.connecting is not me:  # abandoned meanwhile (request timeout)
                return
            self.connecting = None
            b = self.backend
            router.release(self)
            if not self.closed:
                router.connect_failed(self, b, e)
            return
        if self.connecting is not me:
            pool.put(up, monotonic())
            return
        self.connecting = None
        if self.closed:  # the client left while we connected: keep the connection for others
            pool.put(up, monotonic())
            router.release(self)
            return
        up.start(self, msg, head_request=self.head_request, reuse=reuse)

    def upstream_stale(self, pool: Pool) -> None:
        """The pooled connection was closed by the backend before any byte of an answer."""
        self.upstream = None
        if self.resent or self.closed or self.backend is None:
            self.upstream_failed("error")
            return
        self.resent = True
        self.router.on_resend(self)
        line, tail = self.msg
        msg = line + pool.host_field + tail
        reuse = line[-3] == 0x31
        self.connecting = self.router.loop.create_task(self._connect(pool, msg, reuse))

    def on_head(self, resp: ResponseHead) -> None:
        self.answered = True
        if self.router.draining:
            self.keep_alive = False  # say so in this response; close after it
        self.router.on_head(self, resp, monotonic())

    def upstream_failed(self, kind: str) -> None:
        """The backend connection failed mid-exchange (``kind``: error, timeout)."""
        self.upstream = None
        router = self.router
        if self.backend is not None:
            router.on_error(self, kind, monotonic())
            router.release(self)
        if self.closed:
            return
        if self.answered:
            # the head (and maybe part of the body) went out: only a truncation is honest
            self.keep_alive = False
            self.busy = False
            self.transport.close()
            return
        status = 504 if kind == "timeout" else 502
        close = not self.keep_alive or self.router.draining
        self.reply(local_response(status, b"backend failed: %s\n" % kind.encode(), close=close))

    def timeout(self) -> None:
        """The request ran past its time limit (called by the router's sweep)."""
        task = self.connecting
        if task is not None:
            self.connecting = None
            task.cancel()
        up = self.upstream
        if up is not None:
            self.upstream = None
            up.transport.abort()
            up.client = None
        self.upstream_failed("timeout")

    def exchange_done(self) -> None:
        """The current response is complete: next request, or close."""
        self.upstream = None
        if self.backend is not None:
            self.router.release(self)
        if self.closed:
            return
        if not self.keep_alive or self.router.draining:
            self.busy = False
            self.transport.close()
            return
        self.busy = False
        self.idle_since = monotonic()
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        if self.buf:
            self.router.loop.call_soon(self._process)
