"""containerd's configuration file, read as containerd reads it, for ``snapshotter check``.

What lazyblock needs from it (``deploy/containerd/``) lives in different places per
version, so this module answers in containerd's terms, for the containerd that reads it:

* config ``version = 2`` (containerd 1.6/1.7; 2.x migrates it when it starts) and ``version =
  3`` (2.x); no ``version`` is version 1, whose plugin names are short (``cri``);
* ``imports``: more files (globs, relative to the importing file), merged in order as
  containerd does: a later file replaces a whole ``[proxy_plugins.NAME]``; a whole
  ``[plugins."URI"]`` on 1.x, key by key on 2.x;
* the CRI image settings (``snapshotter``, ``disable_snapshot_annotations``): 1.x's under
  ``io.containerd.grpc.v1.cri``'s ``containerd`` table, 2.x's under
  ``io.containerd.cri.v1.images`` (where 2.x's migration moves a version 2 file's), with
  containerd's defaults (overlayfs, annotations hidden) and, on 2.1 and later, which pull
  mode CRI takes: through the transfer service unless a setting only the local pull has is
  present (``CheckLocalImagePullConfigs`` in containerd);
* the transfer service's ``unpack_config`` (2.x), None when unset (containerd's default
  then: overlayfs and erofs only).

A file that cannot be read or is not TOML is a ``ContainerdConfigError``; keys of the wrong
type read as absent. Nothing here talks to containerd.
"""

from __future__ import annotations

import glob
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snapshotter.errors import SnapshotterError

DEFAULT_PATH = Path("/etc/containerd/config.toml")
DEFAULT_ADDRESS = Path("/run/containerd/containerd.sock")
CRI_V1 = "io.containerd.grpc.v1.cri"  # 1.x's CRI plugin, and 2.x's CRI gRPC service
CRI_IMAGES = "io.containerd.cri.v1.images"  # 2.x
TRANSFER = "io.containerd.transfer.v1.local"
SERVER_GRPC = "io.containerd.server.v1.grpc"  # config version 4 (containerd 2.3)
DEFAULT_SNAPSHOTTER = "overlayfs"
# Version 1's short plugin names, as containerd migrates them (those lazyblock reads).
_V1_NAMES = {"cri": CRI_V1}
# containerd 2.1's CRI settings that make it pull locally instead of through the transfer
# service (internal/cri/config: CheckLocalImagePullConfigs), checked in this order.
_LOCAL_PULL_ONLY = (
    ("disable_snapshot_annotations", lambda v: v is False),
    ("discard_unpacked_layers", lambda v: v is True),
    ("registry.mirrors", bool),
    ("registry.configs", bool),
    ("registry.auths", bool),
    ("max_concurrent_downloads", lambda v: v is not None and v != 3),
    ("image_pull_with_sync_fs", lambda v: v is True),
)


class ContainerdConfigError(SnapshotterError):
    """containerd's configuration file (or a file it imports) cannot be read or parsed."""


@dataclass(frozen=True)
class ProxyPlugin:
    """One ``[proxy_plugins.NAME]``."""

    name: str
    type: str
    address: str
    exports: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class CriImages:
    """How containerd's CRI plugin pulls images, as configured."""

    enabled: bool  # not in disabled_plugins
    section: str  # where its settings live, as a TOML table name
    snapshotter: str
    annotations: bool  # passes the image labels to snapshotters (local pull)
    transfer: bool  # pulls through the transfer service (2.1+)
    local_reason: str  # why a 2.1+ pull is local: the setting found, "use_local_image_pull"


@dataclass(frozen=True)
class UnpackEntry:
    """One ``[[plugins."io.containerd.transfer.v1.local".unpack_config]]``."""

    platform: str
    snapshotter: str
    differ: str


