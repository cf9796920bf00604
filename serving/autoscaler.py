"""The autoscaler loop: measure load, decide (``serving.scaling``), act.

Every ``tick_s`` it measures total concurrency and demand, reads the workload's replica
status, calls the pure :func:`serving.scaling.decide` and, if the answer differs from the
current replica count, asks the actuator to scale. This module owns the I/O around the policy:

* :class:`LoadMeter` scrapes ``/metrics`` of the routers and/or the pods: concurrency
  (in flight), arrival rate (counters) and mean service time without queueing (the pods'
  counters), whose product, the demand, caps the scale-up signal so that a backlog piling up
  while pods cold-start does not buy pods up to the cap. If no target answers, the
  measurement is missing and the policy holds; if only some answer, their sums are scaled up
  by ``targets / answered``.
* Actuators: :class:`KubeDeploymentActuator` (the Deployment's ``scale`` subresource) and
  :class:`LocalPoolActuator` (processes on this machine, the embedded default used by
  ``serving up``; it also publishes its pods as endpoints, starting → ready → draining).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import shlex
import signal
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from serving.endpoints import Endpoint, EndpointStore
from serving.errors import ActuatorError, ConfigError
from serving.promtext import sum_samples
from serving.scaling import Observation, ScalerState, ScalingPolicy, decide

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaStatus:
    #: desired replicas currently set on the workload (spec)
    current: int
    ready: int
    starting: int


class Actuator(ABC):
    @abstractmethod
    async def status(self) -> ReplicaStatus: ...

    @abstractmethod
    async def scale(self, replicas: int) -> None: ...


# -- measurement --------------------------------------------------------------------------------


ROUTER_INFLIGHT = "serving_router_backend_inflight"
ROUTER_ARRIVALS = "serving_router_arrivals_total"
ROUTER_NAMES = frozenset({ROUTER_INFLIGHT, ROUTER_ARRIVALS})
POD_RUNNING = "vllm:num_requests_running"
POD_WAITING = "vllm:num_requests_waiting"
POD_SUCCESS = "vllm:request_success_total"
POD_WORK_SUM = "vllm:request_inference_time_seconds_sum"
POD_WORK_COUNT = "vllm:request_inference_time_seconds_count"
POD_NAMES = frozenset({POD_RUNNING, POD_WAITING, POD_SUCCESS, POD_WORK_SUM, POD_WORK_COUNT})


@dataclass(frozen=True)
class Load:
    """One tick's measurement (see :class:`LoadMeter`)."""

    #: total in-flight requests (running + queued), or None when no target answered
    concurrency: float | None
    #: offered load as concurrency, backlog excluded: arrival rate x mean service time
    demand: float | None = None
    arrival_rps: float | None = None
    #: mean time a request runs on a pod, queueing excluded
    service_s: float | None = None


