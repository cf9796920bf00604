"""RangeClient (``imagetool.registry.ranged``): ranged GETs read into the caller's buffers, against
loopback HTTP servers: redirects and where credentials go, kept connections (and ones the
server closed while idle), a real forward proxy (tinyproxy) and the proxies left to httpx,
timeouts."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from support import ForwardProxy, require_tool

from imagetool.registry.client import default_ssl_context
from imagetool.registry.ranged import RangeClient

BLOB = bytes(range(256)) * 4096  # 1 MiB


class _Ranges(BaseHTTPRequestHandler):
    """Serves ranges of BLOB at /blob over HTTP/1.1 keep-alive; /moved redirects to
    ``target`` (another server). Records what it was sent."""

    protocol_version = "HTTP/1.1"
    target = ""
    close_after = False  # close the connection after each answer, without saying so
    seen: list[tuple[str, str | None]]  # (path, Authorization)

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        cls = type(self)
        cls.seen.append((self.path, self.headers.get("Authorization")))
        if self.path.startswith("/moved"):
            self.send_response(307)
            self.send_header("Location", f"http://{cls.target}/blob?signed=1")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start, end = (int(x) for x in self.headers["Range"].removeprefix("bytes=").split("-"))
        data = BLOB[start : end + 1]
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{len(BLOB)}")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        if cls.close_after:
            self.close_connection = True


@pytest.fixture
def ranges(http_server: Callable) -> Iterator[Callable[[], type[_Ranges]]]:
    def start() -> type[_Ranges]:
        handler = type("Ranges", (_Ranges,), {"seen": []})
        handler.host = http_server(handler)  # type: ignore[attr-defined]
        return handler

    yield start


def _client(timeout: float = 5.0) -> RangeClient:
    return RangeClient(ssl_context=default_ssl_context, timeout=timeout, user_agent="test")


def _read(client: RangeClient, url: str, offset: int, length: int, **headers: str) -> bytes:
    resp = client.get(url, {"Range": f"bytes={offset}-{offset + length - 1}", **headers})
    assert resp is not None
    with resp:
        assert resp.status == 206
        out = bytearray(length)
        view, got = memoryview(out), 0
        while got < length:
            n = resp.readinto(view[got:])
            assert n > 0
            got += n
        return bytes(out)


def test_reads_into_buffers_on_kept_connections(ranges) -> None:
    server = ranges()
    with _client() as client:
        for offset in (0, 1000, 500_000):
            assert (
                _read(client, f"http://{server.host}/blob", offset, 70_000)
                == BLOB[offset : offset + 70_000]
            )
        assert client.connections_opened == 1


def test_response_left_early_closes_its_connection(ranges) -> None:
    server = ranges()
    with _client() as client:
        resp = client.get(f"http://{server.host}/blob", {"Range": "bytes=0-99999"})
        assert resp is not None
        resp.readinto(memoryview(bytearray(10)))
        resp.close()  # 99,990 bytes unread: the connection cannot take another request
        assert _read(client, f"http://{server.host}/blob", 5, 10) == BLOB[5:15]
        assert client.connections_opened == 2


def test_redirect_keeps_credentials_at_home(ranges) -> None:
    storage = ranges()
    registry = ranges()
    registry.target = storage.host
    with _client() as client:
        for _ in range(2):
            got = _read(client, f"http://{registry.host}/moved", 10, 20, Authorization="Bearer t")
            assert got == BLOB[10:30]
        assert registry.seen == [("/moved", "Bearer t")] * 2
        assert storage.seen == [("/blob?signed=1", None)] * 2
        assert client.connections_opened == 2  # one per origin, both kept


def test_connections_idle_too_long_are_not_reused(ranges, monkeypatch) -> None:
    server = ranges()
    with _client() as client:
        assert _read(client, f"http://{server.host}/blob", 0, 5) == BLOB[:5]
        monkeypatch.setattr("imagetool.registry.ranged.KEEPALIVE_EXPIRY", 0.0)
        assert _read(client, f"http://{server.host}/blob", 5, 5) == BLOB[5:10]
        assert client.connections_opened == 2


def test_connection_closed_while_idle_is_replaced(ranges) -> None:
    server = ranges()
    server.close_after = True
    with _client() as client:
        for offset in (0, 10, 20):
            assert _read(client, f"http://{server.host}/blob", offset, 5) == BLOB[offset:][:5]
        assert client.connections_opened == 3
        assert len(server.seen) == 3


@pytest.fixture
def proxy_env(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """``proxy_env(HTTP_PROXY=..., NO_PROXY=...)``: exactly those proxy variables."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    return lambda **env: [monkeypatch.setenv(k, v) for k, v in env.items()] and None


