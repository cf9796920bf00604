"""The router's data path on the wire: raw HTTP/1.1 bytes in, raw bytes out, on loopback.

The backends here are scripted: each answers a request with a list of actions (bytes to send,
a pause, a close), so framing edge cases (keep-alive, close-delimited bodies, interim
responses, a backend dying mid-body) can be produced exactly.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
from servinghelp import run
from support import free_port, wait_port

from serving.router import Router, RouterConfig
from serving.wire.http1 import parse_request_head

pytestmark = pytest.mark.integration

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Backend: s\r\n\r\nok"


class Scripted:
    """A backend on 127.0.0.1 that answers each request with ``script(head, body)``.

    The script returns a list of actions: bytes (sent), a float (a pause, seconds), or the
    string ``"close"``. ``requests`` records (head, body) as received; ``conns`` counts
    accepted connections; ``resets`` counts connections the router broke off.
    """

    def __init__(self, script) -> None:
        self.script = script
        self.requests: list[tuple[bytes, bytes]] = []
        self.conns = 0
        self.resets = 0
        #: connections waiting for their next request
        self.idle: set[asyncio.StreamWriter] = set()
        self.server: asyncio.AbstractServer | None = None
        self.url = ""

    async def start(self) -> Scripted:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.conns += 1
        try:
            while True:
                self.idle.add(writer)
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                finally:
                    self.idle.discard(writer)
                h = parse_request_head(head[:-4])
                body = await reader.readexactly(h.length or 0)
                self.requests.append((head, body))
                for action in self.script(head, body):
                    if action == "close":
                        writer.close()
                        return
                    if isinstance(action, float):
                        await asyncio.sleep(action)
                    else:
                        writer.write(action)
                        await writer.drain()
        except (ConnectionError, OSError):
            self.resets += 1
        finally:
            writer.close()

    def close_idle(self) -> None:
        """Close every connection waiting for a request (a keep-alive timeout firing)."""
        for w in list(self.idle):
            w.close()

    async def stop(self) -> None:
        self.server.close()


async def router_for(*urls: str, **kw) -> Router:
    return await Router(RouterConfig(port=0, backends=urls, scrape_interval_s=0, **kw)).start()


async def exchange(router: Router, data: bytes, *, timeout: float = 10) -> bytes:
    """Send ``data`` on a new connection; everything received until the router closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


async def read_response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    return head, await reader.readexactly(n)


POST = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\n\r\n{}"
LAST = POST.replace(b"Host: r", b"Host: r\r\nConnection: close")  # the router closes after it


def test_chunked_request_with_expect_is_reframed():
    async def main():
        be = await Scripted(lambda h, b: [OK]).start()
        r = await router_for(be.url)
        out = await exchange(
            r,
            b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nExpect: 100-continue\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\nX-Keep: 1\r\n\r\n"
            b'3\r\n{"a\r\n3\r\n":1\r\n1\r\n}\r\n0\r\n\r\n',
        )
        assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n")
        assert out.endswith(b"Connection: close\r\n\r\nok")
        head, body = be.requests[0]
        assert body == b'{"a":1}'
        host = be.url.removeprefix("http://").encode()
        assert head == (
            b"POST /v1/completions HTTP/1.1\r\nHost: " + host + b"\r\nX-Keep: 1\r\n"
            b"Content-Length: 7\r\n\r\n"
        )
        await r.stop()
        await be.stop()

    run(main())


def test_keep_alive_pipelining_and_connection_reuse():
    async def main():
        be = await Scripted(lambda h, b: [OK]).start()
        r = await router_for(be.url)
        reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
        writer.write(POST + POST)  # two requests in one segment: answered in order
        for _ in range(2):
            assert (await read_response(reader))[1] == b"ok"
        for _ in range(3):
            writer.write(POST)
            head, body = await read_response(reader)
            assert head.startswith(b"HTTP/1.1 200") and b"Connection" not in head
        writer.close()
        assert be.conns == 1 and len(be.requests) == 5  # one pooled backend connection
        assert r.bal.backends[be.url].inflight == 0
        await r.stop()
        await be.stop()

    run(main())


def test_http10_client_and_head_request():
    async def main():
        be = await Scripted(
            lambda h, b: [
                b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"
                if h.startswith(b"HEAD")
                else b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
            ]
        ).start()
        r = await router_for(be.url)
        out = await exchange(r, b"GET /v1/models HTTP/1.0\r\n\r\n")
        assert out.endswith(b"Connection: close\r\n\r\nhello")
        assert be.requests[0][0].startswith(b"GET /v1/models HTTP/1.0\r\n")
        # HEAD: a Content-Length but no body; the connection goes on
        reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
        writer.write(b"HEAD /v1/models HTTP/1.1\r\nHost: r\r\n\r\n")
        assert (
            await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"
        )
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: r\r\n\r\n")
        assert (await read_response(reader))[1] == b"hello"
        writer.close()
        await r.stop()
        await be.stop()

    run(main())


