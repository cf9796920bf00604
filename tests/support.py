"""Test support: environment checks and real servers (import as ``support``).

Tests that need root, loop devices, FUSE or an external tool call ``require(...)``. On a
laptop that skips with the reason; under ``.ci/run`` (LAZYBLOCK_REQUIRE_ALL=1) it fails, since
CI has all of them.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import select
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from benchmarks.coldstart.netns import stop_process

REQUIRE_ALL = os.environ.get("LAZYBLOCK_REQUIRE_ALL") == "1"


def in_threads(work: Callable[[int], object], count: int, timeout: float = 60.0) -> None:
    """Run ``work(i)`` for each i in ``range(count)``, each on a thread of its own, all at
    once; the first failure is raised here (in a thread it would only be printed)."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as e:  # raised below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), f"threads still running after {timeout}s"
    if errors:
        raise errors[0]


def require(condition: bool, reason: str) -> None:
    """Skip (or, in CI, fail) unless ``condition`` holds."""
    if condition:
        return
    if REQUIRE_ALL:
        pytest.fail(f"CI requires this test to run, but: {reason}", pytrace=False)
    pytest.skip(reason)


def require_root() -> None:
    require(os.geteuid() == 0, "needs root")


def require_tool(*names: str) -> None:
    for name in names:
        require(shutil.which(name) is not None, f"needs {name} on PATH")


def require_fuse() -> None:
    require_root()
    require(os.path.exists("/dev/fuse"), "needs /dev/fuse")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port}")


class Registry:
    """A real Distribution registry (Debian's docker-registry) on loopback."""

    def __init__(self, root: Path, *, extra_config: str = "", log_level: str = "error") -> None:
        """``extra_config``: more top-level sections of the registry's config (e.g. auth)."""
        self.root = root
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        config = root / "config.yml"
        config.write_text(
            f"version: 0.1\nlog:\n  level: {log_level}\n  accesslog:\n    disabled: false\n"
            f"storage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n"
            "  delete:\n    enabled: true\n"
            f"http:\n  addr: 127.0.0.1:{self.port}\n" + extra_config
        )
        self.log = root / "registry.log"
        self._logf = open(self.log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            ["docker-registry", "serve", str(config)], stdout=self._logf, stderr=self._logf
        )
        try:
            wait_port(self.port)
        except BaseException:  # interrupted too: no registry left running
            self.stop()
            raise

    def stop(self) -> None:
        stop_process(self.proc)
        self._logf.close()