@pytest.fixture
def forward_proxy(tmp_path: Path) -> Iterator[ForwardProxy]:
    require_tool("tinyproxy")
    proxy = ForwardProxy(tmp_path / "proxy", auth=("node", "s3cret"))
    yield proxy
    proxy.stop()


def test_reads_through_the_environments_proxy(ranges, proxy_env, forward_proxy) -> None:
    server = ranges()
    proxy_env(HTTP_PROXY=forward_proxy.url)
    with _client() as client:
        for offset in (0, 4096, 700_000):
            assert _read(client, f"http://{server.host}/blob", offset, 5000) == BLOB[offset:][:5000]
    # Every read went through tinyproxy (which authenticated us with the URL's user:secret).
    assert forward_proxy.requests() == [f"GET http://{server.host}/blob HTTP/1.1"] * 3
    assert len(server.seen) == 3


def test_no_proxy_and_the_given_proxy(ranges, proxy_env, forward_proxy) -> None:
    server = ranges()
    proxy_env(HTTP_PROXY=forward_proxy.url, NO_PROXY="127.0.0.1")
    with _client() as client:
        assert _read(client, f"http://{server.host}/blob", 0, 2) == BLOB[:2]
    assert forward_proxy.requests() == []
    # A proxy given to the client (hosts.toml's ``proxy``) overrides NO_PROXY.
    with RangeClient(
        ssl_context=default_ssl_context, timeout=5, user_agent="t", proxy=forward_proxy.url
    ) as client:
        assert _read(client, f"http://{server.host}/blob", 0, 2) == BLOB[:2]
    assert len(forward_proxy.requests()) == 1


def test_proxy_refusing_our_credentials_is_an_answer(ranges, proxy_env, forward_proxy) -> None:
    server = ranges()
    proxy_env(HTTP_PROXY=forward_proxy.url.replace("s3cret", "wrong"))
    with _client() as client:
        resp, answer = client.get_range(f"http://{server.host}/blob", 0, 2, {}, "blob")
    # tinyproxy says 401 where the spec says 407: either way, no read and no bytes.
    assert resp is None and answer.split(",")[0] in ("HTTP 401", "HTTP 407")
    assert server.seen == []


def test_proxies_it_does_not_speak_are_left_to_httpx(ranges, proxy_env) -> None:
    server = ranges()
    proxy_env(HTTP_PROXY="https://127.0.0.1:9")  # TLS to the proxy itself
    with _client() as client:
        assert client.get(f"http://{server.host}/blob", {"Range": "bytes=0-1"}) is None
    assert server.seen == []


def test_connect_timeout_is_shorter_than_the_read_timeout() -> None:
    # A listener that never accepts, its queue filled: further SYNs go unanswered.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    for _ in range(4):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(listener.getsockname())
        fillers.append(s)
    try:
        with RangeClient(
            ssl_context=default_ssl_context, timeout=30, user_agent="t", connect_timeout=0.3
        ) as client:
            start = time.monotonic()
            with pytest.raises(TimeoutError):
                client.get(f"http://127.0.0.1:{listener.getsockname()[1]}/blob", {})
            assert time.monotonic() - start < 3
    finally:
        for s in fillers:
            s.close()
        listener.close()


def test_silent_server_times_out() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    accepted: list[socket.socket] = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True)
    thread.start()
    try:
        with _client(timeout=0.3) as client:
            start = time.monotonic()
            with pytest.raises(TimeoutError):
                client.get(f"http://127.0.0.1:{listener.getsockname()[1]}/blob", {})
            assert time.monotonic() - start < 3
    finally:
        thread.join(5)
        for conn in accepted:
            conn.close()
        listener.close()
