"""The Endpoint Discovery Service: endpoint sources, the EDS HTTP server, and its client.

Sources write full snapshots into an :class:`~serving.endpoints.EndpointStore`:

* :class:`StaticSource`: a fixed list (``--backends``).
* :class:`FileSource`: a file (JSON or one URL per line) re-read when its stat changes; the
  last good content stays in force while the file is being rewritten or is malformed.
* :class:`serving.kube.EndpointSliceSource`: Kubernetes EndpointSlices of a Service.

The server (:func:`make_eds_app`) serves the store to routers:

* ``GET /v1/endpoints`` → the current set as JSON; with ``?after=V&timeout=S`` it is a
  long-poll that answers as soon as the version exceeds ``V`` (or after ``S`` seconds).
* ``GET /v1/endpoints/stream`` → server-sent events: one ``event: endpoints`` per version
  (``id:`` is ``<epoch>.<version>``, ``data:`` the JSON set), a comment line as heartbeat.
  A client that reconnects with ``Last-Event-ID`` equal to the current id gets no duplicate.

A change reaches a connected router in one network round trip (milliseconds), well within
the one-second budget; :func:`follow_eds` reconnects with backoff and keeps the last set
while the EDS is unreachable, so an EDS restart never empties a router.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from pathlib import Path

import aiohttp
from aiohttp import web

from serving.endpoints import Endpoint, EndpointStore, decode, encode, parse_endpoint_text
from serving.errors import ConfigError

log = logging.getLogger(__name__)

# How often a FileSource stats its file: cheap, and well inside the one-second budget.
FILE_POLL_S = 0.25
# SSE heartbeat: keeps idle proxies/NATs from closing the stream and lets clients notice death.
HEARTBEAT_S = 10.0
# Longest long-poll the server accepts.
MAX_LONG_POLL_S = 60.0


class EndpointSource(ABC):
    """Something that keeps an EndpointStore up to date until cancelled."""

    @abstractmethod
    async def run(self, store: EndpointStore) -> None: ...


class StaticSource(EndpointSource):
    def __init__(self, endpoints: Iterable[Endpoint]) -> None:
        self.endpoints = tuple(endpoints)

    async def run(self, store: EndpointStore) -> None:
        store.update(self.endpoints)


class FileSource(EndpointSource):
    def __init__(self, path: str | os.PathLike, *, poll_s: float = FILE_POLL_S) -> None:
        self.path = Path(path)
        self.poll_s = poll_s

    def read(self) -> tuple[Endpoint, ...]:
        return parse_endpoint_text(self.path.read_text())

    async def run(self, store: EndpointStore) -> None:
        last = None
        while True:
            try:
                st = self.path.stat()
                key = (st.st_ino, st.st_mtime_ns, st.st_size)
            except FileNotFoundError:
                key = None
            if key != last:
                last = key
                if key is None:
                    log.warning("endpoint file %s is missing; keeping the last set", self.path)
                else:
                    try:
                        eps = self.read()
                    except (OSError, ConfigError) as e:
                        log.warning(
                            "endpoint file %s unreadable (%s); keeping the last set", self.path, e
                        )
                    else:
                        if store.update(eps):
                            log.info(
                                "endpoints from %s: %d (v%d)", self.path, len(eps), store.version
                            )
            await asyncio.sleep(self.poll_s)


# -- server ------------------------------------------------------------------------------------


def make_eds_app(store: EndpointStore, *, heartbeat_s: float = HEARTBEAT_S) -> web.Application:
    """The EDS HTTP application for ``store``."""
    # event ids are "<epoch>.<version>": a restarted EDS (versions from 1 again) never matches
    # a client's Last-Event-ID from its previous life
    epoch = secrets.token_hex(4)

    async def snapshot(request: web.Request) -> web.Response:
        try:
            after = int(request.query.get("after", "-1"))
            timeout = min(float(request.query.get("timeout", "0")), MAX_LONG_POLL_S)
        except ValueError:
            raise web.HTTPBadRequest(text="after and timeout must be numbers") from None
        if after >= 0 and timeout > 0:
            await store.wait_newer(after, timeout)
        return web.Response(
            text=encode(store.version, store.endpoints), content_type="application/json"
        )

    streams: set[asyncio.Task] = set()

    async def stream(request: web.Request) -> web.StreamResponse:
        task = asyncio.current_task()
        streams.add(task)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        sent = -1
        if request.headers.get("Last-Event-ID") == f"{epoch}.{store.version}":
            sent = store.version
        try:
            while True:
                if store.version > sent:
                    sent = store.version
                    data = encode(sent, store.endpoints)
                    await resp.write(
                        f"id: {epoch}.{sent}\nevent: endpoints\ndata: {data}\n\n".encode()
                    )
                elif not await store.wait_newer(sent, heartbeat_s):
                    await resp.write(b": ping\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass  # client gone, or server shutting down
        finally:
            streams.discard(task)
        return resp

    async def end_streams(app: web.Application) -> None:
        # streams never finish on their own; end them so shutdown does not wait its timeout
        for t in list(streams):
            t.cancel()

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_get("/v1/endpoints", snapshot)
    app.router.add_get("/v1/endpoints/stream", stream)
    app.router.add_get("/healthz", healthz)
    app.on_shutdown.append(end_streams)
    return app


# -- client ------------------------------------------------------------------------------------


async def follow_eds(
    base_url: str,
    on_update: Callable[[int, tuple[Endpoint, ...]], None],
    *,
    session: aiohttp.ClientSession | None = None,
    retry_min_s: float = 0.2,
    retry_max_s: float = 5.0,
) -> None:
    """Follow the EDS stream at ``base_url`` forever, calling ``on_update`` per new version.

    Reconnects with exponential backoff; the caller keeps its last set meanwhile.
    """
    own = session is None
    if own:
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=None))
    url = base_url.rstrip("/") + "/v1/endpoints/stream"
    delay = retry_min_s
    last_id = ""
    try:
        while True:
            try:
                headers = {"Last-Event-ID": last_id} if last_id else {}
                timeout = aiohttp.ClientTimeout(
                    total=None, sock_connect=5, sock_read=HEARTBEAT_S * 3
                )
                async with session.get(url, headers=headers, timeout=timeout) as resp:
                    if resp.status != 200:
                        raise aiohttp.ClientResponseError(
                            resp.request_info, (), status=resp.status, message="EDS stream refused"
                        )
                    delay = retry_min_s
                    event, data, ev_id = "", [], ""
                    async for raw in resp.content:
                        line = raw.decode().rstrip("\r\n")
                        if not line:
                            if event == "endpoints" and data and ev_id != last_id:
                                v, eps = decode("\n".join(data))
                                last_id = ev_id
                                on_update(v, eps)
                            event, data, ev_id = "", [], ""
                        elif line.startswith(":"):
                            continue
                        elif line.startswith("id:"):
                            ev_id = line[3:].strip()
                        elif line.startswith("event:"):
                            event = line[6:].strip()
                        elif line.startswith("data:"):
                            data.append(line[5:].lstrip())
                log.warning("EDS stream %s ended; reconnecting", url)
            except (aiohttp.ClientError, TimeoutError, ConfigError, UnicodeDecodeError) as e:
                log.warning("EDS stream %s failed (%s); retrying in %.1fs", url, e, delay)
            await asyncio.sleep(delay)
            delay = min(retry_max_s, delay * 2)
    finally:
        if own:
            await session.close()
