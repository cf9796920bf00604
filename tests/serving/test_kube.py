"""The EndpointSlice watcher against recorded watch streams (see data/endpointslices/README.md).

No API server can run here; the pure watch logic is fed the recorded events directly, and the
production loop (real ``kubernetes`` client: list, watch, bookmark, 410 → relist) talks to a
loopback HTTP server that replays them.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web
from servinghelp import AppServer, run

from serving.endpoints import Endpoint, EndpointStore
from serving.errors import DiscoveryError
from serving.kube import EndpointSliceSource, KubeConfig, ResourceExpired, SliceState, parse_slice

DATA = Path(__file__).parent / "data" / "endpointslices"


def load(name: str):
    return json.loads((DATA / name).read_text())


def events(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line]


def test_parse_slice_conditions_zone_and_port():
    item = load("list1.json")["items"][0]
    assert parse_slice(item, "http") == (
        Endpoint("http://10.0.1.1:8000", "zone-a", True, False),
        Endpoint("http://10.0.1.2:8000", "zone-b", False, False),
    )
    assert parse_slice(item)[0].url == "http://10.0.1.1:9100"  # first port by default
    assert parse_slice(item, "grpc") == ()
    # unset conditions mean ready and not terminating; IPv6 gets brackets
    bare = {"ports": [{"port": 80}], "endpoints": [{"addresses": ["fd00::1"]}]}
    assert parse_slice(bare) == (Endpoint("http://[fd00::1]:80"),)


def test_recorded_stream_drives_state():
    st = SliceState("http")
    st.replace(load("list1.json"))
    assert st.resource_version == "1000"
    assert [e.serving for e in st.endpoints()] == [True, False]
    evs = events("watch1.jsonl")
    assert st.apply(evs[0]["type"], evs[0]["object"])  # .2 ready
    assert all(e.serving for e in st.endpoints())
    st.apply(evs[1]["type"], evs[1]["object"])  # second slice
    assert len(st.endpoints()) == 3
    assert not st.apply(evs[2]["type"], evs[2]["object"])  # bookmark
    assert st.resource_version == "1050"
    st.apply(evs[3]["type"], evs[3]["object"])  # .1 terminating
    draining = [e.url for e in st.endpoints() if not e.serving]
    assert draining == ["http://10.0.1.1:8000"]
    with pytest.raises(ResourceExpired):
        st.apply(evs[4]["type"], evs[4]["object"])
    st.replace(load("list2.json"))
    st.apply(*(lambda e: (e["type"], e["object"]))(events("watch2.jsonl")[0]))
    assert st.endpoints() == (Endpoint("http://10.0.1.2:8000", "zone-b"),)


def test_other_watch_errors_raise():
    st = SliceState()
    with pytest.raises(DiscoveryError):
        st.apply("ERROR", {"code": 500, "reason": "InternalError", "message": "boom"})


def test_duplicate_endpoint_across_slices_serving_wins():
    st = SliceState("http")
    a = load("list1.json")["items"][0]
    b = json.loads(json.dumps(a))
    b["metadata"]["name"] = "llm-moved"
    b["endpoints"][0]["conditions"] = {"ready": False, "terminating": True}
    st.apply("ADDED", a)
    st.apply("ADDED", b)
    eps = {e.url: e for e in st.endpoints()}
    assert eps["http://10.0.1.1:8000"].serving


class FakeApiServer:
    """Replays recorded list responses and watch streams, one per request, and logs requests."""

    PATH = "/apis/discovery.k8s.io/v1/namespaces/serving/endpointslices"

    def __init__(self, lists: list[str], watches: list[str]) -> None:
        self.lists = [(DATA / n).read_bytes() for n in lists]
        self.watches = [(DATA / n).read_bytes() for n in watches]
        self.requests: list[dict] = []
        self.closing = asyncio.Event()
        app = web.Application()
        app.router.add_get(self.PATH, self.handle)
        app.on_shutdown.append(self._shutdown)
        self.server = AppServer(app)

    async def _shutdown(self, app):
        self.closing.set()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        q = dict(request.query)
        self.requests.append(q)
        assert q.get("labelSelector") == "kubernetes.io/service-name=llm"
        if q.get("watch", "").lower() != "true":
            body = self.lists.pop(0) if len(self.lists) > 1 else self.lists[0]
            return web.Response(body=body, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        if self.watches:
            for line in self.watches.pop(0).splitlines(keepends=True):
                await resp.write(line)
                await asyncio.sleep(0.01)
        # then stay quiet until the watch's own timeout, like the API server
        try:
            await asyncio.wait_for(self.closing.wait(), float(q.get("timeoutSeconds", 5)))
        except TimeoutError:
            pass
        return resp


@pytest.mark.integration
def test_watcher_with_real_client_against_replayed_streams():
    from kubernetes import client

    async def main():
        fake = FakeApiServer(["list1.json", "list2.json"], ["watch1.jsonl", "watch2.jsonl"])
        await fake.server.start()
        conf = client.Configuration(host=fake.server.url)
        src = EndpointSliceSource(
            KubeConfig(namespace="serving", service="llm", port_name="http", watch_timeout_s=2),
            api_client=client.ApiClient(conf),
        )
        store = EndpointStore()
        seen: list[tuple] = []
        task = asyncio.ensure_future(src.run(store))
        final = (Endpoint("http://10.0.1.2:8000", "zone-b"),)
        for _ in range(1000):
            if not seen or seen[-1] != store.endpoints:
                seen.append(store.endpoints)
            if store.endpoints == final:
                break
            await asyncio.sleep(0.01)
        assert store.endpoints == final
        # it went through the recorded states: .1 draining was published before the relist
        assert any(any(e.url.endswith(".1:8000") and not e.serving for e in s) for s in seen)
        lists = [q for q in fake.requests if q.get("watch", "").lower() != "true"]
        watches = [q for q in fake.requests if q.get("watch", "").lower() == "true"]
        assert len(lists) == 2 and src.lists == 2  # the 410 caused exactly one relist
        assert watches[0]["resourceVersion"] == "1000"  # watch from the list's version
        assert watches[1]["resourceVersion"] == "2000"  # after the relist
        assert watches[0]["allowWatchBookmarks"].lower() == "true"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await fake.server.stop()

    run(main(), timeout=30)


@pytest.mark.integration
def test_periodic_resync_relists_without_any_error():
    """No watch event arrives; after resync_s the watcher lists again and replaces its state."""
    from kubernetes import client

    async def main():
        fake = FakeApiServer(["list1.json", "list2.json"], [])  # quiet watches
        await fake.server.start()
        src = EndpointSliceSource(
            KubeConfig(
                namespace="serving",
                service="llm",
                port_name="http",
                resync_s=1.2,
                watch_timeout_s=1,
            ),
            api_client=client.ApiClient(client.Configuration(host=fake.server.url)),
        )
        store = EndpointStore()
        task = asyncio.ensure_future(src.run(store))
        expected = SliceState("http")
        expected.replace(load("list2.json"))
        for _ in range(600):
            if src.lists >= 2 and store.endpoints == expected.endpoints():
                break
            await asyncio.sleep(0.01)
        assert src.lists == 2 and store.endpoints == expected.endpoints()
        # list, quiet watch(es) from its version until resync_s, list again: no error involved
        kinds = ["watch" if q.get("watch", "").lower() == "true" else "list" for q in fake.requests]
        second = kinds.index("list", 1)
        assert kinds[0] == "list" and second >= 2 and kinds.count("list") == 2
        assert all(q["resourceVersion"] == "1000" for q in fake.requests[1:second])
        assert all(q["resourceVersion"] == "2000" for q in fake.requests[second + 1 :])
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await fake.server.stop()

    run(main(), timeout=30)
