"""The mount server: one long-lived process per mounted image.

``snapshotter mount`` (``snapshotter.mount.api.mount``) starts it detached, or the CLI runs it in
the foreground. In order, it:

1. opens the store, resolves the reference, fetches the index (or takes it from the node's
   index cache, ``snapshotter.cache.indexes``) and verifies it (digest, format);
2. starts the prefetcher (``snapshotter.datapath.prefetch``), then fetches the metadata
   sectors (in parallel, through the fetcher: coalesced requests on its workers, ahead of
   the prefetch) into the node's sector cache, while another thread asks the store for the
   size of each data blob the index names (each must match the index's; checked before
   step 5);
3. serves the FUSE file (``snapshotter.mount.fuse`` over ``fusewire``) on its threads;
4. puts the kernel's erofs on it at the mountpoint (``snapshotter.mount.kernel``) and raises the
   mount's read-ahead, so that sequential reads reach FUSE as 1 MiB requests;
5. records itself (``snapshotter.mount.state``), opens its control socket and reports readiness;
6. starts the mount's holder (``snapshotter.mount.holder``), which keeps a copy of the FUSE
   connection's descriptor so that the connection outlives this process;
7. serves until the FUSE file system is unmounted (that is how ``snapshotter umount`` ends
   it) or it gets SIGTERM/SIGINT/SIGHUP (then it unmounts erofs and FUSE itself), or until a
   successor retires it (then it exits and leaves every mount in place).

A successor (``adopt``: started by the holder when this server died, or by ``snapshotter
upgrade-mounts``) does none of steps 1-6 but the data path's setup: it takes the index digest,
the kernel side and INIT's outcome from the mount's record and the holder, the index from the
node's index cache and the sectors from the node's sector cache; it serves the connection the
holder hands it, retires its predecessor if that one still runs, has the kernel resend what
the predecessor left unanswered (``snapshotter.mount.handover``) and records itself.

The erofs mount (a loop device is autoclear) and the FUSE mount outlive every server; the
FUSE connection lives as long as the holder or a server holds its /dev/fuse file. ``umount``
takes it all down and removes the state directory, also after a crash.

Readiness goes to the parent as one JSON line on an inherited pipe: ``{"ok": true, ...}`` or
``{"ok": false, "type": ..., "error": ...}``.

It runs as its own interpreter (``python -m snapshotter.mount.server``, the request as JSON on
stdin), forked from the pre-imported fork server (``snapshotter.mount.forkserver``) or forked from
its caller (the ``snapshotter`` command, when no fork server runs yet); all end up in
``serve_request``. Its statistics say which (``launch``: exec, fork, self) and how long each
step of the mount took (``mount_seconds``, with ``launch``: from the caller's request to the
server's first step).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any, Generic, TypeVar

from imagetool.errors import FormatError
from imagetool.format import Index
from imagetool.stores import open_store, parse_ref
from imagetool.stores.base import Store
from snapshotter.cache import indexes as indexcache
from snapshotter.cache.sectors import SectorCache, remove_copy
from snapshotter.config import MountConfig
from snapshotter.datapath.fetcher import SectorFetcher
from snapshotter.datapath.prefetch import Prefetcher
from snapshotter.datapath.reader import BlockReader
from snapshotter.errors import CacheError, SnapshotterError
from snapshotter.metrics import MountMetrics
from snapshotter.mount import fuse, handover, holder, kernel, localcopy, memory, state
from snapshotter.mount.control import ControlServer
from snapshotter.mount.fusewire import FuseError, FuseServer

log = logging.getLogger(__name__)
T = TypeVar("T")

# erofs mount options tried in order: "directio" makes erofs read the FUSE file with direct
# I/O (one cache, the erofs one, and no FUSE read-ahead past what erofs asked for); kernels
# before 6.13 lack the option.
EROFS_FILE_OPTIONS = ("directio", "")
# The kernel's default read-ahead (KiB).
DEFAULT_READ_AHEAD_KB = 128
# How often a server checks that its mount's holder lives (and starts a new one if not).
HOLDER_CHECK_INTERVAL = 5.0


class MountServer:
    """One mounted image. ``start`` does steps 1-5, ``serve`` step 6, ``close`` tears down."""

    def __init__(
        self,
        ref: str,
        mountpoint: Path,
        config: MountConfig,
        launch: str = "exec",
        sent_at: float | None = None,
        adopt: bool = False,
        log_level: int = logging.INFO,
    ) -> None:
        self.ref = ref
        self.adopt = adopt  # take a live mount over (see the module docstring)
        self.log_level = log_level
        self.sent_at = sent_at  # time.time() at which the caller asked for this server
        self.launch = launch  # how this process started: "exec" or "fork" (fork server)
        self.mountpoint = Path(os.path.abspath(mountpoint))
        self.config = config
        self.dir = state.mount_dir(config.state_dir, self.mountpoint)
        self.fuse_dir = self.dir / state.FUSE_DIR
        self.stop_requested = threading.Event()
        self.started = time.time()
        self.record: state.MountRecord | None = None
        self.store: Store | None = None
        self.index: Index | None = None
        self.index_digest = ""
        self.metrics = MountMetrics()
        self.cache: SectorCache | None = None
        self.fetcher: SectorFetcher | None = None
        self.reader: BlockReader | None = None
        self.operations: fuse.BlockFile | None = None
        self.prefetcher: Prefetcher | None = None
        self.control: ControlServer | None = None
        self._fuse: FuseServer | None = None
        self._fuse_thread: threading.Thread | None = None
        self.holder_pid = 0
        self._holder_start = 0
        self.fuse_init: dict[str, int] = {}
        self.servers = 1  # this mount's servers so far, this one included
        self.retiring = threading.Event()
        self._fuse_outcome: dict[str, BaseException] = {}
        self._backing = ""
        self._loop_device = ""
        self._fuse_device = ""
        self._mount_seconds: dict[str, float] = {}
        self._index_cached = False
        self._local_copy = ""  # path of the image's copy the loop device reads, once made
        self._copy_state = "off" if not config.local_copy else "waiting"
        self._copy_seconds = 0.0

    # --- start ----------------------------------------------------------------------------

    def start(self) -> None:
        if self.adopt:
            self._adopt()
            return
        cfg = self.config
        phases = _Phases()
        # From the caller's request to here: a new interpreter's start and imports, or a fork.
        launched = time.time() - self.sent_at if self.sent_at is not None else None
        if not self.mountpoint.is_dir():
            raise MountServerError(f"mountpoint {self.mountpoint} is not a directory")
        if kernel.is_mountpoint(self.mountpoint):
            raise MountServerError(f"{self.mountpoint} is already a mount point")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fuse_dir.mkdir(exist_ok=True)
        self._save("starting")
        # Opening the node's sector cache scans it (thousands of entries on a busy node):
        # let that overlap the store's round trips.
        opening = _Task("lazyblock-cache-open", SectorCache, cfg.cache_dir, cfg.cache_size)

        ref = parse_ref(self.ref)
        self.store = open_store(ref, cfg.store)
        phases.done("store_open")  # the store client's imports, its TLS context
        self.index_digest = self.store.resolve_ref(ref)
        phases.done("resolve")
        self.index = self._load_index()
        blob_sizes = _Task("lazyblock-blob-size", blob_sizes_of, self.store, self.index)
        phases.done("index_read")  # read (or taken from the node) and verified

        self.cache = opening.result(phases.started + cfg.mount_timeout)
        phases.done("cache_open")
        self._build_data_path(cfg)
        # Prefetch starts now, with the index verified: behind the metadata (an on-demand
        # read) it keeps the link busy while the tree is mounted and the container starts.
        self.prefetcher = Prefetcher.for_mount(self.fetcher, cfg.prefetch_config()).start()
        phases.done("prefetch_start")
        try:
            self.fetcher.get(
                range(self.index.metadata_sectors), time.monotonic() + cfg.mount_timeout
            )
        except SnapshotterError:
            if blob_sizes.wait(1.0):  # "no such blob" says more
                self._check_blob_sizes(blob_sizes.result(0.0))
            raise
        phases.done("metadata")

        initialised = threading.Event()
        self.operations = fuse.BlockFile(self.reader, on_init=initialised.set)
        fsname = f"lazyblock:{self.index_digest[7:19]}"
        self._fuse, self._fuse_thread, self._fuse_outcome = fuse.serve_in_thread(
            self.operations, self.fuse_dir, fsname
        )
        while not initialised.wait(0.05):
            if not self._fuse_thread.is_alive():
                err = self._fuse_outcome.get("error")
                raise MountServerError(f"FUSE server did not start: {err or 'exited'}")
            if phases.elapsed() > cfg.mount_timeout:
                raise MountServerError("FUSE server did not start in time")
        phases.done("fuse")
        st = os.stat(self.fuse_dir)
        self._fuse_device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"

        self._attach()
        if cfg.kernel_read_ahead_kb:
            kernel.set_read_ahead(self.mountpoint, cfg.kernel_read_ahead_kb)
        phases.done("kernel")
        self._check_blob_sizes(blob_sizes.result(phases.started + cfg.mount_timeout))
        phases.done("blob_check")
        self.fuse_init = dict(self._fuse.negotiated)
        self._start_holder()
        phases.done("holder")
        self._mount_seconds = phases.seconds()
        if launched is not None:
            self._mount_seconds["launch"] = launched
        self._start_control()
        self._save("ready")
        self._mirror_cached()
        log.info(
            "mounted %s (%s) at %s via %s in %.3fs",
            self.ref, self.index_digest, self.mountpoint, self._backing, phases.elapsed(),
        )  # fmt: skip

    def _mirror_cached(self) -> None:
        """In the background: the compiled READ loop is given the entries of this image
        that the node cache holds (``BlockReader.mirror_cached``), so that a new server for
        a warm image answers even the first READ of each without the interpreter."""
        reader, operations = self.reader, self.operations
        if reader is None or operations is None or operations.fast is None:
            return

        def run() -> None:
            start = time.monotonic()
            try:
                given = reader.mirror_cached(self.stop_requested)
            except Exception:  # the READs of those entries go through Python, as before
                log.exception("giving the compiled read loop the cached entries failed")
                return
            if given:
                log.info("%d cached sectors read past the interpreter (checked in %.2fs)",
                         given, time.monotonic() - start)  # fmt: skip

        threading.Thread(target=run, name="lazyblock-mirror-cached", daemon=True).start()

    def _start_control(self) -> None:
        self.control = ControlServer(
            self.dir / state.CONTROL_SOCKET,
            {
                "stats": self._stats,
                "profile": self._profile,
                "credentials": self._credentials,
                "retire": self._retire,
            },
        ).start()

    # --- handover -------------------------------------------------------------------------

    def _hand(self) -> dict[str, Any]:
        """What the holder keeps for a successor: how to start one, and its request."""
        request = {
            "ref": self.ref,
            "mountpoint": str(self.mountpoint),
            "config": self.config.to_dict(),
            "log_level": self.log_level,
        }
        argv = [sys.executable, "-m", "snapshotter.mount.server", "--ready-fd=-1"]
        return {
            "mount_dir": str(self.dir),
            "init": self.fuse_init,
            "launch": {"argv": argv, "env": dict(os.environ)},
            "request": request,
        }

    def _start_holder(self) -> None:
        """Start the holder of this mount's FUSE connection; without one (it could not
        start) the mount works as before handovers: it dies with its server."""
        assert self._fuse is not None
        try:
            self.holder_pid = holder.start(
                self.dir, self._fuse.fd, os.getpid(), self._hand(), sys.stderr.fileno()
            )
        except OSError as e:
            log.warning("no holder for %s (its server cannot be replaced): %s",
                        self.mountpoint, e)  # fmt: skip
            return
        self._holder_start = state.process_start(self.holder_pid) or 0

    def _keep_holder(self) -> None:
        """Start a new holder if this mount's holder died (killed, OOM) while its server
        lives, so that the mount survives this server too."""
        if not self.holder_pid or self.retiring.is_set() or self.stop_requested.is_set():
            return
        if state.process_start(self.holder_pid) == self._holder_start:
            return
        log.warning("the holder %d of %s is gone; starting a new one", self.holder_pid,
                    self.mountpoint)  # fmt: skip
        self._start_holder()
        self._save("ready")

    def _adopt(self) -> None:
        """Take the live mount at ``mountpoint`` over (see the module docstring)."""
        cfg = self.config
        phases = _Phases()
        launched = time.time() - self.sent_at if self.sent_at is not None else None
        record = state.MountRecord.load(self.dir)
        if record is None or record.phase != "ready" or not record.held:
            raise handover.HandoverError(
                f"no live mount with a holder at {self.mountpoint} to take over"
            )
        self.index_digest = record.index_digest
        self._backing, self._loop_device = record.backing, record.loop_device
        self._fuse_device = record.fuse_device
        if record.local_copy:
            self._local_copy, self._copy_state = record.local_copy, "done"
        opening = _Task("lazyblock-cache-open", SectorCache, cfg.cache_dir, cfg.cache_size)
        self.store = open_store(parse_ref(self.ref), cfg.store)
        self.index = self._load_index()
        self.cache = opening.result(phases.started + cfg.mount_timeout)
        self._build_data_path(cfg)
        phases.done("prepare")
        with handover.lock(self.dir):
            record = state.MountRecord.load(self.dir) or record  # another may have just served
            try:
                fd, answer = holder.adopt(
                    self.dir, os.getpid(), self._hand()["launch"], self._hand()["request"]
                )
            except holder.HolderError as e:
                raise handover.HandoverError(str(e)) from None
            self.holder_pid = int(answer["holder_pid"])
            self._holder_start = state.process_start(self.holder_pid) or 0
            self.fuse_init = dict(answer.get("init") or record.fuse_init)
            self.servers = record.servers + 1
            self.operations = fuse.BlockFile(self.reader)
            fsname = f"lazyblock:{self.index_digest[7:19]}"
            self._fuse, self._fuse_thread, self._fuse_outcome = fuse.serve_in_thread(
                self.operations, self.fuse_dir, fsname, fd=fd, negotiated=self.fuse_init
            )
            phases.done("adopt")
            retired = handover.retire(self.dir, record)
            phases.done("retire")
            latest = state.MountRecord.load(self.dir)
            if latest is not None and latest.local_copy and not self._local_copy:
                # The predecessor finished a copy after this server read the record.
                self._local_copy, self._copy_state = latest.local_copy, "done"
            try:
                self._fuse.resend()
            except FuseError as e:
                log.warning("%s: requests the predecessor left unanswered wait for ever", e)
            self._start_control()
            self._save("ready")
        self.prefetcher = Prefetcher.for_mount(self.fetcher, cfg.prefetch_config()).start()
        self._mirror_cached()
        self._mount_seconds = phases.seconds()
        if launched is not None:
            self._mount_seconds["launch"] = launched
        log.info("took %s over from server %d (%s) in %.3fs", self.mountpoint, record.pid,
                 "retired" if retired else "dead", phases.elapsed())  # fmt: skip

    def _retire(self, request: dict[str, Any]) -> dict[str, Any]:
        """A successor serves the mount now: exit (soon after this answer) without
        unmounting anything, once the requests read so far are answered."""
        self.retiring.set()
        threading.Thread(target=self._exit_retired, name="lazyblock-retire", daemon=True).start()
        return {"pid": os.getpid()}

    def _exit_retired(self) -> None:
        time.sleep(0.05)  # the answer goes out first
        log.info("retiring: a successor serves %s", self.mountpoint)
        deadline = time.monotonic() + handover.RETIRE_DRAIN
        while self._fuse is not None and self._fuse.in_flight and time.monotonic() < deadline:
            time.sleep(0.005)
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(0)

    def _build_data_path(self, cfg: MountConfig) -> None:
        """The fetcher and the reader over the store, index and cache already open."""
        assert self.store is not None and self.index is not None and self.cache is not None
        self.fetcher = SectorFetcher(self.store, self.index, self.cache, cfg.fetch, self.metrics)
        self.reader = BlockReader(
            self.index,
            self.fetcher,
            cfg.memory_sectors,
            timeout=cfg.read_timeout,
            readahead_bytes=cfg.readahead_bytes,
        )

    def _load_index(self) -> Index:
        """The verified index: from the node's index cache if a copy there matches the
        digest, else from the store (``read_blob`` verifies it), then kept for next time."""
        assert self.store is not None
        cache_dir = self.config.cache_dir
        data = indexcache.load(cache_dir, self.index_digest)
        if data is None:
            data = self.store.read_blob(self.index_digest)
            index = Index.from_bytes(data)
            indexcache.save(cache_dir, self.index_digest, data)
            return index
        self._index_cached = True
        return Index.from_bytes(data)

    def _check_blob_sizes(self, sizes: dict[str, int]) -> None:
        assert self.index is not None
        for blob in self.index.blobs:
            if sizes[blob.digest] != blob.size:
                raise FormatError(
                    f"data blob {blob.digest} has {sizes[blob.digest]} bytes, "
                    f"the index says {blob.size}"
                )

    def _attach(self) -> None:
        image = self.fuse_dir / fuse.IMAGE_NAME
        backing = self.config.backing
        if backing == "auto" and self.config.kernel_read_ahead_kb > DEFAULT_READ_AHEAD_KB:
            # Both read a whole read-ahead window, in 1 MiB FUSE requests, once it is raised
            # (a file-backed mount's own bdi only on kernels that name it, 6.10+); the loop
            # device serves random reads at about twice the rate (``kernel``'s docstring).
            # Loop first, then, if it can.
            try:
                self._backing, device = kernel.attach_erofs(image, self.mountpoint, "loop")
                self._loop_device = device or ""
                return
            except (kernel.KernelMountError, OSError) as e:  # OSError: no losetup
                log.info("erofs on a loop device failed (%s); trying a file-backed mount", e)
        if backing in ("auto", "file"):
            for options in EROFS_FILE_OPTIONS:
                try:
                    kernel.sys_mount(str(image), self.mountpoint, "erofs", kernel.MS_RDONLY,
                                     options)  # fmt: skip
                    self._backing = "file"
                    return
                except kernel.KernelMountError as e:
                    log.debug("erofs file-backed mount with %r: %s", options, e)
                    last = e
            if backing == "file":
                raise last
        self._backing, device = kernel.attach_erofs(image, self.mountpoint, "loop")
        self._loop_device = device or ""

    # --- serve ----------------------------------------------------------------------------

    def serve(self) -> None:
        """Serve (the prefetch goes on in the background) until unmounted or asked to stop."""
        assert self.fetcher is not None and self.cache is not None
        assert self._fuse_thread is not None
        metrics = self.fetcher.metrics
        trimmer = memory.Trimmer()
        quiet = _Quiet(localcopy.QUIET_SECONDS)
        next_holder_check = time.monotonic() + HOLDER_CHECK_INTERVAL
        next_copy_check = 0.0
        while self._fuse_thread.is_alive():
            if self.stop_requested.wait(0.2):
                log.info("stopping: unmounting %s", self.mountpoint)
                self.unmount()
                self._fuse_thread.join(10)
                break
            if time.monotonic() >= next_holder_check:
                next_holder_check = time.monotonic() + HOLDER_CHECK_INTERVAL
                self._keep_holder()
            work = metrics.read_bytes.value + metrics.bytes_fetched.value
            now = time.monotonic()
            if trimmer.due(work, now):
                self.fetcher.release_buffers()
                self.cache.release_windows()
                memory.trim()
            if quiet.since(work, now) and now >= next_copy_check and self._copy_state == "waiting":
                next_copy_check = now + localcopy.CHECK_INTERVAL
                self._start_copy()
        log.info("FUSE file system of %s is gone; exiting", self.mountpoint)

    def _start_copy(self) -> None:
        """Copy the image out of the cache for the loop device (``snapshotter.mount.localcopy``)
        in a thread of its own, if it is whole in the cache and the mount is on a loop
        device."""
        assert self.index is not None and self.cache is not None
        if self.retiring.is_set():
            return
        if self._backing != "loop" or not self._loop_device:
            self._copy_state = "not on a loop device"
            return
        if not localcopy.whole_in_cache(self.index, self.cache):
            return
        self._copy_state = "copying"
        threading.Thread(target=self._copy, name="lazyblock-local-copy", daemon=True).start()

    def _copy(self) -> None:
        assert self.index is not None and self.cache is not None
        name = f"{self.index_digest.removeprefix('sha256:')[:16]}-{os.getpid()}"
        try:
            made = localcopy.make(self.index, self.cache, self._loop_device, name)
        except localcopy.LocalCopyError as e:
            log.warning("%s; the mount goes on through FUSE", e)
            # Tried again when the mount is next quiet and whole in the cache, if that can help.
            self._copy_state = "waiting" if e.again else f"failed: {e}"
            return
        except Exception as e:  # a thread's failure must not take the mount down
            log.exception("local copy of %s failed", self.mountpoint)
            self._copy_state = f"failed: {e}"
            return
        if made is None:
            log.info("no room in the cache for a local copy of %s", self.mountpoint)
            self._copy_state = "no room"
            return
        self._local_copy, self._copy_seconds = str(made.path), made.seconds
        self._copy_state = "done"
        if self.retiring.is_set():
            # The successor's record is the mount's now; it makes a copy of its own, and a
            # rescan removes this one once the loop device has let go of it.
            log.info("retired while copying; %s is not recorded", made.path)
            return
        self._save(self.record.phase if self.record else "ready")
        log.info(
            "%s: the loop device %s reads the local copy %s (%d bytes, made in %.1fs)",
            self.mountpoint, self._loop_device, made.path, made.bytes, made.seconds,
        )  # fmt: skip

    def unmount(self) -> None:
        """Take erofs (lazily if busy) and then FUSE off their mount points."""
        with contextlib.suppress(kernel.KernelMountError):
            kernel.unmount_path(self.mountpoint)
        with contextlib.suppress(kernel.KernelMountError):
            kernel.unmount_fuse(self.fuse_dir)

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stop_requested.set()

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.stop(1.0)
        if self._fuse_thread is not None and self._fuse_thread.is_alive() and not self.adopt:
            # A failed mount is undone; a failed takeover leaves the mount to the holder.
            self.unmount()
            self._fuse_thread.join(10)
        if self.control is not None:
            self.control.close()
        if self.fetcher is not None:
            self.fetcher.close()
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.close()
        if not kernel.is_mountpoint(self.fuse_dir) and (
            self.record is None or self.record.pid == os.getpid()
        ):
            holder.done(self.dir)
            if self._local_copy:  # the loop device went with erofs
                with contextlib.suppress(OSError, CacheError):
                    remove_copy(self.config.cache_dir, self._local_copy)
            state.remove_mount_dir(self.dir)

    # --- state and control ----------------------------------------------------------------

    def _save(self, phase: str) -> None:
        idx = self.index
        self.record = state.MountRecord(
            mountpoint=str(self.mountpoint),
            ref=self.ref,
            pid=os.getpid(),
            pid_start=state.process_start(os.getpid()) or 0,
            phase=phase,
            started_at=self.started,
            cache_dir=str(self.config.cache_dir),
            index_digest=self.index_digest,
            backing=self._backing,
            loop_device=self._loop_device,
            fuse_device=self._fuse_device,
            image_size=idx.image_size if idx else 0,
            sector_count=idx.sector_count if idx else 0,
            metadata_sectors=idx.metadata_sectors if idx else 0,
            holder_pid=self.holder_pid,
            holder_start=self._holder_start,
            fuse_init=self.fuse_init,
            servers=self.servers,
            local_copy=self._local_copy,
        )
        self.record.save(self.dir)

    def _stats(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.index and self.reader and self.cache and self.operations
        idx = self.index
        self.operations.drain()  # the reads the compiled loop answered, counted first
        touched = self.reader.touched_sectors()
        pf = self.prefetcher
        return {
            "mountpoint": str(self.mountpoint),
            "ref": self.ref,
            "index_digest": self.index_digest,
            "pid": os.getpid(),
            "backing": self._backing,
            "loop_device": self._loop_device,
            "local_copy": {
                "state": self._copy_state,
                "path": self._local_copy,
                "seconds": round(self._copy_seconds, 3),
            },
            "uptime": time.time() - self.started,
            "mount_seconds": self._mount_seconds,
            "launch": self.launch,
            "index_cached": self._index_cached,
            "handover": {
                "adopted": self.adopt,
                "servers": self.servers,
                "holder_pid": self.holder_pid,
                "held": bool(self.holder_pid)
                and state.process_start(self.holder_pid) == self._holder_start,
                "resent_requests": self._fuse.resent if self._fuse else 0,
            },
            "image": {
                "size": idx.image_size,
                "sector_size": idx.sector_size,
                "sectors": idx.sector_count,
                "stored_sectors": sum(1 for s in idx.sectors if not s.is_zero),
                "metadata_sectors": idx.metadata_sectors,
                "blob_size": sum(b.size for b in idx.blobs),
                "blobs": len(idx.blobs),
            },
            "fetch": self.metrics.snapshot(),
            "sources": self.store.source_stats(),
            "readahead_sectors": self.fetcher.readahead_sectors.value if self.fetcher else 0,
            "reads": {
                "touched_sectors": len(touched),
                # what the readers needed from the store: the physical floor's bytes
                "touched_stored_bytes": sum(idx.sectors[n].length for n in touched),
                "touched_data_sectors": sum(1 for n in touched if n >= idx.metadata_sectors),
                "errors": self.operations.read_errors.value,
                # answered by the compiled loop (snapshotter.mount._fastreads), from memory
                # or, of those, from the node cache's entries
                "compiled": self._fuse.compiled_reads if self._fuse else 0,
                "compiled_from_cache": self._fuse.compiled_cache_reads if self._fuse else 0,
                # cache entries the compiled loop may read now
                "compiled_entries": self.reader.mirrored_entries,
            },
            "prefetch": {
                "mode": self.config.prefetch_mode.value,
                "planned": len(pf.sectors) if pf else 0,
                "fetched": pf.fetched if pf else 0,
                "running": bool(pf and pf.running),
                "window": pf.window.size if pf and pf.window else 0,
                "streaming": bool(pf and pf.streaming),
                "files_streamed": pf.files_streamed if pf else 0,
            },
            "cache": {
                "dir": str(self.config.cache_dir),
                "max_bytes": self.cache.max_bytes,
                "known_bytes": self.cache.usage(),
                **self.cache.metrics.snapshot(),
            },
        }

    def _credentials(self, request: dict[str, Any]) -> dict[str, str] | None:
        """The registry credentials this mount was started with from the daemon's CRI
        keychain (``StoreOptions.credentials``; not a docker config's), so that a restarted
        daemon can remount the image's other layers, or this one, after this server dies.
        Over the root-only control socket only; never logged."""
        secret = self.config.store.credentials
        return None if secret is None else {"username": secret[0], "password": secret[1]}

    def _profile(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.reader is not None and self.operations is not None
        if request.get("sectors"):
            return {"sectors": self.reader.touched_sectors()}
        profile = self.operations.touched_profile()
        # "files" alone is what servers before ranges answered: read as whole files
        return {
            "files": list(profile.paths),
            "ranges": {e.path: e.ranges for e in profile.entries if e.ranges is not None},
        }


# Blob sizes asked for at once while mounting (a registry HEAD each).
BLOB_SIZE_REQUESTS = 8


class _Quiet:
    """Whether a counter of work has stood still for ``quiet`` seconds (from the first look,
    for a mount that does nothing at all)."""

    def __init__(self, quiet: float) -> None:
        self.quiet = quiet
        self._work: int | None = None
        self._since = 0.0

    def since(self, work: int, now: float) -> bool:
        if work != self._work:
            self._work, self._since = work, now
            return False
        return now - self._since >= self.quiet


def blob_sizes_of(store: Store, index: Index) -> dict[str, int]:
    """The store's size of each data blob ``index`` names (``NotFoundError`` for one it
    lacks), asked for in parallel."""
    digests = list(dict.fromkeys(b.digest for b in index.blobs))
    if len(digests) <= 1:
        return {d: store.blob_size(d) for d in digests}
    workers = min(BLOB_SIZE_REQUESTS, len(digests))
    with ThreadPoolExecutor(workers, thread_name_prefix="lazyblock-blob-size") as pool:
        return dict(zip(digests, pool.map(store.blob_size, digests), strict=True))


class MountServerError(SnapshotterError):
    """The server could not set the mount up."""


class _Phases:
    """The steps of a mount, timed one after the other: ``done(name)`` ends the step that
    began when the previous one ended. ``seconds()``: each step, ``index`` (the three
    steps of getting the index: ``store_open``, ``resolve``, ``index_read``) and ``total``."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self._last = self.started
        self._seconds: dict[str, float] = {}

    def done(self, name: str) -> None:
        now = time.monotonic()
        self._seconds[name] = now - self._last
        self._last = now

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def seconds(self) -> dict[str, float]:
        out = dict(self._seconds)
        out["index"] = sum(out.get(k, 0.0) for k in ("store_open", "resolve", "index_read"))
        out["total"] = self._last - self.started
        return out


