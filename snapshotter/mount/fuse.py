"""The FUSE adapter: a block image's uncompressed filesystem image as one read-only file.

The FUSE file system has a root directory holding one regular file, ``image``; the kernel's
erofs is mounted on that file (``snapshotter.mount.kernel``), so FUSE only ever sees large reads of
one immutable file, never a lookup storm of the image's own files. Each callback translates:
one ``BlockReader.read_into`` per read, straight into libfuse's reply buffer (``_Fuse``), a
``SnapshotterError`` becomes its errno (EIO for fetch failures), anything unexpected becomes
EIO with the traceback logged.

Binding: **mfusepy** (ctypes over libfuse 3's high-level API). Chosen for speed where it
matters here:

* libfuse 3, so reads of up to 1 MiB per request (``max_read``; libfuse 3 negotiates
  ``max_pages`` = 256 from its 1 MiB buffer); libfuse 2 (llfuse, fusepy) stops at 128 KiB.
* libfuse's own multithreaded loop (``fuse_loop_mt``, C threads): a read waiting on the
  store does not hold up reads served from the cache, and the GIL is released while
  zstd decompresses and while the kernel copies. pyfuse3 runs every request through one
  trio event loop and would have to hand each blocking read to a thread pool (an extra
  hop per request), and it needs a C build at install time; mfusepy is pure Python.
* The high-level API's path lookups cost nothing for a one-file file system, and
  ``kernel_cache`` plus long attribute/entry timeouts keep the immutable file's pages and
  attributes in the kernel.

The per-request cost of Python (~tens of microseconds) is small against a 1 MiB read, so
throughput is bounded by decompression and copying, not by the binding. Copies are kept to
what the kernel does: a warm read is one ``preadv`` of the cache file into libfuse's buffer
(checked there, block by block) and libfuse's ``writev`` of it to /dev/fuse. The loop
device's requests are cut at a multiple of ``MAX_READ`` (``kernel.set_read_ahead``), so
a sequential reader's requests are all 1 MiB.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from snapshotter.datapath.reader import BlockReader
from snapshotter.errors import SnapshotterError
from snapshotter.metrics import Counter

# mfusepy picks "libfuse" (2) before "libfuse3" unless told; we need 3 (1 MiB reads).
os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")
import mfusepy  # noqa: E402

log = logging.getLogger(__name__)

IMAGE_NAME = "image"
# The filesystem block: the unit of the startup profile's "already read" map.
BLOCK = 4096
# Reads kept for the profile at most (block-aligned reads of new blocks only: a 10 GB image
# has 2.6 million blocks, a startup reads a few thousand times).
MAX_PROFILE_RANGES = 1 << 20
# Largest FUSE read request: libfuse 3's receive buffer holds 1 MiB of data (256 pages).
MAX_READ = 1 << 20
# The file never changes while mounted: let the kernel keep attributes and entries for a day.
ATTR_TIMEOUT = 86400.0


class BlockFile(mfusepy.Operations):
    """mfusepy operations for one mounted image."""

    use_ns = True

    def __init__(self, reader: BlockReader, on_init: Callable[[], None] | None = None) -> None:
        self.reader = reader
        self.on_init = on_init
        self.read_errors = Counter()  # reads answered with an error
        # Startup profile: the byte ranges read, in first-access order (finer than the
        # reader's sector log), mapped to files only when a profile is asked for: the file
        # map is not needed to serve reads, and building it for a 200,000-file image costs
        # a tenth of a second. One byte per filesystem block says "already read" (blocks a
        # read covered whole), so the log holds only reads that touched something new.
        self._seen = bytearray(-(-reader.size // BLOCK))
        self._ranges: list[tuple[int, int]] = []
        self._touched_lock = threading.Lock()
        now = time.time_ns()
        self._times = {"st_atime": now, "st_mtime": now, "st_ctime": now}

    # --- lifecycle ------------------------------------------------------------------------

    def init_with_config(self, conn: Any, config: Any) -> None:
        if config is not None:
            config.kernel_cache = 1
            config.entry_timeout = ATTR_TIMEOUT
            config.attr_timeout = ATTR_TIMEOUT
            config.negative_timeout = ATTR_TIMEOUT
        if conn is not None:
            conn.max_read = MAX_READ  # must match the max_read mount option
            conn.max_readahead = max(conn.max_readahead, MAX_READ)
        if self.on_init is not None:
            self.on_init()

    # --- metadata -------------------------------------------------------------------------

    def getattr(self, path: str, fh: Any = None) -> dict[str, int]:
        if path == "/":
            return {"st_mode": stat.S_IFDIR | 0o555, "st_nlink": 2, **self._times}
        if path == "/" + IMAGE_NAME:
            return {
                "st_mode": stat.S_IFREG | 0o444,
                "st_nlink": 1,
                "st_size": self.reader.size,
                "st_blocks": -(-self.reader.size // 512),
                **self._times,
            }
        raise mfusepy.FuseOSError(errno.ENOENT)

    def readdir(self, path: str, fh: Any) -> list[str]:
        if path != "/":
            raise mfusepy.FuseOSError(errno.ENOTDIR)
        return [".", "..", IMAGE_NAME]

    def open(self, path: str, flags: int) -> int:
        if path != "/" + IMAGE_NAME:
            raise mfusepy.FuseOSError(errno.ENOENT)
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise mfusepy.FuseOSError(errno.EROFS)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        blocks = -(-self.reader.size // 4096)
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": blocks, "f_namemax": 255}

    # --- data -----------------------------------------------------------------------------

    def read(self, path: str, size: int, offset: int, fh: Any) -> bytes:
        try:
            data = self.reader.read(offset, size)
            self._record(offset, len(data))
            return data
        except SnapshotterError as e:
            self.read_errors.inc()
            log.warning("read %d+%d: %s: %s", offset, size, type(e).__name__, e)
            raise mfusepy.FuseOSError(e.errno) from None
        except Exception:
            self.read_errors.inc()
            log.exception("read %d+%d failed", offset, size)
            raise mfusepy.FuseOSError(errno.EIO) from None

    def read_into(self, offset: int, out: memoryview) -> int:
        """``read`` into libfuse's reply buffer (see ``_Fuse.read``); returns the byte
        count."""
        try:
            n = self.reader.read_into(offset, out)
            self._record(offset, n)
            return n
        except SnapshotterError as e:
            self.read_errors.inc()
            log.warning("read %d+%d: %s: %s", offset, len(out), type(e).__name__, e)
            raise mfusepy.FuseOSError(e.errno) from None
        except Exception:
            self.read_errors.inc()
            log.exception("read %d+%d failed", offset, len(out))
            raise mfusepy.FuseOSError(errno.EIO) from None

    def _record(self, offset: int, length: int) -> None:
        if length <= 0:
            return
        end = offset + length
        first, last = -(-offset // BLOCK), end // BLOCK  # the blocks it covers whole
        seen = self._seen
        whole = offset % BLOCK == 0 and end % BLOCK == 0
        if whole and seen.find(0, first, last) < 0:
            return  # every block of it was read before
        with self._touched_lock:
            if len(self._ranges) >= MAX_PROFILE_RANGES:
                return  # long past any startup
            if last > first:
                seen[first:last] = b"\x01" * (last - first)
            self._ranges.append((offset, length))

    def touched_files(self) -> list[str]:
        """Paths of the files read so far, in first-access order."""
        with self._touched_lock:
            ranges = list(self._ranges)
        touched: dict[str, None] = {}
        for offset, length in ranges:
            for f in self.reader.index.files_in_range(offset, length):
                touched.setdefault(f.path)
        return list(touched)


# A writable memoryview over C memory (libfuse's read buffer), without a copy.
_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_memory_view.restype = ctypes.py_object
_PYBUF_WRITE = 0x200


# libfuse's workers are C threads: for each callback on one, ctypes creates a Python thread
# state and deletes it when the callback returns (allocating, registering and tearing down
# interpreter state on every FUSE request). The first read on a worker keeps its thread
# state for the thread's life instead (one more PyGILState_Ensure, never released). libfuse
# keeps its workers for the mount's life (up to ``max_idle_threads`` idle ones); one that
# exits leaves its few kilobytes behind, and a new thread that happens to get its identifier
# just goes on the old way.
_threads_kept: set[int] = set()


def _keep_thread_state() -> None:
    ident = threading.get_ident()
    if ident not in _threads_kept:
        _threads_kept.add(ident)
        ctypes.pythonapi.PyGILState_Ensure()


class _Fuse(mfusepy.FUSE):
    """mfusepy with a read callback that fills libfuse's buffer in place.

    mfusepy's own ``read`` takes the bytes the operation returns and copies them into the
    buffer libfuse replies from; here the operation is handed that buffer (as a
    memoryview) and the cache file is read straight into it, one copy less and no 1 MiB
    ``bytes`` allocated per request. The view is released when the callback returns
    (nothing keeps a reference to it or its slices past the call)."""

    def read(self, path: bytes | None, buf: Any, size: int, offset: int, fip: Any) -> int:
        _keep_thread_state()
        view = _memory_view(ctypes.cast(buf, ctypes.c_void_p).value, size, _PYBUF_WRITE)
        try:
            return self.operations.read_into(offset, view)
        finally:
            view.release()


def serve(operations: BlockFile, directory: Path, fsname: str) -> None:
    """Mount ``operations`` on ``directory`` and serve until it is unmounted (blocks).

    Runs libfuse's multithreaded loop; call it from a thread other than the main one so
    that the main thread keeps handling signals."""
    _Fuse(
        operations,
        str(directory),
        foreground=True,
        nothreads=False,
        ro=True,
        fsname=fsname,
        subtype="lazyblock",
        max_read=MAX_READ,
        kernel_cache=True,
        # Spare threads kept for bursts of parallel reads (libfuse default: 10).
        max_idle_threads=16,
    )


def serve_in_thread(
    operations: BlockFile, directory: Path, fsname: str
) -> tuple[threading.Thread, dict[str, BaseException]]:
    """``serve`` on a new thread; the returned dict receives the exception it ended with."""
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            serve(operations, directory, fsname)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            outcome["error"] = e

    thread = threading.Thread(target=run, name="lazyblock-fuse", daemon=True)
    thread.start()
    return thread, outcome
