"""``snapshotter check``: is this node set up for lazy pulls, and if not, what to change.

Each check is one ``Check`` line: ``ok``, ``warn`` (works, but something is off or one
client path is not lazy) or ``fail`` (a lazy pull cannot work), with the fix. In order:

* lazyblock's own configuration (its errors are a line, and the rest runs on defaults);
* containerd: its version (the running daemon's Version call, else ``containerd
  --version``), whether it answers, and its configuration file (``ctrdconfig``) for that
  version;
* the proxy plugin: present, of type snapshot, lazyblock's daemon answering at its address
  (a Snapshots ``Stat``), and loaded by the running containerd with that address (its
  Introspection ``Plugins``);
* CRI: the snapshotter it pulls with, and whether it passes image labels; on 2.x, the
  transfer service's label ``exports`` and ``unpack_config`` (failures when CRI pulls
  through it, warnings when only ``ctr image pull`` does);
* the kernel: ``/dev/fuse``, erofs, a backing for it (loop devices, or file-backed erofs);
* the cache directory (writable, room for its cap) and the state directory;
* optionally, registries: an image reference resolved as ``snapshotter pull`` resolves it,
  anonymously first, then with the credentials the daemon's mounts would use.

Nothing here changes the node: the one file written is a probe in the cache directory,
removed at once, and credentials are merged into a temporary directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from imagetool.errors import AuthError, ImageToolError, NotFoundError
from imagetool.registry.auth import parse_challenge
from imagetool.registry.client import RegistryClient
from imagetool.stores.base import StoreOptions
from imagetool.stores.refs import registry_host
from snapshotter.cache.sectors import cache_usage
from snapshotter.config import (
    DEFAULT_CONFIG_PATH,
    Config,
    ConfigError,
    format_size,
    load_config,
)
from snapshotter.containerd.ctrdconfig import (
    DEFAULT_ADDRESS,
    DEFAULT_PATH,
    TRANSFER,
    ContainerdConfig,
    ContainerdConfigError,
    ProxyPlugin,
    read_containerd_config,
)
from snapshotter.containerd.keychain.dockerconfig import Credentials, node_sources
from snapshotter.containerd.mounter import MountBackend
from snapshotter.containerd.pull import ImageName, PullOptions, node_platform, platform_parts
from snapshotter.containerd.pull import resolve as resolve_image
from snapshotter.errors import PullError

OK, WARN, FAIL = "ok", "warn", "fail"
SNAPSHOT_PLUGIN = "io.containerd.snapshotter.v1"
ANNOTATIONS_EXPORT = "enable_remote_snapshot_annotations"
DEPLOY = {1: "deploy/containerd/config-1.6-1.7.toml", 2: "deploy/containerd/config-2.x.toml"}
# File-backed erofs mounts (mount.backing = file): kernel 6.12 and later.
FILE_BACKED_KERNEL = (6, 12)
_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(frozen=True)
class Check:
    name: str  # what was checked, a short id ("proxy-plugin")
    status: str  # OK, WARN or FAIL
    message: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class CheckOptions:
    containerd_config: Path = DEFAULT_PATH
    containerd_address: Path | None = None  # None: the config's [grpc] address, else default
    snapshotter: str = "lazyblock"  # the [proxy_plugins] name
    config_path: Path | None = None  # lazyblock's (None: /etc/lazyblock/config.toml)
    overrides: dict[str, object] = dataclasses.field(default_factory=dict)
    registries: tuple[str, ...] = ()  # HOST or image references
    timeout: float = 3.0  # seconds for each socket to answer


@dataclass(frozen=True)
class ContainerdVersion:
    text: str
    major: int
    minor: int
    source: str  # where it came from: the socket, or "containerd --version"


def failed(checks: list[Check]) -> bool:
    return any(c.status == FAIL for c in checks)


def check_node(options: CheckOptions) -> list[Check]:
    """Every check, in order (see the module docstring)."""
    return list(_Checker(options).run())


class _Checker:
    def __init__(self, options: CheckOptions) -> None:
        self.options = options
        self.name = options.snapshotter
        self.config = Config()

    def run(self) -> Iterator[Check]:
        if os.geteuid() != 0:
            yield Check(
                "privileges",
                WARN,
                "not running as root, as the daemon and its mounts do: devices and "
                "directories are checked for this user",
                "run snapshotter check as root",
            )
        yield self._lazyblock_config()
        yield from self._containerd()
        yield from self._kernel()
        yield from self._directories()
        for target in self.options.registries:
            yield self._registry(target)

    # --- lazyblock's configuration ---------------------------------------------------------

    def _lazyblock_config(self) -> Check:
        path = self.options.config_path or DEFAULT_CONFIG_PATH
        try:
            self.config = load_config(self.options.config_path, self.options.overrides)
        except ConfigError as e:
            return Check(
                "lazyblock-config",
                FAIL,
                f"lazyblock config {path}: {e} (the checks below use the defaults)",
                "correct it (every key is in deploy/config.toml.example): the daemon "
                "does not start with it",
            )
        absent = self.options.config_path is None and not path.exists()
        return Check(
            "lazyblock-config",
            OK,
            f"lazyblock config {path}" + (" absent: the defaults" if absent else ""),
        )

    # --- containerd ------------------------------------------------------------------------

    def _containerd(self) -> Iterator[Check]:
        path = self.options.containerd_config
        cfg: ContainerdConfig | None = None
        cfg_error = ""
        if not path.exists():
            cfg_error = "absent"
        else:
            try:
                cfg = read_containerd_config(path)
            except ContainerdConfigError as e:
                cfg_error = str(e)
        address = (
            self.options.containerd_address or (cfg and cfg.grpc_address()) or (DEFAULT_ADDRESS)
        )
        channel, why = _connect(address, self.options.timeout)
        with contextlib.ExitStack() as stack:
            if channel is not None:
                stack.callback(channel.close)
            version = _running_version(channel) if channel else None
            if version is None:
                version = _installed_version()
            yield _version_check(version, address, channel is not None, why)
            major = version.major if version else (2 if cfg and cfg.version >= 3 else 1)
            minor = version.minor if version else 1
            if cfg is not None and major >= 2:
                cfg = read_containerd_config(path, major)  # 2.x merges imports key by key
            if cfg is None:
                yield self._config_unusable(path, cfg_error, major)
                return
            yield self._config_version(cfg, major)
            plugin = cfg.proxy_plugins().get(self.name)
            yield from self._proxy_plugin(cfg, plugin, major)
            if channel is not None:
                yield self._loaded(channel, cfg, plugin, major)
            yield from self._cri(cfg, plugin, major, minor)

    def _config_unusable(self, path: Path, error: str, major: int) -> Check:
        if error == "absent":
            return Check(
                "containerd-config",
                FAIL,
                f"no containerd config at {path}: containerd runs with its defaults, "
                f"which have no {self.name} snapshotter",
                f"write it from {DEPLOY[min(major, 2)]} and restart containerd "
                "(--containerd-config names another file)",
            )
        return Check(
            "containerd-config",
            FAIL,
            f"containerd config: {error}",
            "correct the file: containerd does not start with it",
        )

    def _config_version(self, cfg: ContainerdConfig, major: int) -> Check:
        where = f"containerd config {cfg.path} (version {cfg.version}"
        if len(cfg.files) > 1:
            where += f", with {len(cfg.files) - 1} imported file(s)"
        where += ")"
        if major < 2 and cfg.version >= 3:
            return Check(
                "containerd-config",
                FAIL,
                f"{where}: containerd {major}.x reads config version 2; the settings "
                f"of a version {cfg.version} file (io.containerd.cri.v1.*) are ignored",
                f"write it as version 2, as {DEPLOY[1]}",
            )
        if major < 2 and cfg.version < 2:
            return Check(
                "containerd-config",
                WARN,
                f"{where}: version 1 is deprecated (read with its short plugin names)",
                f"write it as version 2, as {DEPLOY[1]}",
            )
        if major >= 2 and cfg.version < 3:
            return Check(
                "containerd-config",
                WARN,
                f"{where}: containerd {major}.x migrates it to version 3 when it "
                "starts (read here as migrated)",
                f"'containerd config migrate' prints it as version 3; compare with {DEPLOY[2]}",
            )
        return Check("containerd-config", OK, where)

    def _proxy_plugin(
        self, cfg: ContainerdConfig, plugin: ProxyPlugin | None, major: int
    ) -> Iterator[Check]:
        ours = str(self.config.service.address)
        section = f"[proxy_plugins.{self.name}]"
        if plugin is None:
            others = [p.name for p in cfg.proxy_plugins().values() if p.address == ours]
            fix = (
                f"the proxy plugin at lazyblock's socket is named {others[0]!r}: pass "
                f"--snapshotter {others[0]}"
                if others
                else f'add {section} with type = "snapshot" and address = "{ours}" (as '
                f"{DEPLOY[min(major, 2)]} has it), then restart containerd"
            )
            yield Check(
                "proxy-plugin",
                FAIL,
                f"no {section} in {cfg.path}: containerd has no snapshotter {self.name!r}",
                fix,
            )
            return
        if plugin.type != "snapshot" or not plugin.address:
            yield Check(
                "proxy-plugin",
                FAIL,
                f"{section} has type {plugin.type!r} and address {plugin.address!r}",
                f'set type = "snapshot" and address = "{ours}", then restart containerd',
            )
            return
        yield Check("proxy-plugin", OK, f"{section} type snapshot at {plugin.address}")
        address = Path(plugin.address)
        channel, why = _connect(address, self.options.timeout)
        if channel is None:
            fix = (
                "start lazyblock's daemon (systemctl start lazyblock-snapshotter-grpc, or "
                f"snapshotter serve --address {address})"
            )
            if plugin.address != ours:
                fix += f"; lazyblock's config puts its socket at {ours}: make the two agree"
            yield Check(
                "snapshotter-daemon", FAIL, f"proxy plugin {self.name} at {address}: {why}", fix
            )
            return
        with contextlib.closing(channel):
            answer = _probe_snapshots(channel, self.name, self.options.timeout)
        if answer:
            yield Check(
                "snapshotter-daemon",
                FAIL,
                f"proxy plugin {self.name} at {address}: {answer}",
                f"point address at lazyblock's daemon ({ours})",
            )
            return
        yield Check(
            "snapshotter-daemon",
            OK,
            f"proxy plugin {self.name} at {address} (reachable: lazyblock's daemon "
            "answers the snapshots API)",
        )
        if plugin.address != ours:
            yield Check(
                "snapshotter-daemon",
                WARN,
                f"containerd's {section} address {plugin.address} is not the "
                f"[snapshotter] address of lazyblock's config ({ours})",
                "make the two agree: the daemon's unit starts it at the configured address",
            )

    def _loaded(
        self, channel: grpc.Channel, cfg: ContainerdConfig, plugin: ProxyPlugin | None, major: int
    ) -> Check:
        """What the running containerd loaded: the file may be newer than the daemon."""
        try:
            loaded = _snapshot_plugins(channel, self.options.timeout)
        except grpc.RpcError as e:
            return Check(
                "containerd-plugin", WARN, f"containerd did not list its plugins: {e.code().name}"
            )  # type: ignore[attr-defined]
        restart = f"restart containerd (after lazyblock's daemon) to load {cfg.path}"
        found = loaded.get(self.name)
        if found is None:
            return Check(
                "containerd-plugin",
                FAIL,
                f"the running containerd has no snapshotter {self.name!r}",
                restart + (" (or it reads another file: see its --config)" if plugin else ""),
            )
        exports, init_error = found
        if init_error:
            return Check(
                "containerd-plugin",
                FAIL,
                f"containerd could not load snapshotter {self.name!r}: {init_error}",
                restart,
            )
        if plugin is not None and exports.get("address", plugin.address) != plugin.address:
            return Check(
                "containerd-plugin",
                WARN,
                f"the running containerd dials {self.name} at {exports['address']}, "
                f"not at {plugin.address} as {cfg.path} says",
                restart,
            )
        if plugin is not None and major >= 2:
            want = str(plugin.exports.get(ANNOTATIONS_EXPORT, ""))
            if exports.get(ANNOTATIONS_EXPORT, "") != want:
                return Check(
                    "containerd-plugin",
                    WARN,
                    f"the running containerd's {self.name} exports differ from "
                    f"{cfg.path} ({ANNOTATIONS_EXPORT})",
                    restart,
                )
        return Check(
            "containerd-plugin", OK, f"the running containerd has loaded snapshotter {self.name!r}"
        )

    def _cri(
        self, cfg: ContainerdConfig, plugin: ProxyPlugin | None, major: int, minor: int
    ) -> Iterator[Check]:
        cri = cfg.cri_images(major, minor)
        section = f"[{cri.section}]"
        restart = "then restart containerd"
        if not cri.enabled:
            yield Check(
                "cri",
                OK,
                "the CRI plugin is disabled: no kubelet pulls here "
                "(snapshotter pull still pulls lazily)",
            )
        else:
            if cri.snapshotter == self.name:
                yield Check("cri-snapshotter", OK, f"CRI pulls with snapshotter {self.name!r}")
            else:
                yield Check(
                    "cri-snapshotter",
                    FAIL,
                    f"CRI pulls with snapshotter {cri.snapshotter!r}, not "
                    f"{self.name!r}: pods start without lazyblock",
                    f'set snapshotter = "{self.name}" under {section}, {restart}',
                )
            if cri.transfer:
                yield Check(
                    "cri-annotations",
                    OK,
                    f"CRI pulls through the transfer service (containerd {major}.{minor})"
                    ": image labels come from the proxy plugin's exports (below)",
                )
            elif cri.annotations:
                yield Check(
                    "cri-annotations",
                    OK,
                    "CRI passes image labels to snapshotters "
                    "(disable_snapshot_annotations = false)",
                )
            else:
                fix = f"set disable_snapshot_annotations = false under {section}, {restart}"
                if major >= 2 and minor >= 1:
                    fix += (
                        f" (or remove {cri.local_reason} so that CRI pulls through the "
                        "transfer service)"
                    )
                yield Check(
                    "cri-annotations",
                    FAIL,
                    "CRI hides image labels from snapshotters "
                    "(disable_snapshot_annotations is true, the default): lazyblock "
                    "cannot tell which image a layer is, and pods pull it in full",
                    fix,
                )
        if major < 2:
            return
        # The transfer service: ctr image pull of 2.x, and CRI when it pulls through it.
        cri_needs = cri.enabled and cri.transfer and cri.snapshotter == self.name
        severity = FAIL if cri_needs else WARN
        who = "CRI pulls and 'ctr image pull'" if cri_needs else "'ctr image pull'"
        yield self._exports(plugin, severity, who)
        yield self._unpack(cfg, severity, who)

    def _exports(self, plugin: ProxyPlugin | None, severity: str, who: str) -> Check:
        section = f"[proxy_plugins.{self.name}.exports]"
        value = plugin.exports.get(ANNOTATIONS_EXPORT) if plugin else None
        if value == "true":
            return Check(
                "transfer-exports",
                OK,
                f"the transfer service passes image labels to {self.name} "
                f'({section} {ANNOTATIONS_EXPORT} = "true")',
            )
        if isinstance(value, bool):
            return Check(
                "transfer-exports",
                FAIL,
                f"{section} {ANNOTATIONS_EXPORT} is a boolean; containerd's exports are strings",
                f'write {ANNOTATIONS_EXPORT} = "true" (quoted)',
            )
        return Check(
            "transfer-exports",
            severity,
            f"the transfer service passes no image labels to {self.name} ({section} "
            f'has no {ANNOTATIONS_EXPORT} = "true"): {who} fetch block images in '
            "full instead of lazily",
            f'add {ANNOTATIONS_EXPORT} = "true" under {section}, then restart '
            "containerd (or use snapshotter pull)",
        )

    def _unpack(self, cfg: ContainerdConfig, severity: str, who: str) -> Check:
        here = node_platform()
        section = f'[[plugins."{TRANSFER}".unpack_config]]'
        fix = (
            f'add {section} with platform = "{here}", snapshotter = "{self.name}", '
            f'differ = "walking" (as {DEPLOY[2]}), then restart containerd'
        )
        entries = cfg.unpack_config()
        if entries is None:
            return Check(
                "transfer-unpack",
                severity,
                "the transfer service has no unpack_config: it unpacks only with its "
                f"defaults (overlayfs, erofs), and {who} with {self.name} are not "
                "unpacked",
                fix,
            )
        ours = [e for e in entries if e.snapshotter == self.name]
        os_, arch, _ = platform_parts(here)
        for entry in ours:
            try:
                e_os, e_arch, _ = platform_parts(entry.platform)
            except PullError:
                continue
            if e_os == os_ and (e_arch == arch or not cfg.checks_platform()):
                return Check(
                    "transfer-unpack",
                    OK,
                    f"the transfer service unpacks {entry.platform} with {self.name} "
                    "(unpack_config)",
                )
        named = ", ".join(e.platform or "?" for e in ours)
        return Check(
            "transfer-unpack",
            severity,
            f"unpack_config has no entry for {self.name} on {here}"
            + (f" (only {named})" if named else "")
            + f": {who} with {self.name} are not unpacked",
            fix,
        )

    # --- the kernel ------------------------------------------------------------------------

    def _kernel(self) -> Iterator[Check]:
        try:
            os.close(os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC))
            yield Check("fuse", OK, "/dev/fuse opens")
        except FileNotFoundError:
            yield Check(
                "fuse", FAIL, "no /dev/fuse", "modprobe fuse (in a container: pass /dev/fuse in)"
            )
        except OSError as e:
            yield Check(
                "fuse",
                FAIL,
                f"cannot open /dev/fuse: {e.strerror}",
                "run the daemon as root (in a container: allow the device)",
            )
        yield _erofs_check()
        yield self._backing_check()

    def _backing_check(self) -> Check:
        backing = self.config.mount.backing
        release = os.uname().release
        file_ok = _kernel_version(release) >= FILE_BACKED_KERNEL
        loop, why = _free_loop_device()
        file_text = (
            f"file-backed erofs (kernel {release})"
            if file_ok
            else f"no file-backed erofs (kernel {release} < 6.12)"
        )
        loop_fix = "modprobe loop; free loop devices (losetup -a), or raise max_loop"
        if backing == "file":
            if file_ok:
                return Check("backing", OK, f"mount.backing = file: {file_text}")
            return Check(
                "backing",
                FAIL,
                f"mount.backing = file: {file_text}",
                'set mount.backing = "auto" (or "loop")',
            )
        if loop:
            return Check(
                "backing", OK, f"mount.backing = {backing}: loop devices available ({loop} is free)"
            )
        if backing == "auto" and file_ok:
            return Check(
                "backing", OK, f"mount.backing = auto: no loop device ({why}), {file_text}"
            )
        return Check(
            "backing",
            FAIL,
            f"mount.backing = {backing}: no loop device ({why})"
            + ("" if backing == "loop" else f" and {file_text}"),
            loop_fix,
        )

    # --- directories -----------------------------------------------------------------------

    def _directories(self) -> Iterator[Check]:
        mount = self.config.mount
        cache, size = mount.cache_dir, mount.cache_size
        problem = _unwritable(cache)
        if problem:
            yield Check(
                "cache-dir",
                FAIL,
                f"cache directory {cache}: {problem}",
                "set [cache] dir to a writable directory on a local disk",
            )
        else:
            existing = _existing(cache)
            vfs = os.statvfs(existing)
            free = vfs.f_bavail * vfs.f_frsize
            used = cache_usage(cache)[1] if cache.is_dir() else 0
            text = (
                f"cache directory {cache}: writable, cap {format_size(size)}, {format_size(used)} "
                f"in use, {format_size(free)} free on its file system"
            )
            if free + used < size:
                yield Check(
                    "cache-dir",
                    WARN,
                    text + ": the disk fills before the cap",
                    "lower [cache] size, or give the directory more room",
                )
            else:
                yield Check("cache-dir", OK, text)
        state = mount.state_dir
        problem = _unwritable(state)
        if problem:
            yield Check(
                "state-dir",
                FAIL,
                f"state directory {state}: {problem}",
                "set [state] dir to a writable directory (default /run/lazyblock)",
            )
        else:
            yield Check("state-dir", OK, f"state directory {state}: writable")

    # --- registries ------------------------------------------------------------------------

    def _registry(self, target: str) -> Check:
        """HOST: does it answer, and how it wants clients to authenticate; an image
        reference: resolve it as snapshotter pull does, anonymously and then with the
        credentials the daemon's mounts would use."""
        is_ref = "/" in target
        try:
            name = ImageName.parse(target) if is_ref else None
        except (PullError, ImageToolError) as e:
            return Check(
                "registry",
                FAIL,
                f"registry {target}: {e}",
                "give HOST[:PORT] or an image name host/repository:tag",
            )
        host = name.host if name else registry_host(target)
        with tempfile.TemporaryDirectory(prefix="lazyblock-check-") as tmp:
            backend = MountBackend(
                self.config.mount,
                self.config.service.insecure_registries,
                Credentials(
                    node_sources(self.config.mount.store.docker_config),
                    Path(tmp) / "auth" / "config.json",
                ),
            )
            store = backend.config_for(f"{host}/{name.repository if name else 'x'}").store
            store = dataclasses.replace(
                store, plain_http=store.plain_http or (self.config.mount.store.plain_http)
            )
            has_creds = _has_credentials(store, host)
            anonymous = dataclasses.replace(store, docker_config=Path(tmp) / "none.json")
            if name is None:
                return self._ping(host, anonymous, has_creds)
            return self._resolve(name, anonymous, store, has_creds)

    def _sources(self) -> str:
        return ", ".join(str(p) for p in node_sources(self.config.mount.store.docker_config))

    def _ping(self, host: str, anonymous: StoreOptions, has_creds: bool) -> Check:
        try:
            with RegistryClient(host, "", anonymous) as client:
                challenge = client.ping()
        except ImageToolError as e:
            return _unreachable(e)
        if challenge is None:
            return Check("registry", OK, f"registry {host} answers (anonymous access allowed)")
        parsed = parse_challenge(challenge)
        how = parsed.scheme.capitalize() if parsed else "authentication"
        if has_creds:
            return Check(
                "registry",
                OK,
                f"registry {host} answers and asks for {how}; the node has "
                f"credentials for it (an image reference tries them)",
            )
        return Check(
            "registry",
            WARN,
            f"registry {host} answers and asks for {how}; the node has no credentials "
            f"for it ({self._sources()}): only repositories open to anonymous pulls "
            "mount",
            f"docker login {host}, or set store.docker_config",
        )

    def _resolve(
        self, name: ImageName, anonymous: StoreOptions, store: StoreOptions, has_creds: bool
    ) -> Check:
        how = "anonymously"
        try:
            try:
                image = resolve_image(name, PullOptions(store=anonymous))
            except AuthError:
                if not has_creds:
                    raise
                how = f"with the node's credentials for {name.host} (anonymous access refused)"
                image = resolve_image(name, PullOptions(store=store))
        except AuthError as e:
            fix = f"docker login {name.host} (the daemon reads {self._sources()})"
            if has_creds:
                return Check(
                    "registry",
                    FAIL,
                    f"registry: {e}",
                    f"renew the credentials for {name.host}: {fix}",
                )
            return Check(
                "registry",
                FAIL,
                f"registry: {name.name}: anonymous access refused and the node has "
                f"no credentials for {name.host}",
                fix,
            )
        except NotFoundError as e:
            return Check("registry", FAIL, f"registry: {e}", "check the repository and tag")
        except PullError as e:
            ordinary = "ordinary image" in str(e)
            return Check(
                "registry",
                WARN if ordinary else FAIL,
                f"registry: {e}",
                "convert it with imagetool convert" if ordinary else "",
            )
        except ImageToolError as e:
            return _unreachable(e)
        return Check(
            "registry",
            OK,
            f"registry: {name.name} resolves {how}: a lazyblock block image "
            f"(manifest {image.manifest_digest[:19]}...)",
        )