class _Task(Generic[T]):
    """A call on its own thread, started at once, so that it overlaps the rest of the
    mount; ``result`` hands back its value or raises its exception."""

    def __init__(self, name: str, fn: Callable[..., T], *args: Any) -> None:
        self.name = name
        self._done = threading.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, args=(fn, *args), name=name, daemon=True).start()

    def _run(self, fn: Callable[..., T], *args: Any) -> None:
        try:
            self._value = fn(*args)
        except BaseException as e:  # handed to result()
            self._error = e
        finally:
            self._done.set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(max(0.0, timeout))

    def result(self, deadline: float) -> T:
        """Its value; waits until ``deadline`` (``time.monotonic()``) at most."""
        if not self._done.wait(max(0.0, deadline - time.monotonic())):
            raise MountServerError(f"{self.name} did not finish in time")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def run(
    ref: str,
    mountpoint: Path,
    config: MountConfig,
    ready: Callable[[dict[str, Any]], bool],
    launch: str = "exec",
    sent_at: float | None = None,
    adopt: bool = False,
    log_level: int = logging.INFO,
) -> int:
    """Run a mount server in this process until it is unmounted; returns an exit code.
    ``ready`` hands the readiness document to whoever asked for the mount and says whether
    it got there: a mount nobody waits for any more (they gave up, or died) is undone.

    Must run on the main thread (it handles SIGTERM, SIGINT and SIGHUP)."""
    raise_open_file_limit()
    memory.tune()
    server = MountServer(ref, mountpoint, config, launch, sent_at, adopt, log_level)
    # Installed before the FUSE threads start: they inherit the main thread's handling.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, server.request_stop)
    try:
        try:
            server.start()
        except BaseException as e:
            log.error("mount of %s at %s failed: %s: %s", ref, mountpoint, type(e).__name__, e)
            ready({"ok": False, "type": type(e).__name__, "error": str(e)})
            return 3
        assert server.record is not None
        if not ready(
            {"ok": True, "record": server.record.__dict__, "seconds": server._mount_seconds}
        ):
            log.warning("nobody waits for the mount at %s any more; undoing it", mountpoint)
            return 4
        server.serve()
        return 0
    finally:
        server.close()


