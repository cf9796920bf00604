"""Backend selection: power of two choices on in-flight requests, passive ejection, draining.

This module owns the router's load-balancing *policy* and nothing else: no sockets, no clock,
no global randomness. Time (``now``, monotonic seconds) and the random source are passed in,
so every decision is reproducible in tests and in the simulator.

Load estimate
    A router knows its own in-flight requests to each backend exactly and at once. Other
    routers (and this router's sibling worker processes) also send to the same backend; their
    share is only known from the backend's own report (vLLM's ``/metrics``:
    ``num_requests_running + num_requests_waiting``), which is a snapshot of some age. The
    score of a backend is therefore::

        own_inflight + w(age) * max(0, reported - own_inflight_at_report)

    where ``w(age) = 0.5 ** (age / half_life)`` and ``w = 0`` past ``max_age``: the report's
    "everyone else" part is trusted less the older it is, and a stale report degrades to the
    router's own counts instead of herding every router onto the backend that looked idle a
    while ago. The simulator in ``benchmarks/serving`` compares this with fresh and stale P2C.

Ejection
    A connection failure or a 5xx response counts as a failure. ``eject_after_failures``
    consecutive failures eject the backend for ``eject_base_s * 2**k`` (capped at
    ``eject_max_s``, with +-10% jitter so routers do not re-probe in lockstep). When the
    period ends the backend is eligible again; one more failure ejects it for twice as long,
    one success forgives it.

Zones
    With ``zone`` set (the router's own zone; endpoints carry theirs from EndpointSlices),
    P2C draws from the same-zone backends only, as long as at least ``zone_min_healthy`` of
    them (a fraction, at least one) are eligible; otherwise from all. Locality must not
    become a hot spot, so the same-zone choice is compared with one backend drawn from the
    whole eligible set and gives way to it when it carries more than ``1 + zone_spill``
    times that one's load plus ``zone_spill_min`` requests. The offset keeps light load local:
    a vLLM pod batches dozens of requests, and a few more on a same-zone pod cost less than
    a cross-zone hop. Retries ignore zones: they go wherever P2C sends them.

Draining
    A draining backend (Kubernetes: not ready or terminating) gets no new requests; the ones
    in flight finish. If every non-draining backend is ejected, the one whose ejection ends
    first is used anyway: a guess beats a certain 503 when, say, the network blipped for all.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

# Default half-life of a load report's weight. vLLM requests of ~50 tokens last ~100s of ms,
# so after a second the in-flight set a report described has mostly turned over.
DEFAULT_REPORT_HALF_LIFE_S = 1.0
# Reports older than this are ignored entirely (scrape failing, backend hung).
DEFAULT_REPORT_MAX_AGE_S = 5.0
# First ejection period; doubled per consecutive failure up to the cap.
DEFAULT_EJECT_BASE_S = 1.0
DEFAULT_EJECT_MAX_S = 30.0


@dataclass(frozen=True, kw_only=True)
class BalancerConfig:
    """Policy knobs of the balancer (all times in seconds)."""

    report_half_life_s: float = DEFAULT_REPORT_HALF_LIFE_S
    report_max_age_s: float = DEFAULT_REPORT_MAX_AGE_S
    eject_base_s: float = DEFAULT_EJECT_BASE_S
    eject_max_s: float = DEFAULT_EJECT_MAX_S
    #: consecutive failures before a backend is ejected
    eject_after_failures: int = 1
    #: this router's zone: prefer backends in it (None: no preference)
    zone: str | None = None
    #: prefer the zone while at least this fraction of its backends is eligible
    zone_min_healthy: float = 0.5
    #: leave the zone when the local choice's load exceeds another zone's backend's load
    #: times (1 + zone_spill), plus zone_spill_min
    zone_spill: float = 0.5
    zone_spill_min: float = 4.0


class Backend:
    """Mutable per-backend state, owned by one router process."""

    __slots__ = (
        "url",
        "zone",
        "inflight",
        "draining",
        "failures",
        "ejected_until",
        "ejections",
        "reported",
        "reported_at",
        "own_at_report",
        "peak",
        "key",
    )

    def __init__(self, url: str, *, zone: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.zone = zone
        self.inflight = 0
        self.draining = False
        self.failures = 0
        self.ejected_until = 0.0
        self.ejections = 0
        self.reported: float | None = None
        self.reported_at = 0.0
        self.own_at_report = 0
        #: highest inflight since the current load report was requested
        self.peak = 0
        self.key = self.url  # label value for metrics

    def __repr__(self) -> str:
        return f"Backend({self.url!r}, inflight={self.inflight}, draining={self.draining})"


def report_weight(age: float, cfg: BalancerConfig) -> float:
    """How much a load report of this age is trusted, in [0, 1]."""
    if age < 0:
        age = 0.0
    if age >= cfg.report_max_age_s:
        return 0.0
    return 0.5 ** (age / cfg.report_half_life_s)


def score(b: Backend, now: float, cfg: BalancerConfig) -> float:
    """Estimated outstanding requests at ``b``: own in-flight plus the decayed others' share."""
    s = float(b.inflight)
    if b.reported is not None:
        others = b.reported - b.own_at_report
        if others > 0:
            s += report_weight(now - b.reported_at, cfg) * others
    return s


