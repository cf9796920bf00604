"""The cluster cache tier, run for real: Debian's nginx with ``deploy/nginx``'s configuration.

``NginxTier`` renders ``deploy/nginx/lazyblock-registry-cache.conf`` for one origin registry
(replacing only what its header says to replace: the registry, the listen address, the cache
directory), wraps it in a main configuration of its own (prefix, pid, logs and temporary
directories under its work directory, so nothing of the system's nginx is used), and runs
nginx in the foreground in a session of its own, so that ``kill`` takes its master and
workers down at once, as a crashed cache host would. Its access log records, per request, the
cache status and the bytes sent; ``cached_slices`` lists the slice files on disk.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEPLOY_CONF = REPO / "deploy" / "nginx" / "lazyblock-registry-cache.conf"
DEPLOY_HOSTS = REPO / "deploy" / "nginx" / "hosts.toml"
# What the deploy file says to replace, as it is written there.
DEPLOY_ORIGIN = "registry.example.com"
DEPLOY_LISTEN = "listen 5000;"
DEPLOY_CACHE = "/var/cache/nginx/lazyblock"


class TierError(RuntimeError):
    """The tier did not start or its configuration no longer has what is replaced."""


def render(text: str, origin: str, listen: str, cache_dir: Path, plain_http: bool) -> str:
    """The deploy file for ``origin`` (``host:port``), listening on ``listen``
    (``addr:port``), caching under ``cache_dir``; ``plain_http``: an origin without TLS."""
    for needed in (f"server {DEPLOY_ORIGIN}:443;", DEPLOY_LISTEN, DEPLOY_CACHE):
        if needed not in text:
            raise TierError(f"{DEPLOY_CONF} no longer has {needed!r}")
    hostname = origin.rsplit(":", 1)[0]
    text = text.replace(f"server {DEPLOY_ORIGIN}:443;", f"server {origin};")
    text = text.replace(f"Host {DEPLOY_ORIGIN};", f"Host {origin};")
    text = text.replace(f"proxy_ssl_name {DEPLOY_ORIGIN};", f"proxy_ssl_name {hostname};")
    text = text.replace(DEPLOY_LISTEN, f"listen {listen};")
    text = text.replace(DEPLOY_CACHE, str(cache_dir))
    if plain_http:
        text = text.replace("https://lazyblock_origin", "http://lazyblock_origin")
    return text


def render_hosts(text: str, origin: str, tier: str, plain_http: bool) -> str:
    """``deploy/nginx/hosts.toml`` for ``origin`` with the tier at ``tier`` (``host:port``)."""
    scheme = "http" if plain_http else "https"
    text = text.replace(f"https://{DEPLOY_ORIGIN}", f"{scheme}://{origin}")
    return text.replace("http://registry-cache.internal:5000", f"http://{tier}")


@dataclass(frozen=True)
class AccessEntry:
    path: str
    status: int
    body_bytes: int
    cache: str  # $upstream_cache_status: HIT, MISS, ... or "-"
    range: str


_LINE = re.compile(r'^"(?P<method>\S+) (?P<path>\S+) [^"]*" (?P<status>\d+) (?P<bytes>\d+) '
                   r'(?P<cache>\S+) "(?P<range>[^"]*)"$')  # fmt: skip


class NginxTier:
    """nginx with the deploy configuration, in ``workdir``."""

    def __init__(self, workdir: Path, origin: str, *, plain_http: bool = True) -> None:
        self.workdir = Path(workdir)
        self.origin = origin
        self.plain_http = plain_http
        self.cache_dir = self.workdir / "cache"
        self.port = _free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.access_log = self.workdir / "access.log"
        self.error_log = self.workdir / "error.log"
        self.proc: subprocess.Popen | None = None

    def write_config(self) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        site = self.workdir / "lazyblock-registry-cache.conf"
        site.write_text(
            render(DEPLOY_CONF.read_text(), self.origin, self.host, self.cache_dir, self.plain_http)
        )
        temp = {name: self.workdir / name for name in ("body", "proxy", "fastcgi", "uwsgi", "scgi")}
        main = self.workdir / "nginx.conf"
        main.write_text(
            "user root;\nworker_processes 2;\ndaemon off;\n"
            f"pid {self.workdir / 'nginx.pid'};\nerror_log {self.error_log} info;\n"
            "events { worker_connections 1024; }\nhttp {\n"
            '  log_format lazyblock \'"$request" $status $body_bytes_sent '
            '$upstream_cache_status "$http_range"\';\n'
            f"  access_log {self.access_log} lazyblock;\n"
            f"  client_body_temp_path {temp['body']};\n  proxy_temp_path {temp['proxy']};\n"
            f"  fastcgi_temp_path {temp['fastcgi']};\n  uwsgi_temp_path {temp['uwsgi']};\n"
            f"  scgi_temp_path {temp['scgi']};\n"
            f"  include {site};\n}}\n"
        )
        return main

    def start(self, timeout: float = 15.0) -> None:
        main = self.write_config()
        test = subprocess.run(
            ["nginx", "-t", "-q", "-p", str(self.workdir), "-e", str(self.error_log),
             "-c", str(main)], capture_output=True, text=True,
        )  # fmt: skip
        if test.returncode != 0:
            raise TierError(f"nginx -t: {test.stderr.strip()}")
        self.proc = subprocess.Popen(
            ["nginx", "-p", str(self.workdir), "-e", str(self.error_log), "-c", str(main)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TierError(f"nginx exited: {self.error_log.read_text()[-2000:]}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        self.kill()
        raise TierError(f"nginx not listening on {self.host}")

    def kill(self) -> None:
        """SIGKILL to the master and its workers at once: the cache host dies."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()
        try:  # workers outliving a master that was stopped
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def entries(self) -> list[AccessEntry]:
        if not self.access_log.exists():
            return []
        out = []
        for line in self.access_log.read_text(errors="replace").splitlines():
            if m := _LINE.match(line):
                out.append(
                    AccessEntry(
                        m["path"], int(m["status"]), int(m["bytes"]), m["cache"], m["range"]
                    )
                )
        return out

    def cached_slices(self) -> list[Path]:
        """Files in the blob cache (one per slice)."""
        return sorted(p for p in self.cache_dir.rglob("*") if p.is_file())

    def __enter__(self) -> NginxTier:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
