"""The snapshotter's configuration: one TOML file, parsed once at the edge.

``load_config(path, overrides)`` reads the file (default ``/etc/lazyblock/config.toml``; a
missing default file means all defaults), applies ``section.key=value`` overrides (what the
CLI's flags turn into) and returns a frozen ``Config``. Libraries only ever see the
dataclasses; nothing below the CLI reads files, argv or the environment for settings.
Every key is documented in ``deploy/config.toml.example``.

    [cache]     dir, size                                   -> MountConfig.cache_*
    [state]     dir                                         -> MountConfig.state_dir
    [mount]     backing, local_copy, timeout, memory_sectors, read_timeout, launcher
    [prefetch]  enabled, background_fetch, bandwidth, batch_sectors, max_cache_fraction,
                stream_fraction
    [fetch]     max_parallel, max_parallel_prefetch, request_timeout, retries, backoff_base,
                backoff_max, deadline, max_request_bytes, max_stuck_requests,
                timeout_memory
    [store]     plain_http, timeout, retries, docker_config, registry_config_path,
                mirror_timeout, mirror_backoff
    [metrics]   listen                                      -> Config.metrics_listen
    [snapshotter] address, root, insecure_registries, workers, remount_interval,
                image_service_address, containerd_address   -> ServiceConfig (``serve``)

Every command, ``snapshotter serve`` included, reads the whole file the same way, so one
file serves the whole node and a key is checked wherever it is set. The settings of the
data path (``FetchConfig``, ``PrefetchConfig``) are defined here too, with the rest: this
module imports nothing of the snapshotter but its errors.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imagetool.errors import HostsConfigError
from imagetool.registry.hosts import HostsConfig, load_hosts_dir
from imagetool.stores.base import StoreOptions
from snapshotter.errors import SnapshotterError

DEFAULT_CONFIG_PATH = Path("/etc/lazyblock/config.toml")
DEFAULT_CACHE_DIR = Path("/var/lib/lazyblock/cache")
# /run: mount state must not survive a reboot (the mounts do not).
DEFAULT_STATE_DIR = Path("/run/lazyblock")
DEFAULT_CACHE_SIZE = 20 << 30
DEFAULT_METRICS_LISTEN = "127.0.0.1:9876"
BACKINGS = ("auto", "file", "loop")
# The containerd-facing daemon's defaults ([snapshotter]).
DEFAULT_ADDRESS = Path("/run/lazyblock/snapshotter.sock")
# Persistent (not /run): the snapshots of unpacked ordinary layers live here.
DEFAULT_ROOT = Path("/var/lib/lazyblock/snapshotter")
DEFAULT_WORKERS = 16
# Seconds between checks for lost remote mounts: a mount server that died is replaced within
# this time even if no Prepare asks for its layer.
DEFAULT_REMOUNT_INTERVAL = 30.0
DEFAULT_CONTAINERD_ADDRESS = Path("/run/containerd/containerd.sock")
# containerd's registry hosts directory by convention (its registry.config_path).
DEFAULT_REGISTRY_CONFIG_PATH = Path("/etc/containerd/certs.d")


class ConfigError(SnapshotterError, ValueError):
    """The configuration file or an override is invalid."""


@dataclass(frozen=True)
class FetchConfig:
    """How the fetcher talks to the store. Every field is per mount."""

    max_parallel: int = 10
    """Worker threads, hence store requests in flight at once (hung ones not counted)."""

    max_parallel_prefetch: int | None = None
    """Of those, how many prefetch jobs may hold at once (the most the prefetcher's window
    grows to), so that on-demand reads always find a free worker even while a prefetch
    fills the link. Default: all but two (at least one)."""

    request_timeout: float = 10.0
    """Seconds a ranged read may go without delivering a sector before it is abandoned and
    retried (sectors arrive one by one as their bytes do). Generous: a sector is up to 4 MiB
    over a possibly slow link."""

    retries: int = 3
    """Attempts after the first for one request (failed, timed out or not verifying)."""

    backoff_base: float = 0.1
    """Seconds; retry ``k`` (from 1) sleeps uniformly in ``[0, min(backoff_max,
    backoff_base * 2**(k-1))]`` ("full jitter"), so retrying readers do not stampede."""

    backoff_max: float = 2.0
    """Upper bound of one backoff sleep, in seconds."""

    deadline: float = 30.0
    """Default total seconds a ``get`` may take when the caller passes no deadline; past it
    the read fails with ``FetchTimeoutError`` (EIO) instead of hanging the application."""

    max_request_bytes: int = 16 << 20
    """Largest coalesced ranged read, in blob bytes (a single sector is never split), for
    on-demand reads and read-ahead alike. Bigger requests amortise the store's per-request
    cost and round trips (sectors are handed out as they arrive, so a big request does not
    delay the first); smaller ones spread a sequential reader's window over more
    connections."""

    max_stuck_requests: int = 32
    """Abandoned store calls (timed out, still running on their thread) tolerated at once;
    beyond this, new requests fail immediately until some return."""

    timeout_memory: float = 1.0
    """Seconds after a sector's fetch missed a deadline during which its readers wait at most
    ``RETRY_WAIT`` instead of a whole deadline, unless the store answers a request meanwhile;
    meant for the kernel's immediate retries of a failed read. 0 turns it off."""

    def __post_init__(self) -> None:
        if self.timeout_memory < 0:
            raise ValueError("timeout_memory must not be negative")
        if self.max_parallel < 1 or not 0 <= self.prefetch_workers <= self.max_parallel:
            raise ValueError("need max_parallel >= 1 and 0 <= max_parallel_prefetch <= it")
        if self.request_timeout <= 0 or self.deadline <= 0:
            raise ValueError("request_timeout and deadline must be positive")
        if self.retries < 0 or self.backoff_base < 0 or self.backoff_max < 0:
            raise ValueError("retries and backoff must not be negative")
        if self.max_request_bytes < 1 or self.max_stuck_requests < 0:
            raise ValueError("max_request_bytes must be positive, max_stuck_requests >= 0")

    @property
    def prefetch_workers(self) -> int:
        """``max_parallel_prefetch``, or its default for ``max_parallel``."""
        if self.max_parallel_prefetch is not None:
            return self.max_parallel_prefetch
        return max(1, self.max_parallel - 2)


