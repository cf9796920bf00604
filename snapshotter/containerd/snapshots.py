"""The snapshot store behind the containerd service: metadata in SQLite, layers as overlayfs
directories, remote (lazily mounted) layers as read-only mount points.

It follows containerd's overlayfs snapshotter rules, so ordinary images unpack through it
like through containerd's own:

- a snapshot is *active* (writable, from ``prepare``), a *view* (read-only, from ``view``)
  or *committed* (immutable, a parent for others). Keys and committed names share one
  namespace; a committed snapshot keeps the directories of the active one it came from.
- ``ROOT/snapshots/<id>/fs`` is a snapshot's own layer (the overlay upper of an active
  snapshot) and ``ROOT/snapshots/<id>/work`` its overlay work directory.
- mounts: an active snapshot without parents is a read-write bind mount of its ``fs``; with
  parents it is an overlay (``lowerdir`` = the parents' layers, nearest first). A view is a
  read-only bind of its single parent's layer, or an overlay with only ``lowerdir``.
- a *remote* snapshot is committed directly by ``commit_remote`` (the remote-snapshot
  handshake): its layer is the mount point of a lazily mounted block image (``ROOT/mounts/
  <name>``), or, for a layer that carries no files of its own (the data blob layer of a
  block image), an empty directory. A ``RemoteMounter`` does the mounting; this module only
  records which mount point belongs to which snapshot and releases it on ``remove``.

Every change is one SQLite transaction, so a restart of the daemon loses no snapshot; a
crash between the database and the file system leaves only directories or mounts that no
row names, which ``cleanup`` removes.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import re
import shutil
import sqlite3
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from snapshotter.errors import SnapshotterError

log = logging.getLogger(__name__)

# What an orphan snapshot directory is renamed to before it is deleted (not an id).
_DOOMED = ".removing-"

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshots (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    key         TEXT NOT NULL UNIQUE,     -- active/view key or committed name
    parent      TEXT NOT NULL DEFAULT '', -- the parent's committed name, '' for none
    kind        INTEGER NOT NULL,         -- Kind
    created_ns  INTEGER NOT NULL,
    updated_ns  INTEGER NOT NULL,
    labels      TEXT NOT NULL DEFAULT '{}',
    remote      TEXT                      -- JSON RemoteInfo of a remote snapshot, else NULL
);
CREATE INDEX IF NOT EXISTS snapshots_parent ON snapshots(parent);
"""


class Kind(enum.IntEnum):
    """Snapshot kinds, numbered as in containerd's API."""

    UNKNOWN = 0
    VIEW = 1
    ACTIVE = 2
    COMMITTED = 3


# --- errors (mapped to gRPC status codes by the service) -----------------------------------


class SnapshotError(SnapshotterError):
    """Base of the snapshot store's errors."""