# Descriptors a mount server asks for at most: the kernel's default cap on any process's.
MAX_OPEN_FILES = 1 << 20


def raise_open_file_limit() -> None:
    """Take the hard limit on open descriptors as this process's soft one (as Go's runtime
    does for every program): a mount server keeps many cache entry files open
    (``snapshotter.cache.sectors.open_file_cap``), and a login shell's soft limit of 1024 would have
    it reopen an entry on most random reads."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, MAX_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def serve_request(request: dict[str, Any], ready_fd: int, launch: str = "exec") -> int:
    """Serve a mount request ``{"ref": ..., "mountpoint": ..., "config":
    MountConfig.to_dict(), "log_level": ...}``, reporting readiness on ``ready_fd``; logs go
    to stderr."""
    logging.basicConfig(
        level=request.get("log_level", logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    ready_file = os.fdopen(ready_fd, "w") if ready_fd >= 0 else None
    if "config" not in request:  # a successor that keeps its predecessor's configuration
        try:
            request = {**holder.last_request(Path(request["mount_dir"])), **request}
        except holder.HolderError as e:
            if ready_file is not None:
                with contextlib.suppress(OSError):
                    doc = {"ok": False, "type": "HandoverError", "error": str(e)}
                    ready_file.write(json.dumps(doc) + "\n")
                    ready_file.close()
            return 3
    config = MountConfig.from_dict(request["config"])

    def ready(doc: dict[str, Any]) -> bool:
        if ready_file is None:  # started by the mount's holder: nobody waits
            return bool(doc.get("ok"))
        try:
            ready_file.write(json.dumps(doc) + "\n")
            ready_file.close()
        except OSError:  # the requester closed its end: it gave up or died
            return False
        return True

    return run(
        request["ref"],
        Path(request["mountpoint"]),
        config,
        ready,
        launch,
        request.get("sent_at"),
        adopt=bool(request.get("adopt")),
        log_level=request.get("log_level", logging.INFO),
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m snapshotter.mount.server --ready-fd N`` with the request (see
    ``serve_request``) as JSON on stdin; ``--ready-fd=-1``: nobody waits for readiness (a
    successor the mount's holder started)."""
    from snapshotter.startup import skip_unused_imports

    skip_unused_imports()
    parser = argparse.ArgumentParser(prog="snapshotter-mount-server")
    parser.add_argument("--ready-fd", type=int, required=True)
    args = parser.parse_args(argv)
    return serve_request(json.loads(sys.stdin.read()), args.ready_fd)


if __name__ == "__main__":
    sys.exit(main())