class PrefetchMode(enum.Enum):
    """What a mount fetches in the background (``snapshotter.datapath.prefetch.plan``)."""

    NONE = "none"  # nothing in the background
    PROFILE = "profile"  # the index's prefetch list, then metadata
    FULL = "full"  # ... then the whole image
    AUTO = "auto"  # PROFILE, then the whole image once the start has fetched a share of it


@dataclass(frozen=True)
class PrefetchConfig:
    """How one mount prefetches."""

    mode: PrefetchMode = PrefetchMode.PROFILE
    """What to fetch: see ``plan``."""

    batch_sectors: int = 4
    """Sectors per prefetch batch (adjacent ones become one request). Small, so a batch on
    the wire delays an on-demand read that shares the link little."""

    min_window: int = 2
    """Batches kept in flight at least: two, so that the link does not idle between one
    batch's last byte and the next one's first."""

    bandwidth: int | None = None
    """Cap on stored bytes fetched per second by the prefetcher; None for no cap."""

    burst_bytes: int = 16 << 20
    """Token bucket size: how far the prefetcher may run ahead of ``bandwidth`` after idling."""

    batch_timeout: float = 120.0
    """Seconds one batch may take before it counts as failed."""

    max_failures: int = 3
    """Consecutive failed batches after which the prefetcher gives up."""

    max_cache_fraction: float = 0.5
    """Stop after fetching this fraction of the cache's capacity (decoded bytes, as the
    cache holds them)."""

    stream_fraction: float = 0.25
    """``AUTO``: stream the whole image once the start has read this fraction of its stored
    bytes; a profile that names that much is trusted instead, and the rest waits until the
    start reads outside it; see ``snapshotter.datapath.prefetch``."""

    stream_watch: float = 600.0
    """``AUTO``: seconds after the mount during which that share is watched for."""

    stream_large_share: float = 0.5
    """``AUTO``: stream the whole image from the mount on, without waiting for the start's
    reads, when files of at least ``large_file_bytes`` hold this share of its stored bytes
    (model weights, big shared libraries: what a start reads whole); above 1: never. 0.5
    takes the ML image of the cold-start benchmark from 1.6x its floor to 1.2x without a
    profile; an image whose big files its start never reads is fetched whole too, in the
    background (the quickstart's sample: its start needs 0.4 % of it)."""

    stream_large_files: bool = True
    """``AUTO``: once the start reads a file of at least ``large_file_bytes`` that is not
    cached (weights, a big shared library), fetch the whole file next, in file order, ahead
    of the rest of the plan: such a file is read whole or nearly, and on demand it would
    come one read (one round trip) at a time."""

    large_file_bytes: int = 64 << 20
    """What ``stream_large_share`` and ``stream_large_files`` count as a large file."""

    def __post_init__(self) -> None:
        if self.batch_sectors < 1 or self.max_failures < 1 or self.batch_timeout <= 0:
            raise ValueError("batch_sectors, max_failures and batch_timeout must be positive")
        if self.min_window < 1:
            raise ValueError("min_window must be positive")
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise ValueError("bandwidth must be positive (or None for no cap)")
        if self.burst_bytes < 0 or not 0 < self.max_cache_fraction <= 1:
            raise ValueError("burst_bytes must be >= 0 and max_cache_fraction in (0, 1]")
        if not 0 < self.stream_fraction <= 1 or self.stream_watch < 0:
            raise ValueError("stream_fraction must be in (0, 1] and stream_watch >= 0")
        if self.stream_large_share <= 0 or self.large_file_bytes < 1:
            raise ValueError("stream_large_share and large_file_bytes must be positive")


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
    background_fetch: bool | None = None
    """Then fetch the rest of the image too (bandwidth-capped by ``prefetch_bandwidth``):
    True always, False never, None (``auto``): once the start has read
    ``prefetch_stream_fraction`` of the image's stored bytes (an image read mostly whole), or
    from the mount when ``prefetch_stream_large_share`` is set and files of
    ``prefetch_large_file_bytes`` or more hold that share; with a profile that names
    ``prefetch_stream_fraction`` itself, once the start reads outside it; see
    ``snapshotter.datapath.prefetch``."""
    prefetch_stream_fraction: float = 0.25
    prefetch_stream_large_share: float = 0.5
    prefetch_stream_large_files: bool = True
    prefetch_large_file_bytes: int = 64 << 20
    prefetch_bandwidth: int | None = None
    """Bytes per second the prefetcher may pull; None for no cap."""
    prefetch_batch_sectors: int = 4
    prefetch_max_cache_fraction: float = 0.5
    backing: str = "auto"
    """How the kernel's erofs reads the FUSE file: ``file`` (erofs file-backed mount, kernel
    >= 6.12), ``loop`` (read-only loop device, direct I/O) or ``auto``: loop, else file, when
    ``kernel_read_ahead_kb`` is above the kernel's 128 KiB (the loop device serves random
    reads at about twice the rate, and a file-backed mount's read-ahead can be raised only
    on kernels that say which bdi it has, 6.10+), otherwise file, else loop."""
    local_copy: bool = False
    """Once the image is whole in the cache and the mount quiet, copy it out of the cache
    and have the loop device read the copy, past FUSE (``snapshotter.mount.localcopy``):
    local disk's speed, at the cost of as much disk again (within ``cache_size``) and of
    checks per read (the copy is verified once, when made)."""
    mount_timeout: float = 60.0
    """Seconds ``mount`` waits for the server to be ready (index, metadata, kernel mount)."""
    memory_sectors: int = 16
    """Decoded sectors each mount keeps in memory (64 MiB at 4 MiB sectors)."""
    read_timeout: float | None = None
    """Seconds one FUSE read may take before it fails with EIO (default: fetch.deadline)."""
    readahead_bytes: int = 128 << 20
    """Image bytes fetched ahead of a sequential reader (``snapshotter.datapath.reader``);
    0: none."""
    kernel_read_ahead_kb: int = 4096
    """Read-ahead of the erofs mount, in KiB: how much the kernel asks the FUSE file for at
    once when a file is read sequentially (FUSE splits it into 1 MiB requests); 0 leaves
    the kernel's default (128 KiB)."""
    registry_config_path: Path | None = DEFAULT_REGISTRY_CONFIG_PATH
    """containerd's registry hosts directory (its ``registry.config_path``): the mirrors
    registry blobs are read from first. Read when the configuration is loaded, into
    ``store.registry_hosts``; ``snapshotter serve`` reads it again when it changes. None:
    the registries alone."""
    launcher: str = "auto"
    """Who starts the mount servers (``snapshotter.mount.launcher``): a node launcher's
    socket path (always asked first; when it cannot be used the mount falls back to this
    process's context, with a warning and ``lazyblock_launcher_fallbacks_total``), ``auto``
    (``<state_dir>/launcher.sock`` when that socket exists) or ``off`` (never)."""
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
        if self.background_fetch is None:
            return PrefetchMode.AUTO
        return PrefetchMode.FULL if self.background_fetch else PrefetchMode.PROFILE

    def prefetch_config(self) -> PrefetchConfig:
        return PrefetchConfig(
            mode=self.prefetch_mode,
            bandwidth=self.prefetch_bandwidth,
            batch_sectors=self.prefetch_batch_sectors,
            max_cache_fraction=self.prefetch_max_cache_fraction,
            stream_fraction=self.prefetch_stream_fraction,
            stream_large_share=self.prefetch_stream_large_share,
            stream_large_files=self.prefetch_stream_large_files,
            large_file_bytes=self.prefetch_large_file_bytes,
        )

    # --- transport to the mount server (a JSON document on its stdin) ----------------------

    def absolute(self) -> MountConfig:
        """This configuration with its paths made absolute (against this process's
        directory), for a server that works elsewhere: a forked one works in /, and so does the
        systemd unit's, and a path must not change meaning with the server's directory."""
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
        path = self.registry_config_path
        doc["registry_config_path"] = str(path) if path else None
        store = doc["store"]
        store["docker_config"] = str(self.store.docker_config) if self.store.docker_config else None
        hosts = self.store.registry_hosts
        store["registry_hosts"] = hosts.to_dict() if hosts is not None else None
        return doc

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> MountConfig:
        doc = dict(doc)
        store = dict(doc.pop("store", {}))
        if store.get("docker_config"):
            store["docker_config"] = Path(store["docker_config"])
        if store.get("credentials"):
            store["credentials"] = tuple(store["credentials"])
        if store.get("registry_hosts"):
            store["registry_hosts"] = HostsConfig.from_dict(store["registry_hosts"])
        path = doc.get("registry_config_path")
        return cls(
            **{
                **doc,
                "cache_dir": Path(doc["cache_dir"]),
                "state_dir": Path(doc["state_dir"]),
                "registry_config_path": Path(path) if path else None,
                "fetch": FetchConfig(**doc.get("fetch", {})),
                "store": StoreOptions(**store),
            }
        )