class SnapshotNotFoundError(SnapshotError, KeyError):
    """No snapshot has that key (NOT_FOUND)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class SnapshotExistsError(SnapshotError):
    """The key is taken (ALREADY_EXISTS); also the answer to a remote-snapshot handshake."""


class SnapshotStateError(SnapshotError):
    """The snapshot is in the wrong state for the call (FAILED_PRECONDITION): committing a
    view, removing a parent, asking mounts of a committed snapshot."""


class SnapshotArgumentError(SnapshotError, ValueError):
    """A malformed request (INVALID_ARGUMENT): empty key, bad filter, immutable field."""


# --- data ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteInfo:
    """What backs a remote snapshot. ``mountpoint`` is empty for a layer without files."""

    ref: str
    mountpoint: str = ""
    role: str = ""

    def to_json(self) -> str:
        return json.dumps({"ref": self.ref, "mountpoint": self.mountpoint, "role": self.role})

    @classmethod
    def from_json(cls, text: str) -> RemoteInfo:
        doc = json.loads(text)
        return cls(ref=doc["ref"], mountpoint=doc.get("mountpoint", ""), role=doc.get("role", ""))


@dataclass(frozen=True)
class Info:
    name: str
    parent: str
    kind: Kind
    created_ns: int
    updated_ns: int
    labels: dict[str, str] = field(default_factory=dict)
    remote: RemoteInfo | None = None


@dataclass(frozen=True)
class Mount:
    """One mount(2) for containerd: type, source, fstab options."""

    type: str
    source: str
    options: tuple[str, ...] = ()


@dataclass(frozen=True)
class Usage:
    size: int
    inodes: int


class RemoteMounter(Protocol):
    """Mounts block images for remote snapshots (``mounter.MountBackend`` is the one)."""

    def mount(self, ref: str, mountpoint: Path) -> None: ...

    def unmount(self, mountpoint: Path) -> None: ...

    def is_mounted(self, mountpoint: Path) -> bool: ...

    def lock(self, mountpoint: Path) -> AbstractContextManager[object]:
        """Held while ``mountpoint`` is mounted or unmounted."""
        ...


# --- the store -----------------------------------------------------------------------------


def _now_ns() -> int:
    return time.time_ns()


class SnapshotStore:
    """All snapshots under one root directory. Thread-safe: one lock around each call's
    database transaction; remote mounts happen outside it (they take seconds)."""

    def __init__(self, root: Path, mounter: RemoteMounter | None = None) -> None:
        # Absolute: containerd mounts the paths handed to it, from its own directory.
        self.root = Path(os.path.abspath(root))
        self.mounter = mounter
        self.snapshots_dir = self.root / "snapshots"
        self.mounts_dir = self.root / "mounts"
        for d in (self.root, self.snapshots_dir, self.mounts_dir):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        self._lock = threading.RLock()
        # Mount points of remote commits under way: mounted before their row is written.
        self._mounting: Counter[str] = Counter()
        self._db = sqlite3.connect(
            self.root / "metadata.db", check_same_thread=False, isolation_level=None
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        (version,) = self._db.execute("PRAGMA user_version").fetchone()
        if version == 0:
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        elif version != SCHEMA_VERSION:
            raise SnapshotError(f"{self.root}: metadata schema {version} is not supported")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --- transactions -------------------------------------------------------------------

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _row(self, db: sqlite3.Connection, key: str) -> tuple | None:
        return db.execute(
            "SELECT id, key, parent, kind, created_ns, updated_ns, labels, remote "
            "FROM snapshots WHERE key = ?",
            (key,),
        ).fetchone()

    def _get(self, db: sqlite3.Connection, key: str) -> tuple:
        row = self._row(db, key)
        if row is None:
            raise SnapshotNotFoundError(f"snapshot {key!r} does not exist")
        return row

    @staticmethod
    def _info(row: tuple) -> Info:
        _, key, parent, kind, created, updated, labels, remote = row
        return Info(
            name=key,
            parent=parent,
            kind=Kind(kind),
            created_ns=created,
            updated_ns=updated,
            labels=json.loads(labels),
            remote=RemoteInfo.from_json(remote) if remote else None,
        )

    def _dir(self, sid: int) -> Path:
        return self.snapshots_dir / str(sid)

    def _layer(self, row: tuple) -> Path:
        """The directory that holds a snapshot's own layer."""
        remote = row[7]
        if remote:
            info = RemoteInfo.from_json(remote)
            if info.mountpoint:
                return Path(info.mountpoint)
        return self._dir(row[0]) / "fs"

    def _parents(self, db: sqlite3.Connection, parent: str) -> list[tuple]:
        """The parent chain's rows, nearest first."""
        chain = []
        while parent:
            row = self._get(db, parent)
            chain.append(row)
            parent = row[2]
        return chain

    # --- containerd's Snapshotter interface ---------------------------------------------

    def prepare(
        self, key: str, parent: str = "", labels: dict[str, str] | None = None
    ) -> list[Mount]:
        return self._create(Kind.ACTIVE, key, parent, labels or {})

    def view(self, key: str, parent: str = "", labels: dict[str, str] | None = None) -> list[Mount]:
        return self._create(Kind.VIEW, key, parent, labels or {})

    def _create(self, kind: Kind, key: str, parent: str, labels: dict[str, str]) -> list[Mount]:
        if not key:
            raise SnapshotArgumentError("a snapshot key must not be empty")
        now = _now_ns()
        with self._tx() as db:
            if self._row(db, key) is not None:
                raise SnapshotExistsError(f"snapshot {key!r} already exists")
            if parent:
                prow = self._get(db, parent)
                if prow[3] != Kind.COMMITTED:
                    raise SnapshotArgumentError(f"parent {parent!r} is not a committed snapshot")
            cur = db.execute(
                "INSERT INTO snapshots (key, parent, kind, created_ns, updated_ns, labels) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (key, parent, int(kind), now, now, json.dumps(labels, sort_keys=True)),
            )
            sid = cur.lastrowid
            assert sid is not None
            d = self._dir(sid)
            shutil.rmtree(d, ignore_errors=True)  # a leftover of a rolled-back transaction
            (d / "fs").mkdir(parents=True, mode=0o755)
            if kind == Kind.ACTIVE:
                (d / "work").mkdir(mode=0o711)
            mounts = self._mounts(db, self._get(db, key))
        log.debug("%s %r (parent %r)", kind.name.lower(), key, parent)
        return mounts

    def mounts(self, key: str) -> list[Mount]:
        with self._lock:
            row = self._get(self._db, key)
            if row[3] == Kind.COMMITTED:
                raise SnapshotStateError(f"snapshot {key!r} is committed; it has no mounts")
            return self._mounts(self._db, row)

    def _mounts(self, db: sqlite3.Connection, row: tuple) -> list[Mount]:
        kind = Kind(row[3])
        own = self._dir(row[0])
        lowers = [str(self._layer(p)) for p in self._parents(db, row[2])]
        if kind == Kind.ACTIVE:
            if not lowers:
                return [Mount("bind", str(own / "fs"), ("rw", "rbind"))]
            return [
                Mount(
                    "overlay",
                    "overlay",
                    (
                        "index=off",
                        f"workdir={own / 'work'}",
                        f"upperdir={own / 'fs'}",
                        f"lowerdir={':'.join(lowers)}",
                    ),
                )
            ]
        # A view.
        if not lowers:
            return [Mount("bind", str(own / "fs"), ("ro", "rbind"))]
        if len(lowers) == 1:
            return [Mount("bind", lowers[0], ("ro", "rbind"))]
        return [Mount("overlay", "overlay", ("index=off", f"lowerdir={':'.join(lowers)}"))]

    def commit(self, name: str, key: str, labels: dict[str, str] | None = None) -> None:
        if not name:
            raise SnapshotArgumentError("a committed snapshot's name must not be empty")
        with self._tx() as db:
            row = self._get(db, key)
            if row[3] != Kind.ACTIVE:
                raise SnapshotStateError(f"snapshot {key!r} is not active; only active commit")
            if self._row(db, name) is not None:
                raise SnapshotExistsError(f"snapshot {name!r} already exists")
            merged = json.loads(row[6])
            merged.update(labels or {})
            db.execute(
                "UPDATE snapshots SET key = ?, kind = ?, updated_ns = ?, labels = ? WHERE id = ?",
                (name, int(Kind.COMMITTED), _now_ns(), json.dumps(merged, sort_keys=True), row[0]),
            )
        # The work directory is only needed while the snapshot is an upper.
        shutil.rmtree(self._dir(row[0]) / "work", ignore_errors=True)
        log.debug("committed %r as %r", key, name)

    def remove(self, key: str) -> None:
        with self._tx() as db:
            row = self._get(db, key)
            child = db.execute("SELECT key FROM snapshots WHERE parent = ? LIMIT 1", (key,))
            if child.fetchone() is not None:
                raise SnapshotStateError(f"snapshot {key!r} has children; remove them first")
            db.execute("DELETE FROM snapshots WHERE id = ?", (row[0],))
        self._release(row)
        log.debug("removed %r", key)

    def _release(self, row: tuple) -> None:
        """Free what a removed snapshot held: its mount, then its directories."""
        remote = RemoteInfo.from_json(row[7]) if row[7] else None
        if remote and remote.mountpoint:
            mountpoint = Path(remote.mountpoint)
            if self.mounter is not None:
                try:
                    self.mounter.unmount(mountpoint)
                except Exception as e:  # the row is gone; cleanup retries the unmount
                    log.warning("unmounting %s failed (cleanup retries): %s", mountpoint, e)
                    return
            with contextlib.suppress(OSError):
                mountpoint.rmdir()
        shutil.rmtree(self._dir(row[0]), ignore_errors=True)

    def stat(self, key: str) -> Info:
        with self._lock:
            return self._info(self._get(self._db, key))

    def update(self, info: Info, fieldpaths: Sequence[str] = ()) -> Info:
        """Update labels: all of them (no field paths, or ``labels``) or ``labels.<key>``
        one by one. The other fields are immutable."""
        with self._tx() as db:
            row = self._get(db, info.name)
            labels: dict[str, str] = json.loads(row[6])
            if not fieldpaths:
                labels = dict(info.labels)
            for path in fieldpaths:
                if path == "labels":
                    labels = dict(info.labels)
                elif path.startswith("labels."):
                    k = path[len("labels.") :]
                    if k in info.labels:
                        labels[k] = info.labels[k]
                    else:
                        labels.pop(k, None)
                else:
                    raise SnapshotArgumentError(f"cannot update field {path!r} of a snapshot")
            db.execute(
                "UPDATE snapshots SET labels = ?, updated_ns = ? WHERE id = ?",
                (json.dumps(labels, sort_keys=True), _now_ns(), row[0]),
            )
            return self._info(self._get(db, info.name))

    def list(self, filters: Sequence[str] = ()) -> list[Info]:
        """Snapshots matching any of ``filters`` (containerd filter syntax); all if none."""
        matchers = [parse_filter(f) for f in filters if f.strip()]
        with self._lock:
            rows = self._db.execute(
                "SELECT id, key, parent, kind, created_ns, updated_ns, labels, remote "
                "FROM snapshots ORDER BY id"
            ).fetchall()
        infos = [self._info(r) for r in rows]
        if not matchers:
            return infos
        return [i for i in infos if any(m(i) for m in matchers)]

    def usage(self, key: str) -> Usage:
        """Disk use of the snapshot's own layer (a remote layer uses no snapshot disk)."""
        with self._lock:
            row = self._get(self._db, key)
        if row[7]:
            return Usage(0, 0)
        return disk_usage(self._dir(row[0]) / "fs")

    def cleanup(self) -> None:
        """Remove directories and mounts that no snapshot names (left by a crash or a failed
        unmount).

        What is an orphan is decided under the lock, with the directories listed there: a
        Prepare or a remote commit running beside it makes its directory, or mounts its image,
        before its row is committed, and none of that is an orphan. An orphan directory is
        renamed out of the id space under the lock and deleted outside it."""
        with self._lock:
            rows = self._db.execute("SELECT id, remote FROM snapshots").fetchall()
            ids = {str(r[0]) for r in rows}
            keep = {RemoteInfo.from_json(r[1]).mountpoint for r in rows if r[1]}
            keep |= set(self._mounting)
            doomed = []
            for d in self.snapshots_dir.iterdir():
                if d.name in ids:
                    continue
                if not d.name.startswith(_DOOMED):
                    log.info("cleanup: removing orphan snapshot directory %s", d)
                    target = d.with_name(f"{_DOOMED}{d.name}-{uuid.uuid4().hex[:8]}")
                    try:
                        d.rename(target)
                    except OSError as e:
                        log.warning("cleanup: cannot move %s aside: %s", d, e)
                        continue
                    d = target
                doomed.append(d)
            orphan_mounts = [m for m in self.mounts_dir.iterdir() if str(m) not in keep]
        for d in doomed:
            shutil.rmtree(d, ignore_errors=True)
        for m in orphan_mounts:
            with self._lock:
                if str(m) in self._mounting:  # a remote commit began since the listing
                    continue
            log.info("cleanup: releasing orphan mount point %s", m)
            if self.mounter is not None and self.mounter.is_mounted(m):
                try:
                    self.mounter.unmount(m)
                except Exception as e:
                    log.warning("cleanup: unmounting %s failed: %s", m, e)
                    continue
            with contextlib.suppress(OSError):
                m.rmdir()

    # --- remote snapshots ----------------------------------------------------------------

    def mountpoint_for(self, name: str) -> Path:
        """Where the block image behind remote snapshot ``name`` is mounted."""
        return self.mounts_dir / re.sub(r"[^A-Za-z0-9_.-]", "_", name)

    def commit_remote(
        self,
        name: str,
        parent: str,
        labels: dict[str, str],
        remote: RemoteInfo,
        mount: Callable[[], None] | None = None,
    ) -> None:
        """Record a committed remote snapshot ``name``, running ``mount`` first (outside the
        lock). Raises ``SnapshotExistsError`` if ``name`` is already there: for the handshake
        both outcomes are "it exists"; the caller answers ALREADY_EXISTS either way."""
        with self._lock:
            if self._row(self._db, name) is not None:
                raise SnapshotExistsError(f"snapshot {name!r} already exists")
            if parent:
                prow = self._get(self._db, parent)
                if prow[3] != Kind.COMMITTED:
                    raise SnapshotArgumentError(f"parent {parent!r} is not a committed snapshot")
            if remote.mountpoint:
                self._mounting[remote.mountpoint] += 1
        try:
            self._commit_remote(name, parent, labels, remote, mount)
        finally:
            if remote.mountpoint:
                with self._lock:
                    self._mounting -= Counter({remote.mountpoint: 1})  # drops it at zero

    def _commit_remote(
        self,
        name: str,
        parent: str,
        labels: dict[str, str],
        remote: RemoteInfo,
        mount: Callable[[], None] | None,
    ) -> None:
        if mount is not None:
            mount()
        now = _now_ns()
        try:
            with self._tx() as db:
                if self._row(db, name) is not None:
                    raise SnapshotExistsError(f"snapshot {name!r} already exists")
                cur = db.execute(
                    "INSERT INTO snapshots "
                    "(key, parent, kind, created_ns, updated_ns, labels, remote) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (name, parent, int(Kind.COMMITTED), now, now,
                     json.dumps(labels, sort_keys=True), remote.to_json()),
                )  # fmt: skip
                sid = cur.lastrowid
                assert sid is not None
                shutil.rmtree(self._dir(sid), ignore_errors=True)
                (self._dir(sid) / "fs").mkdir(parents=True, mode=0o755)
        except SnapshotExistsError:
            raise
        except BaseException:
            if remote.mountpoint and self.mounter is not None:
                with contextlib.suppress(Exception):
                    self.mounter.unmount(Path(remote.mountpoint))
            raise
        log.info("committed remote snapshot %r (%s, %s)", name, remote.role, remote.ref)

    def remote_snapshots(self) -> list[Info]:
        return [i for i in self.list() if i.remote is not None]