class LoadMeter:
    """Concurrency and demand from the ``/metrics`` pages of routers and pods, once per tick.

    Concurrency
        With ``routers``: the sum of their ``serving_router_backend_inflight``; otherwise the
        pods' ``vllm:num_requests_running + vllm:num_requests_waiting``.
    Arrival rate (over the last ``rate_window_s``)
        With ``routers``: the rate of their ``serving_router_arrivals_total`` (every request
        the router was asked for, answered or not). Without: from the pods, as the rate of
        requests that entered them, ``request_success_total + running + waiting`` (what
        finished plus what is there now).
    Service time (queueing excluded)
        From the pods only, over the last ``service_window_s``: the increase of
        ``vllm:request_inference_time_seconds`` sum over its count (time spent running,
        prefill + decode), or, on a vLLM without that histogram, Little's law on the running
        stage: the integral of ``num_requests_running`` over the requests that finished.
        Routers cannot measure it: their request times include the queueing in the pods,
        and arrival rate x (service + queueing) is just the concurrency again. Time a request
        spends in a pod outside the engine (HTTP server, tokenizing) is not counted either;
        the policy's ``backlog_factor`` headroom (2x) absorbs it while it is smaller than
        the service time itself.

    Demand is arrival rate x service time, or None until both are known (the policy then uses
    concurrency alone). Targets that do not answer are left out, and sums are scaled by
    ``targets / answered``; counters are read as rates between two answers of the same target,
    and a counter that went down (a restart) is skipped for that tick. No target answering
    means the measurement is missing: the policy holds.
    """

    def __init__(
        self,
        pods: Callable[[], Sequence[str]],
        routers: Callable[[], Sequence[str]] | None = None,
        *,
        rate_window_s: float = 2.0,
        service_window_s: float = 30.0,
        timeout_s: float = 0.8,
    ) -> None:
        if rate_window_s <= 0 or service_window_s <= 0:
            raise ConfigError("rate_window_s and service_window_s must be positive")
        self.pods = pods
        self.routers = routers
        self.rate_window_s = rate_window_s
        self.service_window_s = service_window_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.session: aiohttp.ClientSession | None = None
        #: url -> (time, samples) of its answers within rate_window_s, oldest first (at least
        #: the last one)
        self._seen: dict[str, collections.deque[tuple[float, dict[str, float]]]] = {}
        #: (time, service seconds, completions) per tick, within service_window_s
        self._work: collections.deque[tuple[float, float, float]] = collections.deque()

    async def _scrape(self, url: str, names: frozenset[str]) -> dict[str, float] | None:
        try:
            async with self.session.get(url.rstrip("/") + "/metrics", timeout=self.timeout) as r:
                if r.status != 200:
                    return None
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            return None
        return sum_samples(text, names)

    async def measure(self) -> Load:
        if self.session is None:
            self.session = aiohttp.ClientSession()
        pods = list(self.pods())
        routers = list(self.routers()) if self.routers is not None else []
        got = await asyncio.gather(
            *(self._scrape(u, POD_NAMES) for u in pods),
            *(self._scrape(u, ROUTER_NAMES) for u in routers),
        )
        now = time.monotonic()
        pod_s = {u: s for u, s in zip(pods, got[: len(pods)], strict=True) if s is not None}
        router_s = {u: s for u, s in zip(routers, got[len(pods) :], strict=True) if s is not None}
        # a page without vLLM's gauges is not a pod's: as good as no answer
        pod_s = {u: s for u, s in pod_s.items() if POD_RUNNING in s or POD_WAITING in s}
        if routers:
            # a router with no backends has no inflight samples: that is 0
            concurrency = _scaled([s.get(ROUTER_INFLIGHT, 0.0) for s in router_s.values()], routers)
            arrivals = self._rate(router_s, routers, lambda s: s.get(ROUTER_ARRIVALS), now)
        else:
            concurrency = _scaled(
                [s.get(POD_RUNNING, 0.0) + s.get(POD_WAITING, 0.0) for s in pod_s.values()], pods
            )
            arrivals = self._rate(pod_s, pods, _entered, now)
        service = self._service(pod_s, now)
        for u, s in (*pod_s.items(), *router_s.items()):
            seen = self._seen.setdefault(u, collections.deque())
            seen.append((now, s))
            while len(seen) > 1 and seen[0][0] < now - self.rate_window_s:
                seen.popleft()
        for u in [u for u in self._seen if u not in pods and u not in routers]:
            del self._seen[u]  # gone: forget it
        demand = arrivals * service if arrivals is not None and service is not None else None
        return Load(concurrency, demand, arrivals, service)

    def _rate(
        self,
        answered: dict[str, dict[str, float]],
        targets: list[str],
        value: Callable[[dict[str, float]], float | None],
        now: float,
    ) -> float | None:
        """Per-second increase of ``value`` over about ``rate_window_s`` (not just since the
        last tick: ticks that come late must not turn into bursts), summed over the targets and
        scaled for the silent ones."""
        rates = []
        for u, s in answered.items():
            v, seen = value(s), self._seen.get(u)
            if v is None or not seen:
                continue
            t0, s0 = seen[0]
            v0, vp = value(s0), value(seen[-1][1])
            if v0 is None or vp is None or now <= t0:
                continue
            if v < vp or vp < v0:  # the counter went down: restarted, no rate until it has two
                seen.clear()
                continue
            rates.append((v - v0) / (now - t0))
        return _scaled(rates, targets)

    def _service(self, answered: dict[str, dict[str, float]], now: float) -> float | None:
        """Mean service time over the window, from the pods' counters."""
        work = done = 0.0
        for u, s in answered.items():
            seen = self._seen.get(u)
            if not seen:
                continue
            pt, ps = seen[-1]
            if POD_WORK_COUNT in s and POD_WORK_COUNT in ps:
                dn = s[POD_WORK_COUNT] - ps[POD_WORK_COUNT]
                dw = s.get(POD_WORK_SUM, 0.0) - ps.get(POD_WORK_SUM, 0.0)
            elif POD_SUCCESS in s and POD_SUCCESS in ps:
                dn = s[POD_SUCCESS] - ps[POD_SUCCESS]
                dw = (s.get(POD_RUNNING, 0.0) + ps.get(POD_RUNNING, 0.0)) / 2 * (now - pt)
            else:
                continue
            if dn < 0 or dw < 0:  # restarted
                continue
            work += dw
            done += dn
        w = self._work
        w.append((now, work, done))
        while w and w[0][0] <= now - self.service_window_s:
            w.popleft()
        total = sum(x[2] for x in w)
        return sum(x[1] for x in w) / total if total > 0 else None

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


