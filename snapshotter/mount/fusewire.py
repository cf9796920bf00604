"""The FUSE protocol on /dev/fuse, for a file system of one read-only regular file.

This module is the wire: it mounts a FUSE file system, reads the kernel's requests from
``/dev/fuse`` on a pool of threads and writes the answers, all with plain system calls
(``os.readv``/``os.writev``). It knows the messages (the kernel's uapi header
``linux/fuse.h``, protocol 7.23 and later) and nothing of block images: what the file holds
comes from a ``FileSource`` (``snapshotter.mount.fuse.BlockFile``).

Why not libfuse. The mount serves one immutable file that the kernel's erofs reads in
requests of up to 1 MiB, so its whole protocol is a dozen messages, and the data path is what
matters. Through libfuse (mfusepy over its high-level API) every READ went through ctypes and
a Python thread state made per C worker thread, and its bytes were copied into libfuse's
reply buffer before libfuse wrote them to the kernel. Here a READ's answer is one
``writev`` of the header and the sector memory (or cache read) that holds the bytes: no copy
in user space at all. Measured on the mount benchmark's 2 GiB image, a server that answers
reads from memory costs 0.15-0.3 CPU-s per GB this way (the kernel's copy into the page
cache), where libfuse's path cost the mount server ~1 CPU-s per GB more than the work of the
data path itself (``benchmarks/mount/results/README.md``).

The compiled loop (``snapshotter.mount._fastreads``, where it is built). A source that has a
``fast`` table (``FileSource``) has its READs of sectors in memory, being fetched, or in
node cache entries it was given answered in C: each FUSE thread calls ``Memory.serve``,
which reads requests and answers those without the interpreter, and returns the others
here (``_next_for_python``), along with its log of answered READs for the source's
bookkeeping (``drain``).

Requests: INIT (once; asks for asynchronous reads, asynchronous direct I/O and 1 MiB
requests), LOOKUP, GETATTR,
OPEN (the file's pages may stay cached: it never changes), READ, RELEASE, FLUSH, STATFS,
OPENDIR, READDIR, RELEASEDIR; FORGET, BATCH_FORGET and INTERRUPT need no answer (a read is
never abandoned half way: it ends within its deadline); everything else is answered ENOSYS,
which the kernel remembers (xattrs, access checks) or which a read-only file system is
right to refuse. An answer the kernel no longer wants (ENOENT on write: the request was
interrupted, the reading process died) is dropped. When the file system is unmounted, reads
of /dev/fuse fail with ENODEV and every thread ends.

Handover (``snapshotter.mount.holder``): a server may also serve a connection it did not make,
``fd`` being a copy of another process's /dev/fuse descriptor and ``negotiated`` what that
process's INIT answer said (INIT comes once per connection). ``resend`` then asks the kernel
to queue again every request that was read from the connection but never answered
(``FUSE_NOTIFY_RESEND``, kernel 6.9 and later): those a dead predecessor held. Such a request
comes back with bit 63 of its ``unique`` set (``FUSE_UNIQUE_RESEND``) and is answered as any
other; a request answered twice (the predecessor's answer raced the resend) costs only the
work, the kernel drops the late answer (ENOENT, ignored here).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import stat
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from snapshotter.errors import SnapshotterError

try:  # READs answered from sector memory without the interpreter (see its source)
    from snapshotter.mount import _fastreads
except ImportError:  # not built: every request is answered in Python
    _fastreads = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

# Opcodes (enum fuse_opcode).
LOOKUP, FORGET, GETATTR, OPEN, READ, STATFS, RELEASE = 1, 2, 3, 14, 15, 17, 18
FLUSH, INIT, OPENDIR, READDIR, RELEASEDIR = 25, 26, 27, 28, 29
# enum fuse_notify_code: queue the connection's unanswered requests again (kernel 6.9+).
NOTIFY_RESEND = 7
# The bit the kernel sets in a resent request's ``unique``.
UNIQUE_RESEND = 1 << 63
INTERRUPT, DESTROY, BATCH_FORGET = 36, 38, 42
_NO_REPLY = frozenset({FORGET, BATCH_FORGET, INTERRUPT})

IN_HEADER = struct.Struct("<IIQQIIIHH")  # fuse_in_header
OUT_HEADER = struct.Struct("<IiQ")  # fuse_out_header
READ_IN = struct.Struct("<QQIIQII")  # fuse_read_in
INIT_IN = struct.Struct("<IIII")  # fuse_init_in: major, minor, max_readahead, flags
INIT_OUT = struct.Struct("<IIIIHHIIHHII6I")  # fuse_init_out (7.23+), 64 bytes
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr
ENTRY_OUT = struct.Struct("<QQQQII")  # fuse_entry_out, before its fuse_attr
ATTR_OUT = struct.Struct("<QII")  # fuse_attr_out, before its fuse_attr
OPEN_OUT = struct.Struct("<QIi")  # fuse_open_out
KSTATFS = struct.Struct("<QQQQQIIII6I")  # fuse_kstatfs
DIRENT = struct.Struct("<QQII")  # fuse_dirent, before its name

KERNEL_MAJOR = 7
MIN_MINOR = 23  # the fuse_init_out above (and max_pages from 28)
OUR_MINOR = 31
FUSE_ASYNC_READ = 1 << 0
# Direct I/O (the loop device's reads of the FUSE file) submitted asynchronously, several
# requests in flight at once; without it each one waits for the one before.
FUSE_ASYNC_DIO = 1 << 15
FUSE_MAX_PAGES = 1 << 22
FOPEN_KEEP_CACHE = 1 << 1
ROOT_ID, FILE_ID = 1, 2
DT_DIR, DT_REG = 4, 8
PAGE = 4096
# Largest READ asked for: 256 pages, the kernel's default cap on a request.
MAX_READ = 1 << 20
# No WRITE ever comes, but the kernel sizes the smallest read of /dev/fuse by max_write.
MAX_WRITE = 1 << 16
REQUEST_BUFFER = MAX_WRITE + 2 * PAGE
# The file never changes while mounted: attributes and entries are valid for a day.
VALID_SECONDS = 86400
# Reader threads: reads that wait on the network must not hold up those the cache answers;
# the kernel sends at most max_background (12) asynchronous reads at once.
THREADS = 16
MAX_BACKGROUND = 12

MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]


# Set to 0, the FUSE threads answer every READ in Python, the compiled loop
# (``snapshotter.mount._fastreads``) left unused: for comparing the two, or ruling it out.
COMPILED_READS_ENV = "LAZYBLOCK_COMPILED_READS"


def compiled_reads_wanted() -> bool:
    """Whether READs may be answered by the compiled loop: it is built and not turned off
    (``COMPILED_READS_ENV``)."""
    return _fastreads is not None and os.environ.get(COMPILED_READS_ENV, "1") != "0"


def compiled_memory(
    sector_size: int, image_size: int, drain_every: int, disk_min_read: int = 0
) -> object | None:
    """A table of sectors in memory (and cache entries) for the compiled loop to answer
    READs from (``_fastreads.Memory``, a ``FileSource``'s ``fast``; READs of entries only
    when longer than ``disk_min_read``); None where that loop is not built or turned off
    (``compiled_reads_wanted``)."""
    if not compiled_reads_wanted():
        return None
    return _fastreads.Memory(sector_size, image_size, drain_every, disk_min_read=disk_min_read)


class FuseError(SnapshotterError):
    """The FUSE file system could not be mounted or served."""


class ReadError(Exception):
    """A read that is answered with ``errno`` (the source says why in its log)."""

    def __init__(self, err: int) -> None:
        super().__init__(os.strerror(err))
        self.errno = err


class FileSource(Protocol):
    """What the one file holds: its size, and its bytes. A source may also have ``fast``, a
    ``snapshotter.mount._fastreads.Memory`` of the bytes it keeps in memory (or None), whose
    READs the FUSE threads then answer without the interpreter; and ``drain()``, which takes
    the log of those READs into its bookkeeping."""

    @property
    def size(self) -> int: ...

    def read_parts(
        self, offset: int, length: int, scratch: memoryview, waited: float = 0.0
    ) -> Sequence[object]:
        """Buffers whose concatenation is bytes ``[offset, offset+length)`` (short at the
        end of the file); ``scratch`` is this thread's page-aligned memory for bytes that
        must be read from somewhere first; ``waited``: seconds the request has already
        waited for its bytes (in the compiled loop), which its deadline counts. Raises
        ``ReadError``."""
        ...


class FuseServer:
    """One mounted FUSE file system: a root directory holding the regular file ``name``."""

    def __init__(
        self,
        source: FileSource,
        directory: Path,
        fsname: str,
        name: str = "image",
        threads: int = THREADS,
        on_init: Callable[[], None] | None = None,
        scratch_bytes: int = MAX_READ * 2,
        fd: int = -1,
        negotiated: dict[str, int] | None = None,
    ) -> None:
        self.source = source
        self.directory = directory
        self.fsname = fsname
        self.name = name.encode()
        self.threads = threads
        self.on_init = on_init
        self.scratch_bytes = scratch_bytes
        # What INIT settled (minor, flags, max_readahead): given for an adopted connection.
        self.negotiated: dict[str, int] = dict(negotiated or {})
        self._fd = fd  # an adopted connection's /dev/fuse descriptor, or -1 until mounted
        self._resent = 0  # requests that came back through a resend
        self._in_flight = 0  # requests read and not yet answered
        # READs answered from sector memory in compiled code (None: all in Python)
        self._fast = getattr(source, "fast", None)
        self._lock = threading.Lock()
        now = int(time.time())
        size = source.size
        self._file_attr = ATTR.pack(
            FILE_ID, size, -(-size // 512), now, now, now, 0, 0, 0,
            stat.S_IFREG | 0o444, 1, 0, 0, 0, PAGE, 0,
        )  # fmt: skip
        self._root_attr = ATTR.pack(
            ROOT_ID, 0, 0, now, now, now, 0, 0, 0, stat.S_IFDIR | 0o555, 2, 0, 0, 0, PAGE, 0
        )
        entries = [(ROOT_ID, b".", DT_DIR), (ROOT_ID, b"..", DT_DIR), (FILE_ID, self.name, DT_REG)]
        self._dirents = []
        for i, (ino, entry, kind) in enumerate(entries):
            packed = DIRENT.pack(ino, i + 1, len(entry), kind) + entry
            self._dirents.append(packed + bytes(-len(packed) % 8))

    # --- mounting -------------------------------------------------------------------------

    def mount(self) -> None:
        """Open /dev/fuse and mount the file system on ``directory`` (read-only)."""
        try:
            self._fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise FuseError(f"cannot open /dev/fuse: {e.strerror}") from None
        options = (
            f"fd={self._fd},rootmode={stat.S_IFDIR:o},user_id={os.getuid()},"
            f"group_id={os.getgid()},default_permissions,max_read={MAX_READ}"
        )
        flags = MS_RDONLY | MS_NOSUID | MS_NODEV
        source = self.fsname.encode()
        if _libc.mount(source, os.fsencode(self.directory), b"fuse.lazyblock", flags,
                       options.encode()):  # fmt: skip
            err = ctypes.get_errno()
            os.close(self._fd)
            self._fd = -1
            raise FuseError(f"mount -t fuse {self.directory}: {os.strerror(err)}")

    @property
    def fd(self) -> int:
        """The /dev/fuse descriptor (-1 before ``mount``)."""
        return self._fd

    @property
    def in_flight(self) -> int:
        return self._in_flight + (self._fast.in_flight if self._fast is not None else 0)

    @property
    def resent(self) -> int:
        """Requests that came back through a resend (``resend``) and were answered."""
        return self._resent + (self._fast.resent if self._fast is not None else 0)

    @property
    def compiled_reads(self) -> int:
        """READs answered without the interpreter."""
        return self._fast.served if self._fast is not None else 0

    @property
    def compiled_cache_reads(self) -> int:
        """... of which read sectors from the node cache's entries."""
        fast = self._fast
        return fast.disk_reads - fast.disk_failures if fast is not None else 0

    def resend(self) -> None:
        """Have the kernel queue again the requests read from this connection and never
        answered (``FUSE_NOTIFY_RESEND``). Raises ``FuseError`` where the kernel lacks it
        (before 6.9: EINVAL); such requests then wait for ever."""
        try:
            os.write(self._fd, OUT_HEADER.pack(OUT_HEADER.size, NOTIFY_RESEND, 0))
        except OSError as e:
            raise FuseError(f"FUSE_NOTIFY_RESEND: {e.strerror}") from None

    # --- serving --------------------------------------------------------------------------

    def serve(self) -> None:
        """Answer requests on ``threads`` threads until the file system is unmounted."""
        if self._fd < 0:
            self.mount()
        workers = [
            threading.Thread(target=self._work, name=f"lazyblock-fuse-{i}", daemon=True)
            for i in range(self.threads)
        ]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        os.close(self._fd)
        self._fd = -1

    def _work(self) -> None:
        buf = bytearray(REQUEST_BUFFER)
        view = memoryview(buf)
        scratch = _aligned_buffer(self.scratch_bytes)
        fd = self._fd
        fast = self._fast
        unpack_in = IN_HEADER.unpack_from
        while True:
            waited = 0.0  # seconds the request waited in the compiled loop for a fetch
            if fast is not None:
                got = self._next_for_python(fast, fd, buf)
                if got is None:
                    return
                n, waited = got
            else:
                try:
                    n = os.readv(fd, [buf])
                except OSError as e:
                    if e.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                        continue  # interrupted, or a request withdrawn before we read it
                    if e.errno == errno.ENODEV:
                        return  # unmounted
                    log.exception("reading /dev/fuse failed")
                    return
            _, opcode, unique, nodeid, *_ = unpack_in(buf)
            with self._lock:
                self._in_flight += 1
                if unique & UNIQUE_RESEND:
                    self._resent += 1
            if fast is not None:
                fast.handed()  # counted here from now on
            try:
                if opcode == READ:
                    self._read(fd, unique, view, scratch, waited)
                else:
                    self._other(fd, opcode, unique, nodeid, view[IN_HEADER.size : n])
            except Exception:  # a bug: answer EIO and keep serving
                log.exception("FUSE request %d failed", opcode)
                if opcode not in _NO_REPLY:
                    self._error(fd, unique, errno.EIO)
            finally:
                with self._lock:
                    self._in_flight -= 1

    def _next_for_python(self, fast: object, fd: int, buf: bytearray) -> tuple[int, float] | None:
        """Have the compiled loop answer what it can (``_fastreads.Memory.serve``); the
        length of the next request for Python, in ``buf``, and the seconds it waited there
        for a fetch; None once unmounted."""
        while True:
            try:
                status, n, waited = fast.serve(fd, buf)  # type: ignore[attr-defined]
            except OSError:
                log.exception("reading /dev/fuse failed")
                return None
            if status == _fastreads.REQUEST:
                # The reads answered so far go into the source's bookkeeping first: a READ
                # answered here moves read-ahead along as one answered in Python does.
                self.source.drain()  # type: ignore[attr-defined]
                return n, waited
            if status == _fastreads.DRAIN:
                self.source.drain()  # type: ignore[attr-defined]
            elif status == _fastreads.ENDED:
                return None
            else:  # REPLY_FAILED, n its errno
                log.error("answering a FUSE read failed: %s", os.strerror(n))

    def _read(
        self, fd: int, unique: int, request: memoryview, scratch: memoryview, waited: float
    ) -> None:
        _, offset, size, *_ = READ_IN.unpack_from(request, IN_HEADER.size)
        try:
            parts = self.source.read_parts(offset, size, scratch, waited)
        except ReadError as e:
            self._error(fd, unique, e.errno)
            return
        length = sum(len(p) for p in parts)  # type: ignore[arg-type]
        self._reply(fd, unique, OUT_HEADER.pack(OUT_HEADER.size + length, 0, unique), *parts)

    def _other(self, fd: int, opcode: int, unique: int, nodeid: int, body: memoryview) -> None:
        if opcode == LOOKUP:
            name = bytes(body).split(b"\0", 1)[0]
            if nodeid != ROOT_ID or name != self.name:
                self._error(fd, unique, errno.ENOENT)
                return
            entry = ENTRY_OUT.pack(FILE_ID, 0, VALID_SECONDS, VALID_SECONDS, 0, 0)
            self._answer(fd, unique, entry, self._file_attr)
        elif opcode == GETATTR:
            attr = self._root_attr if nodeid == ROOT_ID else self._file_attr
            self._answer(fd, unique, ATTR_OUT.pack(VALID_SECONDS, 0, 0), attr)
        elif opcode == OPEN:
            self._answer(fd, unique, OPEN_OUT.pack(0, FOPEN_KEEP_CACHE, 0))
        elif opcode == OPENDIR:
            self._answer(fd, unique, OPEN_OUT.pack(0, 0, 0))
        elif opcode == READDIR:
            _, offset, size, *_ = READ_IN.unpack_from(body)
            out, used = [], 0
            for dirent in self._dirents[offset:]:  # whole entries only: the kernel asks again
                if used + len(dirent) > size:
                    break
                out.append(dirent)
                used += len(dirent)
            self._answer(fd, unique, *out)
        elif opcode == STATFS:
            blocks = -(-self.source.size // PAGE)
            self._answer(fd, unique, KSTATFS.pack(blocks, 0, 0, 2, 0, PAGE, 255, PAGE, 0,
                                                  *[0] * 6))  # fmt: skip
        elif opcode in (RELEASE, RELEASEDIR, FLUSH, DESTROY):
            self._answer(fd, unique)
        elif opcode == INIT:
            self._init(fd, unique, body)
        elif opcode not in _NO_REPLY:
            self._error(fd, unique, errno.ENOSYS)

    def _init(self, fd: int, unique: int, body: memoryview) -> None:
        major, minor, max_readahead, flags = INIT_IN.unpack_from(body)
        if major != KERNEL_MAJOR or minor < MIN_MINOR:
            log.error("the kernel speaks FUSE %d.%d; lazyblock needs 7.%d", major, minor,
                      MIN_MINOR)  # fmt: skip
            self._error(fd, unique, errno.EPROTO)
            return
        ours = flags & (FUSE_ASYNC_READ | FUSE_ASYNC_DIO | FUSE_MAX_PAGES)
        self.negotiated = {"minor": min(minor, OUR_MINOR), "flags": ours,
                           "max_readahead": max_readahead}  # fmt: skip
        self._answer(fd, unique, INIT_OUT.pack(
            KERNEL_MAJOR, min(minor, OUR_MINOR), max(max_readahead, MAX_READ), ours,
            MAX_BACKGROUND, MAX_BACKGROUND * 3 // 4, MAX_WRITE, 1, MAX_READ // PAGE, 0, 0, 0,
            *[0] * 6,
        ))  # fmt: skip
        if self.on_init is not None:
            self.on_init()

    # --- answers --------------------------------------------------------------------------

    def _answer(self, fd: int, unique: int, *parts: bytes | memoryview) -> None:
        length = OUT_HEADER.size + sum(len(p) for p in parts)
        self._reply(fd, unique, OUT_HEADER.pack(length, 0, unique), *parts)

    def _error(self, fd: int, unique: int, err: int) -> None:
        self._reply(fd, unique, OUT_HEADER.pack(OUT_HEADER.size, -err, unique))

    @staticmethod
    def _reply(fd: int, unique: int, *parts: object) -> None:
        try:
            os.writev(fd, parts)  # type: ignore[arg-type]
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENODEV):  # withdrawn, or unmounted
                raise


def _aligned_buffer(size: int) -> memoryview:
    """``size`` bytes of page-aligned, writable memory (for direct I/O into it)."""
    return memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
