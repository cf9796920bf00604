"""The router: a stateless reverse proxy for OpenAI-style requests, P2C on in-flight load.

HTTP stack
    The proxy path is raw asyncio Protocols on uvloop (:mod:`serving.wire.proxy`) with a small
    HTTP/1.1 framer of our own (:mod:`serving.wire.http1`): keep-alive on both sides, pooled
    backend connections, Content-Length and chunked bodies, responses streamed through as
    they arrive (server-sent events untouched). aiohttp, which this used to be built on, cost
    0.6-0.8 ms of CPU per proxied request on the benchmark machine (client and server request
    objects, header multidicts, stream readers, a task per request); the Protocol path does
    the same exchange in ~0.1 ms, without a task, future or timer per request
    (``benchmarks/serving/README.md``). aiohttp is kept where nothing is hot: the
    EDS client. The load-report scraper reads ``/metrics`` on a kept-alive raw connection
    (:mod:`serving.fetch`): through aiohttp it cost ~10% of the router's CPU at 2,000
    requests/s. Throughput scales by process: :func:`serve`
    starts one worker per core on the same port (``SO_REUSEPORT``), and the kernel spreads
    connections among them.

Per request
    The body is read whole (prompts are small), a backend is chosen by
    :class:`~serving.balancer.Balancer` (power of two choices on in-flight requests combined
    with staleness-weighted load reports scraped from each backend's ``/metrics``), and the
    request is forwarded on a pooled connection. If the connection to the backend cannot be
    established, no byte has reached it, so the request is retried once on another backend;
    if a pooled connection turns out closed by the backend before any byte of an answer (its
    idle timeout crossed the request), the request goes again on a new connection.
    Any other failure (the backend dropped the connection, timed out, answered 5xx) may have
    been seen by the backend and is not retried; it counts as a failure for ejection, and the
    client gets the backend's answer, a 502 (504 after ``request_timeout_s``), or, if the
    answer had begun, a truncated one.

Membership
    Static ``--backends`` or the EDS stream (``--eds``). Endpoints that are not ready,
    terminating, or gone are *draining*: no new requests, in-flight ones finish, then the
    backend is forgotten and its idle connections are closed.

Metrics (``GET /metrics``; with several workers, each also on ``admin_port + index``)
    ``serving_router_backend_inflight``, ``..._backend_reported_load``,
    ``..._backend_ejected``, ``..._backend_draining`` (read from balancer state at scrape time),
    ``serving_router_arrivals_total`` (proxied requests received: the autoscaler's arrival
    rate), ``serving_router_requests_total{backend,code}``, ``serving_router_request_seconds`` and
    ``serving_router_upstream_seconds{backend}`` histograms, ``serving_router_retries_total``,
    ``serving_router_resent_total`` (sent again on a new connection: a stale pooled one),
    ``serving_router_ejections_total{backend}``, ``serving_router_no_backend_total``. Requests
    update plain integers (:class:`RouterStats`); the Prometheus objects are built only when
    scraped.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import time
from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiohttp
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from serving.balancer import Backend, Balancer, BalancerConfig, begin_report, record_report
from serving.discovery import follow_eds
from serving.endpoints import Endpoint, normalize_url
from serving.fetch import FetchError, Getter
from serving.promtext import vllm_load
from serving.wire.http1 import RequestHead, ResponseHead
from serving.wire.proxy import ClientConn, Dispatcher, Pool, local_response

log = logging.getLogger(__name__)

# Latency buckets (s): the router adds well under a millisecond; vLLM requests take 10s-1000s ms.
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# How often timeouts, idle connections and drained backends are looked after.
_SWEEP_S = 0.25
_CTYPE_METRICS = CONTENT_TYPE_LATEST.encode()


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    host: str = "127.0.0.1"
    #: 0 = any free port (``Router.port`` tells which)
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
    #: idle client keep-alive connections (and clients that never finish a request head) are
    #: closed after this long
    keepalive_s: float = 30.0
    #: idle backend connections are closed after this long: under the 5 s keep-alive timeout
    #: of uvicorn (vLLM's server), so the router, not the backend, closes idle connections
    #: and a request never races a backend's close
    upstream_idle_s: float = 4.0
    #: seconds to let in-flight requests finish on SIGTERM
    drain_s: float = 30.0


class _Hist:
    """A histogram of plain counters; exported by :class:`_Collector`."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(_BUCKETS) + 1)
        self.total = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(_BUCKETS, v)] += 1
        self.total += v

    def buckets(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for le, c in zip((*(str(b) for b in _BUCKETS), "+Inf"), self.counts, strict=True):
            acc += c
            out.append((le, acc))
        return out


class RouterStats:
    """Per-request counters of one router worker (plain numbers: no locks, no objects)."""

    def __init__(self) -> None:
        #: (backend key, status code or failure kind) -> requests
        self.requests: dict[tuple[str, int | str], int] = {}
        self.latency = _Hist()
        self.upstream: dict[str, _Hist] = {}
        #: proxied requests asked for (``/v1/``), answered or not: the arrival counter
        self.arrivals = 0
        self.retries = 0
        #: requests sent again on a new connection after a stale pooled one
        self.resent = 0
        self.no_backend = 0
        self.ejections: dict[str, int] = {}


class _Collector:
    """Builds the Prometheus metrics from router state when scraped."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self):
        now = time.monotonic()
        bal, st = self.router.bal, self.router.stats
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
        for b in list(bal.backends.values()):
            inflight.add_metric([b.key], b.inflight)
            if b.reported is not None:
                reported.add_metric([b.key], b.reported)
            ejected.add_metric([b.key], 1.0 if b.ejected_until > now else 0.0)
            draining.add_metric([b.key], 1.0 if b.draining else 0.0)
        yield from (inflight, reported, ejected, draining)
        requests = CounterMetricFamily(
            "serving_router_requests", "Requests by backend and status", labels=["backend", "code"]
        )
        for (key, code), n in list(st.requests.items()):
            requests.add_metric([key, str(code)], n)
        yield requests
        latency = HistogramMetricFamily(
            "serving_router_request_seconds", "Time to answer headers, retries included"
        )
        latency.add_metric([], st.latency.buckets(), st.latency.total)
        yield latency
        upstream = HistogramMetricFamily(
            "serving_router_upstream_seconds",
            "Backend time to response headers",
            labels=["backend"],
        )
        for key, h in list(st.upstream.items()):
            upstream.add_metric([key], h.buckets(), h.total)
        yield upstream
        yield CounterMetricFamily(
            "serving_router_arrivals", "Proxied requests received", value=st.arrivals
        )
        yield CounterMetricFamily(
            "serving_router_retries", "Requests retried on another backend", value=st.retries
        )
        yield CounterMetricFamily(
            "serving_router_resent",
            "Requests sent again after the backend closed a pooled connection",
            value=st.resent,
        )
        ejections = CounterMetricFamily(
            "serving_router_ejections", "Backends ejected after failures", labels=["backend"]
        )
        for key, n in list(st.ejections.items()):
            ejections.add_metric([key], n)
        yield ejections
        yield CounterMetricFamily(
            "serving_router_no_backend", "Requests refused: no backend", value=st.no_backend
        )


class Router(Dispatcher):
    """One router worker: the balancer, the backend pools, the listeners, the metrics.

    ``await Router(cfg).start()`` listens; ``await router.stop()`` drains and closes.
    """

    def __init__(self, cfg: RouterConfig, *, balancer: Balancer | None = None) -> None:
        self.cfg = cfg
        self.bal = balancer or Balancer(cfg.balancer)
        self.stats = RouterStats()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_Collector(self))
        self.connect_timeout_s = cfg.connect_timeout_s
        self.draining = False
        self.conns: set[ClientConn] = set()
        self.pools: dict[str, Pool] = {}
        self.port = cfg.port
        self.session: aiohttp.ClientSession | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._tasks: list[asyncio.Task] = []
        self._scraped: dict[str, asyncio.Task] = {}

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self, index: int = 0) -> Router:
        cfg = self.cfg
        self.loop = loop = asyncio.get_running_loop()
        for url in cfg.backends:
            self.bal.add(normalize_url(url))
        server = await loop.create_server(
            lambda: ClientConn(self), cfg.host, cfg.port, reuse_port=True, backlog=4096
        )
        self._servers.append(server)
        self.port = server.sockets[0].getsockname()[1]
        if cfg.admin_port:
            self._servers.append(
                await loop.create_server(
                    lambda: ClientConn(self, admin=True), cfg.host, cfg.admin_port + index
                )
            )
        if cfg.eds_url:
            self.session = aiohttp.ClientSession(skip_auto_headers=("User-Agent",))
        if cfg.eds_url:
            self._tasks.append(
                asyncio.ensure_future(
                    follow_eds(cfg.eds_url, self.apply_endpoints, session=self.session)
                )
            )
        self._tasks.append(asyncio.ensure_future(self._housekeeping()))
        return self

    async def stop(self, drain_s: float | None = None) -> None:
        """Stop listening, let requests in flight finish (up to ``drain_s``), close all."""
        drain_s = self.cfg.drain_s if drain_s is None else drain_s
        self.draining = True
        for s in self._servers:
            s.close()
        for c in list(self.conns):
            if not c.busy:
                c.transport.close()
        deadline = time.monotonic() + drain_s
        while any(c.busy for c in self.conns) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for c in list(self.conns):
            c.transport.abort()
        for t in [*self._tasks, *self._scraped.values()]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._scraped.values(), return_exceptions=True)
        for p in self.pools.values():
            p.close()
        self.pools.clear()
        if self.session is not None:
            await self.session.close()
        await asyncio.sleep(0)  # let transports finish closing

    def apply_endpoints(self, version: int, endpoints: Iterable[Endpoint]) -> None:
        eps = list(endpoints)
        ready = [(e.url, e.zone) for e in eps if e.serving]
        self.bal.set_endpoints(ready, [e.url for e in eps if not e.serving])
        self._close_pools()
        log.info(
            "endpoints v%d: %d serving, %d draining", version, len(ready), len(eps) - len(ready)
        )

    def _close_pools(self) -> None:
        """Close the pools of backends the balancer has forgotten."""
        for url in [u for u in self.pools if u not in self.bal.backends]:
            self.pools.pop(url).close()

    def _reap(self) -> None:
        if self.bal.reap():
            self._close_pools()

    async def _housekeeping(self) -> None:
        """Timeouts, idle connections, drained backends, one load scraper per backend."""
        cfg = self.cfg
        while True:
            self._reap()
            if cfg.scrape_interval_s > 0:
                for url in list(self._scraped):
                    if url not in self.bal.backends:
                        self._scraped.pop(url).cancel()
                for url, b in self.bal.backends.items():
                    if url not in self._scraped:
                        self._scraped[url] = asyncio.ensure_future(self._scrape(b))
            now = time.monotonic()
            late = now - cfg.request_timeout_s
            idle = now - cfg.keepalive_s
            for c in list(self.conns):
                if c.busy:
                    if c.backend is not None and c.t0 < late:
                        log.warning("request to %s timed out", c.backend.url)
                        c.timeout()
                elif c.idle_since < idle:
                    c.transport.close()
            idle = now - cfg.upstream_idle_s
            for p in self.pools.values():
                p.expire(idle)
            await asyncio.sleep(_SWEEP_S)

    async def _scrape(self, b: Backend) -> None:
        netloc = b.url.split("://", 1)[-1]
        host, _, port = netloc.rpartition(":")
        getter = Getter(host.strip("[]"), int(port), "/metrics", netloc)
        timeout = max(1.0, self.cfg.scrape_interval_s * 2)
        try:
            while True:
                try:
                    begin_report(b)
                    status, body = await getter.get(timeout)
                    if status == 200:
                        load = vllm_load(body.decode())
                        if load is not None:
                            own = max(b.peak, b.inflight)
                            record_report(b, load, time.monotonic(), own=own)
                except (FetchError, UnicodeDecodeError):
                    pass  # a missing report ages out; passive health acts on real traffic only
                await asyncio.sleep(self.cfg.scrape_interval_s)
        finally:
            getter.close()

    # -- the data path's questions (serving.wire.proxy.Dispatcher) ---------------------------------

    def dispatch(self, conn: ClientConn, req: RequestHead, body: bytes) -> None:
        path = req.path
        if path.startswith(b"/v1/") and not conn.admin:
            self.stats.arrivals += 1
            now = conn.t0 = time.monotonic()
            b = self.bal.pick(now)
            if b is None:
                self.stats.no_backend += 1
                self._answer(conn, 503, b"no backend available\n")
                return
            conn.prepare(req, body)
            self._send(conn, b)
        elif path == b"/metrics" and req.method in (b"GET", b"HEAD"):
            self._answer(conn, 200, generate_latest(self.registry), _CTYPE_METRICS)
        elif path == b"/healthz" and req.method in (b"GET", b"HEAD"):
            self._answer(conn, 200, b"ok\n")
        else:
            self._answer(conn, 404, b"not found\n")

    def _answer(
        self, conn: ClientConn, status: int, body: bytes, ctype: bytes = b"text/plain"
    ) -> None:
        conn.reply(
            local_response(
                status,
                body,
                ctype=ctype,
                close=not conn.keep_alive or self.draining,
                head_only=conn.head_request,
            )
        )

    def _send(self, conn: ClientConn, b: Backend) -> None:
        n = b.inflight = b.inflight + 1  # balancer.note_sent, inlined on the hot path
        if n > b.peak:
            b.peak = n
        pool = self.pools.get(b.url)
        if pool is None:
            pool = self.pools[b.url] = Pool(b.url)
        conn.send(b, pool)

    def connect_failed(self, conn: ClientConn, backend: Backend, exc: BaseException) -> None:
        now = time.monotonic()
        self._failed(backend, now, "connect")
        alt = None if conn.retried else self.bal.pick(now, exclude=backend)
        if alt is None:
            msg = f"backend unreachable: {type(exc).__name__}: {exc}\n"
            self._answer(conn, 502, msg.encode())
            return
        log.debug("retrying on %s after connect failure to %s", alt.url, backend.url)
        self.stats.retries += 1
        conn.retried = True
        self._send(conn, alt)

    def on_head(self, conn: ClientConn, resp: ResponseHead, now: float) -> None:
        b = conn.backend
        st = self.stats
        h = st.upstream.get(b.key)
        if h is None:
            h = st.upstream[b.key] = _Hist()
        h.observe(now - conn.t1)
        st.latency.observe(now - conn.t0)
        status = resp.status
        if status >= 500:
            self._failed(b, now, status)
        else:
            b.failures = 0  # Balancer.on_success, inlined on the hot path
            key = (b.key, status)
            st.requests[key] = st.requests.get(key, 0) + 1

    def on_error(self, conn: ClientConn, kind: str, now: float) -> None:
        self._failed(conn.backend, now, kind)

    def on_resend(self, conn: ClientConn) -> None:
        self.stats.resent += 1
        log.debug("resending on a new connection to %s (stale pooled one)", conn.backend.url)

    def release(self, conn: ClientConn) -> None:
        b = conn.backend
        conn.backend = None
        b.inflight -= 1
        if b.draining and b.inflight == 0:
            self._reap()

    def conn_closed(self, conn: ClientConn) -> None:
        self.conns.discard(conn)

    def _failed(self, b: Backend, now: float, code: int | str) -> None:
        st = self.stats
        key = (b.key, code)
        st.requests[key] = st.requests.get(key, 0) + 1
        if self.bal.on_failure(b, now):
            st.ejections[b.key] = st.ejections.get(b.key, 0) + 1
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
    router = await Router(cfg).start(index)
    log.info("router worker %d listening on %s:%d", index, cfg.host, cfg.port)
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await router.stop(cfg.drain_s)


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