@dataclass(frozen=True)
class ServiceConfig:
    """What ``snapshotter serve`` needs beyond its mounts' ``MountConfig``: the
    ``[snapshotter]`` section. Its paths are absolute (``load_config`` makes them so):
    containerd and the kubelet reach them from their own directories."""

    address: Path = DEFAULT_ADDRESS
    """The unix socket containerd's ``[proxy_plugins.lazyblock] address`` names."""
    root: Path = DEFAULT_ROOT
    """Snapshot metadata (``metadata.db``), layer directories and mount points."""
    insecure_registries: tuple[str, ...] = ()
    """``HOST:PORT`` of registries reached over plain HTTP (loopback tests only)."""
    workers: int = DEFAULT_WORKERS
    """gRPC handler threads (mounts of several layers can run at once)."""
    remount_interval: float = DEFAULT_REMOUNT_INTERVAL
    """Seconds between checks for remote snapshots whose mount is gone (a killed mount
    server), which are then remounted; 0: only at start and when a Prepare needs one."""
    image_service_address: Path | None = None
    """Unix socket for the CRI image service proxy (the kubelet's
    ``--image-service-endpoint``) that records pull credentials for lazy mounts
    (``snapshotter.containerd.keychain.cri``); None: not served."""
    containerd_address: Path = DEFAULT_CONTAINERD_ADDRESS
    """containerd's gRPC socket, where the image service proxy forwards CRI calls."""

    def __post_init__(self) -> None:
        if self.workers < 1 or self.remount_interval < 0:
            raise ConfigError("snapshotter.workers must be >= 1, remount_interval >= 0")


