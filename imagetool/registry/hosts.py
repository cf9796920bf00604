"""containerd's registry hosts directory (``hosts.toml``), read as containerd reads it.

A node's containerd finds its registry mirrors under ``config_path`` (conventionally
``/etc/containerd/certs.d``): one directory per *registry host namespace*, named by the
image's registry host, holding a ``hosts.toml`` (or, without one, docker's certificate files:
``*.crt`` CAs, ``*.cert``/``*.key`` client pairs). ``load_hosts_dir`` reads every namespace
of such a directory into a ``HostsConfig``; ``HostsConfig.hosts_for(registry)`` gives the
hosts to try for one registry, in order: the ``[host."URL"]`` entries as the file lists
them, then the *server* (``server = "URL"``, or the registry itself when the file names
none), which is what containerd does. The facts follow containerd's ``docs/hosts.md``:

* The namespace of ``myregistry.io:5000`` is the first directory of ``myregistry.io_5000_``,
  ``myregistry.io:5000``, ``_default`` that exists; Docker Hub's is ``docker.io``.
* A host URL without ``/v2`` at the end of its path gets it appended, unless
  ``override_path = true`` (the path is then the API root as it is); ``server =
  "registry.example"`` without a scheme means ``https://``.
* ``capabilities`` (``pull``, ``resolve``, ``push``; all three when absent), ``ca`` (a path
  or a list), ``client`` (a path, a list of paths, or of ``[cert, key]`` pairs), ``skip_verify``,
  ``[header]`` (a string or a list of strings per name), ``dial_timeout`` (a Go duration such
  as ``"1s"``), ``proxy`` (an ``http://`` or ``https://`` URL) apply to the host they are
  written under; the file's top-level ones to the server. Relative paths are relative to the
  file's directory.
* A request to a host other than the namespace's registry carries ``?ns=<registry>``
  (Dragonfly's dfdaemon, among others, reads the origin from it).

lazyblock is stricter than containerd in one way: a malformed file is an error
(``HostsConfigError``, naming the file and the problem) instead of a logged fallback, so that
``snapshotter serve`` refuses it at start and keeps the previous configuration on a reload.
Keys this reader does not know are logged and ignored, as containerd ignores them.
"""

from __future__ import annotations

import logging
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from imagetool.errors import HostsConfigError
from imagetool.stores.refs import DOCKER_HUB_REGISTRY

log = logging.getLogger(__name__)

HOSTS_FILE = "hosts.toml"
DEFAULT_NAMESPACE = "_default"
# Docker Hub's namespace directory (its API host is registry-1.docker.io).
DOCKER_HUB_NAMESPACE = "docker.io"
CAPABILITIES = ("pull", "resolve", "push")
PROXY_SCHEMES = ("http", "https")
_KNOWN_KEYS = frozenset(
    {"capabilities", "ca", "client", "skip_verify", "header", "override_path", "dial_timeout",
     "proxy"}
)  # fmt: skip
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_DURATION_UNITS = {
    "ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
    "h": 3600.0,
}  # fmt: skip


@dataclass(frozen=True)
class RegistryHost:
    """One host to ask: a mirror (a ``[host."URL"]`` entry) or a namespace's server."""

    url: str | None
    """``scheme://host[:port]/path`` of the API root (``.../v2``); None for a server that is
    the registry itself (``https://REGISTRY/v2``, or ``http://`` where asked for)."""
    capabilities: tuple[str, ...] = CAPABILITIES
    ca: tuple[str, ...] = ()
    """CA certificate files (absolute), trusted on top of the usual ones."""
    client: tuple[tuple[str, str], ...] = ()
    """Client certificate (cert, key) file pairs; key "" when the cert file holds it."""
    skip_verify: bool = False
    header: tuple[tuple[str, str], ...] = ()
    """Extra request headers (a name may repeat)."""
    dial_timeout: float | None = None
    """Seconds a connection attempt may take (None: the store's timeout)."""
    proxy: str | None = None
    """The proxy for this host, overriding ``HTTP(S)_PROXY``/``NO_PROXY``; None: those."""
    mirror: bool = True
    """A ``[host]`` entry (True) or the namespace's server (False)."""

    def can(self, capability: str) -> bool:
        return capability in self.capabilities

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "capabilities": list(self.capabilities),
            "ca": list(self.ca),
            "client": [list(p) for p in self.client],
            "skip_verify": self.skip_verify,
            "header": [list(h) for h in self.header],
            "dial_timeout": self.dial_timeout,
            "proxy": self.proxy,
            "mirror": self.mirror,
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> RegistryHost:
        return cls(
            url=doc["url"],
            capabilities=tuple(doc["capabilities"]),
            ca=tuple(doc["ca"]),
            client=tuple((str(c), str(k)) for c, k in doc["client"]),
            skip_verify=bool(doc["skip_verify"]),
            header=tuple((str(n), str(v)) for n, v in doc["header"]),
            dial_timeout=doc["dial_timeout"],
            proxy=doc["proxy"],
            mirror=bool(doc["mirror"]),
        )


