"""Kubernetes EndpointSlices of a Service as an endpoint source (official ``kubernetes`` client).

The standard list-then-watch protocol:

1. **List** the Service's slices (label ``kubernetes.io/service-name=<service>``) and remember
   the list's ``resourceVersion``.
2. **Watch** from that version (``allow_watch_bookmarks``), applying each ADDED / MODIFIED /
   DELETED event to the per-slice state and publishing the merged endpoint set. Each watch
   call is bounded (``watch_timeout_s``, server side) and re-issued from the last version
   seen, which BOOKMARK events keep fresh on quiet Services.
3. **Resync**: every ``resync_s`` the watcher lists again from scratch, replacing all state,
   which repairs anything a missed event might have left behind.
4. **410 Gone** (the version fell out of the API server's window) → list again at once. Any
   other failure → log, back off (capped exponential), list again. The last published set
   stays in force meanwhile: an API server outage never empties the routers.

Endpoint semantics follow the EndpointSlice API: ``conditions.ready`` unset means ready;
``terminating`` unset means false. A terminating endpoint is published as draining (its
in-flight requests finish; routers send it nothing new). The port is the slice port named
``port_name`` (or the first one). One endpoint may show up in two slices while the
EndpointSlice controller moves it; the serving copy wins.

The watch logic (:class:`SliceState`) is pure and tested against recorded watch event streams;
:class:`EndpointSliceSource` is the production loop, tested against a loopback HTTP server
that replays those streams to the real client (``tests/serving/test_kube.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from serving.discovery import EndpointSource
from serving.endpoints import Endpoint, EndpointStore, canonical
from serving.errors import DiscoveryError

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
HTTP_GONE = 410


@dataclass(frozen=True, kw_only=True)
class KubeConfig:
    namespace: str
    service: str
    #: name of the slice port to use; None = the first port
    port_name: str | None = None
    #: full relist period
    resync_s: float = 300.0
    #: server-side bound of one watch call
    watch_timeout_s: int = 60
    #: client-side bound of a list call
    request_timeout_s: float = 30.0
    #: kubeconfig path; None = in-cluster config, falling back to ~/.kube/config
    kubeconfig: str | None = None
    retry_max_s: float = 10.0


class ResourceExpired(DiscoveryError):
    """The watch's resource version is too old (HTTP 410): relist."""


def _fmt_host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr


def parse_slice(obj: dict, port_name: str | None = None) -> tuple[Endpoint, ...]:
    """The endpoints of one EndpointSlice object (API JSON form)."""
    port = None
    for p in obj.get("ports") or ():
        if p.get("port") is None:
            continue
        if port_name is None or p.get("name") == port_name:
            port = p["port"]
            break
    if port is None:
        return ()
    out = []
    for ep in obj.get("endpoints") or ():
        cond = ep.get("conditions") or {}
        ready = cond.get("ready")
        ready = True if ready is None else bool(ready)
        terminating = bool(cond.get("terminating") or False)
        zone = ep.get("zone")
        for addr in ep.get("addresses") or ():
            out.append(Endpoint(f"http://{_fmt_host(addr)}:{port}", zone, ready, terminating))
    return tuple(out)


class SliceState:
    """Per-slice endpoints of one Service, driven by list results and watch events. No I/O."""

    def __init__(self, port_name: str | None = None) -> None:
        self.port_name = port_name
        self.slices: dict[str, tuple[Endpoint, ...]] = {}
        self.resource_version: str | None = None

    def replace(self, listing: dict) -> None:
        """Reset from an EndpointSliceList (the list call's JSON)."""
        self.slices = {
            item["metadata"]["name"]: parse_slice(item, self.port_name)
            for item in listing.get("items") or ()
        }
        self.resource_version = (listing.get("metadata") or {}).get("resourceVersion")

    def apply(self, kind: str, obj: dict) -> bool:
        """Apply one watch event. Returns True if the endpoint set may have changed.

        Raises ResourceExpired for a 410 ERROR event, DiscoveryError for other errors.
        """
        if kind == "ERROR":
            code = obj.get("code")
            msg = f"{obj.get('reason')}: {obj.get('message')}"
            if code == HTTP_GONE:
                raise ResourceExpired(msg)
            raise DiscoveryError(f"watch error {code}: {msg}")
        meta = obj.get("metadata") or {}
        rv = meta.get("resourceVersion")
        if rv:
            self.resource_version = rv
        if kind == "BOOKMARK":
            return False
        name = meta.get("name")
        if name is None:
            return False
        if kind in ("ADDED", "MODIFIED"):
            self.slices[name] = parse_slice(obj, self.port_name)
        elif kind == "DELETED":
            self.slices.pop(name, None)
        else:
            log.warning("unknown watch event type %r", kind)
            return False
        return True

    def endpoints(self) -> tuple[Endpoint, ...]:
        return canonical(e for eps in self.slices.values() for e in eps)


