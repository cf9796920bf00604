"""Byte-range reads over a block image's uncompressed filesystem image.

``BlockReader.read_parts(offset, length, scratch)`` is what the FUSE file answers a read
with: views of memory whose concatenation is the range, which the FUSE thread writes to the
kernel as they are (``read_into`` and ``read`` copy them into a buffer or ``bytes``). It maps
the range to sectors and serves each piece, without copying it, from, in order:

1. a small in-memory LRU of decoded sectors that were just fetched from the store (for this
   reader, or by read-ahead or prefetch; ``SectorFetcher.on_fetched``) or are all zeros, so
   the reads that follow a fetch do not even go to the disk cache (which writes entries past
   the page cache);
2. the node's sector cache, which keeps sectors decoded: a read is one ``preadv`` of the
   blocks that cover the bytes asked for into the caller's page-aligned ``scratch``, checked
   block by block (``SectorCache.read_view``): past the page cache for a random read,
   through it for a read of a sequential stream, whose sectors the kernel has been asked to
   read ahead;
3. the fetcher, asked for all the remaining sectors in one call (so adjacent misses are
   coalesced into one ranged read).

Sequential read-ahead. The kernel reads a big file a window at a time, and a 4 MiB sector
fetched only when the first read of it arrives costs a whole store round trip, with nothing
else in flight. So the reader watches for sequential streams — a few at once, since several
files may be streamed in parallel and the kernel's requests within a window arrive in any
order — and once a stream has read ``STREAM_MIN_SECTORS`` sectors' worth of bytes in a row, it
keeps the next ``readahead_bytes`` of the image in flight ahead of it
(``SectorFetcher.readahead``: fetches queued behind on-demand reads, promoted when a read
wants them; cached sectors read ahead by the kernel), leaving ``READAHEAD_MARGIN`` sectors
of the memory LRU to the ones being read. A sector in memory whose every byte has been read
goes first in line for eviction: a sequential reader has used it up, and the sectors
fetched ahead of it, which nobody has read yet, must outlive it. A
stream that goes quiet (pushed out by ``MAX_STREAMS`` newer ones, as random reads
do) has its read-ahead that has not started yet cancelled. Random reads never build up a
stream, so they never trigger read-ahead: spread out, they start new streams; close together,
they rarely move a stream's end forward (``STREAM_FORWARD_SHARE``).

It also keeps an access log: the sectors touched, in first-access order. Right after a
container starts, that log is its startup profile; ``touched_files()`` maps it to file paths
through the index's file map, which is what ``imagetool convert --profile`` lays out first.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections import OrderedDict
from typing import Protocol

from imagetool.format import Index
from snapshotter.cache.sectors import view_room
from snapshotter.datapath.fetcher import SectorBytes, SectorFetcher
from snapshotter.errors import InvalidReadError

# Decoded sectors kept in memory per reader: 8 x 4 MiB = 32 MiB, enough for a few readers
# streaming different files at once without thrashing.
DEFAULT_MEMORY_SECTORS = 8
# Image bytes kept in flight ahead of a sequential reader: 32 sectors of 4 MiB, enough to
# keep all the fetcher's workers busy (so a single reader gets the store's parallel
# throughput), and a bounded waste when the reader stops early.
DEFAULT_READAHEAD_BYTES = 128 << 20
# Sectors of the memory LRU that read-ahead leaves to the ones a sequential reader is in: the
# kernel's 4 MiB read-ahead window can span two sectors, and its requests arrive in any order.
READAHEAD_MARGIN = 4
# Streams tracked at once: a few files read in parallel. Random reads push streams out.
MAX_STREAMS = 8
# A read continues a stream if it starts within this distance of where the stream got to:
# the kernel's read-ahead window arrives as several requests served in any order.
STREAM_SLACK = 16 << 20
# Bytes a stream must have read before read-ahead starts, in sectors: random reads that
# happen to land near one another never get there.
STREAM_MIN_SECTORS = 2
# And at least one read in this many must have moved its end forward. Random reads within a
# few tens of MiB (a database file, one shard of weights) all land within the slack of some
# stream and would add up to any number of bytes, but ever fewer of them go past the
# furthest byte read so far (about ln n of n); a sequential reader's kernel sends each
# window as a few requests, of which at least the last moves the end. Without this, random
# 128 KiB reads within one 64 MiB file read sectors ahead and had the disk read whole cache
# entries: 0.7-4 ms per read (median) instead of 0.45-0.5.
STREAM_FORWARD_SHARE = 8
# Cache entries a mirror of this reader's memory (``mirror_memory``) may read from at once
# (their block digests: 2 KiB each for a 4 MiB sector).
MIRRORED_ENTRIES = 2048
# ``mirror_cached`` stops after this many sectors in a row that the node cache does not
# hold: the image is cold, and a walk of its every sector would be spent for nothing.
MIRROR_MISSES = 64


def scratch_memory(size: int) -> memoryview:
    """``size`` bytes of page-aligned memory for ``read_parts`` (direct reads go into it)."""
    return memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


class _Stream:
    __slots__ = ("end", "seen", "reads", "forward", "ahead_from", "ahead_to")

    def __init__(self, start: int) -> None:
        self.end = start  # the furthest byte read
        self.seen = 0  # bytes read in this stream
        self.reads = 0
        self.forward = 0  # reads that moved ``end`` forward
        self.ahead_from = 0  # sectors [ahead_from, ahead_to) were asked ahead
        self.ahead_to = 0


class MemoryMirror(Protocol):
    """Where a copy of a reader's memory is kept (``BlockReader.mirror_memory``)."""

    def put(self, n: int, data: SectorBytes, /) -> None: ...

    def drop(self, n: int, /) -> None: ...

    def clear(self) -> None: ...

    def cached(
        self, n: int, path: str, digests: bytes, block: int, buffered: bool = False, /
    ) -> bool:
        """Sector ``n`` may be read from its cache entry at ``path`` (with direct I/O, or
        through the page cache if ``buffered``), checked against its block ``digests``,
        where nothing is held for it; whether it was taken."""
        ...

    def uncache(self, n: int, /) -> None: ...


