"""Prefetch: warming the sector cache in the background after a mount.

Why. A container's startup reads a predictable set of files — the interpreter, its shared
libraries, the application's modules, then perhaps gigabytes of weights. A lazy mount serves
each of them on demand, and every cold read pays a round trip to the store. Prefetching hides
those round trips by fetching ahead of the reads, in the order the reads will come.

What, in which order. ``plan(index, mode)`` is the whole policy, a pure function of the index:

1. the index's ``prefetch`` list: sector numbers hottest first, recorded from a startup
   profile at conversion (the writer also laid those files out first, so the list is mostly
   a few long runs that coalesce into few requests);
2. the metadata sectors (the mount normally fetched them already; listing them keeps a plan
   complete when it did not);
3. with ``PrefetchMode.FULL``, every other sector in image order: for images that will be
   read almost entirely (model weights), streaming the image sequentially at full bandwidth
   beats fetching it in scattered on-demand pieces.

``PrefetchMode.AUTO`` (the default) decides the third step. From the index, at the mount
(``stream_large_share``, 0.5; above 1 turns it off): an image whose large files
(``large_file_bytes``, 64 MiB and more) hold at least that share of its stored bytes is
streamed whole from the start. Those are model weights and the big shared libraries of ML
frameworks, which a start reads whole or nearly (the cold-start benchmark's ML image: two
such files, the weights and libtorch_cpu.so, hold 77 % of its stored bytes, and its start
reads 75-89 % of them). Without a profile, waiting for the start's reads to show it keeps
that image at 1.6x its floor at 1 Gbit/s (the start reads the weights only once torch is
imported, 5-7 s in, and the link carries one read at a time until then); streaming from the
mount brought it to 1.2x (``benchmarks/coldstart/README.md``). It is a guess from the
index's shape, wrong for an image whose big files its start never reads: the quickstart's
sample (an app and 256 MiB of weights it does not read) is fetched whole, in the background,
though its start needs 0.4 % of it (the start is not slower for it; the egress and the cache
space are spent, up to ``max_cache_fraction`` of the cache). That is the trade stargz's
snapshotter makes for every layer by default (its background fetch); here it is made only
for images shaped like what GPU serving runs. Streaming the image at the start's first read
of a large file instead (libtorch, 2-3 s in) kept that sample lazy but measured 1.7x on the
ML image, no better than waiting
(``benchmarks/coldstart/results/2026-12-06-stream-on-first-large-read.md``).
Otherwise, while the container starts:
the whole image is streamed once the start has read ``stream_fraction`` (a quarter) of the
image's stored bytes (the sectors its reads touched, each counted once; read-ahead and
prefetch do not count: guesses must not feed guesses). A
start that reads a quarter of an image reads most of it, in the images this is for: measured
by the cold-start benchmark, an ML start (torch, then its weights) fetches 75-89 % of the
image's stored bytes, a vLLM start 45-57 %; a start that reads a few files of a large image
(a web app; the quickstart's 2 % of 270 MB) never gets there and fetches only what it reads.
Without a profile this is what keeps the link busy between the workload's reads. A profile
that names that share itself is trusted instead: it *is* what the start reads, so it is
fetched first and the rest of the image waits, the large files' rule above included, until
the start reads outside it on demand (``OUTSIDE_PROFILE_SHARE``, 5 % of the profile's
bytes: the profile is stale, or was recorded on another start); fetching the rest during the
start only competes with it for the link and for the node's CPU. Measured on the cold-start
benchmark's ML image at 1 Gbit/s (6 rounds each, interleaved): 689 MB fetched during the
start instead of 837, and 0.8 CPU-seconds less in the mount server and 0.3 in the registry
(``benchmarks/coldstart/results/2026-12-07-trusted-profile/``). A small or foreign profile
is not trusted: the rules above apply as without one. And as
soon as the start reads a sector of a large file that was not cached (but a sector a trusted
profile names: a profile with byte ranges names what the start reads of a large library,
and streaming the rest of it fetched 48 MB that the benchmark's ML start does not read;
``stream_large_files``;
the fetcher tells the prefetcher of every on-demand read), the whole file goes next in the
plan, from that sector to the file's end, then its beginning: weights and the big shared
libraries of ML frameworks are read whole or nearly, and on demand they would come one read,
one round trip, at a time, with the link idle in between. A large file the start never
reads (a data set beside the application) is never fetched for it.

All-zero sectors are never listed (they cost nothing to read).

When. From the moment the mount server has verified the index, before the metadata is
fetched and the tree mounted (``snapshotter.mount.server``): the metadata fetch is an
on-demand read and goes first, and the link then stays busy while the kernel mounts and the
container starts.

How fast. The link must be kept full: a batch that completes before the next one is on the
wire leaves it idle for a round trip, and one connection may not fill a fast link. So the
prefetcher keeps a *window* of batches in flight (``Window``): at least ``min_window``,
and one more for as long as each step up raised the rate the batches arrive at, up to the
fetcher's ``max_parallel_prefetch``; when a step did not pay, it steps back and tries again
later. The window follows what the link (and the store, and this node's CPU) delivers, not
a count fixed for one kind of link.

How, without getting in the way. Prefetch must never slow down the reads it is meant to
speed up. The ``Prefetcher`` goes through the same ``SectorFetcher`` as on-demand reads, so a
reader that wants a sector being prefetched waits on that fetch instead of duplicating it
(and promotes it to on-demand priority). Its requests carry ``Priority.PREFETCH``: queued
behind every on-demand and read-ahead request, so an on-demand read waits at most for what
is already on the wire (the window, a few batches of ``batch_sectors``); and the fetcher
lets a prefetch job that has waited too long behind them run, so prefetch is never starved
for good either. An optional token bucket caps the bytes it pulls per second, so that a
full prefetch does not saturate the node's link for its neighbours.

The cache is shared by every image on the node, and prefetched sectors compete with all the
others under its LRU. A full prefetch of an image larger than the cache would only evict its
own beginning (and everybody else's hot sectors), so the prefetcher stops once it has brought
in ``max_cache_fraction`` of the cache's capacity.

Prefetch is an optimisation: a failed batch is logged and counted and the next one tried;
after ``max_failures`` failed batches in a row (the store is probably down, and on-demand
reads will say so themselves) the prefetcher gives up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from imagetool.format import FileMap, Index
from snapshotter.config import PrefetchConfig, PrefetchMode
from snapshotter.datapath.fetcher import PrefetchBatch, SectorFetcher
from snapshotter.errors import ClosedError

log = logging.getLogger(__name__)

STREAM_POLL_SECONDS = 0.1  # how often AUTO looks at the bytes the mount has fetched
# AUTO with a profile that names ``stream_fraction`` of the image: the rest is streamed once
# the start has read this share of the profile's stored bytes outside it, on demand (the
# profile is stale or was recorded on another start), not before.
OUTSIDE_PROFILE_SHARE = 0.05


def large_files(index: Index, large_file_bytes: int) -> list[tuple[str, list[int]]]:
    """Each file of at least ``large_file_bytes`` in ``index``: its path and its stored
    sectors in file order."""
    files = index.files
    if isinstance(files, FileMap):
        large = files.at_least(large_file_bytes)
    else:
        large = tuple(f for f in files if f.length >= large_file_bytes)
    sectors = index.sectors
    return [
        (f.path, [n for n in index.sectors_for_range(f.offset, f.length) if not sectors[n].is_zero])
        for f in large
    ]


def large_file_share(index: Index, large_file_bytes: int) -> float:
    """The share of ``index``'s stored bytes in sectors that hold files of at least
    ``large_file_bytes`` (each sector counted once)."""
    return _stored_share(index, large_files(index, large_file_bytes))


def _stored_share(index: Index, files: list[tuple[str, list[int]]]) -> float:
    """The share of ``index``'s stored bytes in the sectors of ``files`` (``large_files``)."""
    stored = sum(s.length for s in index.sectors)
    if not stored:
        return 0.0
    covered = {n for _, numbers in files for n in numbers}
    return sum(index.sectors[n].length for n in covered) / stored


