"""Registry credentials for the snapshotter daemon and the mount servers it starts.

Sources (the first that names a host wins): docker ``config.json`` files (``auths``) and
Kubernetes ``kubernetes.io/dockerconfigjson`` secrets mounted as files
(``.dockerconfigjson``); each source is a file or a directory searched for
``config.json``/``.dockerconfigjson``/``*.json``. Credentials from the kubelet's CRI pulls
are not merged here (they would land on disk): ``keychain.cri`` holds them in memory and
they take precedence, per repository, over this file.

They are merged into one docker ``config.json`` under the daemon's root (mode 0600, written
atomically), which is what every mount server's ``StoreOptions.docker_config`` names.
``refresh()`` re-reads the sources when one changed (mtime/size), so rotated secrets and
``docker login`` take effect for the next mount without a restart; registry *tokens* are
renewed on expiry by the registry client itself. Nothing here logs a secret: log lines name
hosts and files only.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from imagetool.stores.refs import registry_host

log = logging.getLogger(__name__)

SECRET_FILE_NAMES = ("config.json", ".dockerconfigjson")


def node_sources(configured: Path | None) -> list[Path]:
    """The daemon's sources: ``store.docker_config`` if set, then ``$DOCKER_CONFIG``
    (default ``/root/.docker``)."""
    sources = [configured] if configured else []
    sources.append(Path(os.environ.get("DOCKER_CONFIG", "/root/.docker")))
    return sources


def _source_files(sources: Sequence[Path]) -> list[Path]:
    files: list[Path] = []
    for src in sources:
        if src.is_dir():
            named = [src / n for n in SECRET_FILE_NAMES if (src / n).is_file()]
            files += named or sorted(p for p in src.glob("*.json") if p.is_file())
            files += sorted(
                p for sub in sorted(src.iterdir()) if sub.is_dir()
                for p in (sub / n for n in SECRET_FILE_NAMES) if p.is_file()
            )  # fmt: skip
        elif src.is_file():
            files.append(src)
    return files


def _auths(path: Path) -> dict[str, dict[str, str]]:
    """The ``auths`` of one docker config (``{}`` if unreadable, with a warning)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        log.warning("ignoring credentials file %s: %s", path, type(e).__name__)
        return {}
    auths = doc.get("auths") if isinstance(doc, dict) else None
    if not isinstance(auths, dict):
        return {}
    return {str(k): v for k, v in auths.items() if isinstance(v, dict)}


class Credentials:
    """Merged registry credentials, written to ``out`` for the mount servers."""

    def __init__(self, sources: Sequence[Path], out: Path) -> None:
        self.sources = [Path(s) for s in sources]
        self.out = Path(out)
        self._lock = threading.Lock()
        self._seen: tuple[tuple[str, int, int], ...] | None = None

    def _fingerprint(self, files: list[Path]) -> tuple[tuple[str, int, int], ...]:
        out = []
        for f in files:
            try:
                st = f.stat()
            except OSError:
                continue
            out.append((str(f), st.st_mtime_ns, st.st_size))
        return tuple(out)

    def refresh(self) -> Path:
        """Rewrite the merged file if a source changed; returns its path."""
        with self._lock:
            files = _source_files(self.sources)
            seen = self._fingerprint(files)
            if seen == self._seen and self.out.exists():
                return self.out
            merged: dict[str, dict[str, str]] = {}
            for f in reversed(files):  # earlier sources win
                for key, entry in _auths(f).items():
                    merged[registry_host(key)] = entry
            self._write({"auths": merged})
            self._seen = seen
            log.info("registry credentials: %d host(s) from %d file(s)", len(merged), len(files))
            return self.out

    def _write(self, doc: dict[str, object]) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=self.out.parent, prefix=".auth-")
        try:
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o600)
                json.dump(doc, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.out)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