class BlockReader:
    """Reads of one mounted image, through ``fetcher``."""

    def __init__(
        self,
        index: Index,
        fetcher: SectorFetcher,
        memory_sectors: int = DEFAULT_MEMORY_SECTORS,
        timeout: float | None = None,
        readahead_bytes: int = DEFAULT_READAHEAD_BYTES,
        stream_slack: int = STREAM_SLACK,
    ) -> None:
        """``timeout``: seconds one read may take (default: the fetcher's deadline);
        ``readahead_bytes``: image bytes fetched ahead of a sequential reader (0: none);
        ``stream_slack``: how far from a stream's end a read may start and continue it."""
        if memory_sectors < 0 or readahead_bytes < 0:
            raise ValueError("memory_sectors and readahead_bytes must not be negative")
        self.index = index
        self.fetcher = fetcher
        self.memory_sectors = memory_sectors
        self.timeout = timeout
        # Read-ahead lands in the memory LRU (the cache writes entries past the page cache),
        # so it never runs further ahead than that holds, less the sectors the reader is in
        # (READAHEAD_MARGIN): what it fetched would push out the sectors about to be read,
        # to be read back from disk. With no margin, a quarter of a cold pass was.
        self.readahead_sectors = readahead_bytes // index.sector_size
        if memory_sectors:
            room = max(1, memory_sectors - READAHEAD_MARGIN)
            self.readahead_sectors = min(self.readahead_sectors, room)
        self.stream_slack = stream_slack
        self.metrics = fetcher.metrics
        self._lock = threading.Lock()
        self._memory: OrderedDict[int, SectorBytes] = OrderedDict()  # LRU first
        self._used: dict[int, int] = {}  # bytes read so far of each sector in memory
        self._touched: dict[int, None] = {}  # insertion-ordered set
        self._streams: list[_Stream] = []  # most recently used last
        # A copy of ``_memory`` kept elsewhere (``mirror_memory``): the FUSE file's table of
        # the buffers its compiled loop answers READs from.
        self._mirror: MemoryMirror | None = None
        # Entries given to the mirror, and whether it reads each through the page cache
        self._mirrored_entries: OrderedDict[int, bool] = OrderedDict()
        if memory_sectors:
            # Every fetched sector, read-ahead included, is kept: the cache writes entries
            # with direct I/O, so the page cache does not have them.
            fetcher.on_fetched(self._remember_one)

    @property
    def size(self) -> int:
        return self.index.image_size

    def read(self, offset: int, length: int) -> bytes:
        """Image bytes ``[offset, offset+length)``, short at the end of the image.

        Raises ``FetchError`` when sectors cannot be fetched in time (EIO).
        """
        if offset < 0 or length < 0:
            raise InvalidReadError(f"invalid read: offset {offset}, length {length}")
        out = bytearray(max(0, min(length, self.index.image_size - offset)))
        self.read_into(offset, memoryview(out))
        return bytes(out)

    def read_into(self, offset: int, out: memoryview) -> int:
        """Image bytes ``[offset, offset+len(out))`` into ``out``; returns how many, short
        at the end of the image. Those bytes of ``out`` are all verified ones; on an
        exception its contents are undefined.

        Raises ``FetchError`` when sectors cannot be fetched in time (EIO).
        """
        done = 0
        for part in self.read_parts(offset, len(out)):
            out[done : done + len(part)] = part
            done += len(part)
        return done

    def read_parts(
        self, offset: int, length: int, scratch: memoryview | None = None, waited: float = 0.0
    ) -> list[memoryview]:
        """Image bytes ``[offset, offset+length)``, short at the end of the image, as views
        whose concatenation they are: of the sectors in memory, of the ``scratch``
        (page-aligned memory of the caller's, e.g. the FUSE thread's) that sectors in the
        node cache are read into, of sectors just fetched. Every byte verified; nothing
        copied. The FUSE file answers a read with these views as they are. ``waited``:
        seconds the read has already waited for a fetch elsewhere (the compiled READ loop),
        taken off its ``timeout``.

        Raises ``FetchError`` when sectors cannot be fetched in time (EIO).
        """
        if offset < 0 or length < 0:
            raise InvalidReadError(f"invalid read: offset {offset}, length {length}")
        index = self.index
        numbers = index.sectors_for_range(offset, length)
        self.metrics.reads.inc()
        if not numbers:
            return []
        end = min(offset + length, index.image_size)
        sequential = bool(self.readahead_sectors) and self._follow(offset, end)
        # Sector n's bytes [lo, hi) are the read's [start + lo - offset, start + hi - offset).
        spans = {}
        for n in numbers:
            start, size = index.sector_span(n)
            spans[n] = (start, max(offset, start) - start, min(end, start + size) - start)
        with self._lock:
            for n in numbers:
                if n not in self._touched:
                    self._touched[n] = None
                    self.metrics.touched_stored_bytes.inc(index.sectors[n].length)
        parts: dict[int, memoryview] = {}
        wanted = []
        room = scratch
        for n in numbers:
            # Memory is looked at just before the disk, sector by sector: read-ahead may
            # deliver a sector while an earlier one of this read comes from the disk (a
            # fetched sector reaches memory before the cache).
            with self._lock:
                if (view := self._from_memory(n, spans[n])) is not None:
                    parts[n] = view
                    continue
            _, lo, hi = spans[n]
            if room is None or len(room) < view_room(hi - lo):
                room = scratch_memory(max(view_room(hi - lo), len(room) if room else 0))
            got = self.fetcher.read_cached_view(n, lo, hi - lo, room, sequential=sequential)
            if got is None:
                wanted.append(n)
                continue
            parts[n], took = got
            room = room[took:]
            # A stream reads an entry through the page cache that its read-ahead fills
            # (``_follow`` has the mirror read it that way too); once it has read to the
            # entry's end, the mirror reads it with direct I/O, for the random reads after.
            if self._mirror is not None and (not sequential or hi == index.sector_span(n)[1]):
                self._mirror_entry(n)
        if wanted:  # ... or since its cache lookup: then the fetcher would read it back
            with self._lock:
                for n in wanted:
                    if (view := self._from_memory(n, spans[n])) is not None:
                        parts[n] = view
            wanted = [n for n in wanted if n not in parts]
        if wanted:
            deadline = None if self.timeout is None else time.monotonic() + self.timeout - waited
            fetched = self.fetcher.get(wanted, deadline)
            self._remember(fetched, spans)
            for n, data in fetched.items():
                _, lo, hi = spans[n]
                parts[n] = memoryview(data)[lo:hi]
        self.metrics.read_bytes.inc(end - offset)
        return [parts[n] for n in numbers]

    def _from_memory(self, n: int, span: tuple[int, int, int]) -> memoryview | None:
        """Lock held: sector ``n``'s bytes ``span`` from memory, or None if it is not there.

        A sector whose every byte has been read has most likely been used up (a sequential
        reader moves on): it goes first when room is needed, before the sectors read ahead
        that nobody has read yet. The kernel's requests within its read-ahead window arrive
        in any order, so bytes are counted, not just whether a read reached the sector's end.
        """
        data = self._memory.get(n)
        if data is None:
            return None
        _, lo, hi = span
        used = self._used.get(n, 0) + hi - lo
        self._used[n] = used
        self._memory.move_to_end(n, last=used < len(data))
        self.metrics.memory_hits.inc()
        return memoryview(data)[lo:hi]

    def touched_sectors(self) -> list[int]:
        """Sectors read so far, in first-access order."""
        with self._lock:
            return list(self._touched)

    def touched_files(self) -> list[str]:
        """Paths of files in the sectors read so far, in first-access order (by image
        offset within one sector)."""
        seen: dict[str, None] = {}
        for n in self.touched_sectors():
            start, size = self.index.sector_span(n)
            for f in self.index.files_in_range(start, size):
                seen.setdefault(f.path)
        return list(seen)

    def drop_memory(self) -> None:
        """Forget the decoded sectors held in memory."""
        with self._lock:
            self._memory.clear()
            self._used.clear()
            if self._mirror is not None:
                self._mirror.clear()  # the entries given to it too
                self._mirrored_entries.clear()

    def mirror_memory(self, mirror: MemoryMirror) -> None:
        """Keep ``mirror`` a copy of the sectors held in memory: every one added is
        ``put`` there, every one evicted ``drop``ped (under this reader's lock, so the two
        never disagree for longer than a call). Reads answered from it are reported back
        through ``account_served``."""
        with self._lock:
            mirror.clear()
            for n, data in self._memory.items():
                mirror.put(n, data)
            self._mirror = mirror
            self._mirrored_entries.clear()

    @property
    def mirrored_entries(self) -> int:
        """How many cache entries the mirror may read from now."""
        with self._lock:
            return len(self._mirrored_entries)

    def mirror_cached(self, stop: threading.Event | None = None) -> int:
        """Give the mirror the entries of this image that the node cache holds already,
        each checked as a first read of it would check it (its trailer), the image's
        prefetch order first, up to ``MIRRORED_ENTRIES``: a new server for a warm image
        answers READs of them in the compiled loop from the first, not one first READ of
        each in the interpreter. Skips sectors in memory and those a stream reads ahead
        (through the page cache). Stops when ``stop`` is set, and after ``MIRROR_MISSES``
        sectors in a row that the cache does not hold. Returns how many it gave."""
        if self._mirror is None:
            return 0
        index = self.index
        given = misses = 0
        for n in dict.fromkeys([*index.prefetch, *range(index.sector_count)]):
            if given >= MIRRORED_ENTRIES or (stop is not None and stop.is_set()):
                break
            if misses >= MIRROR_MISSES:
                break  # a cold image
            if index.sectors[n].is_zero:
                continue
            with self._lock:
                if (
                    n in self._memory
                    or n in self._mirrored_entries
                    or any(s.ahead_from <= n < s.ahead_to for s in self._streams)
                ):
                    continue
            if self._mirror_entry(n, check=True):
                given += 1
                misses = 0
            else:
                misses += 1
        return given

    def _mirror_entry(self, n: int, check: bool = False, buffered: bool = False) -> bool:
        """Give the mirror sector ``n``'s cache entry to answer reads from (past the page
        cache, as ``read_view`` reads random ones), where this process knows the entry's
        block digests: it wrote the entry (``_mirror_evicted``), or a read here found it
        whole and checked its trailer (a random read, or a stream's that reached the
        entry's end), or ``check`` has it check the trailer now (``mirror_cached``).
        ``buffered``: the mirror reads it through the page cache (a stream's read-ahead
        fills that), not with direct I/O; an entry given the other way is given anew. At
        most ``MIRRORED_ENTRIES`` at once, the least recently given dropped first. Returns
        whether it gave it now."""
        with self._lock:
            given = self._mirrored_entries.get(n)
            if given is buffered:  # given already (a small read, which stays here)
                self._mirrored_entries.move_to_end(n)
                return False
        handle = self.fetcher.cached_entry(n, check)
        if handle is None:
            return False
        path, digests, block = handle
        assert self._mirror is not None
        if given is not None:  # read the other way until now
            with self._lock:
                self._mirrored_entries.pop(n, None)
            self._mirror.uncache(n)
        if not self._mirror.cached(n, path, digests, block, buffered):
            return False
        with self._lock:
            self._mirrored_entries[n] = buffered
            self._mirrored_entries.move_to_end(n)
            old = (
                self._mirrored_entries.popitem(last=False)[0]
                if len(self._mirrored_entries) > MIRRORED_ENTRIES
                else None
            )
        if old is not None:
            self._mirror.uncache(old)
        return True

    def _mirror_evicted(self, evicted: list[int]) -> None:
        """Sectors just evicted from memory: the mirror reads them from their cache entries
        from now on, instead of sending their next READs here for a first look at each
        entry (a sector fetched by this process has its entry's digests known already)."""
        if self._mirror is None:
            return
        for n in evicted:
            self._mirror_entry(n)

    def account_served(self, reads: list[tuple[int, int]]) -> None:
        """Reads ``(offset, length)`` answered from the mirror of this reader's memory and
        of the cache entries given to it (``mirror_memory``), in the order they were
        answered: counted, logged and followed (sequential streams, read-ahead) as
        ``read_parts`` does its own."""
        if not reads:
            return
        index = self.index
        total = hits = touched = 0
        from_disk: list[int] = []  # pieces read from the node cache's entries
        streamed: list[int] = []  # ... through the page cache, to the entry's end
        with self._lock:
            for offset, length in reads:
                end = offset + length
                total += length
                for n in index.sectors_for_range(offset, length):
                    if n not in self._touched:
                        self._touched[n] = None
                        touched += index.sectors[n].length
                    data = self._memory.get(n)
                    if data is None:
                        from_disk.append(n)  # (or memory it was evicted from since)
                        if self._mirrored_entries.get(n) and end >= sum(index.sector_span(n)):
                            streamed.append(n)
                        continue
                    hits += 1
                    start, size = index.sector_span(n)
                    used = self._used.get(n, 0) + min(end, start + size) - max(offset, start)
                    self._used[n] = used
                    self._memory.move_to_end(n, last=used < len(data))
        metrics = self.metrics
        metrics.reads.inc(len(reads))
        metrics.read_bytes.inc(total)
        metrics.memory_hits.inc(hits)
        if from_disk:
            metrics.cache_hits.inc(len(from_disk))
            for n in dict.fromkeys(from_disk):
                self.fetcher.cache.note_read(index.sectors[n].checksum)
        for n in streamed:  # read with direct I/O again, for the random reads after a stream
            self._mirror_entry(n)
        if touched:
            metrics.touched_stored_bytes.inc(touched)
        if self.readahead_sectors:
            # Adjacent reads as one: a read-ahead window's requests, answered in any order.
            merged: list[list[int]] = []
            for offset, length in sorted(reads):
                if merged and offset <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], offset + length)
                else:
                    merged.append([offset, offset + length])
            for offset, end in merged:
                self._follow(offset, end)

    def _remember_one(self, n: int, data: SectorBytes) -> None:
        with self._lock:
            self._memory[n] = data
            self._memory.move_to_end(n)
            if self._mirror is not None:
                self._mirror.put(n, data)
            evicted = self._evict()
        self._mirror_evicted(evicted)

    def _remember(
        self, fetched: dict[int, SectorBytes], spans: dict[int, tuple[int, int, int]]
    ) -> None:
        """Keep sectors a read fetched, counting the bytes of them it read (``spans``)."""
        if not self.memory_sectors:
            return
        with self._lock:
            for n, data in fetched.items():
                self._memory[n] = data
                self._memory.move_to_end(n)
                if self._mirror is not None:
                    self._mirror.put(n, data)
                _, lo, hi = spans[n]
                self._used[n] = self._used.get(n, 0) + hi - lo
            evicted = self._evict()
        self._mirror_evicted(evicted)

    def _evict(self) -> list[int]:
        """Lock held. Returns the sectors evicted."""
        evicted = []
        while len(self._memory) > self.memory_sectors:
            n, _ = self._memory.popitem(last=False)
            self._used.pop(n, None)
            evicted.append(n)
            if self._mirror is not None:
                self._mirror.drop(n)  # whatever it held for n, its entry too
                self._mirrored_entries.pop(n, None)
        return evicted

    # --- sequential read-ahead ------------------------------------------------------------

    def _follow(self, offset: int, end: int) -> bool:
        """Account the read [offset, end) to a stream; keep read-ahead going for streams
        that are sequential. Returns whether the read is part of one."""
        sector_size = self.index.sector_size
        ahead: tuple[int, int] | None = None
        dropped: list[_Stream] = []
        with self._lock:
            for i, stream in enumerate(self._streams):
                if stream.end - self.stream_slack <= offset <= stream.end + self.stream_slack:
                    del self._streams[i]
                    break
            else:
                stream = _Stream(offset)
                if len(self._streams) >= MAX_STREAMS:
                    dropped.append(self._streams.pop(0))
            self._streams.append(stream)
            stream.seen += end - offset
            stream.reads += 1
            if end > stream.end:
                stream.forward += 1
                stream.end = end
            sequential = (
                stream.seen >= STREAM_MIN_SECTORS * sector_size
                and stream.forward * STREAM_FORWARD_SHARE >= stream.reads
            )
            if sequential:
                first = (stream.end - 1) // sector_size + 1
                last = min(self.index.sector_count, first + self.readahead_sectors)
                # Ask again once a third of the window has been consumed: runs long enough
                # to amortise the store's per-request cost, with enough requests in flight
                # to fill a fast link (benchmarks/mount/results/README.md, "Design notes").
                if last - stream.ahead_to >= max(1, self.readahead_sectors // 3):
                    ahead = (max(first, stream.ahead_to), last)
                    if stream.ahead_to < first:
                        stream.ahead_from = first
                    stream.ahead_to = last
        for old in dropped:
            if old.ahead_to > old.ahead_from:
                self.fetcher.cancel_readahead(range(old.ahead_from, old.ahead_to))
        if ahead is not None and ahead[1] > ahead[0]:
            self.fetcher.readahead(range(*ahead))
            if self._mirror is not None:
                # A stream reads these through the page cache, which read-ahead fills
                # (``will_need``): so does the mirror, for the entries it may read.
                for n in range(*ahead):
                    self._mirror_entry(n, buffered=True)
        return sequential