@dataclass(frozen=True)
class Config:
    """The whole file: what mounts use, what the node's metrics exporter uses, and what the
    containerd-facing daemon uses."""

    mount: MountConfig = field(default_factory=MountConfig)
    metrics_listen: str = DEFAULT_METRICS_LISTEN
    service: ServiceConfig = field(default_factory=ServiceConfig)


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


def format_size(n: int) -> str:
    """Bytes for people, in the binary units ``parse_size`` reads: ``1.5GiB``, ``512B``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f}{unit}" if unit != "B" else f"{int(size)}B"
        size /= 1024
    return f"{n}B"


# section.key -> (converter, where it goes). "m." is a MountConfig field, "f." a FetchConfig
# field, "s." a StoreOptions field, "c." a Config field, "d." a ServiceConfig field.
def _bool(v: object) -> bool:
    if isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"not a boolean: {v!r}")


def _auto_bool(v: object) -> bool | None:
    """A boolean, or None for ``auto``."""
    if str(v).strip().lower() == "auto":
        return None
    return _bool(v)


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


def _abs_path(v: object) -> Path:
    return Path(os.path.abspath(str(v)))


def _opt_abs_path(v: object) -> Path | None:
    return _abs_path(v) if str(v) else None


def _hosts(v: object) -> tuple[str, ...]:
    """A TOML list of ``HOST:PORT``, or one string of them separated by commas (``--set``)."""
    items = v.split(",") if isinstance(v, str) else v
    if not isinstance(items, list | tuple):
        raise ConfigError(f"not a list of hosts: {v!r}")
    return tuple(str(h).strip() for h in items if str(h).strip())


KEYS: dict[str, tuple[Any, str]] = {
    "cache.dir": (lambda v: Path(str(v)), "m.cache_dir"),
    "cache.size": (parse_size, "m.cache_size"),
    "state.dir": (lambda v: Path(str(v)), "m.state_dir"),
    "mount.backing": (str, "m.backing"),
    "mount.local_copy": (_bool, "m.local_copy"),
    "mount.timeout": (_float, "m.mount_timeout"),
    "mount.memory_sectors": (_int, "m.memory_sectors"),
    "mount.read_timeout": (_opt_float, "m.read_timeout"),
    "mount.readahead": (parse_size, "m.readahead_bytes"),
    "mount.kernel_read_ahead_kb": (_int, "m.kernel_read_ahead_kb"),
    "mount.launcher": (lambda v: str(v).strip(), "m.launcher"),
    "prefetch.enabled": (_bool, "m.prefetch"),
    "prefetch.background_fetch": (_auto_bool, "m.background_fetch"),
    "prefetch.stream_fraction": (_float, "m.prefetch_stream_fraction"),
    "prefetch.stream_large_share": (_float, "m.prefetch_stream_large_share"),
    "prefetch.stream_large_files": (_bool, "m.prefetch_stream_large_files"),
    "prefetch.large_file_bytes": (parse_size, "m.prefetch_large_file_bytes"),
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
    "store.registry_config_path": (_opt_path, "m.registry_config_path"),
    "store.mirror_timeout": (_float, "s.mirror_timeout"),
    "store.mirror_backoff": (_float, "s.mirror_backoff"),
    "metrics.listen": (str, "c.metrics_listen"),
    "snapshotter.address": (_abs_path, "d.address"),
    "snapshotter.root": (_abs_path, "d.root"),
    "snapshotter.insecure_registries": (_hosts, "d.insecure_registries"),
    "snapshotter.workers": (_int, "d.workers"),
    "snapshotter.remount_interval": (_float, "d.remount_interval"),
    "snapshotter.image_service_address": (_opt_abs_path, "d.image_service_address"),
    "snapshotter.containerd_address": (_abs_path, "d.containerd_address"),
}


def load_config(path: Path | None = None, overrides: dict[str, object] | None = None) -> Config:
    """The configuration from ``path`` (default file if None; absent default = defaults),
    with ``overrides`` (``"section.key" -> value``) applied on top."""
    return config_from_document(read_config_file(path), overrides, path or DEFAULT_CONFIG_PATH)


def read_config_file(path: Path | None = None) -> dict[str, Any]:
    """The parsed TOML of ``path`` (the default file if None; a missing default file is
    empty, a missing explicit one an error)."""
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
    """The configuration from a parsed file (``where`` names it in errors)."""
    flat: dict[str, object] = {}
    for section, table in doc.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: top-level key {section!r} must be a [section]")
        for key, value in table.items():
            flat[f"{section}.{key}"] = value
    flat.update(overrides or {})
    return build_config(flat)


def read_registry_hosts(path: Path, required: bool = False) -> HostsConfig | None:
    """The hosts directory at ``path`` (``imagetool.registry.hosts``), None when it holds
    no namespace (or is missing, unless ``required``); ``ConfigError`` naming the file and
    the problem when it is malformed."""
    try:
        hosts = load_hosts_dir(path, required=required)
    except HostsConfigError as e:
        raise ConfigError(f"store.registry_config_path: {e}") from None
    return hosts if hosts.namespaces else None


def build_config(flat: dict[str, object]) -> Config:
    parts: dict[str, dict[str, object]] = {"m": {}, "f": {}, "s": {}, "c": {}, "d": {}}
    for key, value in flat.items():
        if key not in KEYS:
            raise ConfigError(f"unknown configuration key {key!r}")
        convert, target = KEYS[key]
        kind, name = target.split(".", 1)
        try:
            parts[kind][name] = convert(value)
        except ConfigError as e:
            raise ConfigError(f"{key}: {e}") from None
    hosts_path = parts["m"].get("registry_config_path", DEFAULT_REGISTRY_CONFIG_PATH)
    if hosts_path is not None:
        # A directory named on purpose must exist; the conventional one need not.
        required = hosts_path != DEFAULT_REGISTRY_CONFIG_PATH
        parts["s"]["registry_hosts"] = read_registry_hosts(hosts_path, required)  # type: ignore[arg-type]
    try:
        fetch = FetchConfig(**parts["f"])  # type: ignore[arg-type]
        store = StoreOptions(**parts["s"])  # type: ignore[arg-type]
        if store.mirror_timeout <= 0 or store.mirror_backoff < 0:
            raise ConfigError("store.mirror_timeout must be positive, mirror_backoff >= 0")
        mount = MountConfig(**parts["m"], fetch=fetch, store=store)  # type: ignore[arg-type]
        mount.prefetch_config()  # validate
        service = ServiceConfig(**parts["d"])  # type: ignore[arg-type]
        return Config(mount=mount, service=service, **parts["c"])  # type: ignore[arg-type]
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