def disk_usage(path: Path) -> Usage:
    """Bytes (allocated blocks) and inodes under ``path``, hard links counted once."""
    size = inodes = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [*dirnames, *filenames]:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            ident = (st.st_dev, st.st_ino)
            if ident in seen:
                continue
            seen.add(ident)
            inodes += 1
            size += st.st_blocks * 512
    return Usage(size, inodes)


# --- containerd filters --------------------------------------------------------------------

_FIELD = re.compile(r'\s*(labels\.(?:"(?:[^"\\]|\\.)*"|[A-Za-z0-9_./-]+)|[A-Za-z_]+)\s*')


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] == '"':
        try:
            return str(json.loads(text))
        except json.JSONDecodeError:
            raise SnapshotArgumentError(f"malformed quoted value {text}") from None
    return text


def _split(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside double quotes."""
    parts, buf, quoted, escaped = [], [], False, False
    for ch in text:
        if escaped:
            buf.append(ch)
            escaped = False
        elif ch == "\\" and quoted:
            buf.append(ch)
            escaped = True
        elif ch == '"':
            buf.append(ch)
            quoted = not quoted
        elif ch == sep and not quoted:
            parts.append("".join(buf))
            buf = []
        else:
            buf.append(ch)
    if quoted:
        raise SnapshotArgumentError(f"unterminated quote in filter {text!r}")
    parts.append("".join(buf))
    return parts


def _field(info: Info, name: str) -> str | None:
    if name == "name":
        return info.name
    if name == "parent":
        return info.parent
    if name == "kind":
        return info.kind.name.lower()
    if name.startswith("labels."):
        return info.labels.get(_unquote(name[len("labels.") :]))
    raise SnapshotArgumentError(f"unknown filter field {name!r}")


def parse_filter(text: str) -> Callable[[Info], bool]:
    """One containerd filter: ``term,term,...`` (all must hold), each term ``field``
    (present), ``field==value``, ``field!=value`` or ``field~=regexp``; fields ``name``,
    ``parent``, ``kind``, ``labels.KEY`` or ``labels."KEY"``; values plain or quoted."""
    terms: list[Callable[[Info], bool]] = []
    for raw in _split(text, ","):
        m = _FIELD.match(raw)
        if not m:
            raise SnapshotArgumentError(f"malformed filter term {raw!r}")
        name, rest = m.group(1), raw[m.end() :].strip()
        _field(Info("", "", Kind.UNKNOWN, 0, 0), name)  # validate the field name
        if not rest:
            terms.append(lambda i, n=name: _field(i, n) not in (None, ""))
            continue
        op, value = rest[:2], _unquote(rest[2:].strip())
        if op == "==":
            terms.append(lambda i, n=name, v=value: _field(i, n) == v)
        elif op == "!=":
            terms.append(lambda i, n=name, v=value: _field(i, n) != v)
        elif op == "~=":
            if len(value) >= 2 and value[0] == value[-1] == "/":
                value = value[1:-1]
            try:
                rx = re.compile(value)
            except re.error as e:
                raise SnapshotArgumentError(f"bad regular expression in {raw!r}: {e}") from None
            terms.append(lambda i, n=name, r=rx: r.search(_field(i, n) or "") is not None)
        else:
            raise SnapshotArgumentError(f"unknown operator in filter term {raw!r}")
    return lambda info: all(t(info) for t in terms)