def test_backend_connection_close_and_close_delimited_bodies():
    async def main():
        def script(head, body):
            if b"/v1/close" in head:
                return [
                    b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
                    "close",
                ]
            return [
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil ",
                0.05,
                b"close",
                "close",
            ]

        be = await Scripted(script).start()
        r = await router_for(be.url)
        reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
        for _ in range(2):
            writer.write(b"GET /v1/close HTTP/1.1\r\nHost: r\r\n\r\n")
            head, body = await read_response(reader)
            # the backend's "close" concerns its connection to the router, not the client's
            assert body == b"ok" and b"Connection" not in head
        assert be.conns == 2  # not reused
        writer.write(b"GET /v1/eof HTTP/1.1\r\nHost: r\r\n\r\n")
        out = await asyncio.wait_for(reader.read(), 5)  # the router closes: the body's end
        assert b"Connection: close\r\n" in out and out.endswith(b"\r\n\r\nuntil close")
        writer.close()
        assert r.stats.requests[(be.url, 200)] == 3 and not r.stats.ejections
        await r.stop()
        await be.stop()

    run(main())


def test_interim_responses_are_skipped():
    async def main():
        be = await Scripted(
            lambda h, b: [b"HTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n", OK]
        ).start()
        r = await router_for(be.url)
        out = await exchange(r, LAST)
        assert out.startswith(b"HTTP/1.1 200 OK") and out.endswith(b"ok")
        await r.stop()
        await be.stop()

    run(main())