# --- helpers ---------------------------------------------------------------------------------


def _connect(address: Path, timeout: float) -> tuple[grpc.Channel | None, str]:
    """A gRPC channel to the unix socket ``address`` once it answers, or why not."""
    try:
        mode = os.stat(address).st_mode
    except FileNotFoundError:
        return None, "no such socket"
    except OSError as e:
        return None, f"cannot stat it: {e.strerror}"
    if not stat.S_ISSOCK(mode):
        return None, "not a socket"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(str(address))
        except OSError as e:
            if e.errno == errno.ECONNREFUSED:
                return None, "connection refused (a socket left by a process that is gone)"
            return None, f"cannot connect: {e.strerror or e}"
    channel = grpc.insecure_channel(f"unix://{address.absolute()}")
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        channel.close()
        return None, f"no gRPC answer within {timeout:g}s"
    return channel, ""


def _stubs() -> Any:
    from snapshotter.containerd.proto import load_client

    return load_client(("version", "introspection", "snapshots"))


def _running_version(channel: grpc.Channel) -> ContainerdVersion | None:
    from google.protobuf.empty_pb2 import Empty

    try:
        reply = _stubs().version_grpc.VersionStub(channel).Version(Empty(), timeout=5)
    except grpc.RpcError:
        return None
    return _parse_version(reply.version, "running")


