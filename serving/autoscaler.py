"""The autoscaler loop: measure concurrency, decide (``serving.scaling``), act.

Every ``tick_s`` it measures total concurrency, reads the workload's replica status, calls the
pure :func:`serving.scaling.decide` and, if the answer differs from the current replica count,
asks the actuator to scale. This module owns the I/O around the policy:

* :class:`ConcurrencyMeter` scrapes ``/metrics`` of the pods (vLLM ``num_requests_running +
  num_requests_waiting``) or of the routers (``serving_router_backend_inflight``) and sums
  them. If no target answers, the measurement is missing (``None``) and the policy holds; if
  only some answer, their sum is scaled up by ``targets / answered``.
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
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from serving.endpoints import Endpoint, EndpointStore
from serving.errors import ActuatorError, ConfigError
from serving.promtext import sum_samples, vllm_load
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


ROUTER_INFLIGHT = frozenset({"serving_router_backend_inflight"})


class ConcurrencyMeter:
    """Total in-flight requests from pod or router ``/metrics`` pages."""

    def __init__(
        self,
        targets: Callable[[], Sequence[str]],
        *,
        kind: str = "pods",
        timeout_s: float = 0.8,
    ) -> None:
        if kind not in ("pods", "routers"):
            raise ConfigError("meter kind must be 'pods' or 'routers'")
        self.targets = targets
        self.kind = kind
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.session: aiohttp.ClientSession | None = None

    async def _one(self, url: str) -> float | None:
        try:
            async with self.session.get(url.rstrip("/") + "/metrics", timeout=self.timeout) as r:
                if r.status != 200:
                    return None
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            return None
        if self.kind == "pods":
            return vllm_load(text)
        s = sum_samples(text, ROUTER_INFLIGHT)
        return s.get("serving_router_backend_inflight")

    async def measure(self) -> float | None:
        if self.session is None:
            self.session = aiohttp.ClientSession()
        urls = list(self.targets())
        if not urls:
            return None
        vals = [v for v in await asyncio.gather(*(self._one(u) for u in urls)) if v is not None]
        if not vals:
            return None
        return sum(vals) * len(urls) / len(vals)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


# -- the loop -----------------------------------------------------------------------------------


class Autoscaler:
    def __init__(
        self,
        policy: ScalingPolicy,
        meter: ConcurrencyMeter | Callable[[], object],
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
        #: (time, concurrency, current, ready, desired) per tick, for tests and status
        self.history: collections.deque = collections.deque(maxlen=history)

    async def _measure(self) -> float | None:
        m = self.meter.measure() if isinstance(self.meter, ConcurrencyMeter) else self.meter()
        if asyncio.iscoroutine(m):
            m = await m
        return m

    async def tick(self) -> int:
        loop = asyncio.get_running_loop()
        c = await self._measure()
        st = await self.actuator.status()
        d = decide(
            self.policy, self.state, Observation(loop.time(), c, st.current, st.ready, st.starting)
        )
        self.state = d.state
        self.history.append((loop.time(), c, st.current, st.ready, d.desired))
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
    "ConcurrencyMeter",
    "KubeDeploymentActuator",
    "LocalPoolActuator",
    "ReplicaStatus",
    "default_runtime_command",
]
