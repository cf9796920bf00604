"""The autoscaler loop against the local process pool: a 10x ramp of real traffic."""

from __future__ import annotations

import asyncio
import math
import sys
import time

import aiohttp
import pytest
from aiohttp import web
from servinghelp import AppServer, post, run

from serving.autoscaler import (
    Autoscaler,
    Load,
    LoadMeter,
    LocalPoolActuator,
    ReplicaStatus,
)
from serving.discovery import make_eds_app
from serving.endpoints import EndpointStore
from serving.errors import ConfigError
from serving.fakebackend import BackendConfig, make_backend_app
from serving.router import Router, RouterConfig
from serving.scaling import ScalingPolicy


class FakeActuator:
    def __init__(self, current: int) -> None:
        self.current = current
        self.calls: list[int] = []

    async def status(self) -> ReplicaStatus:
        return ReplicaStatus(self.current, self.current, 0)

    async def scale(self, n: int) -> None:
        self.calls.append(n)
        self.current = n


def test_loop_holds_when_metrics_missing():
    async def main():
        act = FakeActuator(3)
        a = Autoscaler(ScalingPolicy(target_per_pod=1), lambda: None, act)
        for _ in range(5):
            assert await a.tick() == 3
        assert act.calls == []

    run(main())


def test_meter_missing_when_nothing_answers():
    async def main():
        m = LoadMeter(lambda: ["http://127.0.0.1:9"], timeout_s=0.5)
        assert await m.measure() == Load(None)
        m2 = LoadMeter(lambda: [], lambda: ["http://127.0.0.1:9"], timeout_s=0.5)
        assert await m2.measure() == Load(None)
        await m.close()
        await m2.close()

    run(main())


async def _timed_measure(m: LoadMeter) -> tuple[float, Load, float]:
    t0 = time.monotonic()
    load = await m.measure()
    return t0, load, time.monotonic()


def test_meter_measures_arrivals_and_service_time_through_a_router():
    """Arrival rate from the router's counter, service time from the pods' histogram."""

    async def main():
        bs = [
            await AppServer(make_backend_app(BackendConfig(name=f"b{i}", service_s=0.02))).start()
            for i in range(2)
        ]
        r = await Router(
            RouterConfig(port=0, backends=tuple(b.url for b in bs), scrape_interval_s=0)
        ).start()
        m = LoadMeter(lambda: [b.url for b in bs], lambda: [r.url])
        first = await _timed_measure(m)
        assert first[1].concurrency == 0 and first[1].demand is None  # no rates yet
        n = 40
        async with aiohttp.ClientSession() as s:
            got = await asyncio.gather(*(post(s, r.url) for _ in range(n)))
        assert all(g[0] == 200 for g in got)
        second = await _timed_measure(m)
        load = second[1]
        # the rate is n requests over the time between the two scrapes
        assert n / (second[2] - first[0]) <= load.arrival_rps <= n / (second[0] - first[2])
        # every request ran 20 ms (asyncio timers may fire up to a clock tick early)
        assert 0.018 <= load.service_s < 0.2
        assert load.demand == pytest.approx(load.arrival_rps * load.service_s)
        assert load.concurrency == 0
        await m.close()
        await r.stop()
        for b in bs:
            await b.stop()

    run(main())


def test_meter_without_routers_or_histogram_uses_pod_counters():
    """Pods alone: arrivals = finished + in the pod; service time by Little's law on running."""
    page = {"text": ""}

    def set_page(running: int, waiting: int, success: int) -> None:
        page["text"] = (
            f'vllm:num_requests_running{{model_name="m"}} {running}\n'
            f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
            f'vllm:request_success_total{{finished_reason="stop",model_name="m"}} {success}\n'
        )

    async def metrics(request):
        return web.Response(text=page["text"])

    async def main():
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        pod = await AppServer(app).start()
        m = LoadMeter(lambda: [pod.url])
        set_page(4, 2, 100)
        first = await _timed_measure(m)
        assert first[1].concurrency == 6
        await asyncio.sleep(0.2)
        set_page(4, 6, 108)  # 8 finished, 4 more waiting: 12 arrived
        second = await _timed_measure(m)
        load = second[1]
        lo, hi = second[0] - first[2], second[2] - first[0]
        assert load.concurrency == 10
        assert 12 / hi <= load.arrival_rps <= 12 / lo
        # 4 running the whole time, 8 finished: 4 * dt / 8 seconds each
        assert 4 * lo / 8 <= load.service_s <= 4 * hi / 8
        set_page(1, 0, 3)  # the pod restarted: its counters went down, no rate this tick
        third = await m.measure()
        assert third.concurrency == 1 and third.arrival_rps is None
        await m.close()
        await pod.stop()

    run(main())