def _installed_version() -> ContainerdVersion | None:
    binary = shutil.which("containerd")
    if binary is None:
        return None
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    # "containerd github.com/containerd/containerd[/v2] VERSION [REVISION]"
    words = out.stdout.split()
    return _parse_version(words[2], f"{binary} --version") if len(words) >= 3 else None


def _parse_version(text: str, source: str) -> ContainerdVersion | None:
    m = _VERSION.match(text.strip())
    if not m:
        return None
    return ContainerdVersion(text.strip(), int(m.group(1)), int(m.group(2)), source)


def _version_check(
    version: ContainerdVersion | None, address: Path, running: bool, why: str
) -> Check:
    if running and version is not None:
        return Check("containerd", OK, f"containerd {version.text} answers at {address}")
    if running:
        return Check("containerd", WARN, f"containerd answers at {address} but not its version")
    installed = f"; installed: {version.text}" if version else "; none on PATH either"
    return Check(
        "containerd",
        FAIL,
        f"containerd does not answer at {address} ({why}){installed}",
        "start containerd after lazyblock's daemon (systemctl start containerd), or "
        "name its socket with --containerd-address",
    )


def _probe_snapshots(channel: grpc.Channel, name: str, timeout: float) -> str:
    """'' if a snapshots service answers on ``channel`` (a Stat of a key that does not
    exist), else what answered instead."""
    pb = _stubs()
    stub = pb.snapshots_grpc.SnapshotsStub(channel)
    request = pb.snapshots.StatSnapshotRequest(snapshotter=name, key="lazyblock-check-probe")
    try:
        stub.Stat(request, timeout=timeout + 2)
    except grpc.RpcError as e:
        code = e.code()  # type: ignore[attr-defined]
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return "something answers there, but not the snapshots API"
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return f"the snapshots API does not answer ({code.name})"
    return ""