def test_backend_dying_mid_body_truncates_and_counts_a_failure():
    async def main():
        be = await Scripted(
            lambda h, b: [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial", 0.05, "close"]
        ).start()
        r = await router_for(be.url)
        out = await exchange(r, POST)
        assert out.startswith(b"HTTP/1.1 200 OK") and out.endswith(b"partial")  # then closed
        b = r.bal.backends[be.url]
        assert b.inflight == 0 and b.ejections == 1
        assert r.stats.requests[(be.url, "error")] == 1
        await r.stop()
        await be.stop()

    run(main())


def test_backend_closing_before_answering_is_502_not_retried():
    async def main():
        be = await Scripted(lambda h, b: ["close"]).start()
        r = await router_for(be.url)
        out = await exchange(r, LAST)
        assert out.startswith(b"HTTP/1.1 502 ") and b"Connection: close" in out
        assert len(be.requests) == 1 and r.stats.retries == 0  # it may have seen the request
        await r.stop()
        await be.stop()

    run(main())


def test_stale_pooled_connection_is_resent_once_on_a_new_one():
    """A pooled connection closed by the backend without a byte of answer: sent again."""

    def script(head, body):
        # each connection answers its first request; the second one arrives just as the
        # backend's keep-alive timeout closes the connection: dropped unread
        n = sum(1 for h, _ in be.requests if h is head)
        return [OK] if n and len(be.requests) % 2 == 1 else ["close"]

    async def main():
        nonlocal be
        be = await Scripted(script).start()
        r = await router_for(be.url)
        reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
        for _ in range(3):
            writer.write(POST)
            head, body = await read_response(reader)
            assert head.startswith(b"HTTP/1.1 200") and body == b"ok"
        writer.close()
        # requests 2 and 3 each met a stale pooled connection and went again on a new one
        assert be.conns == 3 and len(be.requests) == 5
        assert r.stats.resent == 2 and r.stats.retries == 0
        assert r.bal.backends[be.url].failures == 0 and not r.stats.ejections
        await r.stop()
        await be.stop()

    be = None
    run(main())


def test_stale_pooled_connection_resent_at_most_once():
    """If the new connection fails too, the client gets the 502 (no loop of resends)."""

    async def main():
        be = await Scripted(lambda h, b: [OK] if len(be.requests) == 1 else ["close"]).start()
        r = await router_for(be.url)
        reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
        writer.write(POST)
        assert (await read_response(reader))[1] == b"ok"
        writer.write(POST)
        head, _ = await read_response(reader)
        assert head.startswith(b"HTTP/1.1 502 ")
        writer.close()
        assert len(be.requests) == 3 and r.stats.resent == 1
        await r.stop()
        await be.stop()

    run(main())


def test_backend_idle_timeout_crossing_a_request_is_not_a_502():
    """The real race: the router (its own process, paused) has a request to send on a pooled
    connection when the backend's idle timeout closes that connection."""

    async def main():
        be = await Scripted(lambda h, b: [OK]).start()
        port = free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "serving.cli",
                "router",
                "--listen",
                f"127.0.0.1:{port}",
                "--backends",
                be.url,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            await asyncio.to_thread(wait_port, port, 30)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(5):
                writer.write(POST)  # pools a backend connection
                assert (await read_response(reader))[1] == b"ok"
                os.kill(proc.pid, signal.SIGSTOP)
                try:
                    writer.write(POST)  # waits in the router's socket ...
                    await writer.drain()
                    await asyncio.sleep(0.05)
                    be.close_idle()  # ... while the backend closes the idle connection
                    await asyncio.sleep(0.05)
                finally:
                    os.kill(proc.pid, signal.SIGCONT)
                head, body = await read_response(reader)
                assert head.startswith(b"HTTP/1.1 200") and body == b"ok"
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: r\r\n\r\n")
            _, metrics = await read_response(reader)
            writer.close()
            # the router mostly reads the request before the close (epoll reports in arrival
            # order); those requests crossed a closing connection and were sent again
            resent = next(
                float(ln.split()[1])
                for ln in metrics.splitlines()
                if ln.startswith(b"serving_router_resent_total ")
            )
            assert resent >= 1
        finally:
            proc.terminate()
            proc.wait(10)
            await be.stop()

    run(main())


def test_client_going_away_aborts_the_backend_stream():
    async def main():
        chunk = b"10\r\ndata: 0123456789\r\n"

        def script(head, body):
            return [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", chunk] + [
                0.05,
                chunk,
            ] * 100

        be = await Scripted(script).start()
        r = await router_for(be.url)
        reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
        writer.write(POST)
        await reader.readuntil(b"data: ")
        writer.close()
        deadline = time.monotonic() + 5
        while be.resets == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert be.resets == 1  # the backend saw the disconnect (vLLM then stops generating)
        b = r.bal.backends[be.url]
        assert b.inflight == 0 and b.failures == 0  # the client left: not the backend's fault
        await r.stop()
        await be.stop()

    run(main())


def test_request_timeout_is_504():
    async def main():
        be = await Scripted(lambda h, b: [2.0, OK]).start()
        r = await router_for(be.url, request_timeout_s=0.2)
        t0 = time.monotonic()
        out = await exchange(r, LAST)
        assert out.startswith(b"HTTP/1.1 504 ") and time.monotonic() - t0 < 1.5
        assert r.stats.requests[(be.url, "timeout")] == 1
        assert r.bal.backends[be.url].inflight == 0
        await r.stop()
        await be.stop()

    run(main())


@pytest.mark.parametrize(
    "data,status",
    [
        (b"POST /v1/x HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"GET /v1/x HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n", 431),
        (b"POST /v1/x HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n", 413),
        (b"GET /v1/x HTTP/3.0\r\n\r\n", 505),
    ],
)
def test_bad_requests_are_answered_and_closed(data, status):
    async def main():
        be = await Scripted(lambda h, b: [OK]).start()
        r = await router_for(be.url)
        out = await exchange(r, data + POST)  # what follows a bad request is not read
        assert out.startswith(b"HTTP/1.1 %d " % status) and b"Connection: close" in out
        assert out.count(b"HTTP/1.1") == 1 and not be.requests
        await r.stop()
        await be.stop()

    run(main())


def test_large_streamed_response_passes_intact():
    async def main():
        piece = bytes(range(256)) * 256  # 64 KiB
        n = 64

        def script(head, body):
            return [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (len(piece) * n)] + [
                piece
            ] * n

        be = await Scripted(script).start()
        r = await router_for(be.url)
        reader, writer = await asyncio.open_connection("127.0.0.1", r.port, limit=1 << 16)
        writer.write(POST)
        await reader.readuntil(b"\r\n\r\n")
        got = bytearray()
        while len(got) < len(piece) * n:
            got += await reader.read(1 << 16)
            await asyncio.sleep(0)  # a slow reader: the router must pause the backend
        assert bytes(got) == piece * n
        writer.close()
        await r.stop()
        await be.stop()

    run(main())


def test_stop_lets_requests_in_flight_finish():
    async def main():
        be = await Scripted(lambda h, b: [0.3, OK]).start()
        r = await router_for(be.url)
        reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
        writer.write(POST)
        await asyncio.sleep(0.1)
        stopping = asyncio.ensure_future(r.stop(drain_s=5))
        await asyncio.sleep(0.05)
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", r.port)  # no longer listening
        head, body = await read_response(reader)
        assert body == b"ok" and b"Connection: close" in head
        await stopping
        await be.stop()

    run(main())
