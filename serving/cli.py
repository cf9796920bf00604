"""``serving``: the router, the EDS, the autoscaler, and all of them at once (``serving up``).

Options become frozen config objects here and nowhere else; errors derived from
``ServingError`` become one line, ``serving: error: <Type>: <message>``, and exit code 3, as
in every lazyblock command (``lazyblock.cli``).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
from collections.abc import Awaitable, Callable

import click
from aiohttp import web

from lazyblock.cli import ToolGroup
from serving.autoscaler import (
    Autoscaler,
    KubeDeploymentActuator,
    LoadMeter,
    LocalPoolActuator,
    default_runtime_command,
)
from serving.balancer import BalancerConfig
from serving.discovery import EndpointSource, FileSource, StaticSource, make_eds_app
from serving.endpoints import Endpoint, EndpointStore, normalize_url
from serving.errors import ConfigError, ServingError
from serving.router import RouterConfig, _install_uvloop, serve
from serving.scaling import ScalingPolicy

log = logging.getLogger("serving")


def _hostport(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"expected HOST:PORT, got {value!r}")
    return host or "127.0.0.1", int(port)


def _urls(value: str | None) -> tuple[str, ...]:
    if not value:
        return ()
    return tuple(normalize_url(u) for u in value.split(",") if u.strip())


def _nsname(value: str) -> tuple[str, str]:
    ns, sep, name = value.partition("/")
    if not sep or not ns or not name:
        raise ConfigError(f"expected NAMESPACE/NAME, got {value!r}")
    return ns, name


def _run(main: Callable[[], Awaitable[None]]) -> None:
    """Run ``main`` on uvloop until it returns or SIGTERM/SIGINT arrives."""
    _install_uvloop()

    async def wrapper():
        task = asyncio.ensure_future(main())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            pass

    asyncio.run(wrapper())


@click.group("serving", cls=ToolGroup, errors=(ServingError,))
@click.option("-v", "--verbose", count=True, help="More logging (-vv for debug).")
def main(verbose: int) -> None:
    """lazyblock serving: EDS, router and autoscaler for vLLM pods."""
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(
        level=max(level, logging.DEBUG), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )


# -- router -------------------------------------------------------------------------------------


@main.command()
@click.option("--listen", required=True, help="HOST:PORT to serve on.")
@click.option("--backends", help="Comma-separated backend URLs (static membership).")
@click.option("--eds", "eds_url", help="EDS base URL to follow for membership.")
@click.option(
    "--workers",
    type=int,
    default=1,
    show_default=True,
    help="Processes (SO_REUSEPORT); one per core.",
)
@click.option(
    "--admin-port", type=int, default=0, help="Worker i also serves /metrics on this port + i."
)
@click.option(
    "--scrape-interval",
    type=float,
    default=0.5,
    show_default=True,
    help="Backend /metrics poll, s.",
)
@click.option(
    "--zone", help="This router's zone: prefer same-zone endpoints (from the EDS) while healthy."
)
@click.option("--report-half-life", type=float, default=1.0, show_default=True)
@click.option("--eject-base", type=float, default=1.0, show_default=True)
@click.option("--eject-max", type=float, default=30.0, show_default=True)
@click.option("--connect-timeout", type=float, default=1.0, show_default=True)
@click.option("--request-timeout", type=float, default=300.0, show_default=True)
def router(
    listen,
    backends,
    eds_url,
    workers,
    admin_port,
    scrape_interval,
    zone,
    report_half_life,
    eject_base,
    eject_max,
    connect_timeout,
    request_timeout,
):
    """Reverse proxy for OpenAI-style requests, power of two choices on in-flight load."""
    host, port = _hostport(listen)
    if not backends and not eds_url:
        raise ConfigError("give --backends or --eds")
    cfg = RouterConfig(
        host=host,
        port=port,
        backends=_urls(backends),
        eds_url=eds_url,
        workers=max(1, workers),
        admin_port=admin_port,
        scrape_interval_s=scrape_interval,
        connect_timeout_s=connect_timeout,
        request_timeout_s=request_timeout,
        balancer=BalancerConfig(
            report_half_life_s=report_half_life,
            eject_base_s=eject_base,
            eject_max_s=eject_max,
            zone=zone or None,
        ),
    )
    serve(cfg)


# -- EDS ----------------------------------------------------------------------------------------


def _source(backends, file, kube_service, port_name, kubeconfig) -> EndpointSource:
    given = [x for x in (backends, file, kube_service) if x]
    if len(given) != 1:
        raise ConfigError("give exactly one of --backends, --file, --kube-service")
    if backends:
        return StaticSource(Endpoint(u) for u in _urls(backends))
    if file:
        return FileSource(file)
    from serving.kube import EndpointSliceSource, KubeConfig

    ns, svc = _nsname(kube_service)
    return EndpointSliceSource(
        KubeConfig(namespace=ns, service=svc, port_name=port_name, kubeconfig=kubeconfig)
    )


async def _serve_app(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


@main.command()
@click.option("--listen", required=True, help="HOST:PORT to serve the endpoint stream on.")
@click.option("--backends", help="Static comma-separated endpoint URLs.")
@click.option("--file", type=click.Path(dir_okay=False), help="Endpoint file to watch.")
@click.option("--kube-service", help="NAMESPACE/SERVICE whose EndpointSlices to watch.")
@click.option("--port-name", help="EndpointSlice port name (default: the first port).")
@click.option(
    "--kubeconfig",
    type=click.Path(dir_okay=False),
    help="Default: in-cluster, then ~/.kube/config.",
)
def eds(listen, backends, file, kube_service, port_name, kubeconfig):
    """Endpoint Discovery Service: serve the live endpoint set as a stream."""
    host, port = _hostport(listen)
    source = _source(backends, file, kube_service, port_name, kubeconfig)

    async def run():
        store = EndpointStore()
        runner = await _serve_app(make_eds_app(store), host, port)
        try:
            await source.run(store)
            await asyncio.Event().wait()  # static sources return at once
        finally:
            await runner.cleanup()

    _run(run)


# -- autoscaler ---------------------------------------------------------------------------------


def _policy_options(f):
    opts = [
        click.option(
            "--target-per-pod",
            type=float,
            required=True,
            help="Sustainable concurrency of one pod.",
        ),
        click.option("--min-replicas", type=int, default=1, show_default=True),
        click.option("--max-replicas", type=int, default=64, show_default=True),
        click.option("--up-window", type=float, default=6.0, show_default=True),
        click.option("--down-window", type=float, default=120.0, show_default=True),
        click.option("--stabilization", type=float, default=300.0, show_default=True),
        click.option("--tick", type=float, default=1.0, show_default=True),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _policy(kw) -> ScalingPolicy:
    return ScalingPolicy(
        target_per_pod=kw["target_per_pod"],
        min_replicas=kw["min_replicas"],
        max_replicas=kw["max_replicas"],
        up_window_s=kw["up_window"],
        down_window_s=kw["down_window"],
        stabilization_s=kw["stabilization"],
    )


@main.command()
@_policy_options
@click.option("--kube-deployment", help="NAMESPACE/DEPLOYMENT to scale (scale subresource).")
@click.option("--kube-service", help="NAMESPACE/SERVICE whose pods to measure (EndpointSlices).")
@click.option("--routers", help="Comma-separated router admin URLs to measure instead of pods.")
@click.option(
    "--runtime-command", help="Local pool: runtime argv with {port} (default: emulated vLLM)."
)
@click.option("--kubeconfig", type=click.Path(dir_okay=False))
def autoscaler(kube_deployment, kube_service, routers, runtime_command, kubeconfig, **kw):
    """Scale runtime pods on concurrency and demand: up fast, down slowly (local pool by default).

    Concurrency and arrival rate come from the routers (--routers: every worker's metrics URL)
    or else the pods; the service time that turns the arrival rate into demand always comes
    from the pods (--kube-service, or the local pool)."""
    policy = _policy(kw)

    async def run():
        store = EndpointStore()
        tasks = []
        if kube_deployment:
            from serving.kube import EndpointSliceSource, KubeConfig, _api_client

            ns, name = _nsname(kube_deployment)
            kcfg = KubeConfig(namespace=ns, service=name, kubeconfig=kubeconfig)
            actuator = KubeDeploymentActuator(ns, name, api_client=_api_client(kcfg))
            if kube_service:
                sns, svc = _nsname(kube_service)
                src = EndpointSliceSource(
                    KubeConfig(namespace=sns, service=svc, kubeconfig=kubeconfig)
                )
                tasks.append(asyncio.ensure_future(src.run(store)))
            elif not routers:
                raise ConfigError(
                    "with --kube-deployment, give --kube-service or --routers to measure"
                )
        else:
            actuator = LocalPoolActuator(runtime_command or default_runtime_command(), store=store)
            await actuator.scale(policy.min_replicas)
        # pods give the service time (and, without routers, everything); routers, when
        # given, the concurrency and arrival rate of all traffic
        urls = _urls(routers) if routers else ()
        meter = LoadMeter(
            lambda: [e.url for e in store.endpoints if e.serving],
            (lambda: urls) if routers else None,
        )
        scaler = Autoscaler(policy, meter, actuator, tick_s=kw["tick"])
        try:
            await scaler.run()
        finally:
            for t in tasks:
                t.cancel()
            if isinstance(actuator, LocalPoolActuator):
                await actuator.close()
            await meter.close()

    _run(run)


# -- everything ---------------------------------------------------------------------------------


@main.command()
@click.option("--listen", default="127.0.0.1:8080", show_default=True, help="Router HOST:PORT.")
@click.option("--eds-listen", default="127.0.0.1:8070", show_default=True, help="EDS HOST:PORT.")
@click.option("--workers", type=int, default=1, show_default=True, help="Router processes.")
@click.option("--runtime-command", help="Runtime argv with {port} (default: emulated vLLM).")
@_policy_options
def up(listen, eds_listen, workers, runtime_command, **kw):
    """The whole stack on this machine: local pod pool, EDS, autoscaler, router."""
    policy = _policy(kw)
    rhost, rport = _hostport(listen)
    ehost, eport = _hostport(eds_listen)
    eds_url = f"http://{ehost}:{eport}"
    rcfg = RouterConfig(host=rhost, port=rport, eds_url=eds_url, workers=max(1, workers))

    async def run():
        store = EndpointStore()
        pool = LocalPoolActuator(runtime_command or default_runtime_command(), store=store)
        runner = await _serve_app(make_eds_app(store), ehost, eport)
        await pool.scale(policy.min_replicas)
        router_proc = multiprocessing.get_context("spawn").Process(
            target=serve, args=(rcfg,), daemon=False
        )
        router_proc.start()
        meter = LoadMeter(lambda: [e.url for e in store.endpoints if e.serving])
        scaler = Autoscaler(policy, meter, pool, tick_s=kw["tick"])
        log.warning("serving up: router on %s, EDS on %s", listen, eds_url)
        try:
            await scaler.run()
        finally:
            if router_proc.is_alive():
                router_proc.terminate()
            await asyncio.to_thread(router_proc.join, 30)
            await pool.close()
            await meter.close()
            await runner.cleanup()

    _run(run)


@main.command(context_settings={"ignore_unknown_options": True}, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def backend(args):
    """Run the emulated vLLM backend (see serving.fakebackend --help)."""
    from serving import fakebackend

    fakebackend.main(list(args))


if __name__ == "__main__":
    main()