def _api_client(cfg: KubeConfig):
    from kubernetes import client, config

    if cfg.kubeconfig:
        return config.new_client_from_config(config_file=cfg.kubeconfig)
    try:
        config.load_incluster_config()
        return client.ApiClient()
    except config.ConfigException:
        return config.new_client_from_config()


class EndpointSliceSource(EndpointSource):
    """Runs the list/watch loop in a thread (the client is synchronous) and feeds a store."""

    def __init__(self, cfg: KubeConfig, *, api_client=None) -> None:
        self.cfg = cfg
        self._api_client = api_client
        self._stop = threading.Event()
        self._watch = None
        self.lists = 0  # how many full lists were made (observability, tests)

    async def run(self, store: EndpointStore) -> None:
        loop = asyncio.get_running_loop()

        def publish(eps: tuple[Endpoint, ...]) -> None:
            loop.call_soon_threadsafe(store.update, eps)

        self._stop.clear()
        fut = loop.run_in_executor(None, self.run_blocking, publish)
        try:
            await asyncio.shield(fut)
        finally:
            self.stop()
            try:
                await asyncio.wait_for(asyncio.shield(fut), 5)
            except (TimeoutError, asyncio.CancelledError):
                pass

    def stop(self) -> None:
        self._stop.set()
        w = self._watch
        if w is not None:
            w.stop()

    def run_blocking(self, publish: Callable[[tuple[Endpoint, ...]], None]) -> None:
        """The list/watch/resync loop; returns when stop() is called."""
        from kubernetes import client, watch
        from kubernetes.client.rest import ApiException

        cfg = self.cfg
        api = client.DiscoveryV1Api(self._api_client or _api_client(cfg))
        selector = f"{SERVICE_NAME_LABEL}={cfg.service}"
        state = SliceState(cfg.port_name)
        delay = 0.5
        while not self._stop.is_set():
            try:
                resp = api.list_namespaced_endpoint_slice(
                    cfg.namespace,
                    label_selector=selector,
                    _preload_content=False,
                    _request_timeout=cfg.request_timeout_s,
                )
                state.replace(json.loads(resp.data))
                self.lists += 1
                publish(state.endpoints())
                log.info(
                    "listed %d slices of %s/%s at version %s",
                    len(state.slices),
                    cfg.namespace,
                    cfg.service,
                    state.resource_version,
                )
                delay = 0.5
                resync_at = time.monotonic() + cfg.resync_s
                while not self._stop.is_set():
                    left = resync_at - time.monotonic()
                    if left <= 0:
                        break  # periodic resync: list again
                    self._watch = w = watch.Watch()
                    timeout = max(1, min(cfg.watch_timeout_s, int(left)))
                    for ev in w.stream(
                        api.list_namespaced_endpoint_slice,
                        cfg.namespace,
                        label_selector=selector,
                        resource_version=state.resource_version,
                        allow_watch_bookmarks=True,
                        timeout_seconds=timeout,
                        _request_timeout=timeout + 10,
                    ):
                        if state.apply(ev["type"], ev["raw_object"]):
                            publish(state.endpoints())
                        if self._stop.is_set():
                            w.stop()
                            break
            except ResourceExpired as e:
                log.info("watch expired (%s); relisting", e)
            except ApiException as e:
                if e.status == HTTP_GONE:
                    log.info("watch expired (%s); relisting", e.reason)
                    continue
                log.warning(
                    "Kubernetes API error %s %s; retrying in %.1fs", e.status, e.reason, delay
                )
                self._stop.wait(delay)
                delay = min(cfg.retry_max_s, delay * 2)
            except Exception as e:  # urllib3/socket errors, bad JSON: keep the last set, retry
                if self._stop.is_set():
                    break
                log.warning(
                    "EndpointSlice watch failed (%s: %s); retrying in %.1fs",
                    type(e).__name__,
                    e,
                    delay,
                )
                self._stop.wait(delay)
                delay = min(cfg.retry_max_s, delay * 2)