@dataclass(frozen=True)
class HostNamespace:
    """One namespace directory: its mirrors in order, then its server."""

    source: str
    """The file (or directory) it was read from, for messages."""
    mirrors: tuple[RegistryHost, ...]
    server: RegistryHost

    @property
    def hosts(self) -> tuple[RegistryHost, ...]:
        return (*self.mirrors, self.server)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "mirrors": [h.to_dict() for h in self.mirrors],
            "server": self.server.to_dict(),
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> HostNamespace:
        return cls(
            source=str(doc["source"]),
            mirrors=tuple(RegistryHost.from_dict(h) for h in doc["mirrors"]),
            server=RegistryHost.from_dict(doc["server"]),
        )


@dataclass(frozen=True)
class HostsConfig:
    """A whole hosts directory, read once (``load_hosts_dir``): what the node's mounts use,
    handed to each mount server as data so that all of them see the same configuration."""

    root: str
    namespaces: Mapping[str, HostNamespace] = field(default_factory=dict)

    def namespace_for(self, registry: str) -> tuple[str, HostNamespace] | None:
        """(directory name, namespace) for a registry ``host[:port]``, as containerd finds
        it (see the module docstring); None when no directory applies."""
        for name in namespace_names(registry):
            if name in self.namespaces:
                return name, self.namespaces[name]
        return None

    def hosts_for(self, registry: str) -> tuple[RegistryHost, ...]:
        """The hosts to try for ``registry``, in order; the last is the server."""
        found = self.namespace_for(registry)
        return found[1].hosts if found else (RegistryHost(url=None, mirror=False),)

    def to_dict(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "namespaces": {k: v.to_dict() for k, v in self.namespaces.items()},
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> HostsConfig:
        return cls(
            root=str(doc["root"]),
            namespaces={
                str(k): HostNamespace.from_dict(v) for k, v in (doc.get("namespaces") or {}).items()
            },
        )


def namespace_name(registry: str) -> str:
    """The namespace a registry host belongs to (Docker Hub's API host is ``docker.io``)."""
    return DOCKER_HUB_NAMESPACE if registry == DOCKER_HUB_REGISTRY else registry


def namespace_names(registry: str) -> list[str]:
    """Directory names that may hold ``registry``'s configuration, in the order containerd
    looks for them."""
    name = namespace_name(registry)
    host, sep, port = name.rpartition(":")
    names = [f"{host}_{port}_", name] if sep and host and "]" not in port else [name]
    return [*names, DEFAULT_NAMESPACE]


def load_hosts_dir(root: Path, *, required: bool = False) -> HostsConfig:
    """Every namespace under ``root``. A missing ``root`` is an empty configuration (or a
    ``HostsConfigError`` when ``required``); a malformed file is a ``HostsConfigError``."""
    root = Path(os.path.abspath(root))
    try:
        entries = sorted(p for p in root.iterdir() if p.is_dir())
    except FileNotFoundError:
        if required:
            raise HostsConfigError(f"registry hosts directory {root} does not exist") from None
        return HostsConfig(str(root))
    except OSError as e:
        raise HostsConfigError(
            f"cannot read registry hosts directory {root}: {e.strerror}"
        ) from None
    namespaces = {}
    for directory in entries:
        namespaces[directory.name] = load_namespace(directory)
    return HostsConfig(str(root), namespaces)


def hosts_dir_stamp(root: Path) -> tuple[tuple[str, int, int], ...]:
    """What changes when a file under ``root`` changes (names, sizes, mtimes): a reader
    compares it to decide whether to read the directory again."""
    stamp: list[tuple[str, int, int]] = []
    try:
        for dirpath, _, files in os.walk(root):
            for name in (".", *files):
                path = os.path.join(dirpath, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                stamp.append((path, st.st_size, st.st_mtime_ns))
    except OSError:
        pass
    return tuple(sorted(stamp))


def load_namespace(directory: Path) -> HostNamespace:
    """A namespace directory: its hosts.toml, else docker's certificate files (with
    neither, the registry itself with its defaults: the directory still stops the search
    before ``_default``, as in containerd)."""
    path = directory / HOSTS_FILE
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        text = b""
    except OSError as e:
        raise HostsConfigError(f"{path}: cannot read: {e.strerror}") from None
    if text:
        return parse_hosts_file(path, text)
    return _cert_files(directory)


def parse_hosts_file(path: Path, text: bytes | str) -> HostNamespace:
    """A ``hosts.toml``; ``HostsConfigError`` naming ``path`` and the problem."""
    try:
        doc = tomllib.loads(text.decode() if isinstance(text, bytes) else text)
    except UnicodeDecodeError:
        raise HostsConfigError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise HostsConfigError(f"{path}: not valid TOML: {e}") from None
    base = path.parent
    hosts = doc.get("host", {})
    if not isinstance(hosts, dict):
        raise HostsConfigError(f'{path}: "host" must be tables [host."URL"]')
    mirrors = []
    for url, table in hosts.items():
        where = f'{path}: [host."{url}"]'
        if not isinstance(table, dict):
            raise HostsConfigError(f"{where} must be a table")
        if "host" in table:
            raise HostsConfigError(f"{where}: hosts cannot be nested")
        mirrors.append(_host(where, base, url, table, mirror=True))
    top = {k: v for k, v in doc.items() if k not in ("host", "server")}
    server = doc.get("server")
    if server is not None and (not isinstance(server, str) or not server):
        raise HostsConfigError(f'{path}: "server" must be a URL string')
    return HostNamespace(
        str(path), tuple(mirrors), _host(str(path), base, server, top, mirror=False)
    )


def _host(
    where: str, base: Path, url: str | None, table: dict[str, Any], *, mirror: bool
) -> RegistryHost:
    for key in table:
        if key not in _KNOWN_KEYS:
            log.warning("%s: ignoring unknown key %r", where, key)
    override_path = _bool(where, table, "override_path")
    return RegistryHost(
        url=_api_url(where, url, override_path) if url is not None else None,
        capabilities=_capabilities(where, table.get("capabilities")),
        ca=tuple(_path(where, base, p, "ca") for p in _strings(where, table.get("ca"), "ca")),
        client=_client(where, base, table.get("client")),
        skip_verify=_bool(where, table, "skip_verify"),
        header=_header(where, table.get("header")),
        dial_timeout=_duration(where, table.get("dial_timeout")),
        proxy=_proxy(where, table.get("proxy")),
        mirror=mirror,
    )


def _api_url(where: str, url: str, override_path: bool) -> str:
    text = url if "://" in url else f"https://{url}"
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as e:
        raise HostsConfigError(f"{where}: cannot parse {url!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HostsConfigError(f"{where}: {url!r} is not an http(s) URL with a host")
    path = parts.path
    if path:
        path = os.path.normpath(path).rstrip("/") if path != "/" else ""
        if not path.endswith("/v2") and not override_path:
            path += "/v2"
    elif not override_path:
        path = "/v2"
    return f"{parts.scheme}://{parts.netloc}{path}"


def _capabilities(where: str, value: object) -> tuple[str, ...]:
    if value is None:
        return CAPABILITIES
    names = _strings(where, value, "capabilities")
    for name in names:
        if name.lower() not in CAPABILITIES:
            raise HostsConfigError(
                f"{where}: unknown capability {name!r} (known: {', '.join(CAPABILITIES)})"
            )
    # containerd's empty list means all of them.
    return tuple(c for c in CAPABILITIES if c in {n.lower() for n in names}) or CAPABILITIES


def _strings(where: str, value: object, key: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise HostsConfigError(f"{where}: {key!r} must be a string or a list of strings")


def _path(where: str, base: Path, value: str, key: str) -> str:
    path = Path(value) if os.path.isabs(value) else base / value
    if not path.is_file():
        raise HostsConfigError(f"{where}: {key} file {path} does not exist")
    return str(path)


def _client(where: str, base: Path, value: object) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise HostsConfigError(f"{where}: 'client' must be a path, a list of paths or of pairs")
    pairs = []
    for item in items:
        if isinstance(item, str):
            pairs.append((_path(where, base, item, "client"), ""))
        elif isinstance(item, list) and len(item) == 2 and all(isinstance(p, str) for p in item):
            cert, key = item
            pairs.append(
                (
                    _path(where, base, cert, "client"),
                    _path(where, base, key, "client") if key else "",
                )
            )
        else:
            raise HostsConfigError(f"{where}: invalid 'client' entry {item!r}")
    return tuple(pairs)


def _bool(where: str, table: dict[str, Any], key: str) -> bool:
    value = table.get(key, False)
    if not isinstance(value, bool):
        raise HostsConfigError(f"{where}: {key!r} must be true or false")
    return value


def _header(where: str, value: object) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise HostsConfigError(f"{where}: 'header' must be a table")
    out = []
    for name, values in value.items():
        if isinstance(values, str):
            values = [values]
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise HostsConfigError(f"{where}: header {name!r} must be a string or a list of them")
        if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name) or any(
            "\n" in v or "\r" in v for v in values
        ):
            raise HostsConfigError(f"{where}: header {name!r} is not a valid HTTP header")
        out.extend((name, v) for v in values)
    return tuple(out)


def parse_duration(text: str) -> float:
    """A Go duration (``"1s"``, ``"1m30s"``, ``"500ms"``) in seconds; ``ValueError``."""
    if text in ("0", ""):
        return 0.0
    pos, total = 0, 0.0
    for m in _DURATION.finditer(text):
        if m.start() != pos:
            break
        total += float(m[1]) * _DURATION_UNITS[m[2]]
        pos = m.end()
    if pos != len(text) or pos == 0:
        raise ValueError(f"not a duration: {text!r} (e.g. 1s, 500ms, 1m30s)")
    return total


def _duration(where: str, value: object) -> float | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise HostsConfigError(f"{where}: 'dial_timeout' must be a string such as \"1s\"")
    try:
        seconds = parse_duration(value)
    except ValueError as e:
        raise HostsConfigError(f"{where}: dial_timeout: {e}") from None
    return seconds or None


def _proxy(where: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise HostsConfigError(f"{where}: 'proxy' must be a URL string")
    parts = urlsplit(value)
    if parts.scheme in ("socks5", "socks5h"):
        raise HostsConfigError(f"{where}: proxy {value!r}: lazyblock speaks http(s) proxies only")
    if parts.scheme not in PROXY_SCHEMES or not parts.hostname:
        raise HostsConfigError(f"{where}: proxy {value!r} is not an http(s) URL with a host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise HostsConfigError(f"{where}: proxy {value!r} must not have a path or query")
    return value


def _cert_files(directory: Path) -> HostNamespace:
    """docker's certificate layout: ``*.crt`` CAs, ``NAME.cert`` with ``NAME.key``."""
    try:
        names = sorted(p.name for p in directory.iterdir() if p.is_file())
    except OSError as e:
        raise HostsConfigError(f"cannot read {directory}: {e.strerror}") from None
    ca = tuple(str(directory / n) for n in names if n.endswith(".crt"))
    client = []
    for name in names:
        if name.endswith(".cert"):
            key = name.removesuffix(".cert") + ".key"
            if key not in names:
                raise HostsConfigError(f"{directory / name}: client certificate without {key}")
            client.append((str(directory / name), str(directory / key)))
    return HostNamespace(
        str(directory), (), RegistryHost(None, ca=ca, client=tuple(client), mirror=False)
    )