def _snapshot_plugins(channel: grpc.Channel, timeout: float) -> dict[str, tuple[dict, str]]:
    """The running containerd's snapshotters: id -> (exports, init error or '')."""
    pb = _stubs()
    stub = pb.introspection_grpc.IntrospectionStub(channel)
    reply = stub.Plugins(pb.introspection.PluginsRequest(), timeout=timeout + 2)
    return {
        p.id: (dict(p.exports), p.init_err.message if p.init_err.code else "")
        for p in reply.plugins
        if p.type == SNAPSHOT_PLUGIN
    }


def _erofs_check() -> Check:
    try:
        filesystems = Path("/proc/filesystems").read_text()
    except OSError:
        filesystems = ""
    if re.search(r"\serofs$", filesystems, re.MULTILINE):
        return Check("erofs", OK, "the kernel has erofs (/proc/filesystems)")
    release = os.uname().release
    modules = Path("/lib/modules") / release
    with contextlib.suppress(OSError):
        listed = (modules / "modules.dep").read_text() + (modules / "modules.builtin").read_text()
        if re.search(r"/erofs\.ko", listed):
            return Check(
                "erofs",
                WARN,
                "erofs is not loaded, but the kernel has it as a module (the first mount loads it)",
                "modprobe erofs (or list it in /etc/modules-load.d/)",
            )
    return Check(
        "erofs",
        FAIL,
        f"kernel {release} has no erofs",
        "a kernel with CONFIG_EROFS_FS (Debian 12's has it; modprobe erofs)",
    )