def test_pool_requires_port_placeholder():
    with pytest.raises(ConfigError):
        LocalPoolActuator(["sleep", "10"])


class Stack:
    """The local pool, the EDS it publishes to, a router following the EDS, the meter."""

    def __init__(self, cmd: list[str]) -> None:
        self.store = EndpointStore()
        self.pool = LocalPoolActuator(cmd, store=self.store, drain_notice_s=0.2, health_poll_s=0.05)

    async def start(self) -> Stack:
        self.eds = await AppServer(make_eds_app(self.store)).start()
        self.router = await Router(
            RouterConfig(port=0, eds_url=self.eds.url, scrape_interval_s=0.25)
        ).start()
        self.meter = LoadMeter(
            lambda: [p.url for p in self.pool.pods if p.ready and not p.terminating],
            lambda: [self.router.url],
            service_window_s=5.0,
        )
        await self.pool.scale(1)
        for _ in range(600):
            if (await self.pool.status()).ready == 1 and self.router.bal.backends:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the first pod never became ready behind the router")
        return self

    async def close(self) -> None:
        await self.pool.close()
        await self.meter.close()
        await self.router.stop(1.0)
        await self.eds.stop()


def _backend_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "serving.fakebackend", "--port", "{port}", *args]


def _reversals(desired: list[int]) -> int:
    moves = [b > a for a, b in zip(desired, desired[1:], strict=False) if b != a]
    return sum(1 for x, y in zip(moves, moves[1:], strict=False) if x != y)


@pytest.mark.integration
def test_ten_x_ramp_through_router_against_local_pool():
    """Clients -> router -> pods; replicas rise within the up window, fall slowly, no flapping."""
    policy = ScalingPolicy(
        target_per_pod=4,
        min_replicas=1,
        max_replicas=6,
        up_window_s=1.0,
        up_max_pods=2,
        up_max_percent=100,
        down_window_s=2.0,
        stabilization_s=2.0,
        down_max_pods=1,
        down_max_percent=0,
        down_period_s=1.0,
        panic_hold_s=1.0,
    )

    async def main():
        # 200 ms requests: the time a request spends in a pod outside its service time (HTTP
        # server, a busy test machine) stays small next to it, as with real model requests
        stack = await Stack(_backend_cmd("--service-ms", "200", "--drain-s", "5")).start()
        pool, url = stack.pool, stack.router.url
        scaler = Autoscaler(policy, stack.meter, pool, tick_s=0.25)
        loop = asyncio.get_running_loop()
        level = {"n": 2}
        errors = []

        async def client(i: int, s: aiohttp.ClientSession):
            while True:
                if i >= level["n"]:
                    await asyncio.sleep(0.02)
                    continue
                try:
                    st = (await post(s, url))[0]
                    if st != 200:
                        errors.append(st)
                except aiohttp.ClientError as e:
                    errors.append(repr(e))

        runner = asyncio.ensure_future(scaler.run())
        try:
            async with aiohttp.ClientSession() as s:
                clients = [asyncio.ensure_future(client(i, s)) for i in range(20)]
                t0 = loop.time()
                for step in range(10):  # 2 -> 20 concurrent clients over 2 s
                    level["n"] = 2 + 2 * step
                    await asyncio.sleep(0.2)
                ramp_end = loop.time()
                level["n"] = 20
                while loop.time() - ramp_end < 6.0 and max(h[4] for h in scaler.history) < 5:
                    await asyncio.sleep(0.1)
                up_at = next((h[0] for h in scaler.history if h[4] >= 5), None)
                await asyncio.sleep(1.0)
                level["n"] = 2  # back down
                drop = loop.time()
                top = max(h[4] for h in scaler.history)
                while loop.time() - drop < 12.0 and (await pool.status()).current > top - 2:
                    await asyncio.sleep(0.1)
                for c in clients:
                    c.cancel()
                await asyncio.gather(*clients, return_exceptions=True)
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
            desired = [h[4] for h in scaler.history]
            # the meter saw the demand through the router and the pods
            assert any(h[5] is not None and h[5] > 0 for h in scaler.history), desired
            # rose to what 20 in flight / 4 per pod needs, within the up window (+ slack for
            # process start-up on busy test machines)
            assert up_at is not None and up_at - t0 < 2.0 + 6.0, [
                (round(h[0] - t0, 2), h[1], h[3], h[4], h[5] and round(h[5], 1))
                for h in scaler.history
            ]
            # fell slowly: one pod at a time, not at once
            downs = [b - a for a, b in zip(desired, desired[1:], strict=False) if b < a]
            assert downs and all(d == -1 for d in downs), desired
            # no flapping: one way up, then one way down
            assert _reversals(desired) <= 1, desired
            assert (await pool.status()).current < max(desired)
            assert not errors, errors[:5]  # drained pods finished what they had
        finally:
            runner.cancel()
            await stack.close()
        assert pool.pods == []

    run(main(), timeout=90)