def _entered(s: dict[str, float]) -> float | None:
    """Requests that ever entered a pod: finished ones plus those in it now."""
    if POD_SUCCESS not in s:
        return None
    return s[POD_SUCCESS] + s.get(POD_RUNNING, 0.0) + s.get(POD_WAITING, 0.0)


def _scaled(vals: list[float], targets: Sequence[str]) -> float | None:
    """The sum over the answering targets, scaled up for the silent ones; None if none."""
    if not vals:
        return None
    return sum(vals) * len(targets) / len(vals)


# -- the loop -----------------------------------------------------------------------------------


class Autoscaler:
    """Measure, decide, act, every ``tick_s``.

    ``meter`` is a :class:`LoadMeter` or any callable returning a :class:`Load`, a plain
    concurrency (float) or None (missing), possibly as a coroutine.
    """

    def __init__(
        self,
        policy: ScalingPolicy,
        meter: LoadMeter | Callable[[], object],
        actuator: Actuator,
        *,
        tick_s: float = 1.0,
        history: int = 3600,
    ) -> None:
        self.policy = policy
        self.meter = meter
        self.actuator = actuator
        self.tick_s = tick_s
        self.state = ScalerState()
        #: (time, concurrency, current, ready, desired, demand) per tick, for tests and status
        self.history: collections.deque = collections.deque(maxlen=history)

    async def _measure(self) -> Load:
        m = self.meter.measure() if isinstance(self.meter, LoadMeter) else self.meter()
        if asyncio.iscoroutine(m):
            m = await m
        return m if isinstance(m, Load) else Load(m)

    async def tick(self) -> int:
        loop = asyncio.get_running_loop()
        m = await self._measure()
        st = await self.actuator.status()
        obs = Observation(loop.time(), m.concurrency, st.current, st.ready, st.starting, m.demand)
        d = decide(self.policy, self.state, obs)
        self.state = d.state
        self.history.append((obs.now, m.concurrency, st.current, st.ready, d.desired, m.demand))
        if d.desired != st.current:
            log.info("scale %d -> %d (%s)", st.current, d.desired, d.reason)
            await self.actuator.scale(d.desired)
        return d.desired

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            try:
                await self.tick()
            except ActuatorError as e:
                log.warning("scaling failed: %s", e)
            next_at += self.tick_s
            await asyncio.sleep(max(0.0, next_at - loop.time()))


# -- actuators ----------------------------------------------------------------------------------


class KubeDeploymentActuator(Actuator):
    """Scales a Deployment through its ``scale`` subresource (official client, in a thread)."""

    def __init__(self, namespace: str, deployment: str, *, api_client=None) -> None:
        from kubernetes import client

        self.namespace = namespace
        self.deployment = deployment
        self.api = client.AppsV1Api(api_client)

    async def status(self) -> ReplicaStatus:
        def read():
            d = self.api.read_namespaced_deployment_status(self.deployment, self.namespace)
            spec = d.spec.replicas or 0
            ready = d.status.ready_replicas or 0
            exists = d.status.replicas or 0
            return ReplicaStatus(spec, ready, max(0, max(spec, exists) - ready))

        try:
            return await asyncio.to_thread(read)
        except Exception as e:
            raise ActuatorError(
                f"reading deployment {self.namespace}/{self.deployment}: {e}"
            ) from e

    async def scale(self, replicas: int) -> None:
        body = {"spec": {"replicas": replicas}}
        try:
            await asyncio.to_thread(
                self.api.patch_namespaced_deployment_scale, self.deployment, self.namespace, body
            )
        except Exception as e:
            raise ActuatorError(
                f"scaling deployment {self.namespace}/{self.deployment}: {e}"
            ) from e


class _Pod:
    __slots__ = ("port", "proc", "ready", "terminating", "url")

    def __init__(self, port: int, proc: subprocess.Popen, url: str) -> None:
        self.port = port
        self.proc = proc
        self.url = url
        self.ready = False
        self.terminating = False