def _kernel_version(release: str) -> tuple[int, int]:
    m = _VERSION.match(release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _free_loop_device() -> tuple[str, str]:
    """(a free loop device, '') or ('', why none)."""
    if shutil.which("losetup") is None:
        return "", "no losetup on PATH"
    try:
        out = subprocess.run(["losetup", "--find"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return "", f"losetup --find: {e}"
    if out.returncode != 0:
        return "", f"losetup --find: {' '.join(out.stderr.split()) or out.returncode}"
    return out.stdout.strip(), ""


def _existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _unwritable(directory: Path) -> str:
    """'' if the daemon can use ``directory`` (it exists and takes a file, or can be made),
    else why not."""
    if directory.exists() and not directory.is_dir():
        return "not a directory"
    if not directory.exists():
        parent = _existing(directory)
        if not parent.is_dir():
            return f"absent, and {parent} is not a directory"
        if not os.access(parent, os.W_OK | os.X_OK) or os.statvfs(parent).f_flag & os.ST_RDONLY:
            return f"absent, and {parent} is not writable to create it in"
        return ""
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".lazyblock-check-")
    except OSError as e:
        return f"not writable ({e.strerror})"
    os.close(fd)
    os.unlink(probe)
    return ""


def _has_credentials(store: StoreOptions, host: str) -> bool:
    from imagetool.registry.auth import default_docker_config, load_docker_credentials

    if store.credentials is not None:
        return True
    try:
        return load_docker_credentials(default_docker_config(store), host) is not None
    except AuthError:
        return False


def _unreachable(error: Exception) -> Check:
    return Check(
        "registry",
        FAIL,
        f"registry: {error}",
        "check the network and the name; a registry over plain HTTP must be in "
        "[snapshotter] insecure_registries",
    )