def record_report(b: Backend, load: float, now: float, *, own: int | None = None) -> None:
    """Store a backend's reported load (running + waiting) observed at ``now``.

    ``own``: this router's in-flight requests to ``b`` to subtract from the report (default:
    ``b.inflight`` now). The backend counted our requests at one instant between sending the
    scrape and reading its answer, and our count moves meanwhile; with requests of a few
    milliseconds the difference is noise, and as ``score`` only counts a positive "others"
    share, noise would turn into phantom load. The router therefore passes the *highest*
    in-flight count of that window (:func:`begin_report` .. now), which can only under-
    estimate the others' share.
    """
    b.reported = load
    b.reported_at = now
    b.own_at_report = b.inflight if own is None else own


def begin_report(b: Backend) -> None:
    """A load report of ``b`` is being fetched: start tracking our peak in-flight count."""
    b.peak = b.inflight


def note_sent(b: Backend) -> None:
    """Count one more request in flight to ``b`` (keeps the peak :func:`record_report` uses)."""
    n = b.inflight = b.inflight + 1
    if n > b.peak:
        b.peak = n


def backoff(failures: int, cfg: BalancerConfig, rng: random.Random) -> float:
    """Ejection period after ``failures`` consecutive failures (>= eject_after_failures)."""
    k = max(0, failures - cfg.eject_after_failures)
    base = min(cfg.eject_max_s, cfg.eject_base_s * (2.0 ** min(k, 30)))
    return base * rng.uniform(0.9, 1.1)


