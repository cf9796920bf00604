"""EDS: endpoint parsing, static and file sources, the SSE stream, and a router following it."""

from __future__ import annotations

import asyncio
import json
import os

import aiohttp
import pytest
from servinghelp import AppServer, post, run

from serving.discovery import FileSource, StaticSource, follow_eds, make_eds_app
from serving.endpoints import (
    Endpoint,
    EndpointStore,
    canonical,
    decode,
    encode,
    normalize_url,
    parse_endpoint_text,
)
from serving.errors import ConfigError
from serving.fakebackend import BackendConfig, make_backend_app
from serving.router import Router, RouterConfig


def test_normalize_url():
    assert normalize_url("127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert normalize_url("http://h:1/") == "http://h:1"
    for bad in ("https://h:1", "http://h", "http://h:1/v1", "ftp://h:1"):
        with pytest.raises(ConfigError):
            normalize_url(bad)


def test_parse_text_and_json():
    eps = parse_endpoint_text("# pods\nhttp://a:1 zone=z1\nb:2 draining\n\nc:3 notready zone=z2\n")
    assert eps == (
        Endpoint("http://a:1", "z1"),
        Endpoint("http://b:2", None, True, True),
        Endpoint("http://c:3", "z2", False, False),
    )
    assert [e.serving for e in eps] == [True, False, False]
    assert parse_endpoint_text(json.dumps({"endpoints": [{"url": "a:1", "zone": "z"}]})) == (
        Endpoint("http://a:1", "z"),
    )
    assert parse_endpoint_text('["a:1", "b:2"]') == (Endpoint("http://a:1"), Endpoint("http://b:2"))
    with pytest.raises(ConfigError):
        parse_endpoint_text("a:1 bogus")
    with pytest.raises(ConfigError):
        parse_endpoint_text("{not json")


def test_canonical_dedups_preferring_serving():
    eps = canonical(
        [Endpoint("http://a:1", terminating=True), Endpoint("http://a:1"), Endpoint("http://0:1")]
    )
    assert eps == (Endpoint("http://0:1"), Endpoint("http://a:1"))


def test_wire_roundtrip():
    eps = (Endpoint("http://a:1", "z", True, True),)
    assert decode(encode(5, eps)) == (5, eps)


def test_store_versions_only_on_change():
    async def main():
        st = EndpointStore()
        assert st.update([Endpoint("http://a:1")]) and st.version == 1
        assert not st.update([Endpoint("http://a:1")]) and st.version == 1
        waiter = asyncio.ensure_future(st.wait_newer(1, 5))
        await asyncio.sleep(0)
        st.update([])
        assert await waiter and st.version == 2
        assert not await st.wait_newer(2, 0.05)

    run(main())


def test_file_source_follows_rewrites_and_keeps_last_good(tmp_path):
    path = tmp_path / "eps.txt"
    path.write_text("a:1\n")

    async def main():
        st = EndpointStore()
        task = asyncio.ensure_future(FileSource(path, poll_s=0.02).run(st))
        await wait_for(lambda: st.version == 1)
        assert st.endpoints == (Endpoint("http://a:1"),)
        tmp = tmp_path / "eps.new"
        tmp.write_text("a:1 draining\nb:2\n")
        os.replace(tmp, path)
        await wait_for(lambda: st.version == 2)
        assert [e.serving for e in st.endpoints] == [False, True]
        path.write_text("garbage garbage\n")  # malformed: last good set stays
        await asyncio.sleep(0.1)
        path.unlink()
        await asyncio.sleep(0.1)
        assert st.version == 2
        task.cancel()

    run(main())


async def wait_for(cond, timeout=5.0):
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


def test_sse_stream_and_long_poll():
    async def main():
        st = EndpointStore()
        await StaticSource([Endpoint("http://a:1")]).run(st)
        srv = await AppServer(make_eds_app(st, heartbeat_s=0.05)).start()
        seen = []
        task = asyncio.ensure_future(follow_eds(srv.url, lambda v, e: seen.append((v, e))))
        await wait_for(lambda: len(seen) == 1)
        assert seen[0] == (1, (Endpoint("http://a:1"),))
        st.update([Endpoint("http://a:1"), Endpoint("http://b:2")])
        await wait_for(lambda: len(seen) == 2)
        await asyncio.sleep(0.2)  # heartbeats pass, nothing new is reported
        assert len(seen) == 2
        async with aiohttp.ClientSession() as s:
            async with s.get(srv.url + "/v1/endpoints") as r:
                assert decode(await r.text())[0] == 2
            poll = asyncio.ensure_future(s.get(srv.url + "/v1/endpoints?after=2&timeout=5"))
            await asyncio.sleep(0.05)
            st.update([])
            r = await poll
            assert decode(await r.text()) == (3, ())
            r.release()
        await wait_for(lambda: len(seen) == 3)
        task.cancel()
        await srv.stop()

    run(main())


def test_follow_reconnects_after_eds_restart():
    async def main():
        st = EndpointStore()
        st.update([Endpoint("http://a:1")])
        srv = await AppServer(make_eds_app(st)).start()
        seen = []
        task = asyncio.ensure_future(
            follow_eds(srv.url, lambda v, e: seen.append(e), retry_min_s=0.05)
        )
        await wait_for(lambda: len(seen) == 1)
        await srv.stop()
        st2 = EndpointStore()  # a new EDS life: versions restart at 1
        st2.update([Endpoint("http://b:2")])
        srv2 = await AppServer(make_eds_app(st2), port=srv.port).start()
        await wait_for(lambda: len(seen) == 2)
        assert seen[-1] == (Endpoint("http://b:2"),)
        task.cancel()
        await srv2.stop()

    run(main())


@pytest.mark.integration
def test_router_follows_eds_file_within_a_second(tmp_path):
    path = tmp_path / "eps.txt"

    async def main():
        bs = [
            await AppServer(make_backend_app(BackendConfig(name=f"b{i}"))).start() for i in range(2)
        ]
        path.write_text(f"{bs[0].url}\n")
        st = EndpointStore()
        src = asyncio.ensure_future(FileSource(path, poll_s=0.05).run(st))
        eds = await AppServer(make_eds_app(st)).start()
        router = rs = await Router(RouterConfig(port=0, eds_url=eds.url)).start()
        await wait_for(lambda: bs[0].url in router.bal.backends)
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as s:
            assert {(await post(s, rs.url))[1] for _ in range(5)} == {"b0"}
            t0 = loop.time()
            path.write_text(f"{bs[0].url} draining\n{bs[1].url}\n")
            await wait_for(lambda: bs[1].url in router.bal.backends, timeout=1.0)
            assert loop.time() - t0 < 1.0
            assert {(await post(s, rs.url))[1] for _ in range(5)} == {"b1"}
        src.cancel()
        for srv in (rs, eds, *bs):
            await srv.stop()

    run(main())
