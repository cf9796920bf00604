"""Reading a repository's blobs from its mirrors first: the hosts of a hosts directory in
order, then the registry's server, as containerd pulls.

``HostChain.open_range`` asks each host that may ``pull`` in turn and returns the first
answer. A host that fails (an error, no answer within ``mirror_timeout``, a range cut short,
or bytes its caller found corrupt: ``RangeBody.reject``) is *backing off*: skipped for
``mirror_backoff`` seconds, twice that after a second failure in a row, and so on up to
``MAX_BACKOFF``; its next success ends it. A mirror that fails in the middle of a range
hands the rest of it to the next host, so its reader sees no error. The server is never
skipped (it is the last resort): its errors are the reader's. A mirror that answers 404
(it does not hold that blob) is passed over without backing off.

What each host did is counted for the metrics (``stats``): requests, bytes, errors, timeouts,
404s, rejected reads, and the requests that skipped it while it was backing off. The counts
and back-off belong to the process (a mount server), shared by every repository it reads
through the same host.

Nothing here checks bytes: whatever host served them, the caller verifies them against the
image's index (``imagetool.format``) and calls ``reject`` for those that fail.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from imagetool.errors import NotFoundError, StoreError, StoreTimeoutError
from imagetool.registry.client import RegistryClient, registry_hosts
from imagetool.stores.base import RangeBody, StoreOptions

log = logging.getLogger(__name__)

# Longest back-off of a host that keeps failing, in seconds.
MAX_BACKOFF = 600.0


class SourceHealth:
    """One host's counters and back-off, shared by the process (``health``)."""

    COUNTERS = ("requests", "bytes", "errors", "timeouts", "not_found", "rejected", "skipped")

    def __init__(self, url: str, mirror: bool) -> None:
        self.url = url
        self.mirror = mirror
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(self.COUNTERS, 0)
        self.failures = 0  # in a row
        self.until = 0.0  # time.monotonic() before which a mirror is skipped

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def available(self) -> bool:
        return time.monotonic() >= self.until

    def failed(self, kind: str, why: str, backoff: float) -> None:
        """A failure (``kind``: errors, timeouts or rejected): a mirror backs off."""
        with self._lock:
            self.counts[kind] += 1
            if not self.mirror:
                return
            self.failures += 1
            seconds = min(MAX_BACKOFF, backoff * 2 ** (self.failures - 1))
            self.until = time.monotonic() + seconds
        log.warning("mirror %s: %s; skipping it for %.0fs", self.url, why, seconds)

    def succeeded(self) -> None:
        if self.failures:
            with self._lock:
                self.failures = 0
                self.until = 0.0
            log.info("mirror %s answers again", self.url)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "url": self.url,
                "role": "mirror" if self.mirror else "server",
                **self.counts,
                "backoff_seconds": max(0.0, self.until - time.monotonic()),
            }


_health: dict[tuple[str, bool], SourceHealth] = {}
_health_lock = threading.Lock()


def health(url: str, mirror: bool) -> SourceHealth:
    """The process's ``SourceHealth`` of the host at API root ``url``."""
    with _health_lock:
        return _health.setdefault((url, mirror), SourceHealth(url, mirror))


class HostChain:
    """One repository of one registry, its blobs read from its mirrors first."""

    def __init__(self, host: str, repository: str, options: StoreOptions) -> None:
        hosts = registry_hosts(options, host)
        self.server = RegistryClient(host, repository, options, hosts[-1])
        self.mirrors = [
            RegistryClient(host, repository, options, h) for h in hosts[:-1] if h.can("pull")
        ]
        pullers = [*self.mirrors, *([self.server] if hosts[-1].can("pull") else [])]
        self.sources = [(c, health(c.api, c.endpoint.mirror)) for c in pullers]
        self.backoff = options.mirror_backoff
        self.where = f"{host}/{repository}"

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        """``RegistryClient.read_range`` from the first host that serves it."""
        if length == 0 or not self.mirrors:
            return self.server.read_range(digest, offset, length)
        out = bytearray(length)
        with self.open_range(digest, offset, length) as body:
            body.readinto(memoryview(out))
        return bytes(out)

    def open_range(self, digest: str, offset: int, length: int) -> RangeBody:
        """``RegistryClient.open_range`` from the first host that answers; a mirror that
        fails later hands the rest to the next host (``ChainBody``). Without mirrors, the
        server's own body."""
        if length == 0 or not self.mirrors:
            return self.server.open_range(digest, offset, length)
        body, at = self._open(0, digest, offset, length)
        return ChainBody(self, digest, offset, length, body, at)

    def _open(self, start: int, digest: str, offset: int, length: int) -> tuple[RangeBody, int]:
        """The range from the first host from ``start`` on that answers, and its place. The
        last host is asked even while it backs off: there is no other left."""
        if not self.sources:
            raise StoreError(f"{self.where}: no host may pull (see the hosts.toml capabilities)")
        last = len(self.sources) - 1
        for at in range(start, last + 1):
            client, state = self.sources[at]
            if at < last and not state.available():
                state.count("skipped")
                continue
            state.count("requests")
            try:
                return client.open_range(digest, offset, length), at
            except StoreError as e:
                if at == last:
                    self.failed(at, e)
                    raise
                self.failed(at, e)
        raise AssertionError("unreachable: the last host is always asked")

    def failed(self, at: int, error: StoreError) -> None:
        _, state = self.sources[at]
        if isinstance(error, NotFoundError):
            state.count("not_found")
        else:
            kind = "timeouts" if isinstance(error, StoreTimeoutError) else "errors"
            state.failed(kind, str(error), self.backoff)

    def stats(self) -> list[dict[str, Any]]:
        """Per host that may pull, in order: what it did for this process; nothing
        without mirrors (the store's own counts say it all)."""
        return [state.snapshot() for _, state in self.sources] if self.mirrors else []

    def close(self) -> None:
        for client in self.mirrors:
            client.close()
        self.server.close()


class ChainBody(RangeBody):
    """A range read from a ``HostChain``'s hosts: from the one that answered, and from the
    next ones if it fails before the end."""

    def __init__(
        self, chain: HostChain, digest: str, offset: int, length: int, body: RangeBody, at: int
    ) -> None:
        super().__init__(body.where, length)
        self._chain = chain
        self._digest = digest
        self._offset = offset
        self._body = body
        self._at = at
        self._touched: set[int] = set()  # hosts that served bytes of the last readinto

    def readinto(self, out: memoryview) -> None:
        self._touched.clear()
        super().readinto(out)

    def _read_some(self, out: memoryview) -> int:
        while True:
            state = self._chain.sources[self._at][1]
            try:
                n = self._body.read_some(out)
                if n == 0:
                    raise StoreError(
                        f"{self._body.where}: the range ended after {self._body.position} of "
                        f"{self._body.length} bytes"
                    )
            except StoreError as e:
                self._chain.failed(self._at, e)
                if self._at == len(self._chain.sources) - 1:
                    raise
                self._body.close()
                rest = self.length - self.position
                self._body, self._at = self._chain._open(
                    self._at + 1, self._digest, self._offset + self.position, rest
                )
                self.where = self._body.where
                continue
            state.count("bytes", n)
            self._touched.add(self._at)
            if self.position + n == self.length:
                state.succeeded()
            return n

    def reject(self, reason: str) -> None:
        for at in sorted(self._touched):
            self._chain.sources[at][1].failed("rejected", reason, self._chain.backoff)

    def close(self) -> None:
        self._body.close()
