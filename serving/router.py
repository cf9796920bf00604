"""The router: a stateless reverse proxy for OpenAI-style requests, P2C on in-flight load.

HTTP stack
    aiohttp on uvloop, server and client. Its HTTP/1.1 parser is llhttp (C), its client keeps
    keep-alive pools per backend (``TCPConnector``), and it streams response bodies chunk by
    chunk, so server-sent-event streams pass through untouched. Raw asyncio protocols would
    save perhaps a third of the per-request CPU, but would re-implement chunked encoding,
    pipelining, ``Expect`` and half-closes: more risk than the gain is worth while the router's
    cost is dwarfed by the ~100 ms of a vLLM request. Throughput scales by process:
    :func:`serve` starts one worker per core on the same port (``SO_REUSEPORT``), and the
    kernel spreads connections among them.

Per request
    The body is read whole (prompts are small), a backend is chosen by
    :class:`~serving.balancer.Balancer` (power of two choices on in-flight requests combined
    with staleness-weighted load reports scraped from each backend's ``/metrics``), and the
    request is forwarded on a pooled connection. If the connection to the backend cannot be
    established, no byte has reached it, so the request is retried once on another backend.
    Any other failure (the backend dropped the connection, timed out, answered 5xx) may have
    been seen by the backend and is not retried; it counts as a failure for ejection, and the
    client gets the backend's answer or a 502.

Membership
    Static ``--backends`` or the EDS stream (``--eds``). Endpoints that are not ready,
    terminating, or gone are *draining*: no new requests, in-flight ones finish, then the
    backend is forgotten.

Metrics (``GET /metrics``; with several workers, each also on ``admin_port + index``)
    ``serving_router_backend_inflight``, ``..._backend_reported_load``,
    ``..._backend_ejected``, ``..._backend_draining`` (read from balancer state at scrape time,
    free per request), ``serving_router_requests_total{backend,code}``,
    ``serving_router_request_seconds`` and ``serving_router_upstream_seconds{backend}``
    histograms, ``serving_router_retries_total``, ``serving_router_ejections_total{backend}``,
    ``serving_router_no_backend_total``.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from serving.balancer import Backend, Balancer, BalancerConfig, record_report
from serving.discovery import follow_eds
from serving.endpoints import Endpoint, normalize_url
from serving.promtext import vllm_load

log = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 7.6.1) and those aiohttp recomputes; never forwarded.
_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)
# Latency buckets (s): the router adds well under a millisecond; vLLM requests take 10s-1000s ms.
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    #: static backends (http://host:port); used when eds_url is None
    backends: tuple[str, ...] = ()
    #: base URL of an EDS to follow
    eds_url: str | None = None
    #: worker processes sharing the port (SO_REUSEPORT); 1 = run in this process
    workers: int = 1
    #: with workers > 1, worker i also serves /metrics on admin_port + i (0 = off)
    admin_port: int = 0
    balancer: BalancerConfig = field(default_factory=BalancerConfig)
    #: how often each backend's /metrics is read for its load report (0 = never)
    scrape_interval_s: float = 0.5
    connect_timeout_s: float = 1.0
    #: whole-request limit (streams included)
    request_timeout_s: float = 300.0
    #: idle keep-alive connections are closed after this long
    keepalive_s: float = 30.0
    #: seconds to let in-flight requests finish on SIGTERM
    drain_s: float = 30.0


class _StateCollector:
    """Gauges read from the balancer at scrape time (no per-request cost)."""

    def __init__(self, bal: Balancer) -> None:
        self.bal = bal

    def collect(self):
        now = time.monotonic()
        inflight = GaugeMetricFamily(
            "serving_router_backend_inflight",
            "Requests in flight from this router",
            labels=["backend"],
        )
        reported = GaugeMetricFamily(
            "serving_router_backend_reported_load",
            "Last load (running+waiting) the backend reported",
            labels=["backend"],
        )
        ejected = GaugeMetricFamily(
            "serving_router_backend_ejected", "1 while the backend is ejected", labels=["backend"]
        )
        draining = GaugeMetricFamily(
            "serving_router_backend_draining", "1 while the backend drains", labels=["backend"]
        )
        for b in list(self.bal.backends.values()):
            inflight.add_metric([b.key], b.inflight)
            if b.reported is not None:
                reported.add_metric([b.key], b.reported)
            ejected.add_metric([b.key], 1.0 if b.ejected_until > now else 0.0)
            draining.add_metric([b.key], 1.0 if b.draining else 0.0)
        yield from (inflight, reported, ejected, draining)


class Router:
    """One router worker: the balancer, the backend pools, the proxy handler, the metrics."""

    def __init__(self, cfg: RouterConfig, *, balancer: Balancer | None = None) -> None:
        self.cfg = cfg
        self.bal = balancer or Balancer(cfg.balancer)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.m_requests = Counter(
            "serving_router_requests_total",
            "Requests by backend and status",
            ["backend", "code"],
            registry=r,
        )
        self.m_latency = Histogram(
            "serving_router_request_seconds",
            "Time to answer headers, retries included",
            buckets=_BUCKETS,
            registry=r,
        )
        self.m_upstream = Histogram(
            "serving_router_upstream_seconds",
            "Backend time to response headers",
            ["backend"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.m_retries = Counter(
            "serving_router_retries_total", "Requests retried on another backend", registry=r
        )
        self.m_ejections = Counter(
            "serving_router_ejections_total",
            "Backends ejected after failures",
            ["backend"],
            registry=r,
        )
        self.m_nobackend = Counter(
            "serving_router_no_backend_total", "Requests refused: no backend", registry=r
        )
        r.register(_StateCollector(self.bal))
        self._children: dict[tuple[str, str], object] = {}
        self.session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._scraped: dict[str, asyncio.Task] = {}

    # -- lifecycle ------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_route("*", "/v1/{tail:.*}", self.proxy)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application | None = None) -> None:
        conn = aiohttp.TCPConnector(
            limit=0,  # no global cap: backpressure is the backends' business
            keepalive_timeout=self.cfg.keepalive_s,
            ttl_dns_cache=300,
        )
        self._timeout = aiohttp.ClientTimeout(
            total=self.cfg.request_timeout_s, sock_connect=self.cfg.connect_timeout_s
        )
        self.session = aiohttp.ClientSession(
            connector=conn,
            timeout=self._timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        for url in self.cfg.backends:
            self.bal.add(normalize_url(url))
        if self.cfg.eds_url:
            self._tasks.append(
                asyncio.ensure_future(follow_eds(self.cfg.eds_url, self.apply_endpoints))
            )
        self._tasks.append(asyncio.ensure_future(self._housekeeping()))

    async def _stop(self, app: web.Application | None = None) -> None:
        for t in [*self._tasks, *self._scraped.values()]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._scraped.values(), return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    def apply_endpoints(self, version: int, endpoints: Iterable[Endpoint]) -> None:
        eps = list(endpoints)
        ready = [(e.url, e.zone) for e in eps if e.serving]
        self.bal.set_endpoints(ready, [e.url for e in eps if not e.serving])
        log.info(
            "endpoints v%d: %d serving, %d draining", version, len(ready), len(eps) - len(ready)
        )

    async def _housekeeping(self) -> None:
        """Reap drained backends; keep one load scraper per backend."""
        while True:
            self.bal.reap()
            if self.cfg.scrape_interval_s > 0:
                for url in list(self._scraped):
                    if url not in self.bal.backends:
                        self._scraped.pop(url).cancel()
                for url, b in self.bal.backends.items():
                    if url not in self._scraped:
                        self._scraped[url] = asyncio.ensure_future(self._scrape(b))
            await asyncio.sleep(0.2)

    async def _scrape(self, b: Backend) -> None:
        url = b.url + "/metrics"
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.cfg.scrape_interval_s * 2))
        loop = asyncio.get_running_loop()
        while True:
            try:
                async with self.session.get(url, timeout=timeout) as resp:
                    if resp.status == 200:
                        load = vllm_load(await resp.text())
                        if load is not None:
                            record_report(b, load, loop.time())
            except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
                pass  # a missing report ages out; passive health acts on real traffic only
            await asyncio.sleep(self.cfg.scrape_interval_s)

    # -- handlers -------------------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _count(self, b: Backend, code: str) -> None:
        key = (b.key, code)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = self.m_requests.labels(b.key, code)
        c.inc()

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        bal = self.bal
        b = bal.pick(t0)
        if b is None:
            self.m_nobackend.inc()
            return web.Response(status=503, text="no backend available\n")
        retried = False
        while True:
            b.inflight += 1
            t1 = loop.time()
            try:
                resp = await self.session.request(
                    request.method, b.url + request.path_qs, data=body, headers=headers
                )
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
                # the connection was never established: nothing reached the backend
                self._release(b)
                self._failed(b, loop.time(), "connect")
                alt = None if retried else bal.pick(loop.time(), exclude=b)
                if alt is None:
                    return web.Response(status=502, text=f"backend unreachable: {e}\n")
                log.debug("retrying on %s after connect failure to %s", alt.url, b.url)
                self.m_retries.inc()
                retried = True
                b = alt
                continue
            except (aiohttp.ClientError, TimeoutError) as e:
                self._release(b)
                self._failed(b, loop.time(), "error")
                return web.Response(status=502, text=f"backend failed: {type(e).__name__}\n")
            break
        try:
            now = loop.time()
            self._upstream(b).observe(now - t1)
            self.m_latency.observe(now - t0)
            status = resp.status
            if status >= 500:
                self._failed(b, now, str(status))
            else:
                bal.on_success(b)
                self._count(b, str(status))
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
            ctype = resp.headers.get("Content-Type", "")
            if resp.content_length is not None and not ctype.startswith("text/event-stream"):
                data = await resp.read()
                return web.Response(status=status, body=data, headers=out_headers)
            out = web.StreamResponse(status=status, headers=out_headers)
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out
        except (aiohttp.ClientError, TimeoutError) as e:
            # the backend broke off mid-response: the client sees a truncated answer
            self._failed(b, loop.time(), "error")
            if request.transport is None or request.transport.is_closing():
                raise
            return web.Response(status=502, text=f"backend failed: {type(e).__name__}\n")
        finally:
            resp.release()
            self._release(b)

    def _upstream(self, b: Backend):
        h = self._children.get((b.key, ""))
        if h is None:
            h = self._children[(b.key, "")] = self.m_upstream.labels(b.key)
        return h

    def _release(self, b: Backend) -> None:
        b.inflight -= 1
        if b.draining and b.inflight == 0:
            self.bal.reap()

    def _failed(self, b: Backend, now: float, code: str) -> None:
        self._count(b, code)
        if self.bal.on_failure(b, now):
            self.m_ejections.labels(b.key).inc()
            log.warning("ejected %s after %d failure(s) (%s)", b.url, b.failures, code)


# -- processes ----------------------------------------------------------------------------------


def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still works
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def run_worker(
    cfg: RouterConfig, index: int = 0, *, stop: asyncio.Event | None = None
) -> None:
    """Run one router worker until ``stop`` is set (or SIGTERM/SIGINT when stop is None)."""
    router = Router(cfg)
    runner = web.AppRunner(
        router.app(), access_log=None, handle_signals=False, shutdown_timeout=cfg.drain_s
    )
    await runner.setup()
    await web.TCPSite(runner, cfg.host, cfg.port, reuse_port=True, backlog=4096).start()
    if cfg.admin_port:
        await web.TCPSite(runner, cfg.host, cfg.admin_port + index, reuse_port=False).start()
    log.info("router worker %d listening on %s:%d", index, cfg.host, cfg.port)
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def _worker_main(cfg: RouterConfig, index: int) -> None:
    _install_uvloop()
    asyncio.run(run_worker(cfg, index))


def serve(cfg: RouterConfig) -> None:
    """Run the router: ``cfg.workers`` processes on one port; returns when they all exit."""
    if cfg.workers <= 1:
        _worker_main(cfg, 0)
        return
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_worker_main, args=(cfg, i), daemon=True) for i in range(cfg.workers)
    ]
    for p in procs:
        p.start()

    def forward(signum, _frame):
        for p in procs:
            if p.pid and p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for p in procs:
        p.join()