@dataclass(frozen=True)
class ContainerdConfig:
    path: Path
    files: tuple[Path, ...]  # the file and every file it imported, in merge order
    version: int  # the file's own (1 when absent)
    doc: dict[str, Any]  # the merged TOML

    # --- where things are ----------------------------------------------------------------

    def plugin(self, uri: str) -> dict[str, Any]:
        """``[plugins."URI"]`` (``{}`` if absent), under version 1's short name too."""
        plugins = _table(self.doc, "plugins")
        found = _table(plugins, uri)
        if not found and self.version <= 1:
            short = next((k for k, v in _V1_NAMES.items() if v == uri), None)
            if short:
                found = _table(plugins, short)
        return found

    def proxy_plugins(self) -> dict[str, ProxyPlugin]:
        out = {}
        for name, table in _table(self.doc, "proxy_plugins").items():
            if isinstance(table, dict):
                out[name] = ProxyPlugin(
                    name,
                    str(table.get("type", "")),
                    str(table.get("address", "")),
                    dict(_table(table, "exports")),
                )
        return out

    def disabled(self, uri: str) -> bool:
        names = self.doc.get("disabled_plugins")
        if not isinstance(names, list):
            return False
        return uri in names or any(_V1_NAMES.get(str(n)) == uri for n in names)

    def grpc_address(self) -> Path | None:
        """The socket containerd serves its API on, if the file sets it."""
        for table in (_table(self.doc, "grpc"), self.plugin(SERVER_GRPC)):
            address = table.get("address")
            if isinstance(address, str) and address:
                return Path(address)
        return None

    # --- what CRI and the transfer service do --------------------------------------------

    def cri_images(self, major: int, minor: int) -> CriImages:
        """The CRI image settings that containerd ``major.minor`` takes from this file."""
        if major < 2:
            section = f'plugins."{CRI_V1}".containerd'
            table = _table(self.plugin(CRI_V1), "containerd")
            return CriImages(
                enabled=not self.disabled(CRI_V1),
                section=section,
                snapshotter=_str(table.get("snapshotter"), DEFAULT_SNAPSHOTTER),
                annotations=table.get("disable_snapshot_annotations") is False,
                transfer=False,
                local_reason="containerd 1.x",
            )
        table = self._cri_images_v3()
        local_reason = ""
        if minor < 1:
            local_reason = "containerd 2.0"
        elif table.get("use_local_image_pull") is True:
            local_reason = "use_local_image_pull = true"
        else:
            for key, present in _LOCAL_PULL_ONLY:
                if present(_dotted(table, key)):
                    local_reason = key
                    break
        return CriImages(
            enabled=not (self.disabled(CRI_V1) or self.disabled(CRI_IMAGES)),
            section=f'plugins."{CRI_IMAGES}"',
            snapshotter=_str(table.get("snapshotter"), DEFAULT_SNAPSHOTTER),
            annotations=table.get("disable_snapshot_annotations") is False,
            transfer=not local_reason,
            local_reason=local_reason,
        )

    def _cri_images_v3(self) -> dict[str, Any]:
        """``io.containerd.cri.v1.images`` as containerd 2.x sees it: a version 2 file's CRI
        settings moved there first (plugins/cri/images: configMigration)."""
        table = dict(self.plugin(CRI_IMAGES))
        if self.version < 3:
            old = self.plugin(CRI_V1)
            for key in ("registry", "max_concurrent_downloads", "image_pull_with_sync_fs"):
                if key in old:
                    table[key] = old[key]
            containerd = _table(old, "containerd")
            for key in ("snapshotter", "disable_snapshot_annotations", "discard_unpacked_layers"):
                if key in containerd:
                    table[key] = containerd[key]
        return table

    def unpack_config(self) -> list[UnpackEntry] | None:
        """The transfer service's unpack configurations; None when the file sets none."""
        entries = self.plugin(TRANSFER).get("unpack_config")
        if not isinstance(entries, list):
            return None
        return [
            UnpackEntry(
                _str(e.get("platform"), ""),
                _str(e.get("snapshotter"), ""),
                _str(e.get("differ"), ""),
            )  # fmt: skip
            for e in entries
            if isinstance(e, dict)
        ]

    def checks_platform(self) -> bool:
        """Whether the transfer service matches an unpack entry's architecture too
        (``check_platform_supported``; otherwise only its OS)."""
        return self.plugin(TRANSFER).get("check_platform_supported") is True


def read_containerd_config(path: Path = DEFAULT_PATH, major: int = 1) -> ContainerdConfig:
    """The file at ``path`` with its imports, merged as containerd ``major`` merges them."""
    files: list[Path] = []
    merged: dict[str, Any] = {}
    version = 0
    pending = [path]
    while pending:
        current, pending = pending[0], pending[1:]
        if current in files:
            continue
        doc = _load(current)
        if current == path:
            version = doc.get("version") if isinstance(doc.get("version"), int) else 1
        _merge(merged, doc, deep_plugins=major >= 2)
        files.append(current)
        pending += _imports(current, doc.get("imports"))
    return ContainerdConfig(path, tuple(files), max(version, 1), merged)


def _load(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except OSError as e:
        raise ContainerdConfigError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ContainerdConfigError(f"{path}: not a text file") from None
    except tomllib.TOMLDecodeError as e:
        raise ContainerdConfigError(f"{path}: {' '.join(str(e).split())}") from None


def _imports(parent: Path, imports: object) -> list[Path]:
    """containerd's resolveImports: globs as they are, other paths against the parent's
    directory."""
    out: list[Path] = []
    for item in imports if isinstance(imports, list) else []:
        text = str(item)
        if "*" in text:
            out += [Path(p) for p in sorted(glob.glob(text))]
        else:
            p = Path(os.path.normpath(text))
            out.append(p if p.is_absolute() else parent.parent / p)
    return out


def _merge(to: dict[str, Any], src: dict[str, Any], deep_plugins: bool) -> None:
    for key, value in src.items():
        if key == "plugins" and isinstance(value, dict):
            plugins = to.setdefault("plugins", {})
            for uri, table in value.items():
                if deep_plugins and isinstance(table, dict) and isinstance(plugins.get(uri), dict):
                    _deep_merge(plugins[uri], table)
                else:
                    plugins[uri] = table
        elif key == "proxy_plugins" and isinstance(value, dict):
            to.setdefault("proxy_plugins", {}).update(value)
        elif key in ("imports", "disabled_plugins", "required_plugins") and isinstance(value, list):
            to[key] = [*to.get(key, []), *value]
        elif isinstance(value, dict) and isinstance(to.get(key), dict):
            _deep_merge(to[key], value)
        else:
            to[key] = value


def _deep_merge(to: dict[str, Any], src: dict[str, Any]) -> None:
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(to.get(key), dict):
            _deep_merge(to[key], value)
        else:
            to[key] = value


def _table(doc: dict[str, Any], key: str) -> dict[str, Any]:
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def _dotted(doc: dict[str, Any], key: str) -> object:
    value: object = doc
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _str(value: object, default: str) -> str:
    return value if isinstance(value, str) and value else default
