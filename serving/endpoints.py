"""Endpoints and versioned endpoint sets: the data the EDS serves and the router consumes.

An ``Endpoint`` is one backend URL with its zone and state. ``ready and not terminating`` means
it may take new requests; anything else that is still listed is *draining* (in-flight requests
finish, nothing new is sent). The wire form (EDS stream, endpoint files) is JSON::

    {"version": 7, "endpoints": [{"url": "http://10.0.0.5:8000", "zone": "a",
                                  "ready": true, "terminating": false}]}

Endpoint files may also be plain text, one endpoint per line (``#`` comments)::

    http://10.0.0.5:8000 zone=a
    http://10.0.0.6:8000 zone=b draining
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from serving.errors import ConfigError


@dataclass(frozen=True, order=True)
class Endpoint:
    url: str
    zone: str | None = None
    ready: bool = True
    terminating: bool = False

    @property
    def serving(self) -> bool:
        """May take new requests."""
        return self.ready and not self.terminating

    def to_json(self) -> dict:
        return {
            "url": self.url,
            "zone": self.zone,
            "ready": self.ready,
            "terminating": self.terminating,
        }

    @classmethod
    def from_json(cls, d: dict) -> Endpoint:
        try:
            return cls(
                url=normalize_url(d["url"]),
                zone=d.get("zone"),
                ready=bool(d.get("ready", True)),
                terminating=bool(d.get("terminating", False)),
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"bad endpoint {d!r}") from e


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port[/]`` → ``http://host:port``; rejects anything else."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http",) or not parts.hostname or parts.port is None:
        raise ConfigError(f"backend must be http://host:port, got {url!r}")
    if parts.path not in ("", "/") or parts.query:
        raise ConfigError(f"backend URL must not have a path: {url!r}")
    return f"http://{parts.netloc}"


def canonical(endpoints: Iterable[Endpoint]) -> tuple[Endpoint, ...]:
    """Sorted, one entry per URL (a serving entry wins over a draining duplicate)."""
    by_url: dict[str, Endpoint] = {}
    for e in endpoints:
        old = by_url.get(e.url)
        if old is None or (e.serving and not old.serving):
            by_url[e.url] = e
    return tuple(sorted(by_url.values()))


def parse_endpoint_text(text: str) -> tuple[Endpoint, ...]:
    """Parse an endpoint file: JSON (``{"endpoints": [...]}`` or a list) or one URL per line."""
    stripped = text.strip()
    if stripped.startswith(("{", "[")):
        try:
            doc = json.loads(stripped)
        except ValueError as e:
            raise ConfigError(f"bad endpoint JSON: {e}") from e
        items = doc.get("endpoints", []) if isinstance(doc, dict) else doc
        return canonical(
            Endpoint.from_json(d if isinstance(d, dict) else {"url": d}) for d in items
        )
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        url, *attrs = line.split()
        zone = None
        ready, terminating = True, False
        for a in attrs:
            if a.startswith("zone="):
                zone = a[5:]
            elif a in ("draining", "terminating"):
                terminating = True
            elif a in ("notready", "unready"):
                ready = False
            else:
                raise ConfigError(f"unknown endpoint attribute {a!r} in line {line!r}")
        out.append(Endpoint(normalize_url(url), zone, ready, terminating))
    return canonical(out)


def encode(version: int, endpoints: Iterable[Endpoint]) -> str:
    return json.dumps(
        {"version": version, "endpoints": [e.to_json() for e in endpoints]}, separators=(",", ":")
    )


def decode(text: str) -> tuple[int, tuple[Endpoint, ...]]:
    try:
        doc = json.loads(text)
        return int(doc["version"]), canonical(Endpoint.from_json(d) for d in doc["endpoints"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"bad endpoint set: {e}") from e


class EndpointStore:
    """The current endpoint set with a version that increases on every change.

    Sources write full snapshots with ``update``; readers wait for a version newer than the one
    they hold. Lives on one event loop; threads use ``loop.call_soon_threadsafe(store.update,..)``.
    """

    def __init__(self) -> None:
        self.version = 0
        self.endpoints: tuple[Endpoint, ...] = ()
        self._changed = asyncio.Event()

    def update(self, endpoints: Iterable[Endpoint]) -> bool:
        """Replace the set. Returns True (and bumps the version) if it changed."""
        new = canonical(endpoints)
        if new == self.endpoints and self.version:
            return False
        self.endpoints = new
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()
        return True

    async def wait_newer(self, version: int, timeout: float) -> bool:
        """Wait until ``self.version > version``; False on timeout."""
        if self.version > version:
            return True
        ev = self._changed
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except TimeoutError:
            return False
        return self.version > version