class Balancer:
    """The set of backends of one router process and the P2C choice among them."""

    def __init__(
        self,
        cfg: BalancerConfig | None = None,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self.cfg = cfg or BalancerConfig()
        self.rng = rng or random.Random()
        self.backends: dict[str, Backend] = {}
        self._eligible: list[Backend] = []
        #: eligible backends in cfg.zone, or None when the zone is not preferred now
        self._local: list[Backend] | None = None
        # the eligible list is valid until this time (the next ejection expiry) or a change
        self._valid_until = -1.0

    # -- membership ---------------------------------------------------------------------------

    def add(self, url: str, *, zone: str | None = None) -> Backend:
        """Add a backend, or undrain it if known. Returns its state."""
        key = url.rstrip("/")
        b = self.backends.get(key)
        if b is None:
            b = self.backends[key] = Backend(key, zone=zone)
        else:
            b.draining = False
            b.zone = zone
        self._invalidate()
        return b

    def drain(self, url: str) -> None:
        """Stop sending new requests to ``url``; in-flight requests finish."""
        b = self.backends.get(url.rstrip("/"))
        if b is not None and not b.draining:
            b.draining = True
            self._invalidate()

    def set_endpoints(
        self, ready: Iterable[tuple[str, str | None]], draining: Iterable[str]
    ) -> None:
        """Apply a full endpoint set: ``ready`` (url, zone) pairs serve, everything else drains."""
        seen = set()
        for url, zone in ready:
            b = self.add(url, zone=zone)
            seen.add(b.url)
        for url in draining:
            key = url.rstrip("/")
            if key not in seen:
                if key not in self.backends:
                    continue  # never used, nothing to drain
                self.drain(key)
                seen.add(key)
        for key, b in self.backends.items():
            if key not in seen and not b.draining:
                b.draining = True
                self._invalidate()
        self.reap()

    def reap(self) -> list[str]:
        """Forget draining backends with nothing in flight. Returns their URLs."""
        gone = [k for k, b in self.backends.items() if b.draining and b.inflight == 0]
        for k in gone:
            del self.backends[k]
        if gone:
            self._invalidate()
        return gone

    def _invalidate(self) -> None:
        self._valid_until = -1.0

    def eligible(self, now: float) -> list[Backend]:
        """Backends that may take new requests now (not draining, not ejected)."""
        if now < self._valid_until:
            return self._eligible
        eligible = []
        next_expiry = float("inf")
        zone = self.cfg.zone
        local: list[Backend] = []
        in_zone = 0
        for b in self.backends.values():
            if b.draining:
                continue
            if zone is not None and b.zone == zone:
                in_zone += 1
            if b.ejected_until > now:
                next_expiry = min(next_expiry, b.ejected_until)
                continue
            eligible.append(b)
            if zone is not None and b.zone == zone:
                local.append(b)
        self._eligible = eligible
        self._local = local if local and len(local) >= self.cfg.zone_min_healthy * in_zone else None
        self._valid_until = next_expiry
        return eligible

    # -- choice -------------------------------------------------------------------------------

    def pick(self, now: float, *, exclude: Backend | None = None) -> Backend | None:
        """Power of two choices: the less loaded of two random eligible backends.

        ``exclude`` (the backend a retried request just failed on) is avoided if anything
        else is available. Returns None only when no non-draining backend exists.
        """
        cands = self.eligible(now)
        n = len(cands)
        if exclude is not None and n and exclude in cands:
            if n == 1:
                return self._fallback(now, exclude)
            # draw from the list without `exclude`, without copying it
            i = cands.index(exclude)
            a = int(self.rng.random() * (n - 1))
            a += a >= i
            if n == 2:
                return cands[a]
            c = int(self.rng.random() * (n - 2))
            lo, hi = (a, i) if a < i else (i, a)
            c += c >= lo
            c += c >= hi
            return self._better(cands[a], cands[c], now)
        if n == 0:
            return self._fallback(now, exclude)
        if n == 1:
            return cands[0]
        local = self._local
        if local is not None and exclude is None:
            return self._pick_local(local, cands, now)
        # int(random() * n), not randrange(n): the same uniform draw at a tenth of the cost
        rnd = self.rng.random
        a = int(rnd() * n)
        c = int(rnd() * (n - 1))
        c += c >= a
        return self._better(cands[a], cands[c], now)

    def _pick_local(self, local: list[Backend], cands: list[Backend], now: float) -> Backend:
        """P2C within the zone, giving way to a much less loaded backend elsewhere."""
        m = len(local)
        if m == 1:
            x = local[0]
        else:
            rnd = self.rng.random
            a = int(rnd() * m)
            c = int(rnd() * (m - 1))
            c += c >= a
            x = self._better(local[a], local[c], now)
        if m == len(cands):
            return x
        y = cands[int(self.rng.random() * len(cands))]
        if y.zone != self.cfg.zone:
            sy = score(y, now, self.cfg)
            cfg = self.cfg
            if score(x, now, cfg) > (1 + cfg.zone_spill) * sy + cfg.zone_spill_min:
                return y
        return x

    def _better(self, x: Backend, y: Backend, now: float) -> Backend:
        sx = score(x, now, self.cfg)
        sy = score(y, now, self.cfg)
        if sx < sy:
            return x
        if sy < sx:
            return y
        return x if self.rng.random() < 0.5 else y

    def _fallback(self, now: float, exclude: Backend | None) -> Backend | None:
        """Nothing eligible: the non-draining backend whose ejection ends first, if any."""
        best = None
        for b in self.backends.values():
            if b.draining or b is exclude:
                continue
            if best is None or b.ejected_until < best.ejected_until:
                best = b
        return best

    # -- outcomes -----------------------------------------------------------------------------

    def on_success(self, b: Backend) -> None:
        b.failures = 0

    def on_failure(self, b: Backend, now: float) -> bool:
        """Count a failure (connect error or 5xx). Returns True if the backend was ejected."""
        b.failures += 1
        if b.failures < self.cfg.eject_after_failures:
            return False
        b.ejected_until = now + backoff(b.failures, self.cfg, self.rng)
        b.ejections += 1
        self._invalidate()
        return True
