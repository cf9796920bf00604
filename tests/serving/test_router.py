"""Integration tests of the router with real HTTP backends on loopback."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import aiohttp
import pytest
from servinghelp import AppServer, BackendProcess, post, run
from support import free_port

from serving.balancer import BalancerConfig
from serving.endpoints import Endpoint
from serving.fakebackend import BackendConfig, make_backend_app
from serving.router import Router, RouterConfig

pytestmark = pytest.mark.integration


async def backends(n: int, **kw) -> list[AppServer]:
    out = []
    for i in range(n):
        cfg = BackendConfig(
            name=f"b{i}", **{k: (v[i] if isinstance(v, list) else v) for k, v in kw.items()}
        )
        out.append(await AppServer(make_backend_app(cfg)).start())
    return out


async def router_for(urls, **kw) -> tuple[Router, Router]:
    """A started router; returned twice, as the router and as the server (url, stop)."""
    cfg = RouterConfig(port=0, backends=tuple(urls), **kw)
    r = await Router(cfg).start()
    return r, r


async def stop_all(*servers):
    for s in servers:
        await s.stop()


def test_proxies_completions_chat_and_streams():
    async def main():
        bs = await backends(2, tokens=5)
        r, rs = await router_for([b.url for b in bs])
        async with aiohttp.ClientSession() as s:
            status, who, body = await post(s, rs.url)
            assert status == 200 and who in ("b0", "b1")
            assert json.loads(body)["object"] == "text_completion"
            status, _, body = await post(s, rs.url, chat=True)
            assert json.loads(body)["choices"][0]["message"]["role"] == "assistant"
            status, _, body = await post(s, rs.url, chat=True, stream=True)
            events = [e for e in body.decode().split("\n\n") if e]
            assert status == 200 and len(events) == 6 and events[-1] == "data: [DONE]"
            # streaming passes through chunk by chunk, not buffered to the end
            payload = {"prompt": "x", "stream": True}
            async with s.post(rs.url + "/v1/completions", json=payload) as resp:
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                first = await resp.content.readline()
                assert first.startswith(b"data: ")
                await resp.read()
            async with s.get(rs.url + "/v1/models") as resp:
                assert resp.status == 404  # the backend's answer, passed through
            async with s.get(rs.url + "/metrics") as resp:
                text = await resp.text()
                assert "serving_router_requests_total" in text
                assert "serving_router_backend_inflight" in text
        await stop_all(rs, *bs)

    run(main())


def test_spreads_load_and_counts_in_flight():
    async def main():
        bs = await backends(3, service_s=0.02)
        r, rs = await router_for([b.url for b in bs])
        async with aiohttp.ClientSession() as s:
            results = await asyncio.gather(*(post(s, rs.url) for _ in range(300)))
        assert all(st == 200 for st, _, _ in results)
        per = Counter(who for _, who, _ in results)
        assert len(per) == 3 and min(per.values()) > 50
        assert all(b.inflight == 0 for b in r.bal.backends.values())
        await stop_all(rs, *bs)

    run(main())


def test_p2c_sends_less_to_a_slow_backend():
    async def main():
        bs = await backends(3, service_s=0.01, slowdown=[1.0, 1.0, 10.0])
        r, rs = await router_for([b.url for b in bs], scrape_interval_s=0)
        async with aiohttp.ClientSession() as s:
            sem = asyncio.Semaphore(12)

            async def one():
                async with sem:
                    return await post(s, rs.url)

            results = await asyncio.gather(*(one() for _ in range(240)))
        per = Counter(who for _, who, _ in results)
        assert per["b2"] < min(per["b0"], per["b1"]) / 2, per
        await stop_all(rs, *bs)

    run(main())


def test_connect_failure_is_retried_and_ejects():
    async def main():
        bs = await backends(2)
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        r, rs = await router_for(
            [dead, *(b.url for b in bs)], balancer=BalancerConfig(eject_base_s=30)
        )
        async with aiohttp.ClientSession() as s:
            results = [await post(s, rs.url) for _ in range(30)]
        assert all(st == 200 for st, _, _ in results)
        assert r.bal.backends[dead].ejections >= 1
        assert r.stats.retries >= 1
        await stop_all(rs, *bs)

    run(main())


def test_5xx_ejects_the_backend_and_is_passed_through():
    async def main():
        bs = await backends(2)
        r, rs = await router_for([b.url for b in bs], balancer=BalancerConfig(eject_base_s=30))
        async with aiohttp.ClientSession() as s:
            async with s.post(
                bs[0].url + "/admin/fail", json={"status": 500, "count": 1000}
            ) as resp:
                assert resp.status == 200
            results = [await post(s, rs.url) for _ in range(40)]
        codes = Counter(st for st, _, _ in results)
        assert codes[500] == 1  # the backend answered; it is not retried, but ejected
        assert codes[200] == 39
        assert r.bal.backends[bs[0].url].ejections == 1
        await stop_all(rs, *bs)

    run(main())


def test_no_backend_answers_503():
    async def main():
        r, rs = await router_for([])
        async with aiohttp.ClientSession() as s:
            assert (await post(s, rs.url))[0] == 503
        await rs.stop()

    run(main())


def test_backend_dies_mid_run(backend_procs):
    procs = [BackendProcess("--service-ms", "20", "--dist", "exp") for _ in range(3)]
    backend_procs.extend(procs)
    for p in procs:
        p.wait()

    async def main():
        r, rs = await router_for([p.url for p in procs], balancer=BalancerConfig(eject_base_s=30))
        concurrency = 8
        results: list[tuple[float, int]] = []
        killed_at = None

        async def client(s):
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                t = time.monotonic()
                try:
                    st = (await post(s, rs.url))[0]
                except aiohttp.ClientError:
                    st = -1
                results.append((t, st))

        async with aiohttp.ClientSession() as s:
            tasks = [asyncio.ensure_future(client(s)) for _ in range(concurrency)]
            await asyncio.sleep(1.0)
            procs[0].kill()
            killed_at = time.monotonic()
            await asyncio.gather(*tasks)
        errors = [(t, st) for t, st in results if st != 200]
        # only requests already at the dead backend may fail (at most one per client)
        assert len(errors) <= concurrency, errors
        assert all(t < killed_at for t, _ in errors), errors
        after = [st for t, st in results if t > killed_at + 0.05]
        assert len(after) > 50 and all(st == 200 for st in after)
        assert r.bal.backends[procs[0].url].ejections >= 1
        await rs.stop()

    run(main())


def test_draining_backend_finishes_in_flight_and_gets_nothing_new():
    async def main():
        bs = await backends(2, service_s=0.3)
        r, rs = await router_for([])
        r.apply_endpoints(1, [Endpoint(bs[0].url), Endpoint(bs[1].url)])
        async with aiohttp.ClientSession() as s:
            first = [asyncio.ensure_future(post(s, rs.url)) for _ in range(20)]
            await asyncio.sleep(0.1)
            assert r.bal.backends[bs[0].url].inflight > 0
            r.apply_endpoints(2, [Endpoint(bs[0].url, terminating=True), Endpoint(bs[1].url)])
            second = await asyncio.gather(*(post(s, rs.url) for _ in range(20)))
            first = await asyncio.gather(*first)
        assert all(st == 200 for st, _, _ in first + second)  # no request lost
        assert {who for _, who, _ in second} == {"b1"}
        assert bs[0].url not in r.bal.backends  # reaped once idle
        await stop_all(rs, *bs)

    run(main())


def test_zone_preference_from_endpoint_zones():
    async def main():
        bs = await backends(3)
        r, rs = await router_for([], balancer=BalancerConfig(zone="a"))
        r.apply_endpoints(
            1, [Endpoint(bs[0].url, "a"), Endpoint(bs[1].url, "b"), Endpoint(bs[2].url, "a")]
        )
        async with aiohttp.ClientSession() as s:
            results = [await post(s, rs.url) for _ in range(30)]
            assert {who for _, who, _ in results} == {"b0", "b2"}  # same zone only
            # the zone's backends drain: traffic leaves the zone rather than failing
            r.apply_endpoints(2, [Endpoint(bs[1].url, "b")])
            results = [await post(s, rs.url) for _ in range(5)]
        assert {(st, who) for st, who, _ in results} == {(200, "b1")}
        await stop_all(rs, *bs)

    run(main())