class ForwardProxy:
    """A real HTTP forward proxy on loopback (Debian's tinyproxy, in the foreground with its
    own config): absolute-form requests for http URLs, CONNECT tunnels for https ones, with
    ``user:secret`` Basic proxy authentication when given. ``log`` records each request."""

    def __init__(self, root: Path, auth: tuple[str, str] | None = None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.log = root / "tinyproxy.log"
        config = root / "tinyproxy.conf"
        config.write_text(
            f"Port {self.port}\nListen 127.0.0.1\nTimeout 60\nMaxClients 64\n"
            f'Allow 127.0.0.1\nLogFile "{self.log}"\nLogLevel Connect\n'
            "DisableViaHeader Yes\n" + (f"BasicAuth {auth[0]} {auth[1]}\n" if auth else "")
        )
        userinfo = f"{auth[0]}:{auth[1]}@" if auth else ""
        self.url = f"http://{userinfo}127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            ["tinyproxy", "-d", "-c", str(config)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_port(self.port)
        except BaseException:
            self.stop()
            raise

    def requests(self) -> list[str]:
        """The request lines tinyproxy logged (``GET http://...``, ``CONNECT host:port``)."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return [
            line.split("Request (file descriptor", 1)[1].split("): ", 1)[1].strip()
            for line in text.splitlines()
            if "Request (file descriptor" in line and "): " in line
        ]

    def stop(self) -> None:
        stop_process(self.proc)


class MirrorServer:
    """A mirror on loopback that passes GETs on to ``upstream`` (another host:port) and can
    misbehave: ``mode`` is ``pass``, ``corrupt`` (one byte of each body flipped), ``missing``
    (404), ``error`` (502), ``cut`` (the connection closed after ``cut_after`` body bytes),
    ``stall`` (no more bytes after ``cut_after``), ``hang`` (no answer) or ``challenge``
    (401 Basic until the request carries ``Authorization``). Records (path, query,
    headers) of every request. With ``tls`` (a server-side ``ssl.SSLContext``) it speaks
    https, its handshakes done in each connection's thread; ``handshake_failures`` counts
    those that failed (an untrusted certificate, a missing client certificate)."""

    def __init__(self, upstream: str, tls: ssl.SSLContext | None = None) -> None:
        self.upstream = upstream
        self.mode = "pass"
        self.cut_after = 4096
        self.seen: list[tuple[str, dict[str, list[str]], dict[str, str]]] = []
        self.release = threading.Event()
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                parts = urlsplit(self.path)
                mirror.seen.append((parts.path, parse_qs(parts.query), dict(self.headers)))
                mode = mirror.mode
                if mode == "hang":
                    mirror.release.wait(30)
                    return
                if mode in ("missing", "error") or (
                    mode == "challenge" and "Authorization" not in self.headers
                ):
                    status = {"missing": 404, "error": 502, "challenge": 401}[mode]
                    self.send_response(status)
                    if status == 401:
                        self.send_header("WWW-Authenticate", 'Basic realm="mirror"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                conn = http.client.HTTPConnection(mirror.upstream, timeout=10)
                headers = {k: v for k, v in self.headers.items() if k.lower() == "range"}
                conn.request("GET", parts.path, headers=headers)
                resp = conn.getresponse()
                body = bytearray(resp.read())
                conn.close()
                if mode == "corrupt" and body:
                    body[len(body) // 2] ^= 0xFF
                self.send_response(resp.status)
                for name in ("Content-Range", "Content-Type", "Docker-Content-Digest"):
                    if resp.getheader(name):
                        self.send_header(name, resp.getheader(name))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if mode in ("cut", "stall"):
                    self.wfile.write(body[: mirror.cut_after])
                    self.wfile.flush()
                    if mode == "stall":
                        mirror.release.wait(30)
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def handle(self) -> None:
                if tls is not None:
                    try:
                        self.request.do_handshake()
                    except (ssl.SSLError, OSError):
                        mirror.handshake_failures += 1
                        return
                super().handle()

        self.handshake_failures = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        if tls is not None:
            self.server.socket = tls.wrap_socket(
                self.server.socket, server_side=True, do_handshake_on_connect=False
            )
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def blob_reads(self) -> int:
        return sum(1 for path, _, _ in self.seen if "/blobs/" in path)

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class PausableProxy:
    """A TCP proxy on loopback in front of ``127.0.0.1:upstream_port`` that can be made to
    hang, for fault tests of clients (threads; one pair of pumps per connection).

    Modes (``set_mode``):

    * ``"pass"``: bytes flow both ways.
    * ``"blackhole"``: new connections are accepted and held; no byte moves in either
      direction on any connection, so a request is never answered.
    * ``"stall_body"``: requests reach the upstream; each response that starts is passed on
      up to the end of its headers plus ``body_prefix`` body bytes, then nothing more.
    * ``"chaos"``: each piece of a response (one ``recv``, up to 64 KiB), at random (seeded):
      passed on with one byte flipped (headers or body), the connection cut before it, held
      up to 0.2 s first, or passed on as it is. ``injected`` counts what was done.

    Back in ``"pass"`` mode everything held moves on, as after a network stall.
    """

    MODES = ("pass", "blackhole", "stall_body", "chaos")
    # Chances per piece of a response in "chaos" mode.
    CHAOS = {"flip": 0.03, "cut": 0.03, "delay": 0.06}

    def __init__(self, upstream_port: int, body_prefix: int = 16, seed: int = 0) -> None:
        self.upstream_port = upstream_port
        self.body_prefix = body_prefix
        self.mode = "pass"
        self.held = 0  # bytes read from either side and held back
        self.connections = 0
        self.injected = dict.fromkeys(self.CHAOS, 0)
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self._closed = False
        self._sockets: set[socket.socket] = set()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self.host = f"127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def set_mode(self, mode: str) -> None:
        if mode not in self.MODES:
            raise ValueError(f"unknown proxy mode {mode!r}")
        with self._cond:
            self.mode = mode
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            sockets = list(self._sockets)
        for s in [self._listener, *sockets]:
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self) -> PausableProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            with self._cond:
                if self._closed:
                    client.close()
                    upstream.close()
                    return
                self.connections += 1
                self._sockets |= {client, upstream}
            conn = {"open": 2}
            for src, dst, down in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(
                    target=self._pump, args=(src, dst, down, conn), name="proxy-pump", daemon=True
                ).start()

    def _count_held(self, n: int) -> None:
        with self._cond:
            self.held += n

    def _chaos(self, data: bytes, src: socket.socket, dst: socket.socket) -> bytes | None:
        """A piece of a response as "chaos" mode passes it on; None: the connection is cut."""
        with self._cond:
            roll, at, pause = self._rng.random(), self._rng.randrange(len(data)), self._rng.random()
            fault = None
            for name, chance in self.CHAOS.items():
                if roll < chance:
                    fault = name
                    self.injected[name] += 1
                    break
                roll -= chance
        if fault == "cut":
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            return None
        if fault == "delay":
            time.sleep(0.2 * pause)
        if fault == "flip":
            data = data[:at] + bytes([data[at] ^ 0x20]) + data[at + 1 :]
        return data

    def _pump(self, src: socket.socket, dst: socket.socket, down: bool, conn: dict) -> None:
        seen = b""  # stall_body: response bytes since the stall began
        stalled = False  # stall_body: this response got its allowance
        pending = b""  # bytes read and held back
        eof = False
        try:
            while True:
                with self._cond:
                    if self._closed:
                        return
                    mode = self.mode
                if mode == "pass":
                    seen, stalled = b"", False
                flowing = mode == "pass" or (mode == "stall_body" and not (down and stalled))
                if flowing and pending:
                    dst.sendall(pending)
                    pending = b""
                if eof:
                    if not pending:
                        with contextlib.suppress(OSError):
                            dst.shutdown(socket.SHUT_WR)
                        return
                    time.sleep(0.05)
                    continue
                ready, _, _ = select.select([src], [], [], 0.1)
                if not ready:
                    continue
                data = src.recv(65536)
                if not data:
                    eof = True
                    continue
                with self._cond:
                    mode = self.mode
                if mode == "blackhole" or (mode == "stall_body" and down and stalled):
                    pending += data
                    self._count_held(len(data))
                    continue
                if mode == "chaos" and down:
                    data = self._chaos(data, src, dst)
                    if data is None:
                        return
                if mode == "stall_body" and down:
                    seen += data
                    end = seen.find(b"\r\n\r\n")
                    if end >= 0:
                        allowed = max(0, end + 4 + self.body_prefix - (len(seen) - len(data)))
                        dst.sendall(data[:allowed])
                        pending = data[allowed:]
                        self._count_held(len(pending))
                        stalled = True
                        continue
                dst.sendall(data)
        except OSError:
            return
        finally:
            with self._cond:
                conn["open"] -= 1
                last = conn["open"] == 0
            if last:
                for s in (src, dst):
                    with contextlib.suppress(OSError):
                        s.close()
                    with self._cond:
                        self._sockets.discard(s)


class TokenServer:
    """A registry token service (what ``auth: token: realm`` names) on loopback.

    It checks Basic credentials (GET) or an OAuth2 password grant (POST) against ``users``
    (anonymous requests are refused) and issues RS256 JWTs, signed with a key and
    certificate made here, for the scopes asked for. ``expires_in`` is what it tells clients;
    ``lifetime`` (default: the same) is how long the registry accepts the token, so a test
    can also hand out tokens that die early.
    Every request is recorded in ``requests`` (time, account, scopes, whether granted).
    """

    # docker-registry accepts a token this long past its "exp" (clock skew leeway).
    REGISTRY_LEEWAY = 60

    def __init__(
        self,
        root: Path,
        users: dict[str, str],
        expires_in: int = 3,
        lifetime: int | None = None,
        service: str = "lazyblock-test",
        issuer: str = "lazyblock-test-issuer",
    ) -> None:
        import base64
        import datetime
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID

        self.users = dict(users)
        self.expires_in = expires_in
        self.lifetime = expires_in if lifetime is None else lifetime
        self.service, self.issuer = service, issuer
        self.requests: list[dict[str, object]] = []
        self.tokens: list[str] = []
        self._key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lazyblock test token signer")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(hours=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.cert_pem = root / "token-signer.pem"
        self.cert_pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self._x5c = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                from urllib.parse import parse_qs, urlsplit

                query = parse_qs(urlsplit(self.path).query)
                account = server.check(self.headers.get("Authorization", ""))
                refused = b'{"details":"bad credentials"}'
                self._grant(account, query.get("scope", []), "token", refused)

            def do_POST(self) -> None:  # noqa: N802
                """The OAuth2 password grant (what containerd tries first when it has a
                username and password): form fields instead of a Basic header."""
                from urllib.parse import parse_qs

                length = int(self.headers.get("Content-Length") or 0)
                form = parse_qs(self.rfile.read(length).decode())
                user = form.get("username", [""])[0]
                ok = (
                    form.get("grant_type") == ["password"]
                    and user in server.users
                    and server.users[user] == form.get("password", [None])[0]
                )
                scopes = " ".join(form.get("scope", [])).split()
                refused = b'{"error":"invalid_grant"}'
                self._grant(user if ok else None, scopes, "access_token", refused)

            def _grant(
                self, account: str | None, scopes: list[str], field: str, refused: bytes
            ) -> None:
                """Record the request; reply with a token for ``scopes`` in ``field`` if
                ``account`` was authenticated, else 401 with ``refused``."""
                server.requests.append(
                    {"time": time.time(), "account": account, "scopes": scopes, "ok": bool(account)}
                )
                if not account:
                    self._reply(401, refused)
                    return
                token = server.sign(account, scopes)
                server.tokens.append(token)
                doc = {field: token, "expires_in": server.expires_in}
                self._reply(200, json.dumps(doc).encode())

            def _reply(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.realm = f"http://127.0.0.1:{self.port}/token"
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()

    def check(self, header: str) -> str | None:
        """The account of a valid ``Basic`` header, else None."""
        import base64

        if not header.startswith("Basic "):
            return None
        try:
            user, _, password = base64.b64decode(header[6:]).decode().partition(":")
        except ValueError:
            return None
        return user if user in self.users and self.users[user] == password else None

    def sign(self, account: str, scopes: list[str]) -> str:
        import uuid

        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        access = []
        for scope in scopes:
            kind, name, actions = scope.split(":")
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        claims = {
            "iss": self.issuer,
            "sub": account,
            "aud": self.service,
            # The registry adds its leeway to "exp": take it off, so that the token really
            # dies ``lifetime`` seconds from now.
            "exp": now + self.lifetime - self.REGISTRY_LEEWAY,
            "nbf": now - 1,
            "iat": now,
            "jti": uuid.uuid4().hex,
            "access": access,
        }
        header = {"alg": "RS256", "typ": "JWT", "x5c": [self._x5c]}
        signing_input = f"{_b64url(json.dumps(header))}.{_b64url(json.dumps(claims))}"
        signature = self._key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing_input}.{_b64url(signature)}"

    def granted(self, scope: str) -> list[float]:
        """When tokens for ``scope`` were issued."""
        return [r["time"] for r in self.requests if r["ok"] and scope in r["scopes"]]  # type: ignore[misc]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _b64url(data: str | bytes) -> str:
    import base64

    raw = data.encode() if isinstance(data, str) else data
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


class AuthRegistry(Registry):
    """A real Distribution registry that requires auth: ``token`` (with a ``TokenServer``)
    or ``htpasswd`` (Basic, bcrypt hashes of ``users``)."""

    def __init__(
        self, root: Path, users: dict[str, str], tokens: TokenServer | None = None
    ) -> None:
        self.tokens = tokens
        if tokens is not None:
            auth = (
                "auth:\n  token:\n"
                f"    realm: {tokens.realm}\n    service: {tokens.service}\n"
                f"    issuer: {tokens.issuer}\n    rootcertbundle: {tokens.cert_pem}\n"
            )
        else:
            import warnings

            with warnings.catch_warnings():  # deprecated, but libcrypt has the bcrypt
                warnings.simplefilter("ignore", DeprecationWarning)  # docker-registry wants
                import crypt

            # The registry hashes the password on every request: the cheapest bcrypt cost.
            htpasswd = root / "htpasswd"
            htpasswd.write_text(
                "".join(
                    f"{u}:{crypt.crypt(p, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))}\n"
                    for u, p in users.items()
                )
            )
            auth = f"auth:\n  htpasswd:\n    realm: lazyblock-test\n    path: {htpasswd}\n"
        super().__init__(root, extra_config=auth, log_level="info")


@contextlib.contextmanager
def token_auth_registry(
    root: Path, users: dict[str, str], expires_in: int, lifetime: int | None = None
) -> Iterator[AuthRegistry]:
    """A registry with token auth and its token service (``registry.tokens``), both on
    loopback under ``root``, stopped on exit."""
    require_tool("docker-registry")
    tokens = TokenServer(root, users, expires_in=expires_in, lifetime=lifetime)
    (root / "registry").mkdir()
    registry = AuthRegistry(root / "registry", users, tokens)
    try:
        yield registry
    finally:
        registry.stop()
        tokens.stop()
