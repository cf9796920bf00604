"""The router's lean GET client (load-report scraper) against real servers on loopback."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from servinghelp import AppServer, run

from serving.fetch import FetchError, Getter

pytestmark = pytest.mark.integration

PAGE = "".join(f'vllm:num_requests_running{{i="{i}"}} {i}\n' for i in range(2000))


def getter(url: str, path: str = "/metrics") -> Getter:
    netloc = url.removeprefix("http://")
    host, _, port = netloc.rpartition(":")
    return Getter(host, int(port), path, netloc)


def test_content_length_chunked_and_keep_alive():
    peers: set[tuple] = set()

    async def fixed(request: web.Request) -> web.Response:
        peers.add(request.transport.get_extra_info("peername"))
        return web.Response(text=PAGE)

    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(0, len(PAGE), 7000):
            await resp.write(PAGE[i : i + 7000].encode())
        await resp.write_eof()
        return resp

    async def main():
        app = web.Application()
        app.router.add_get("/metrics", fixed)
        app.router.add_get("/chunked", chunked)
        srv = await AppServer(app).start()
        g = getter(srv.url)
        for _ in range(3):
            assert await g.get(5) == (200, PAGE.encode())
        assert len(peers) == 1  # one kept-alive connection for all three
        g.close()
        c = getter(srv.url, "/chunked")
        assert await c.get(5) == (200, PAGE.encode())
        assert (await getter(srv.url, "/nope").get(5))[0] == 404
        c.close()
        await srv.stop()

    run(main())


def test_close_delimited_body_and_failures():
    async def main():
        async def close_delimited(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nrunning 3\n")
            await writer.drain()
            writer.close()

        async def garbage(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"SMTP ready\r\n\r\n")
            await writer.drain()

        async def silent(reader, writer):
            await asyncio.sleep(30)

        servers = [
            await asyncio.start_server(h, "127.0.0.1", 0)
            for h in (close_delimited, garbage, silent)
        ]
        urls = [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers]
        g = getter(urls[0])
        for _ in range(2):  # a new connection each time: the server closes it
            assert await g.get(5) == (200, b"running 3\n")
        with pytest.raises(FetchError):
            await getter(urls[1]).get(5)
        with pytest.raises(FetchError, match="no answer"):
            await getter(urls[2]).get(0.3)
        s = servers[2]
        port = s.sockets[0].getsockname()[1]
        for s in servers:
            s.close()
        with pytest.raises(FetchError):
            await getter(f"http://127.0.0.1:{port}").get(5)

    run(main())
