"""The snapshotter's configuration: one TOML file, parsed once at the edge.

``load_config(path, overrides)`` reads the file (default ``/etc/lazyblock/config.toml``; a
missing default file means all defaults), applies ``section.key=value`` overrides (what the
CLI's flags turn into) and returns a frozen ``Config``. Libraries only ever see the
dataclasses; nothing below the CLI reads files, argv or the environment for settings.
Every key is documented in ``deploy/config.toml.example``.

    [cache]     dir, size                                   -> MountConfig.cache_*
    [state]     dir                                         -> MountConfig.state_dir
    [mount]     backing, timeout, memory_sectors, read_timeout
    [prefetch]  enabled, background_fetch, bandwidth, batch_sectors, max_cache_fraction
    [fetch]     max_parallel, max_parallel_prefetch, request_timeout, retries, backoff_base,
                backoff_max, deadline, max_request_bytes, max_stuck_requests,
                timeout_memory
    [store]     plain_http, timeout, retries, docker_config
    [metrics]   listen
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imagetool.stores.base import StoreOptions
from snapshotter.errors import SnapshotterError
from snapshotter.fetcher import FetchConfig
from snapshotter.prefetch import PrefetchConfig, PrefetchMode

DEFAULT_CONFIG_PATH = Path("/etc/lazyblock/config.toml")
DEFAULT_CACHE_DIR = Path("/var/lib/lazyblock/cache")
# /run: mount state must not survive a reboot (the mounts do not).
DEFAULT_STATE_DIR = Path("/run/lazyblock")
DEFAULT_CACHE_SIZE = 20 << 30
DEFAULT_METRICS_LISTEN = "127.0.0.1:9876"
BACKINGS = ("auto", "file", "loop")


class ConfigError(SnapshotterError, ValueError):
    """The configuration file or an override is invalid."""


@dataclass(frozen=True)
class MountConfig:
    """Everything one mount needs. Shared by the CLI, the mount server and the containerd
    service (which builds it directly)."""

    cache_dir: Path = DEFAULT_CACHE_DIR
    """Node-wide sector cache, shared by every mount (content-addressed)."""
    cache_size: int = DEFAULT_CACHE_SIZE
    """Cap on the cache's bytes (decoded sectors, as it holds them), for the directory as a
    whole, whichever mounts wrote them; LRU beyond it. Mounts sharing a directory should
    share the cap too: each enforces its own."""
    state_dir: Path = DEFAULT_STATE_DIR
    """Where mount records, control sockets, FUSE directories and server logs live."""
    prefetch: bool = True
    """Warm the cache with the image's profile (its ``prefetch`` list) after mounting."""
    background_fetch: bool = False
    """Then fetch the rest of the image too (bandwidth-capped by ``prefetch_bandwidth``)."""
    prefetch_bandwidth: int | None = None
    """Bytes per second the prefetcher may pull; None for no cap."""
    prefetch_batch_sectors: int = 4
    prefetch_max_cache_fraction: float = 0.5
    backing: str = "auto"
    """How the kernel's erofs reads the FUSE file: ``file`` (erofs file-backed mount, kernel
    >= 6.12), ``loop`` (read-only loop device, direct I/O) or ``auto``: loop, else file, when
    ``kernel_read_ahead_kb`` is above the kernel's 128 KiB (a file-backed mount cannot use
    more), otherwise file, else loop."""
    mount_timeout: float = 60.0
    """Seconds ``mount`` waits for the server to be ready (index, metadata, kernel mount)."""
    memory_sectors: int = 16
    """Decoded sectors each mount keeps in memory (64 MiB at 4 MiB sectors)."""
    read_timeout: float | None = None
    """Seconds one FUSE read may take before it fails with EIO (default: fetch.deadline)."""
    readahead_bytes: int = 128 << 20
    """Image bytes fetched ahead of a sequential reader (``snapshotter.reader``); 0: none."""
    kernel_read_ahead_kb: int = 4096
    """Read-ahead of the erofs mount, in KiB: how much the kernel asks the FUSE file for at
    once when a file is read sequentially (FUSE splits it into 1 MiB requests); 0 leaves
    the kernel's default (128 KiB)."""
    fetch: FetchConfig = field(default_factory=FetchConfig)
    store: StoreOptions = field(default_factory=StoreOptions)

    def __post_init__(self) -> None:
        if self.backing not in BACKINGS:
            raise ConfigError(f"mount.backing must be one of {', '.join(BACKINGS)}")
        if self.cache_size <= 0 or self.mount_timeout <= 0 or self.memory_sectors < 0:
            raise ConfigError("cache size and mount timeout must be positive")
        if self.readahead_bytes < 0 or self.kernel_read_ahead_kb < 0:
            raise ConfigError("read-ahead sizes must not be negative")

    @property
    def prefetch_mode(self) -> PrefetchMode:
        if not self.prefetch:
            return PrefetchMode.NONE
        return PrefetchMode.FULL if self.background_fetch else PrefetchMode.PROFILE

    def prefetch_config(self) -> PrefetchConfig:
        return PrefetchConfig(
            mode=self.prefetch_mode,
            bandwidth=self.prefetch_bandwidth,
            batch_sectors=self.prefetch_batch_sectors,
            max_cache_fraction=self.prefetch_max_cache_fraction,
        )

    # --- transport to the mount server (a JSON document on its stdin) ----------------------

    def absolute(self) -> MountConfig:
        """This configuration with its paths made absolute (against this process's
        directory), for a server that works elsewhere: a forked one works in /, and so does
        libfuse's loop, even in the foreground."""
        docker_config = self.store.docker_config
        return dataclasses.replace(
            self,
            cache_dir=Path(os.path.abspath(self.cache_dir)),
            state_dir=Path(os.path.abspath(self.state_dir)),
            store=dataclasses.replace(
                self.store,
                docker_config=Path(os.path.abspath(docker_config)) if docker_config else None,
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc["cache_dir"] = str(self.cache_dir)
        doc["state_dir"] = str(self.state_dir)
        store = doc["store"]
        store["docker_config"] = str(self.store.docker_config) if self.store.docker_config else None
        return doc

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> MountConfig:
        doc = dict(doc)
        store = dict(doc.pop("store", {}))
        if store.get("docker_config"):
            store["docker_config"] = Path(store["docker_config"])
        if store.get("credentials"):
            store["credentials"] = tuple(store["credentials"])
        return cls(
            **{
                **doc,
                "cache_dir": Path(doc["cache_dir"]),
                "state_dir": Path(doc["state_dir"]),
                "fetch": FetchConfig(**doc.get("fetch", {})),
                "store": StoreOptions(**store),
            }
        )


@dataclass(frozen=True)
class Config:
    """The whole file: what mounts use, and what the node's metrics exporter uses."""

    mount: MountConfig = field(default_factory=MountConfig)
    metrics_listen: str = DEFAULT_METRICS_LISTEN


_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(value: object) -> int:
    """``20GiB``, ``512M``, ``65536`` (binary units) -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ConfigError(f"not a size: {value!r} (e.g. 20GiB, 512MiB, 1048576)")
    unit = (m.group(2) or "B").upper()[0]
    return int(m.group(1)) << {"B": 0, "K": 10, "M": 20, "G": 30, "T": 40}[unit]


# section.key -> (converter, where it goes). "m." is a MountConfig field, "f." a FetchConfig
# field, "s." a StoreOptions field, "c." a Config field.
def _bool(v: object) -> bool:
    if isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"not a boolean: {v!r}")


def _float(v: object) -> float:
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"not a number: {v!r}") from None


def _int(v: object) -> int:
    try:
        return int(v)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ConfigError(f"not an integer: {v!r}") from None


def _opt_size(v: object) -> int | None:
    size = parse_size(v)
    return size or None  # 0 means "no cap"


def _opt_float(v: object) -> float | None:
    f = _float(v)
    return f if f > 0 else None


def _opt_path(v: object) -> Path | None:
    return Path(str(v)) if str(v) else None


KEYS: dict[str, tuple[Any, str]] = {
    "cache.dir": (lambda v: Path(str(v)), "m.cache_dir"),
    "cache.size": (parse_size, "m.cache_size"),
    "state.dir": (lambda v: Path(str(v)), "m.state_dir"),
    "mount.backing": (str, "m.backing"),
    "mount.timeout": (_float, "m.mount_timeout"),
    "mount.memory_sectors": (_int, "m.memory_sectors"),
    "mount.read_timeout": (_opt_float, "m.read_timeout"),
    "mount.readahead": (parse_size, "m.readahead_bytes"),
    "mount.kernel_read_ahead_kb": (_int, "m.kernel_read_ahead_kb"),
    "prefetch.enabled": (_bool, "m.prefetch"),
    "prefetch.background_fetch": (_bool, "m.background_fetch"),
    "prefetch.bandwidth": (_opt_size, "m.prefetch_bandwidth"),
    "prefetch.batch_sectors": (_int, "m.prefetch_batch_sectors"),
    "prefetch.max_cache_fraction": (_float, "m.prefetch_max_cache_fraction"),
    "fetch.max_parallel": (_int, "f.max_parallel"),
    "fetch.max_parallel_prefetch": (_int, "f.max_parallel_prefetch"),
    "fetch.request_timeout": (_float, "f.request_timeout"),
    "fetch.retries": (_int, "f.retries"),
    "fetch.backoff_base": (_float, "f.backoff_base"),
    "fetch.backoff_max": (_float, "f.backoff_max"),
    "fetch.deadline": (_float, "f.deadline"),
    "fetch.max_request_bytes": (parse_size, "f.max_request_bytes"),
    "fetch.max_stuck_requests": (_int, "f.max_stuck_requests"),
    "fetch.timeout_memory": (_float, "f.timeout_memory"),
    "store.plain_http": (_bool, "s.plain_http"),
    "store.timeout": (_float, "s.timeout"),
    "store.retries": (_int, "s.retries"),
    "store.docker_config": (_opt_path, "s.docker_config"),
    "metrics.listen": (str, "c.metrics_listen"),
}


def load_config(path: Path | None = None, overrides: dict[str, object] | None = None) -> Config:
    """The configuration from ``path`` (default file if None; absent default = defaults),
    with ``overrides`` (``"section.key" -> value``) applied on top."""
    return config_from_document(read_config_file(path), overrides, path or DEFAULT_CONFIG_PATH)


def read_config_file(path: Path | None = None) -> dict[str, Any]:
    """The parsed TOML of ``path`` (the default file if None; a missing default file is
    empty, a missing explicit one an error). Shared by mounts and ``snapshotter serve``."""
    explicit = path is not None
    path = path or DEFAULT_CONFIG_PATH
    if not explicit and not path.exists():
        return {}
    try:
        return tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None


def config_from_document(
    doc: dict[str, Any], overrides: dict[str, object] | None = None, where: Path | str = ""
) -> Config:
    """The mount configuration from a parsed file (``where`` names it in errors); the
    daemon's own sections are skipped."""
    flat: dict[str, object] = {}
    for section, table in doc.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: top-level key {section!r} must be a [section]")
        if section in DAEMON_SECTIONS:
            continue  # read and checked by ``snapshotter serve`` (service.py)
        for key, value in table.items():
            flat[f"{section}.{key}"] = value
    flat.update(overrides or {})
    return build_config(flat)


# Sections of the same file that belong to the containerd-facing daemon, not to mounts.
DAEMON_SECTIONS = frozenset({"snapshotter"})


def build_config(flat: dict[str, object]) -> Config:
    parts: dict[str, dict[str, object]] = {"m": {}, "f": {}, "s": {}, "c": {}}
    for key, value in flat.items():
        if key not in KEYS:
            raise ConfigError(f"unknown configuration key {key!r}")
        convert, target = KEYS[key]
        kind, name = target.split(".", 1)
        try:
            parts[kind][name] = convert(value)
        except ConfigError as e:
            raise ConfigError(f"{key}: {e}") from None
    try:
        fetch = FetchConfig(**parts["f"])  # type: ignore[arg-type]
        store = StoreOptions(**parts["s"])  # type: ignore[arg-type]
        mount = MountConfig(**parts["m"], fetch=fetch, store=store)  # type: ignore[arg-type]
        mount.prefetch_config()  # validate
        return Config(mount=mount, **parts["c"])  # type: ignore[arg-type]
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