class LocalPoolActuator(Actuator):
    """Runtime processes on this machine; each is a pod with its own port.

    ``command`` is an argv template; ``{port}`` and ``{host}`` are substituted. A pod is ready
    when ``GET /health`` answers 200. Scaling down drains the newest pods first: the pod is
    published as terminating, ``drain_notice_s`` later it gets SIGTERM (and finishes its
    in-flight requests), and it is forgotten when it exits.
    """

    def __init__(
        self,
        command: Sequence[str] | str,
        *,
        store: EndpointStore | None = None,
        host: str = "127.0.0.1",
        ports: Callable[[], int] | None = None,
        drain_notice_s: float = 1.0,
        stop_timeout_s: float = 30.0,
        health_poll_s: float = 0.2,
    ) -> None:
        self.command = shlex.split(command) if isinstance(command, str) else list(command)
        if not any("{port}" in a for a in self.command):
            raise ConfigError("the runtime command must contain {port}")
        self.store = store
        self.host = host
        self._ports = ports or _free_port
        self.drain_notice_s = drain_notice_s
        self.stop_timeout_s = stop_timeout_s
        self.health_poll_s = health_poll_s
        self.pods: list[_Pod] = []
        self._tasks: set[asyncio.Task] = set()
        self._session: aiohttp.ClientSession | None = None

    async def status(self) -> ReplicaStatus:
        live = [p for p in self.pods if not p.terminating]
        ready = sum(1 for p in live if p.ready)
        return ReplicaStatus(len(live), ready, len(live) - ready)

    async def scale(self, replicas: int) -> None:
        live = [p for p in self.pods if not p.terminating]
        for _ in range(replicas - len(live)):
            self._start()
        if replicas < len(live):
            # newest (and not-yet-ready) pods go first
            victims = sorted(live, key=lambda p: (p.ready, -self.pods.index(p)))[
                : len(live) - replicas
            ]
            for p in victims:
                p.terminating = True
                self._spawn(self._stop_pod(p))
        self._publish()

    def _spawn(self, coro) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _start(self) -> None:
        port = self._ports()
        argv = [a.format(port=port, host=self.host) for a in self.command]
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        except OSError as e:
            raise ActuatorError(f"cannot start {argv[0]}: {e}") from e
        pod = _Pod(port, proc, f"http://{self.host}:{port}")
        self.pods.append(pod)
        log.info("started pod %s (pid %d)", pod.url, proc.pid)
        self._spawn(self._wait_ready(pod))

    async def _wait_ready(self, pod: _Pod) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        timeout = aiohttp.ClientTimeout(total=1.0)
        while not pod.terminating and pod.proc.poll() is None:
            try:
                async with self._session.get(pod.url + "/health", timeout=timeout) as r:
                    if r.status == 200:
                        pod.ready = True
                        log.info("pod %s ready", pod.url)
                        self._publish()
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(self.health_poll_s)
        if pod.proc.poll() is not None and not pod.terminating:
            log.warning("pod %s exited with %s before it was ready", pod.url, pod.proc.returncode)
            self.pods.remove(pod)
            self._publish()

    async def _stop_pod(self, pod: _Pod) -> None:
        self._publish()
        if pod.ready:
            await asyncio.sleep(self.drain_notice_s)  # let routers stop sending to it first
        if pod.proc.poll() is None:
            pod.proc.send_signal(signal.SIGTERM)
        for _ in range(int(self.stop_timeout_s / 0.05)):
            if pod.proc.poll() is not None:
                break
            await asyncio.sleep(0.05)
        else:
            log.warning("pod %s did not stop in %.0fs; killing it", pod.url, self.stop_timeout_s)
            pod.proc.kill()
            await asyncio.to_thread(pod.proc.wait)
        if pod in self.pods:
            self.pods.remove(pod)
        log.info("pod %s stopped", pod.url)
        self._publish()

    def endpoints(self) -> list[Endpoint]:
        return [Endpoint(p.url, "local", p.ready, p.terminating) for p in self.pods]

    def _publish(self) -> None:
        if self.store is not None:
            self.store.update(self.endpoints())

    async def close(self) -> None:
        """Stop every pod (drain notice skipped) and wait for them."""
        for p in self.pods:
            p.terminating = True
            p.ready = False
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(self._stop_pod(p) for p in list(self.pods)), return_exceptions=True)
        if self._session is not None:
            await self._session.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_runtime_command() -> list[str]:
    """The emulated vLLM backend, for ``serving up`` on a machine without a GPU."""
    import sys

    return [sys.executable, "-m", "serving.fakebackend", "--port", "{port}", "--host", "{host}"]


__all__ = [
    "Actuator",
    "Autoscaler",
    "KubeDeploymentActuator",
    "Load",
    "LoadMeter",
    "LocalPoolActuator",
    "ReplicaStatus",
    "default_runtime_command",
]
