"""Ranged HTTP GETs whose bodies are read straight into the caller's buffers (``http.client``).

httpx hands a response body out as 64 KiB ``bytes`` chunks that h11 has copied twice on the
way in, and putting them into a sector buffer is a third copy, all under the GIL. For the blob
bytes the snapshotter fetches, that cost 0.85-0.95 s of CPU per GB on a loopback registry,
against 0.22-0.26 s for ``http.client``, whose ``readinto`` receives into the buffer itself
(``benchmarks/mount``). So the data path's ranged reads go through this small client, and
everything else (auth challenges and tokens, manifests, uploads, retries with backoff, and
any answer other than the range asked for) stays with the registry client's httpx.

* Connections are kept per origin (scheme, host, port) and reused once a response was read
  to its end; a response left before its end closes its connection. A connection idle for
  ``KEEPALIVE_EXPIRY`` seconds is closed rather than reused (as httpx does): a server or a
  middlebox may have dropped it without a word, and a read on it would wait out ``timeout``.
* A request that fails on a kept connection before any answer (the server closed it while
  it was idle) is sent once more on a new one.
* Redirects are followed (a registry commonly sends blob reads to object storage), up to
  ``MAX_REDIRECTS``; the ``Authorization`` header goes only to the origin it was meant for.
* ``timeout`` bounds connecting and every receive: ``TimeoutError``, never a hang.
* Proxies: the one given (a hosts.toml ``proxy``), else the environment's for the URL
  (``HTTP(S)_PROXY``, ``ALL_PROXY``, less ``NO_PROXY``, as httpx reads them; read once per
  client and origin: a process's environment does not change under it). Through an
  ``http://`` proxy, an ``http`` URL is asked for in absolute form and an ``https`` one
  through a ``CONNECT`` tunnel (TLS with the registry inside it), ``user:password@`` of the
  proxy URL going as ``Proxy-Authorization``; connections are kept per (origin, proxy). A
  proxy of another scheme (TLS to the proxy itself, SOCKS) is not handled here: ``get``
  returns None and the caller asks through httpx.
* ``connect_timeout`` (hosts.toml's ``dial_timeout``) bounds connecting, the tunnel
  included, when it is shorter than ``timeout``.
"""

from __future__ import annotations

import base64
import http.client
import logging
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from urllib.parse import unquote, urljoin, urlsplit

from imagetool.errors import StoreError, StoreTimeoutError
from imagetool.stores.base import RangeBody

log = logging.getLogger(__name__)

MAX_REDIRECTS = 5
# Seconds an idle connection is kept for reuse (httpx's default).
KEEPALIVE_EXPIRY = 5.0
# Idle connections kept per origin: one per fetch worker of a mount.
MAX_IDLE = 16
# Bytes of a redirect's body read so that its connection can be reused; a longer one is
# closed with its connection.
_REDIRECT_BODY_LIMIT = 64 << 10
_REDIRECT_STATUS = frozenset({301, 302, 303, 307, 308})
_Origin = tuple[str, str, int]
# (origin, proxy URL or None): what a kept connection is good for.
_Route = tuple[_Origin, str | None]


