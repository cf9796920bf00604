"""Fetching sectors: local cache first, then ranged reads from the store, always verified.

``SectorFetcher.get(numbers, deadline)`` returns the decoded, verified bytes of the sectors it
is asked for, or raises ``FetchError``. It owns the policy between the data path and the
store:

* **Cache first.** A sector in the node's ``SectorCache`` costs no request. All-zero
  sectors are not stored anywhere and cost nothing.
* **Single flight.** Each missing sector has at most one fetch in flight; concurrent readers
  of the same sector wait on that fetch instead of issuing their own.
* **Coalescing.** Misses that are adjacent in one data blob (consecutive sectors of it, or
  separated only by all-zero sectors, which no blob holds, or by other blobs' sectors) become
  one ranged read of that blob, up to
  ``max_request_bytes`` (a longer run is cut into even pieces). Every request costs the store
  (and us) a fixed overhead: a loopback docker-registry spends ~5 ms of CPU on each, and
  with one request per 2 MiB compressed sector it was the biggest user of CPU after the
  mount server.
* **Streaming.** A request's sectors are verified, cached and handed out one by one as their
  bytes arrive (``Store.open_range``), so a 16 MiB request delivers its first sector after
  2 MiB of it, and a read that fails half-way keeps the sectors it delivered.
* **Bounded parallelism, priorities.** Reads are jobs on a priority queue served by
  ``max_parallel`` worker threads; on-demand jobs always go before prefetch jobs, a prefetch
  job is promoted when an on-demand reader starts waiting on it, and prefetch work never
  holds more than ``max_parallel_prefetch`` workers. Prefetch is never starved for good
  either: while no prefetch job runs, one that has waited ``PREFETCH_MAX_WAIT`` seconds
  behind other work takes the next free worker. ``prefetch(numbers)`` queues prefetch jobs
  without waiting for them (``snapshotter.datapath.prefetch`` keeps a window of them in
  flight).
* **Read-ahead.** ``readahead(numbers)`` starts fetches without waiting for them (for a
  sequential reader, ``snapshotter.datapath.reader``): they queue behind on-demand reads and
  ahead of prefetch, are promoted when a reader starts waiting on them, and
  ``cancel_readahead`` drops those nobody waits on yet. Sectors already cached are only
  hinted to the kernel.
* **Verification.** Every stored sector goes through ``Index.decode_sector_into`` before it is
  cached or returned (a raw sector is received straight into its memory and checked there,
  ``Index.verify_raw``: a hash, no decompression, no copy); a sector that fails is refetched
  (counting against ``retries``) and never served or cached.
* **Timeouts that hold.** The store is called on a separate thread per request and the worker
  waits at most ``request_timeout`` for each of its sectors, so a store call that hangs is
  abandoned (the rest of its result ignored), not waited on; a reader waits at most until
  its deadline and then gets ``FetchTimeoutError``. Hung calls keep their thread until the
  store answers; past ``max_stuck_requests`` of them new requests fail at once instead of
  piling up threads.
  One thing is remembered about failures: for ``timeout_memory`` seconds after a sector's
  fetch missed a deadline, unless the store answers a request meanwhile, readers of it wait
  at most ``RETRY_WAIT`` (the fetch itself is tried again with the full deadline). The
  kernel retries a failed read straight away and readers of one page queue behind each
  other, so without it one application read would wait out several deadlines. Once the
  store answers again, reads succeed.

Deadlines are absolute ``time.monotonic()`` values, so one deadline can span several calls.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from enum import IntEnum
from typing import Protocol

from imagetool.errors import (
    AuthError,
    ChecksumError,
    NotFoundError,
    StoreTimeoutError,
)
from imagetool.format import Index, blob_range, blob_runs, coalesce
from imagetool.stores.base import Store
from snapshotter.cache.entry import VERIFY_BLOCK, EntryBuffer
from snapshotter.cache.sectors import SectorCache
from snapshotter.config import FetchConfig
from snapshotter.errors import ClosedError, FetchError, FetchTimeoutError, InvalidReadError
from snapshotter.metrics import Counter, MountMetrics

log = logging.getLogger(__name__)

# A sector's decoded, verified bytes: ``bytes``, or a read-only view of the memory a fetched
# sector was decoded into (freed with the last reference to it).
SectorBytes = bytes | memoryview

# Seconds a reader waits for a sector whose fetch missed its deadline moments ago (see
# FetchConfig.timeout_memory): long enough for a store that is back to deliver, short enough
# that the kernel's retries of a failed read do not each wait out a whole deadline.
RETRY_WAIT = 0.5
# Seconds a queued prefetch job may wait behind on-demand and read-ahead work while no
# prefetch job runs; then it takes the next free worker (a reader that never stops
# streaming must not stall the profile's prefetch for good).
PREFETCH_MAX_WAIT = 2.0
# Store errors that another attempt cannot fix.
_PERMANENT = (NotFoundError, AuthError)


class FlightWatch(Protocol):
    """What ``SectorFetcher.watch_flights`` tells of the sectors being fetched."""

    def pending(self, n: int, /) -> None: ...

    def settled(self, n: int, /) -> None: ...


class Priority(IntEnum):
    """Queue order of fetch jobs: lower goes first."""

    DEMAND = 0  # a reader (the FUSE file) is waiting
    READAHEAD = 1  # ahead of a sequential reader, who will want it soon
    PREFETCH = 2  # background warming


class _Job:
    """One coalesced ranged read: consecutive stored sectors of the blob."""

    __slots__ = ("sectors", "priority", "origin", "deadline", "taken", "unwanted", "queued")

    def __init__(self, sectors: list[int], priority: Priority, deadline: float) -> None:
        self.sectors = sectors
        self.priority = priority
        self.origin = priority  # who asked first (``priority`` rises as readers join)
        self.deadline = deadline  # the latest deadline of anyone waiting on it
        self.taken = False
        self.unwanted = priority == Priority.READAHEAD  # nobody waits on it (yet)
        self.queued = time.monotonic()


class _Flight:
    """The one fetch of one sector that everybody wanting it waits on."""

    __slots__ = ("job", "done", "data", "error")

    def __init__(self, job: _Job) -> None:
        self.job = job
        self.done = threading.Event()
        self.data: SectorBytes | None = None
        self.error: BaseException | None = None


class PrefetchBatch:
    """Sectors ``SectorFetcher.prefetch`` queued: their stored ``bytes``, and a wait for all
    of them."""

    __slots__ = ("sectors", "bytes", "_flights")

    def __init__(self, sectors: list[int], stored: int, flights: list[_Flight]) -> None:
        self.sectors = sectors
        self.bytes = stored
        self._flights = flights

    def wait(self, timeout: float) -> bool:
        """Whether every sector is done (fetched or failed) within ``timeout`` seconds."""
        end = time.monotonic() + timeout
        return all(f.done.wait(max(0.0, end - time.monotonic())) for f in self._flights)

    @property
    def error(self) -> BaseException | None:
        """What the first failed sector failed with (once ``wait`` is true)."""
        return next((f.error for f in self._flights if f.error is not None), None)


class _Transfer:
    """One ranged read on its store thread, as the worker waiting on it sees it."""

    __slots__ = ("sectors", "cond", "delivered", "last", "error", "finished", "abandoned")

    def __init__(self, sectors: list[int]) -> None:
        self.sectors = sectors
        self.cond = threading.Condition()
        self.delivered: set[int] = set()  # handed out (or being handed out) by the thread
        self.last = time.monotonic()  # when the read started or last delivered a sector
        self.error: BaseException | None = None  # what stopped the rest
        self.finished = False
        self.abandoned = False  # the worker stopped waiting

    def claim(self, n: int) -> bool:
        """Sector ``n`` is about to be delivered; False if the worker has given up."""
        with self.cond:
            if self.abandoned:
                return False
            self.delivered.add(n)
            return True

    def advance(self) -> None:
        """A sector was delivered: the read is alive."""
        with self.cond:
            self.last = time.monotonic()

    def fail(self, error: BaseException) -> None:
        """A sector did not verify; the read goes on with the others."""
        with self.cond:
            self.error = error
            self.last = time.monotonic()

    def finish(self) -> bool:
        """The thread is done; returns whether the worker had abandoned it."""
        with self.cond:
            self.finished = True
            self.cond.notify()
            return self.abandoned


class SectorFetcher:
    """Verified sectors of one image from ``cache`` or ``store``."""

    def __init__(
        self,
        store: Store,
        index: Index,
        cache: SectorCache,
        config: FetchConfig | None = None,
        metrics: MountMetrics | None = None,
    ) -> None:
        self.store = store
        self.index = index
        self.cache = cache
        self.config = config or FetchConfig()
        self.metrics = metrics or MountMetrics()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queue: list[tuple[int, int, _Job]] = []  # heap; may hold stale entries
        self._prefetch_fifo: deque[_Job] = deque()  # queued prefetch jobs, oldest first
        self._seq = itertools.count()
        self._inflight: dict[str, _Flight] = {}  # by checksum: one fetch per content
        self._running_prefetch = 0
        self._stuck = 0
        self._timed_out: dict[str, float] = {}  # checksum -> when its fetch missed a deadline
        self.readahead_sectors = Counter()  # sectors read ahead of a sequential reader
        self._warming: deque[str] = deque()  # cached entries to get ready, for read-ahead
        self._listeners: list[Callable[[int, SectorBytes], None]] = []
        self._demand_listeners: list[Callable[[list[int]], None]] = []
        self._flight_watch: FlightWatch | None = None
        # Transfer buffers (``_take_buffer``): one per request in flight, kept for reuse.
        self._buffer_size = max((s.length for s in index.sectors), default=0)
        self._buffers: list[bytearray] = []
        self._warmer_running = False
        self._readahead_within: frozenset[int] | None = None  # ``limit_readahead``
        self._closed = threading.Event()
        self._workers = [
            threading.Thread(target=self._worker, name=f"lazyblock-fetch-{i}", daemon=True)
            for i in range(self.config.max_parallel)
        ]
        for t in self._workers:
            t.start()

    # --- public ---------------------------------------------------------------------------

    def get(
        self,
        numbers: Iterable[int],
        deadline: float | None = None,
        priority: Priority = Priority.DEMAND,
    ) -> dict[int, SectorBytes]:
        """Decoded, verified bytes of each sector in ``numbers``.

        ``deadline`` is a ``time.monotonic()`` value (default: now + ``config.deadline``).
        Raises ``FetchError`` (``FetchTimeoutError`` when the deadline passes first).
        """
        if deadline is None:
            deadline = time.monotonic() + self.config.deadline
        wanted = sorted(set(numbers))
        if wanted and (wanted[0] < 0 or wanted[-1] >= self.index.sector_count):
            raise InvalidReadError(f"sector numbers out of range: {wanted[0]}..{wanted[-1]}")
        if priority is Priority.DEMAND:
            for listener in self._demand_listeners:
                listener(wanted)
        try:
            return self._get(wanted, deadline, priority)
        except FetchError as e:
            self.metrics.fetch_errors.inc()
            if isinstance(e, FetchTimeoutError) or isinstance(e.__cause__, StoreTimeoutError):
                self._remember_timeout(e.sectors)
            raise

    def missing(self, numbers: Iterable[int]) -> list[int]:
        """Those of ``numbers`` that are stored, not cached and not being fetched: what a
        prefetch of them would have to fetch."""
        sectors = self.index.sectors
        with self._lock:
            return [
                n
                for n in numbers
                if not sectors[n].is_zero
                and sectors[n].checksum not in self._inflight
                and sectors[n].checksum not in self.cache
            ]

    def read_cached(self, n: int, offset: int, length: int) -> bytes | None:
        """Bytes ``[offset, offset+length)`` of sector ``n`` if the cache holds it (verified,
        see ``SectorCache.read``), else None. Costs no request."""
        entry = self.index.sectors[n]
        if entry.is_zero:
            return None
        data = self.cache.read(entry.checksum, offset, length, self.index.sector_span(n)[1])
        if data is not None:
            self.metrics.cache_hits.inc()
        return data

    def read_cached_view(
        self, n: int, offset: int, length: int, scratch: memoryview, *, sequential: bool = False
    ) -> tuple[memoryview, int] | None:
        """Bytes ``[offset, offset+length)`` of sector ``n`` from the cache, read into
        ``scratch`` (``SectorCache.read_view``: the view, and the scratch it took), or None.
        Costs no request."""
        entry = self.index.sectors[n]
        if entry.is_zero:
            return None
        size = self.index.sector_span(n)[1]
        got = self.cache.read_view(
            entry.checksum, offset, length, scratch, size, sequential=sequential
        )
        if got is not None:
            self.metrics.cache_hits.inc()
        return got

    def cached_entry(self, n: int, check: bool = False) -> tuple[str, bytes, int] | None:
        """Sector ``n``'s cache entry for reading elsewhere (``SectorCache.direct_entry``,
        ``check`` its trailer if this process has not): its path, block digests and block
        size, or None."""
        entry = self.index.sectors[n]
        if entry.is_zero:
            return None
        return self.cache.direct_entry(entry.checksum, self.index.sector_span(n)[1], check)

    def on_fetched(self, callback: Callable[[int, SectorBytes], None]) -> None:
        """Call ``callback(n, data)`` with every sector fetched from the store and verified,
        whoever asked for it (read-ahead and prefetch too), on the fetching thread, before
        the sector is written to the cache: the reader keeps the latest in memory."""
        self._listeners.append(callback)

    def on_demand(self, callback: Callable[[list[int]], None]) -> None:
        """Call ``callback(numbers)`` with the sectors of every on-demand ``get`` (a reader
        that found them neither in memory nor in the cache), on the reader's thread, before
        they are fetched: the prefetcher learns from it which large file a start reads."""
        self._demand_listeners.append(callback)

    def watch_flights(self, watch: FlightWatch) -> None:
        """Tell ``watch`` which sectors are being fetched from the store now: ``pending(n)``
        when a worker starts on sector ``n``, ``settled(n)`` when its fetch ends, after the
        listeners of ``on_fetched`` had it if it succeeded. Called with the fetcher's lock
        held: ``watch`` must be quick and never call back."""
        self._flight_watch = watch

    def limit_readahead(self, sectors: frozenset[int] | None) -> None:
        """Read ahead only among ``sectors`` (None: anywhere). The prefetcher limits it to a
        trusted profile while the start stays inside it: the profile says what the start
        reads, and a sequential reader's next sectors outside it are a guess that costs the
        link and the CPU what the start needs (48 MB on the benchmark's ML start, read ahead
        of the parts of a library the start reads)."""
        self._readahead_within = sectors

    def readahead(self, numbers: Iterable[int], deadline: float | None = None) -> int:
        """Start fetching those of ``numbers`` that are neither cached nor in flight, without
        waiting; for cached ones, have the kernel start reading them from disk. Returns how
        many sectors it queued."""
        if (within := self._readahead_within) is not None:
            numbers = [n for n in numbers if n in within]
        try:
            new, _, cached = self._enqueue(numbers, Priority.READAHEAD, deadline)
        except ClosedError:
            return 0
        if cached:
            with self._lock:
                self._warming.extend(c for c in cached if c not in self._warming)
                start = not self._warmer_running and not self._closed.is_set()
                self._warmer_running = self._warmer_running or start
            if start:
                threading.Thread(target=self._warm, name="lazyblock-warm", daemon=True).start()
        self.readahead_sectors.inc(len(new))
        return len(new)

    def prefetch(self, numbers: Iterable[int], deadline: float | None = None) -> PrefetchBatch:
        """Queue fetches, at prefetch priority, of those of ``numbers`` that are neither
        cached nor in flight, without waiting for them; returns them as a batch to wait on
        (empty if there was nothing to fetch). Raises ``ClosedError`` once closed."""
        new, flights, _ = self._enqueue(numbers, Priority.PREFETCH, deadline)
        sectors = self.index.sectors
        return PrefetchBatch(new, sum(sectors[n].length for n in new), flights)

    def _enqueue(
        self, numbers: Iterable[int], priority: Priority, deadline: float | None
    ) -> tuple[list[int], list[_Flight], list[str]]:
        """Queue jobs at ``priority`` for those of ``numbers`` neither cached nor in flight
        (one per sector content), without waiting: (the sectors queued, in order, their
        flights, the checksums of those already cached). ``ClosedError`` once closed."""
        if deadline is None:
            deadline = time.monotonic() + self.config.deadline
        sectors = self.index.sectors
        new: dict[str, int] = {}
        cached: list[str] = []
        flights: list[_Flight] = []
        with self._work:
            if self._closed.is_set():
                raise ClosedError("fetcher closed")
            for n in numbers:
                checksum = sectors[n].checksum
                if sectors[n].is_zero or checksum in self._inflight or checksum in new:
                    continue
                if checksum in self.cache:
                    cached.append(checksum)
                    continue
                new[checksum] = n
            for run in self._plan(sorted(new.values())):
                job = _Job(run, priority, deadline)
                for n in run:
                    flight = self._inflight[sectors[n].checksum] = _Flight(job)
                    flights.append(flight)
                self._push(job)
        return sorted(new.values()), flights, cached

    def _warm(self) -> None:
        """Get cached sectors read ahead ready: verified, or on their way from disk."""
        while True:
            with self._lock:
                if not self._warming or self._closed.is_set():
                    self._warmer_running = False
                    return
                checksum = self._warming.popleft()
            try:
                self.cache.will_need(checksum)
            except Exception:  # an optimisation; the read itself will say what is wrong
                log.debug("warming cache entry %s failed", checksum, exc_info=True)

    def cancel_readahead(self, numbers: Iterable[int]) -> int:
        """Drop the queued read-ahead fetches of ``numbers`` that nobody waits on; returns
        how many sectors were dropped."""
        sectors = self.index.sectors
        dropped: list[_Flight] = []
        with self._work:
            for n in numbers:
                flight = self._inflight.get(sectors[n].checksum)
                if flight is None or flight.job.taken or not flight.job.unwanted:
                    continue
                job = flight.job
                job.taken = True  # the worker skips it
                self.metrics.queued.dec()
                for m in job.sectors:
                    if (f := self._pop_flight(m)) is not None:
                        dropped.append(f)
        self._settle(dropped, ClosedError("read-ahead cancelled"))
        return len(dropped)

    def close(self) -> None:
        """Stop the workers; queued and in-flight reads fail with ``ClosedError``."""
        with self._work:
            if self._closed.is_set():
                return
            self._closed.set()
            flights = list(self._inflight.items())
            self._inflight.clear()
            if (watch := self._flight_watch) is not None:
                for _, flight in flights:
                    for n in flight.job.sectors:
                        watch.settled(n)
            self._queue.clear()
            self._prefetch_fifo.clear()
            self.metrics.queued.set(0)
            self._work.notify_all()
        self._settle([flight for _, flight in flights], ClosedError("fetcher closed"))

    def __enter__(self) -> SectorFetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the read side --------------------------------------------------------------------

    def _get(
        self, wanted: list[int], deadline: float, priority: Priority
    ) -> dict[int, SectorBytes]:
        index, sectors = self.index, self.index.sectors
        result: dict[int, SectorBytes] = {}
        stored = []
        for n in wanted:
            if sectors[n].is_zero:
                result[n] = index.decode_sector(n, b"")
                self.metrics.zero_sectors.inc()
            else:
                stored.append(n)
        if not stored:
            return result
        wait_deadline = self._wait_deadline(stored, deadline) if self._timed_out else deadline
        with self.cache.pin(sectors[n].checksum for n in stored):
            remaining = set(stored)
            tried_cache: set[int] = set()
            while remaining:
                from_cache, waits = self._claim(remaining, tried_cache, deadline, priority)
                for n in from_cache:
                    tried_cache.add(n)
                    data = self._from_cache(n)
                    if data is not None:
                        result[n] = data
                        remaining.discard(n)
                for n, flight in waits.items():
                    waited = time.monotonic()
                    done = flight.done.wait(max(0.0, wait_deadline - waited))
                    if priority == Priority.DEMAND:
                        self._stalled(flight, time.monotonic() - waited)
                    if not done:
                        left = tuple(sorted(n for n in remaining if n not in result))
                        raise FetchTimeoutError(
                            f"sectors {_show(left)} not fetched before the deadline", left
                        )
                    if (err := flight.error) is not None:
                        # A new exception per reader: the flight's error is shared.
                        if isinstance(err, FetchError):
                            raise type(err)(str(err), (n,)) from err
                        raise FetchError(f"sector {n}: {type(err).__name__}: {err}", (n,)) from err
                    assert flight.data is not None
                    result[n] = flight.data
                    remaining.discard(n)
        return result

    def _stalled(self, flight: _Flight, seconds: float) -> None:
        """A reader waited ``seconds`` on the network for ``flight``: for a sector read
        ahead or prefetched that had not arrived yet (too late), or for one nobody had
        asked for before a reader needed it (not prefetched at all)."""
        if flight.job.origin == Priority.DEMAND:
            self.metrics.stall_missing_seconds.add(seconds)
        else:
            self.metrics.stall_late_seconds.add(seconds)

    def _claim(
        self, remaining: set[int], tried_cache: set[int], deadline: float, priority: Priority
    ) -> tuple[list[int], dict[int, _Flight]]:
        """Sort the sectors still wanted into cache reads and flights to wait on, starting
        flights (and queueing their jobs) for the rest."""
        sectors = self.index.sectors
        from_cache: list[int] = []
        waits: dict[int, _Flight] = {}
        new: dict[str, int] = {}  # checksum -> the sector that will fetch it
        same: list[int] = []  # sectors whose content another new sector fetches
        with self._work:
            if self._closed.is_set():
                raise ClosedError("fetcher closed")
            for n in sorted(remaining):
                checksum = sectors[n].checksum
                flight = self._inflight.get(checksum)
                if flight is not None:
                    self._join(flight.job, deadline, priority)
                    waits[n] = flight
                elif checksum in new:
                    same.append(n)
                elif n not in tried_cache and checksum in self.cache:
                    from_cache.append(n)
                    continue
                else:
                    new[checksum] = n
                self.metrics.cache_misses.inc()
            for run in self._plan(list(new.values())):
                job = _Job(run, priority, deadline)
                for n in run:
                    waits[n] = self._inflight[sectors[n].checksum] = _Flight(job)
                self._push(job)
            for n in same:
                waits[n] = self._inflight[sectors[n].checksum]
        return from_cache, waits

    def _remember_timeout(self, numbers: Iterable[int]) -> None:
        """Note that the store missed a deadline for sectors ``numbers`` just now (see
        ``FetchConfig.timeout_memory``)."""
        if self.config.timeout_memory <= 0:
            return
        now = time.monotonic()
        sectors = self.index.sectors
        with self._lock:
            for n in numbers:
                self._timed_out[sectors[n].checksum] = now

    def _wait_deadline(self, stored: list[int], deadline: float) -> float:
        """How long a reader of ``stored`` waits: ``deadline``, or only ``RETRY_WAIT`` if the
        store missed a deadline for one of them moments ago and has not answered since."""
        now, memory = time.monotonic(), self.config.timeout_memory
        sectors = self.index.sectors
        with self._lock:
            for checksum in [c for c, t in self._timed_out.items() if now - t >= memory]:
                del self._timed_out[checksum]
            recent = any(sectors[n].checksum in self._timed_out for n in stored)
        return min(deadline, now + RETRY_WAIT) if recent else deadline

    def _from_cache(self, n: int) -> bytes | None:
        # The size is checked too: the same checksum with another length is not this sector.
        data = self.cache.read(
            self.index.sectors[n].checksum, 0, None, self.index.sector_span(n)[1]
        )
        if data is None:
            return None
        self.metrics.cache_hits.inc()
        return data

    def _plan(self, numbers: list[int]) -> list[list[int]]:
        """Coalesce stored sectors into runs contiguous in one blob (``blob_runs``), each
        cut into as few requests of at most ``max_request_bytes`` as it takes, of about
        equal size: four 2.1 MB sectors under an 8 MiB limit are two requests of two, not
        three and one. A single sector is never split."""
        most = self.config.max_request_bytes
        return [piece for run in blob_runs(self.index, numbers) for piece in self._split(run, most)]

    def _split(self, run: list[int], most: int) -> list[list[int]]:
        """``run`` (blob-contiguous stored sectors) in the fewest pieces of about equal size
        that each fit in ``most`` bytes (or are one sector)."""
        sectors = self.index.sectors
        base = sectors[run[0]].offset
        total = sectors[run[-1]].offset + sectors[run[-1]].length - base
        count = max(1, -(-total // most))
        while True:
            # A sector goes to the piece its middle falls in.
            pieces: list[list[int]] = [[] for _ in range(count)]
            for n in run:
                middle = sectors[n].offset - base + sectors[n].length // 2
                pieces[min(count - 1, middle * count // total)].append(n)
            pieces = [p for p in pieces if p]
            if all(len(p) == 1 or self._span(p) <= most for p in pieces):
                return pieces
            count += 1

    def _span(self, piece: list[int]) -> int:
        sectors = self.index.sectors
        return sectors[piece[-1]].offset + sectors[piece[-1]].length - sectors[piece[0]].offset

    def _join(self, job: _Job, deadline: float, priority: Priority) -> None:
        """A reader starts waiting on ``job``: it runs until the latest deadline and at the
        most urgent priority of its readers. Lock held."""
        job.deadline = max(job.deadline, deadline)
        job.unwanted = False
        if priority < job.priority and not job.taken:
            job.priority = priority
            heapq.heappush(self._queue, (job.priority, next(self._seq), job))
            self._work.notify()

    def _push(self, job: _Job) -> None:
        heapq.heappush(self._queue, (job.priority, next(self._seq), job))
        if job.priority == Priority.PREFETCH:
            self._prefetch_fifo.append(job)
        self.metrics.queued.inc()
        self._work.notify()

    # --- the worker side ------------------------------------------------------------------

    def _next_job(self) -> _Job | None:
        """Pop the most urgent runnable job, skipping stale heap entries; or a prefetch job
        that has waited too long (``PREFETCH_MAX_WAIT``). Lock held."""
        fifo = self._prefetch_fifo
        while fifo and (fifo[0].taken or fifo[0].priority != Priority.PREFETCH):
            fifo.popleft()  # run, cancelled, or promoted by a reader
        if (
            fifo
            and self._running_prefetch == 0
            and self.config.prefetch_workers > 0
            and time.monotonic() - fifo[0].queued >= PREFETCH_MAX_WAIT
        ):
            return fifo.popleft()  # its heap entry goes stale: it is taken
        while self._queue:
            prio, _, job = self._queue[0]
            if job.taken or prio != job.priority:
                heapq.heappop(self._queue)
                continue
            if prio == Priority.PREFETCH and self._running_prefetch >= self.config.prefetch_workers:
                return None
            heapq.heappop(self._queue)
            return job
        return None

    def _worker(self) -> None:
        while True:
            with self._work:
                while (job := self._next_job()) is None:
                    if self._closed.is_set():
                        return
                    # Woken by new work and finished prefetch jobs; the timeout lets a
                    # prefetch job that has waited long enough be seen (PREFETCH_MAX_WAIT).
                    self._work.wait(PREFETCH_MAX_WAIT if self._prefetch_fifo else None)
                if self._closed.is_set():
                    return
                job.taken = True
                if (watch := self._flight_watch) is not None:
                    for n in job.sectors:
                        watch.pending(n)
                self.metrics.queued.dec()
                prefetch = job.priority == Priority.PREFETCH
                if prefetch:
                    self._running_prefetch += 1
            try:
                self._run(job)
            except Exception as e:  # a bug: fail the readers rather than kill the worker
                log.exception("fetch job for sectors %s failed", _show(job.sectors))
                self._fail(job.sectors, e)
            finally:
                with self._work:
                    if prefetch:
                        self._running_prefetch -= 1
                        self._work.notify()

    def _run(self, job: _Job) -> None:
        cfg = self.config
        remaining = job.sectors
        error: BaseException | None = None
        for attempt in range(cfg.retries + 1):
            if attempt:
                self.metrics.retries.inc()
                cap = min(cfg.backoff_max, cfg.backoff_base * 2 ** (attempt - 1))
                self._closed.wait(max(0.0, min(random.uniform(0, cap), self._left(job))))
            if self._left(job) <= 0 and self._expire(job, remaining, error):
                return
            remaining, error = self._fetch(job, remaining)
            if not remaining:
                return
            if isinstance(error, _PERMANENT):
                self.metrics.store_errors.inc()
                self._fail(remaining, error)
                return
            if not isinstance(error, ChecksumError):
                self.metrics.store_errors.inc()
                log.info("sectors %s: %s (attempt %d)", _show(remaining), error, attempt + 1)
        log.warning("giving up on sectors %s: %s", _show(remaining), error)
        self._fail(remaining, error or FetchTimeoutError("deadline passed"))

    def _left(self, job: _Job) -> float:
        return 0.0 if self._closed.is_set() else job.deadline - time.monotonic()

    def _expire(self, job: _Job, remaining: list[int], error: BaseException | None) -> bool:
        """Fail the job's flights if its deadline has passed (or the fetcher closed). Checked
        under the lock that readers extend deadlines under, so a reader that joined in time
        is never failed by an earlier reader's deadline."""
        with self._lock:
            if self._left(job) > 0:
                return False
            flights = [f for n in remaining if (f := self._pop_flight(n)) is not None]
        timeout = FetchTimeoutError(
            f"sectors {_show(remaining)}: deadline passed"
            + (f" (last error: {type(error).__name__}: {error})" if error else "")
        )
        timeout.__cause__ = error
        log.warning("giving up on sectors %s: %s", _show(remaining), timeout)
        self._settle(flights, timeout)
        return True

    def _fetch(self, job: _Job, sectors: list[int]) -> tuple[list[int], BaseException | None]:
        """One ranged read of the blob bytes of ``sectors`` (in blob order), on a thread of
        its own (``_transfer``) that verifies, caches and hands out each sector as soon as
        its bytes are in: a 16 MiB read delivers its first sector after 2 MiB, not 16. The
        worker waits while sectors keep coming, and abandons a read that goes
        ``request_timeout`` seconds without one, or past the job's deadline (a hung store
        call keeps its thread, not the worker). Returns the sectors still to fetch and what
        stopped them (a store error, a ``ChecksumError``, a timeout; None if all came)."""
        with self._lock:
            if self._stuck > self.config.max_stuck_requests:
                return sectors, StoreTimeoutError(
                    f"{self._stuck} requests to {self.store.url} hang"
                )
        t = _Transfer(sectors)
        self.metrics.store_requests.inc()
        self.metrics.inflight.inc()
        threading.Thread(
            target=self._transfer, args=(t,), name="lazyblock-store-read", daemon=True
        ).start()
        with t.cond:
            # Woken when the read finishes; sectors delivered meanwhile only push the stall
            # deadline back (a wake-up per sector would cost a thread switch each).
            while not t.finished:
                stalled = time.monotonic() - t.last
                wait = min(self.config.request_timeout - stalled, self._left(job))
                if wait <= 0:
                    t.abandoned = True
                    break
                t.cond.wait(wait)
            left = [n for n in sectors if n not in t.delivered]
            error = t.error
        if t.abandoned:
            with self._lock:
                self._stuck += 1
            error = StoreTimeoutError(
                f"{self.store.url}: no sector in {stalled:.1f}s from a read of sectors "
                f"{_show(sectors)}"
            )
        return left, error

    def _transfer(self, t: _Transfer) -> None:
        """The store side of ``_fetch``: read the range a sector at a time, into one buffer
        reused for each, and deliver the verified ones as they come."""
        index = self.index
        first, last = t.sectors[0], t.sectors[-1]
        wanted = set(t.sectors)
        blob, offset, length = blob_range(index, t.sectors)
        number = index.sectors[first].blob
        start = time.monotonic()
        buf = self._take_buffer()
        try:
            with self.store.open_range(blob.digest, offset, length) as body:
                for n in range(first, last + 1):
                    entry = index.sectors[n]
                    if entry.is_zero or entry.blob != number:
                        continue
                    at = offset + body.position
                    if entry.offset < at or entry.offset + entry.length > offset + length:
                        # Not in blob order: not an index this project wrote. Alone, in its
                        # own read, it is found where the index says.
                        t.fail(ChecksumError(f"sector {n}: out of blob order"))
                        continue
                    while at < entry.offset:  # bytes of no sector asked for
                        skip = min(len(buf), entry.offset - at)
                        body.readinto(memoryview(buf)[:skip])
                        at += skip
                    decoded = EntryBuffer(index.sector_span(n)[1]) if n in wanted else None
                    # Decoded straight into the memory its cache entry is written from; a
                    # raw sector's stored bytes are received there and only hashed.
                    raw = decoded is not None and entry.raw
                    view = decoded.data if raw else memoryview(buf)[: entry.length]
                    body.readinto(view)
                    self.metrics.bytes_fetched.inc(entry.length)
                    if decoded is None:
                        continue
                    try:
                        # The cache entry's block digests, hashed with the checksum.
                        if raw:
                            decoded.digests = index.verify_raw(n, view, VERIFY_BLOCK)
                        else:
                            decoded.digests = index.decode_sector_into(
                                n, view, decoded.data, VERIFY_BLOCK
                            )
                    except ChecksumError as e:
                        self.metrics.checksum_errors.inc()
                        log.warning("%s from %s; refetching", e, self.store.url)
                        body.reject(str(e))  # a mirror that served it is skipped for a while
                        t.fail(e)
                        continue
                    if not t.claim(n):
                        return  # the worker gave up on this read and retries the rest
                    self._deliver(n, decoded)
                    t.advance()
            self.metrics.fetch_latency.observe(time.monotonic() - start)
        except BaseException as e:  # handed to the waiting worker
            t.error = e
        finally:
            self._give_buffer(buf)
            self.metrics.inflight.dec()
            if t.finish():
                with self._lock:
                    self._stuck -= 1

    def _take_buffer(self) -> bytearray:
        """A buffer for the stored bytes of any one sector: reused, since a new one of a few
        MiB costs page faults and zeroing on every request."""
        with self._lock:
            if self._buffers:
                return self._buffers.pop()
        return bytearray(self._buffer_size)

    def release_buffers(self) -> int:
        """Drop the transfer buffers kept for reuse (a mount server that has gone quiet
        gives their memory back); returns how many bytes they held."""
        with self._lock:
            freed = sum(len(b) for b in self._buffers)
            self._buffers.clear()
        return freed

    def _give_buffer(self, buf: bytearray) -> None:
        with self._lock:
            if len(self._buffers) < self.config.max_parallel:
                self._buffers.append(buf)

    def _deliver(self, n: int, sector: EntryBuffer) -> None:
        """A sector fetched and verified: to the listeners, the cache and its readers (a
        read-only view of its bytes)."""
        with self._lock:
            self._timed_out.clear()  # the store answers again
        self.metrics.sectors_fetched.inc()
        data = sector.data.toreadonly()
        for callback in self._listeners:
            callback(n, data)
        self._cache_put(self.index.sectors[n].checksum, sector)
        self._complete(n, data)

    def _cache_put(self, checksum: str, data: EntryBuffer) -> None:
        try:
            # decode_sector_into checked it, and hashed its blocks too
            self.cache.put(checksum, data, verified=True, digests=data.digests)
        except Exception:  # caching is best effort; the read goes on
            log.exception("sector cache put failed")

    def _complete(self, n: int, data: SectorBytes) -> None:
        with self._lock:
            flight = self._pop_flight(n)
        if flight is not None:
            flight.data = data
            flight.done.set()

    def _fail(self, numbers: Iterable[int], error: BaseException) -> None:
        with self._lock:
            flights = [f for n in numbers if (f := self._pop_flight(n)) is not None]
        self._settle(flights, error)

    def _pop_flight(self, n: int) -> _Flight | None:
        """Lock held."""
        flight = self._inflight.pop(self.index.sectors[n].checksum, None)
        if flight is not None and (watch := self._flight_watch) is not None:
            watch.settled(n)
        return flight

    @staticmethod
    def _settle(flights: list[_Flight], error: BaseException) -> None:
        for flight in flights:
            flight.error = error
            flight.done.set()


def _show(numbers: Iterable[int]) -> str:
    """Sector numbers for a message: runs as a-b, at most a few."""
    runs = [f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}" for r in coalesce(numbers)]
    return ",".join(runs[:8]) + (",…" if len(runs) > 8 else "")