@pytest.mark.integration
def test_slow_starting_pods_do_not_overshoot_to_the_cap():
    """Open-loop traffic beyond one pod while new pods take seconds to start.

    The backlog piles up in the ready pod (concurrency alone would ask for the cap); the
    measured demand (arrival rate x service time) keeps the replicas near what the traffic
    needs, and every request is answered once the new pods are ready.
    """
    target = 2.0
    policy = ScalingPolicy(
        target_per_pod=target,
        min_replicas=1,
        max_replicas=16,
        up_window_s=1.0,
        up_max_pods=2,
        up_max_percent=100,
        down_window_s=30.0,
        stabilization_s=30.0,
        panic_hold_s=1.0,
    )
    # a pod runs 2 requests of 200 ms at once (10 requests/s) and needs 4 s to become ready;
    # long requests and a low rate keep a busy test machine's own delays small next to them
    cmd = _backend_cmd(
        "--service-ms", "200", "--max-running", "2", "--startup-s", "4", "--drain-s", "5"
    )
    rate = 20.0  # 2 pods' worth: demand 4 in flight -> 2 pods, capped at 2x -> 4

    async def main():
        stack = await Stack(cmd).start()
        pool, url = stack.pool, stack.router.url
        scaler = Autoscaler(policy, stack.meter, pool, tick_s=0.25)
        loop = asyncio.get_running_loop()
        statuses: list[int | str] = []

        async def one(s: aiohttp.ClientSession) -> None:
            try:
                statuses.append((await post(s, url))[0])
            except aiohttp.ClientError as e:
                statuses.append(repr(e))

        runner = asyncio.ensure_future(scaler.run())
        sent: set[asyncio.Task] = set()
        try:
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=conn) as s:
                # 2 requests/s for 2 s (demand and service time known), then 20/s for 6 s
                t0 = loop.time()
                k = 0
                while (now := loop.time()) - t0 < 8.0:
                    elapsed = now - t0
                    due = 2 * min(elapsed, 2.0) + rate * max(0.0, elapsed - 2.0)
                    while k < due:
                        k += 1
                        task = asyncio.ensure_future(one(s))
                        sent.add(task)
                        task.add_done_callback(sent.discard)
                    await asyncio.sleep(0.01)
                await asyncio.wait_for(asyncio.gather(*sent), 60)
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
            hist = list(scaler.history)
            desired = [h[4] for h in hist]
            # the backlog was real: concurrency alone would have asked for the cap
            peak_conc = max(h[1] or 0.0 for h in hist)
            assert math.ceil(peak_conc / target) >= policy.max_replicas, (peak_conc, desired)
            # the demand-capped signal (2 pods needed, 2x headroom: 4; more on a machine so
            # busy that the pods run slower) stopped at half the cap or less
            assert max(desired) <= policy.max_replicas // 2, (desired, [h[5] for h in hist])
            assert max(desired) >= 2, desired  # and still scaled up for the traffic
            assert _reversals(desired) <= 1, desired
            bad = [st for st in statuses if st != 200]
            assert len(statuses) == k and not bad, (len(statuses), k, bad[:5])
        finally:
            runner.cancel()
            for task in sent:
                task.cancel()
            await stack.close()

    run(main(), timeout=120)