class RangeResponse:
    """An answer to ``RangeClient.get``: ``status``, ``header()``, and the body read with
    ``readinto``/``read``. ``close`` hands the connection back for reuse when the body was
    read to its end."""

    def __init__(
        self, client: RangeClient, route: _Route, conn: http.client.HTTPConnection,
        resp: http.client.HTTPResponse, url: str,
    ) -> None:  # fmt: skip
        self._client = client
        self._route = route
        self._conn: http.client.HTTPConnection | None = conn
        self._resp = resp
        self.url = url  # where the answer came from, after redirects
        self.status = resp.status
        self.length = resp.length  # Content-Length, or None

    def header(self, name: str) -> str | None:
        return self._resp.getheader(name)

    def is_range(self, offset: int, length: int) -> bool:
        """Whether this answers a request for bytes ``[offset, offset+length)`` with just
        them: 206, that ``Content-Range``, and a body of that length (or a chunked one)."""
        content_range = (self.header("Content-Range") or "").strip()
        return (
            self.status == 206
            and self.length in (None, length)
            and content_range.startswith(f"bytes {offset}-{offset + length - 1}/")
        )

    def readinto(self, out: memoryview) -> int:
        """Up to ``len(out)`` bytes of the body into ``out``; 0 at its end. Raises
        ``TimeoutError`` or another ``OSError``/``http.client.HTTPException``."""
        return self._resp.readinto(out)

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes, received into the returned object itself."""
        return self._resp.read(n)

    def read_all(self, n: int, where: str) -> bytes:
        """``read(n)`` with errors as a store raises them (``where``: for messages)."""
        try:
            return self.read(n)
        except TimeoutError:
            raise StoreTimeoutError(f"{where}: read timed out") from None
        except (OSError, http.client.HTTPException) as e:
            raise StoreError(f"{where}: {type(e).__name__}: {_one_line(e)}") from None

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._resp.isclosed():  # read to its end: the connection can take another request
            self._client._release(self._route, conn)
        else:
            self._resp.close()
            conn.close()

    def __enter__(self) -> RangeResponse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RangeClient:
    """GETs through kept ``http.client`` connections (thread-safe)."""

    def __init__(
        self, *, ssl_context: Callable[[], ssl.SSLContext], timeout: float, user_agent: str,
        max_idle: int = MAX_IDLE, connect_timeout: float | None = None, proxy: str | None = None,
    ) -> None:  # fmt: skip
        self.ssl_context = ssl_context  # called per https connection (callers cache it)
        self.timeout = timeout
        self.connect_timeout = min(timeout, connect_timeout or timeout)
        self.proxy = proxy  # overrides the environment's for every URL
        # The environment's proxy for each origin asked (reading the environment walks all
        # of it: a request's worth of the interpreter, for an answer that does not change).
        self._env_proxies: dict[_Origin, str | None] = {}
        self.user_agent = user_agent
        self.max_idle = max_idle
        self._lock = threading.Lock()
        # per route: (connection, when it went idle), most recent last
        self._idle: dict[_Route, list[tuple[http.client.HTTPConnection, float]]] = {}
        self._closed = False
        self.connections_opened = 0
        self.disabled: str | None = None  # why the caller stopped asking through this client

    def disable(self, reason: str) -> None:
        """The caller will stop asking through this client (``get`` then returns None): a
        server whose successful answers are not what its callers can read directly would
        cost every read a second request."""
        if self.disabled is None:
            self.disabled = reason
            log.info("ranged reads through the store's own client from now on: %s", reason)

    def _env_proxy(self, origin: _Origin) -> str | None:
        try:
            return self._env_proxies[origin]
        except KeyError:
            proxy = self._env_proxies[origin] = _env_proxy(origin)
            return proxy

    def get(self, url: str, headers: Mapping[str, str]) -> RangeResponse | None:
        """GET ``url``, following redirects; the final answer, whatever its status (a body
        to read), or None when a URL on the way goes through a proxy this client does not
        speak (see the module docstring) or the client was disabled. ``headers`` go with
        every hop, ``Authorization`` only to ``url``'s origin. Raises ``TimeoutError``, or
        another ``OSError``/``http.client.HTTPException`` when no answer came."""
        if self.disabled is not None:
            return None
        first = _origin(url)
        for _ in range(MAX_REDIRECTS + 1):
            origin = _origin(url)
            proxy = self.proxy or self._env_proxy(origin)
            if proxy is not None and urlsplit(proxy).scheme != "http":
                return None
            hop = {
                k: v for k, v in headers.items() if origin == first or k.lower() != "authorization"
            }
            response = self._send((origin, proxy), url, hop)
            if response.status not in _REDIRECT_STATUS:
                return response
            location = response.header("Location")
            _discard(response)
            if not location:
                raise http.client.HTTPException(f"HTTP {response.status} without a Location")
            url = urljoin(url, location)
        raise http.client.HTTPException(f"more than {MAX_REDIRECTS} redirects")

    def get_range(
        self, url: str, offset: int, length: int, headers: Mapping[str, str], where: str
    ) -> tuple[RangeResponse | None, str]:
        """GET bytes ``[offset, offset+length)`` (length > 0) of ``url``: the response if it
        is exactly that range (``RangeResponse.is_range``), else None and the error that
        came instead ("HTTP status, Content-Range"; "" if it was a success, if no answer
        came, the URL goes through a proxy it does not speak or the client was disabled),
        for the caller to ask again its own way (a 206 of another range: the range runs
        past the end). A 200 (the Range ignored: the server's way, not an error of the
        moment) disables the client. Raises ``StoreTimeoutError`` when no answer came in
        time (``where``: for messages)."""
        try:
            resp = self.get(url, {**headers, "Range": f"bytes={offset}-{offset + length - 1}"})
        except TimeoutError:
            raise StoreTimeoutError(f"{where}: no answer within {self.timeout:g}s") from None
        except (OSError, http.client.HTTPException) as e:
            log.debug("%s: %s; asking again", where, _one_line(e))
            return None, ""
        if resp is None or resp.is_range(offset, length):
            return resp, ""
        answer = f"HTTP {resp.status}, {resp.header('Content-Range') or 'no Content-Range'}"
        resp.close()
        if resp.status == 200:
            self.disable(f"{where}: a ranged read got {answer}")
        log.debug("%s: %s; asking again", where, answer)
        return None, answer if resp.status >= 300 else ""

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn, _ in conns:
                conn.close()

    def __enter__(self) -> RangeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, route: _Route, url: str, headers: Mapping[str, str]) -> RangeResponse:
        (scheme, _, _), proxy = route
        parts = urlsplit(url)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        hdrs = {"User-Agent": self.user_agent, "Accept-Encoding": "identity", **headers}
        if proxy is not None and scheme == "http":
            # In absolute form to the proxy (http.client sends the URL's Host).
            target = f"http://{parts.netloc.rpartition('@')[2]}{target}"
            if (auth := _proxy_authorization(proxy)) is not None:
                hdrs["Proxy-Authorization"] = auth
        while True:
            conn, kept = self._take(route)
            try:
                conn.request("GET", target, headers=hdrs)
                resp = conn.getresponse()
            except TimeoutError:
                conn.close()
                raise
            except (OSError, http.client.HTTPException):
                conn.close()
                if kept:  # closed by the server while idle: once more on a new connection
                    continue
                raise
            return RangeResponse(self, route, conn, resp, url)

    def _take(self, route: _Route) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            idle = self._idle.get(route, [])
            now = time.monotonic()
            expired = [conn for conn, since in idle if now - since >= KEEPALIVE_EXPIRY]
            idle[:] = [(conn, since) for conn, since in idle if now - since < KEEPALIVE_EXPIRY]
            kept = idle.pop()[0] if idle else None
        for conn in expired:
            conn.close()
        if kept is not None:
            return kept, True
        (scheme, host, port), proxy = route
        at_host, at_port = host, port
        if proxy is not None:
            p = urlsplit(proxy)
            at_host, at_port = p.hostname or "", p.port or 80
        conn: http.client.HTTPConnection
        if scheme == "https":
            conn = http.client.HTTPSConnection(
                at_host, at_port, timeout=self.connect_timeout, context=self.ssl_context()
            )
            if proxy is not None:
                auth = _proxy_authorization(proxy)
                conn.set_tunnel(host, port, {"Proxy-Authorization": auth} if auth else None)
        else:
            conn = http.client.HTTPConnection(at_host, at_port, timeout=self.connect_timeout)
        try:
            conn.connect()
        except BaseException:
            conn.close()
            raise
        if conn.sock is not None:
            conn.sock.settimeout(self.timeout)
        with self._lock:
            self.connections_opened += 1
        return conn, False

    def _release(self, route: _Route, conn: http.client.HTTPConnection) -> None:
        if conn.sock is None:  # the server said it closes the connection
            return
        with self._lock:
            idle = self._idle.setdefault(route, [])
            if not self._closed and len(idle) < self.max_idle:
                idle.append((conn, time.monotonic()))
                return
        conn.close()


class DirectBody(RangeBody):
    """A ranged GET's body (``RangeClient``) as a store's ``open_range`` returns it:
    received straight into the caller's buffers, errors as a store raises them."""

    def __init__(self, resp: RangeResponse, where: str, length: int) -> None:
        super().__init__(where, length)
        self._resp = resp

    def _read_some(self, out: memoryview) -> int:
        try:
            return self._resp.readinto(out)
        except TimeoutError:
            raise StoreTimeoutError(f"{self.where}: read timed out") from None
        except (OSError, http.client.HTTPException) as e:
            raise StoreError(f"{self.where}: {type(e).__name__}: {_one_line(e)}") from None

    def close(self) -> None:
        """The connection goes back to the pool if the range was read to its end."""
        self._resp.close()


def _one_line(e: object) -> str:
    return " ".join(str(e).split())


def _origin(url: str) -> _Origin:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise http.client.HTTPException(f"cannot follow {url!r}")
    return scheme, parts.hostname, parts.port or (443 if scheme == "https" else 80)


def _env_proxy(origin: _Origin) -> str | None:
    """The proxy the environment sends requests to ``origin`` through, if any."""
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(origin[0]) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass_environment(f"{origin[1]}:{origin[2]}", proxies):
        return None
    return proxy if "://" in proxy else f"http://{proxy}"


def _proxy_authorization(proxy: str) -> str | None:
    """``Proxy-Authorization`` for the ``user:password@`` of a proxy URL, if it has one."""
    parts = urlsplit(proxy)
    if parts.username is None:
        return None
    secret = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
    return "Basic " + base64.b64encode(secret.encode()).decode()


def _discard(response: RangeResponse) -> None:
    """Read a redirect's small body to its end so that its connection is kept."""
    if response.length is not None and response.length <= _REDIRECT_BODY_LIMIT:
        try:
            response.read(response.length)
        except (OSError, http.client.HTTPException):
            pass
    response.close()