def plan(index: Index, mode: PrefetchMode) -> list[int]:
    """Sector numbers to prefetch, in order; never a zero sector, never one twice."""
    if mode is PrefetchMode.NONE:
        return []
    order: dict[int, None] = dict.fromkeys(index.prefetch)
    order.update(dict.fromkeys(range(index.metadata_sectors)))
    if mode is PrefetchMode.FULL:
        order.update(dict.fromkeys(range(index.sector_count)))
    return [n for n in order if not index.sectors[n].is_zero]


class TokenBucket:
    """Bytes-per-second limiter. ``take(n)`` spends ``n`` tokens, going into debt if need be,
    and returns how long the caller must wait before spending them (0 within the burst)."""

    def __init__(
        self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._stamp = clock()
        self._lock = threading.Lock()

    def take(self, n: float) -> float:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            return max(0.0, -self._tokens / self.rate)


class Window:
    """How many batches to keep in flight: a hill climb on the rate batches complete at.

    An *epoch* is ``size`` completions (and at least ``EPOCH_SECONDS``); its rate is the
    bytes they delivered over its duration. After the first epoch the window grows by one;
    while a step up raised the rate by at least ``GAIN``, it grows again; a step that did
    not is taken back, and ``HOLD_EPOCHS`` epochs later the window probes one step up
    again (links and loads change). Never below ``low`` nor above ``high``."""

    GAIN = 0.10
    EPOCH_SECONDS = 0.2
    HOLD_EPOCHS = 4

    def __init__(self, low: int, high: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.low = max(1, low)
        self.high = max(self.low, high)
        self.size = self.low
        self._clock = clock
        self._start = clock()
        self._bytes = 0
        self._done = 0
        self._best: tuple[int, float] | None = None  # (size, rate) that last paid
        self._hold = 0

    def completed(self, nbytes: int) -> None:
        """A batch of ``nbytes`` stored bytes arrived."""
        self._bytes += nbytes
        self._done += 1
        now = self._clock()
        elapsed = now - self._start
        if self._done < self.size or elapsed < self.EPOCH_SECONDS:
            return
        rate = self._bytes / elapsed
        self._start, self._bytes, self._done = now, 0, 0
        if self._hold:
            self._hold -= 1
            if self._hold == 0 and self.size < self.high:
                self._best = (self.size, rate)
                self.size += 1  # probe again
            return
        if self._best is None or rate >= self._best[1] * (1 + self.GAIN):
            self._best = (self.size, rate)
            if self.size < self.high:
                self.size += 1
            else:
                self._hold = self.HOLD_EPOCHS
        else:  # the last step up did not pay
            self.size = max(self.low, self._best[0])
            self._hold = self.HOLD_EPOCHS


class Prefetcher:
    """Runs a prefetch plan on a background thread; ``stop()`` ends it early."""

    def __init__(
        self, fetcher: SectorFetcher, sectors: list[int], config: PrefetchConfig | None = None
    ) -> None:
        self.fetcher = fetcher
        self.sectors = list(sectors)
        self.config = config or PrefetchConfig()
        self.fetched = 0  # sectors this prefetcher brought into the cache
        self.window: Window | None = None  # batches it keeps in flight (once running)
        self.streaming = False  # AUTO: the whole image was added to the plan
        self.files_streamed = 0  # AUTO: large files added to the plan once the start read them
        self._large: dict[int, int] = {}  # AUTO: sector -> its large file (in _large_files)
        self._large_files: list[tuple[str, list[int]]] = []  # AUTO: path, stored sectors
        self._demanded: deque[int] = deque()  # sectors of large files read on demand
        self._profile: frozenset[int] = frozenset()  # AUTO: a profile the plan trusts
        self._outside = 0  # AUTO: stored bytes read on demand outside that profile
        self._outside_lock = threading.Lock()
        self._wake = threading.Event()  # a large file was read, or stop()
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lazyblock-prefetch", daemon=True)
        cfg = self.config
        self._bucket = (
            TokenBucket(cfg.bandwidth, cfg.burst_bytes) if cfg.bandwidth is not None else None
        )

    @classmethod
    def for_mount(cls, fetcher: SectorFetcher, config: PrefetchConfig) -> Prefetcher:
        return cls(fetcher, plan(fetcher.index, config.mode), config)

    def start(self) -> Prefetcher:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        """Ask the worker to stop after the batch in progress; wait up to ``timeout``."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the plan to finish; returns whether the worker has ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _stream_rest(self, why: str) -> None:
        """Add every sector not planned yet to the plan, in image order."""
        planned = set(self.sectors)
        rest = [n for n in plan(self.fetcher.index, PrefetchMode.FULL) if n not in planned]
        log.info("prefetch: %s; streaming the other %d sectors", why, len(rest))
        self.fetcher.limit_readahead(None)
        self.streaming = True
        self.sectors += rest

    def _stream_at_mount(self) -> bool:
        """``AUTO``: stream the whole image now if its large files hold
        ``stream_large_share`` of its stored bytes; returns whether it does."""
        cfg = self.config
        if cfg.stream_large_share > 1:
            return False
        share = _stored_share(self.fetcher.index, self._large_files)
        if share < cfg.stream_large_share:
            return False
        self._stream_rest(f"files of {cfg.large_file_bytes >> 20} MiB or more hold "
                          f"{share:.0%} of the stored bytes")  # fmt: skip
        return True

    def _trust_profile(self) -> bool:
        """``AUTO``: whether the index's profile names ``stream_fraction`` of its stored
        bytes: then it is what the start reads, fetched first, and the rest waits until the
        start reads outside it (``_watch``); fetching the rest during the start would only
        compete with the start for the link and for this node's CPU."""
        index = self.fetcher.index
        profile = frozenset(index.prefetch)
        stored = sum(s.length for s in index.sectors)
        profiled = sum(index.sectors[n].length for n in profile)
        if not profile or profiled < self.config.stream_fraction * stored:
            return False
        self._profile = profile | frozenset(range(index.metadata_sectors))
        self.fetcher.on_demand(self._on_demand_outside)
        self.fetcher.limit_readahead(self._profile)  # until the start leaves it
        return True

    def _on_demand_outside(self, numbers: list[int]) -> None:
        """On a reader's thread: count the stored bytes of ``numbers`` outside the profile."""
        sectors, profile = self.fetcher.index.sectors, self._profile
        if outside := sum(sectors[n].length for n in numbers if n not in profile):
            with self._outside_lock:
                self._outside += outside
            self._wake.set()

    def _watch_large_files(self) -> None:
        """``AUTO``: learn from the fetcher which large files the start reads on demand."""
        self._large = {n: k for k, (_, numbers) in enumerate(self._large_files) for n in numbers}
        if self._large:
            self.fetcher.on_demand(self._on_demand)

    def _on_demand(self, numbers: list[int]) -> None:
        """On a reader's thread: note the sectors of large files among ``numbers``, but
        those a trusted profile names: the profile says what of that file the start reads
        (a profile with ranges names part of a large library), and it is being fetched."""
        large, profile = self._large, self._profile
        if hit := [n for n in numbers if n in large and n not in profile]:
            self._demanded.extend(hit)
            self._wake.set()

    def _stream_read_files(self, at: int) -> bool:
        """Insert into the plan at ``at`` the whole of each large file the start has read
        since the last call and that was not streamed yet: from the sector read on to the
        file's end, then its beginning. Returns whether it added any."""
        order: list[int] = []
        while self._demanded:
            read = self._demanded.popleft()
            k = self._large.get(read)
            if k is None:
                continue  # its file was streamed already
            path, numbers = self._large_files[k]
            for n in numbers:
                self._large.pop(n, None)
            log.info("prefetch: the start read %s (%d sectors); streaming it", path, len(numbers))
            self.files_streamed += 1
            at_read = numbers.index(read)
            order += numbers[at_read:] + numbers[:at_read]
        if order:
            self.sectors[at:at] = order
        return bool(order)

    def _watch(self) -> bool:
        """``AUTO``, the plan done: wait (up to ``stream_watch`` seconds after the mount)
        until the start has read ``stream_fraction`` of the image's stored bytes (unless the
        profile names that share already), then add the rest of the image to the plan; or
        until it reads a large file not streamed yet. Returns whether there is more to do."""
        cfg, fetcher, index = self.config, self.fetcher, self.fetcher.index
        stored = sum(s.length for s in index.sectors)
        wanted = cfg.stream_fraction * stored
        profiled = sum(index.sectors[n].length for n in dict.fromkeys(index.prefetch))
        read = fetcher.metrics.touched_stored_bytes
        until = self._started + cfg.stream_watch
        trusted = bool(self._profile)
        while (
            self._outside < OUTSIDE_PROFILE_SHARE * profiled
            if trusted
            else profiled < wanted and read.value < wanted
        ):
            if self._demanded:
                return True
            left = until - time.monotonic()
            if left <= 0 or self._stop.is_set():
                return False
            self._wake.wait(min(STREAM_POLL_SECONDS, left))
            self._wake.clear()
        if trusted:
            self._stream_rest(f"the start read {self._outside} stored bytes outside its profile "
                              f"({profiled} of {stored})")  # fmt: skip
        else:
            self._stream_rest(f"the start read {read.value} and the profile names {profiled} "
                              f"of {stored} stored bytes")  # fmt: skip
        return True

    def _run(self) -> None:
        cfg, fetcher, index = self.config, self.fetcher, self.fetcher.index
        budget = cfg.max_cache_fraction * fetcher.cache.max_bytes
        spent = 0  # decoded bytes asked for (the cache's measure)
        failures = 0
        self.window = window = Window(cfg.min_window, fetcher.config.prefetch_workers)
        pending: deque[PrefetchBatch] = deque()
        i = 0
        watch = cfg.mode is PrefetchMode.AUTO
        try:
            trusted = watch and self._trust_profile()
            if watch and (cfg.stream_large_files or cfg.stream_large_share <= 1):
                self._large_files = large_files(index, cfg.large_file_bytes)  # once, for both
            if watch and cfg.stream_large_files:
                self._watch_large_files()
            if watch and not trusted and self._stream_at_mount():
                watch = False
            while not self._stop.is_set():
                if self._demanded:  # a large file read: it goes before the rest of the plan
                    self._stream_read_files(i)
                # Fill the window, in plan order.
                while i < len(self.sectors) and len(pending) < window.size:
                    wanted = fetcher.missing(self.sectors[i : i + cfg.batch_sectors])
                    i = min(i + cfg.batch_sectors, len(self.sectors))  # the plan may grow
                    if not wanted:
                        continue
                    # The cache holds sectors decoded; the link carries them compressed.
                    cost = sum(index.sector_span(n)[1] for n in wanted)
                    if spent + cost > budget:
                        log.info("prefetch: stopping at %d bytes, the cache's share for it", spent)
                        i = len(self.sectors)
                        break
                    wire = sum(index.sectors[n].length for n in wanted)
                    if self._bucket is not None and self._stop.wait(self._bucket.take(wire)):
                        return
                    batch = fetcher.prefetch(wanted, time.monotonic() + cfg.batch_timeout)
                    spent += cost
                    if batch.sectors:
                        pending.append(batch)
                if not pending:
                    if watch and i >= len(self.sectors) and spent < budget:
                        if self._watch():
                            watch = not self.streaming
                            continue
                        watch = False
                    break
                batch = pending.popleft()
                while not batch.wait(0.1):
                    if self._stop.is_set():
                        return
                if isinstance(error := batch.error, ClosedError):
                    return
                if error is not None:
                    failures += 1
                    fetcher.metrics.prefetch_errors.inc()
                    log.warning("prefetch: batch failed (%d in a row): %s", failures, error)
                    if failures >= cfg.max_failures:
                        log.warning("prefetch: giving up after %d failed batches", failures)
                        return
                    continue
                failures = 0
                window.completed(batch.bytes)
                self.fetched += len(batch.sectors)
                fetcher.metrics.prefetched_sectors.inc(len(batch.sectors))
        except ClosedError:
            return
        finally:
            self._large = {}  # the fetcher's later demands are no news to anyone
            self.fetcher.limit_readahead(None)  # the start is over, or left the profile
            log.debug("prefetch: done, %d sectors fetched, window %d", self.fetched, window.size)
