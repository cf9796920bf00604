"""The Deployment scale actuator against replayed API responses (data/deployments/README.md).

The real ``kubernetes`` client talks to a loopback server that answers the Deployment
``status`` read and the ``scale`` patch with recorded API objects and logs what it was sent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiohttp import web
from servinghelp import AppServer, run

from serving.autoscaler import KubeDeploymentActuator, ReplicaStatus
from serving.errors import ActuatorError

pytestmark = pytest.mark.integration

DATA = Path(__file__).parent / "data" / "deployments"
BASE = "/apis/apps/v1/namespaces/serving/deployments/llm"


class FakeAppsApi:
    def __init__(self, *, forbid_scale: bool = False) -> None:
        self.forbid_scale = forbid_scale
        self.requests: list[tuple[str, str, str, bytes]] = []
        app = web.Application()
        app.router.add_get(BASE + "/status", self.status)
        app.router.add_patch(BASE + "/scale", self.scale)
        self.server = AppServer(app)

    async def status(self, request: web.Request) -> web.Response:
        self.requests.append((request.method, request.path, "", b""))
        return web.Response(
            body=(DATA / "status.json").read_bytes(), content_type="application/json"
        )

    async def scale(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.requests.append((request.method, request.path, request.content_type, body))
        if self.forbid_scale:
            return web.Response(
                status=403,
                body=(DATA / "forbidden.json").read_bytes(),
                content_type="application/json",
            )
        return web.Response(
            body=(DATA / "scale.json").read_bytes(), content_type="application/json"
        )


def actuator(fake: FakeAppsApi) -> KubeDeploymentActuator:
    from kubernetes import client

    conf = client.Configuration(host=fake.server.url)
    return KubeDeploymentActuator("serving", "llm", api_client=client.ApiClient(conf))


def test_status_and_scale_through_the_real_client():
    async def main():
        fake = FakeAppsApi()
        await fake.server.start()
        act = actuator(fake)
        # spec 3, 4 pods exist (a rollout's surge), 2 ready: 2 still starting
        assert await act.status() == ReplicaStatus(current=3, ready=2, starting=2)
        await act.scale(5)
        method, path, ctype, body = fake.requests[-1]
        assert (method, path) == ("PATCH", BASE + "/scale")
        assert ctype.endswith("merge-patch+json")  # a merge patch of spec.replicas only
        assert json.loads(body) == {"spec": {"replicas": 5}}
        await fake.server.stop()

    run(main(), timeout=30)


def test_refused_scale_is_an_actuator_error():
    async def main():
        fake = FakeAppsApi(forbid_scale=True)
        await fake.server.start()
        with pytest.raises(ActuatorError, match="(?s)scaling deployment serving/llm.*Forbidden"):
            await actuator(fake).scale(2)
        await fake.server.stop()

    run(main(), timeout=30)


def test_unreachable_api_is_an_actuator_error():
    async def main():
        fake = FakeAppsApi()  # never started: nothing listens at its port
        with pytest.raises(ActuatorError, match="reading deployment serving/llm"):
            await actuator(fake).status()

    run(main(), timeout=30)
