"""The autoscaler loop against the local process pool: a 10x ramp of real traffic."""

from __future__ import annotations

import asyncio
import sys

import aiohttp
import pytest
from servinghelp import post, run

from serving.autoscaler import Autoscaler, ConcurrencyMeter, LocalPoolActuator, ReplicaStatus
from serving.endpoints import EndpointStore
from serving.errors import ConfigError
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
        m = ConcurrencyMeter(lambda: ["http://127.0.0.1:9"], timeout_s=0.5)
        assert await m.measure() is None
        assert await ConcurrencyMeter(lambda: []).measure() is None
        await m.close()

    run(main())


def test_pool_requires_port_placeholder():
    with pytest.raises(ConfigError):
        LocalPoolActuator(["sleep", "10"])


@pytest.mark.integration
def test_ten_x_ramp_against_local_pool():
    """Replicas rise within the up window, fall slowly afterwards, and do not flap."""
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
    cmd = [
        sys.executable,
        "-m",
        "serving.fakebackend",
        "--port",
        "{port}",
        "--service-ms",
        "50",
        "--drain-s",
        "5",
    ]

    async def main():
        store = EndpointStore()
        pool = LocalPoolActuator(cmd, store=store, drain_notice_s=0.2, health_poll_s=0.05)
        meter = ConcurrencyMeter(lambda: [p.url for p in pool.pods if p.ready])
        scaler = Autoscaler(policy, meter, pool, tick_s=0.25)
        await pool.scale(1)
        for _ in range(400):
            if (await pool.status()).ready == 1:
                break
            await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        level = {"n": 2}
        errors = []

        async def client(i: int, s: aiohttp.ClientSession):
            while True:
                if i >= level["n"]:
                    await asyncio.sleep(0.02)
                    continue
                ready = [p.url for p in pool.pods if p.ready and not p.terminating]
                if not ready:
                    await asyncio.sleep(0.02)
                    continue
                try:
                    st = (await post(s, ready[i % len(ready)]))[0]
                    if st != 200:
                        errors.append(st)
                except aiohttp.ClientError as e:
                    errors.append(repr(e))

        runner = asyncio.ensure_future(scaler.run())
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
        try:
            # rose to what 20 in flight / 4 per pod needs, within the up window (+ slack for
            # process start-up on busy test machines)
            assert up_at is not None and up_at - t0 < 2.0 + 6.0, desired
            # fell slowly: one pod at a time, not at once
            downs = [b - a for a, b in zip(desired, desired[1:], strict=False) if b < a]
            assert downs and all(d == -1 for d in downs), desired
            # no flapping: one way up, then one way down
            moves = [b > a for a, b in zip(desired, desired[1:], strict=False) if b != a]
            reversals = sum(1 for x, y in zip(moves, moves[1:], strict=False) if x != y)
            assert reversals <= 1, desired
            assert (await pool.status()).current < max(desired)
            assert not errors, errors[:5]  # drained pods finished what they had
        finally:
            await pool.close()
            await meter.close()
        assert pool.pods == []

    run(main(), timeout=60)
