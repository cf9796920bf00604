"""Registry authentication: docker credentials, ``WWW-Authenticate`` challenges, tokens.

Requests go out anonymously until the registry answers 401 with a challenge (``Auth``
remembers which). ``Basic`` is answered with the repository's credentials: those given at
run time (``StoreOptions.credentials``, e.g. from a kubelet's pull) or else docker's
``config.json`` (``load_docker_credentials``). ``Bearer`` sends the client to the token
service named in the challenge, asking for ``repository:REPO:pull`` (``pull,push`` for
writes) with those credentials if there are any. Tokens are cached per scope, sent up front
on later requests and renewed before they expire; the client fetches one again once if the
registry still answers 401. Credentials and tokens are never logged and never sent to a host
over plain HTTP unless ``plain_http`` was asked for.

``decode_auth`` is the one reader of the base64 ``user:password`` that docker configs and
CRI's ``AuthConfig.auth`` carry; registry hosts are matched by
``imagetool.stores.refs.registry_host``.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlsplit

import httpx

from imagetool.errors import AuthError, StoreError, StoreTimeoutError
from imagetool.stores.base import StoreOptions
from imagetool.stores.refs import registry_host

log = logging.getLogger(__name__)

# Renew a token this many seconds before the token service says it expires.
TOKEN_MARGIN = 10.0
# The distribution spec's default token lifetime when the service does not give one.
DEFAULT_TOKEN_LIFETIME = 60.0
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
_CHALLENGE_PARAM = re.compile(r'([A-Za-z_][A-Za-z0-9_-]*)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^,\s]+))')

# (attempt, what, why) -> the next attempt, after sleeping: the client's backoff.
Backoff = Callable[[int, str, str], int]


def decode_auth(value: str) -> tuple[str, str]:
    """(username, password) from base64 ``user:password``; ``ValueError`` if it is not."""
    try:
        user, sep, password = base64.b64decode(value, validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        raise ValueError("not base64 of user:password") from None
    if not sep:
        raise ValueError("not base64 of user:password")
    return user, password


def basic_header(creds: tuple[str, str]) -> str:
    return "Basic " + base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()


def default_docker_config(options: StoreOptions) -> Path:
    """Where docker credentials are read from: ``options.docker_config`` (a file or a
    directory), else ``$DOCKER_CONFIG/config.json``, else ``~/.docker/config.json``."""
    if options.docker_config is not None:
        path = Path(options.docker_config)
        return path / "config.json" if path.is_dir() else path
    env = os.environ.get("DOCKER_CONFIG")
    if env:
        return Path(env) / "config.json"
    return Path.home() / ".docker" / "config.json"


def load_docker_credentials(path: Path, host: str) -> tuple[str, str] | None:
    """(username, password) for ``host`` from a docker ``config.json``'s ``auths``, or None.

    Credential helpers (``credsStore``/``credHelpers``) are not consulted."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AuthError(f"cannot read docker config {path}: {type(e).__name__}") from None
    auths = doc.get("auths") if isinstance(doc, dict) else None
    if not isinstance(auths, dict):
        return None
    wanted = registry_host(host)
    for key, entry in auths.items():
        if not isinstance(entry, dict) or registry_host(key) != wanted:
            continue
        if entry.get("auth"):
            try:
                return decode_auth(str(entry["auth"]))
            except ValueError:
                raise AuthError(f"docker config {path}: malformed 'auth' for {key}") from None
        if entry.get("username") and entry.get("password") is not None:
            return str(entry["username"]), str(entry["password"])
    if isinstance(doc, dict) and (doc.get("credsStore") or doc.get("credHelpers")):
        log.debug("docker config %s names credential helpers, which are not supported", path)
    return None


@dataclass
class _Token:
    value: str
    expires: float  # time.monotonic() after which it must be renewed


@dataclass
class Challenge:
    scheme: str  # "basic" or "bearer"
    params: dict[str, str]


def parse_challenge(header: str) -> Challenge | None:
    """Parse a ``WWW-Authenticate`` header (the first challenge in it)."""
    scheme, _, rest = header.strip().partition(" ")
    if not scheme:
        return None
    params = {m[1].lower(): (m[2] if m[2] else m[3] or "") for m in _CHALLENGE_PARAM.finditer(rest)}
    params = {k: re.sub(r"\\(.)", r"\1", v) for k, v in params.items()}
    return Challenge(scheme.lower(), params)


class Auth:
    """The authentication state of one client: one repository on one registry."""

    def __init__(
        self,
        host: str,
        repository: str,
        options: StoreOptions,
        http: httpx.Client,
        backoff: Backoff,
        base: str,
    ) -> None:
        self.host = host
        self.repository = repository
        self.options = options
        self.where = f"{host}/{repository}"
        self.base = base  # the repository's API URL: credentials go there only over HTTPS
        self._http = http
        self._backoff = backoff
        self._credentials: tuple[str, str] | None = None
        self._credentials_loaded = False
        self._scheme: str | None = None  # auth scheme the registry asked for
        self._bearer: dict[str, str] = {}  # realm/service of the bearer challenge
        self._tokens: dict[str, _Token] = {}  # scope -> token
        self._token_lock = threading.Lock()  # one token fetch at a time per client

    def scope(self, push: bool) -> str:
        return f"repository:{self.repository}:{'pull,push' if push else 'pull'}"

    def credentials(self) -> tuple[str, str] | None:
        if not self._credentials_loaded and self.options.credentials is not None:
            user, secret = self.options.credentials
            self._credentials = (str(user), str(secret))
            self._credentials_loaded = True
        if not self._credentials_loaded:
            path = default_docker_config(self.options)
            self._credentials = load_docker_credentials(path, self.host)
            self._credentials_loaded = True
            log.debug(
                "%s: %s credentials in %s", self.host,
                "found" if self._credentials else "no", path,
            )  # fmt: skip
        return self._credentials

    def _credentials_source(self) -> str:
        if self.options.credentials is not None:
            return "the credentials given at run time"
        return str(default_docker_config(self.options))

    def header(self, push: bool) -> str | None:
        """The ``Authorization`` header a request should carry now, if any."""
        if self._scheme == "basic":
            creds = self.credentials()
            return basic_header(creds) if creds else None
        if self._scheme == "bearer":
            scope = self.scope(push)
            with self._token_lock:
                token = self._tokens.get(scope)
                if token is None or time.monotonic() >= token.expires:
                    token = self._fetch_token(scope)
            return f"Bearer {token.value}"
        return None

    def answer(self, header: str, push: bool, had_auth: bool) -> None:
        """Take in a 401's ``WWW-Authenticate`` ``header``; the request is then sent again."""
        challenge = parse_challenge(header) if header else None
        if challenge is None or challenge.scheme not in ("basic", "bearer"):
            raise AuthError(
                f"{self.where}: registry answered 401 without a usable challenge "
                f"({header.split(' ', 1)[0] if header else 'none'})"
            )
        if challenge.scheme == "basic":
            if self.credentials() is None:
                raise AuthError(
                    f"{self.where}: registry requires credentials; none for {self.host} in "
                    f"{default_docker_config(self.options)}"
                )
            if had_auth and self._scheme == "basic":
                raise AuthError(f"{self.where}: registry refused our credentials")
            self._require_secure(self.base)
            self._scheme = "basic"
            return
        realm = challenge.params.get("realm")
        if not realm:
            raise AuthError(f"{self.where}: bearer challenge without a realm")
        self._scheme = "bearer"
        self._bearer = {"realm": realm, "service": challenge.params.get("service", "")}
        # A 401 despite a token: it expired or lacks the scope; fetch a fresh one once.
        with self._token_lock:
            self._tokens.pop(self.scope(push), None)

    def refused(self, what: str, push: bool) -> NoReturn:
        """The registry answered 401 to a request that carried our credentials or a fresh
        token: a one-line ``AuthError`` naming what was refused (never the secret)."""
        if self._scheme == "basic":
            raise AuthError(
                f"{self.where}: {what}: the registry refused our credentials for {self.host} "
                f"(from {self._credentials_source()})"
            )
        raise AuthError(
            f"{self.where}: {what}: the registry refused our token for {self.scope(push)}"
        )

    def _require_secure(self, url: str) -> None:
        if urlsplit(url).scheme != "https" and not self.options.plain_http:
            raise AuthError(f"{self.where}: refusing to send credentials over plain HTTP to {url}")

    def _fetch_token(self, scope: str) -> _Token:
        realm = self._bearer["realm"]
        realm_host = urlsplit(realm).netloc or realm
        params = {"scope": scope}
        if self._bearer.get("service"):
            params["service"] = self._bearer["service"]
        headers: dict[str, str] = {}
        creds = self.credentials()
        if creds:
            self._require_secure(realm)
            headers["Authorization"] = basic_header(creds)
            params["account"] = creds[0]
        what = f"token for {scope} from {realm_host}"
        attempt = 0
        while True:
            try:
                resp = self._http.get(realm, params=params, headers=headers, follow_redirects=True)
            except httpx.TimeoutException:
                raise StoreTimeoutError(
                    f"{self.where}: {what}: no answer within {self.options.timeout:g}s"
                ) from None
            except httpx.TransportError as e:
                if attempt < self.options.retries:
                    attempt = self._backoff(attempt, what, one_line(e))
                    continue
                raise StoreError(
                    f"{self.where}: {what}: {type(e).__name__}: {one_line(e)}"
                ) from None
            if resp.status_code in RETRY_STATUS and attempt < self.options.retries:
                attempt = self._backoff(attempt, what, f"HTTP {resp.status_code}")
                continue
            break
        if resp.status_code in (401, 403):
            raise AuthError(
                f"{self.where}: token service {realm_host} refused "
                f"{'our credentials' if creds else 'anonymous access'} for {scope}"
            )
        if resp.status_code != 200:
            raise StoreError(f"{self.where}: {what}: HTTP {resp.status_code}")
        try:
            doc = resp.json()
            value = doc.get("token") or doc.get("access_token")
            lifetime = float(doc.get("expires_in") or DEFAULT_TOKEN_LIFETIME)
        except (ValueError, AttributeError, TypeError):
            raise StoreError(f"{self.where}: {what}: malformed token response") from None
        if not value or not isinstance(value, str):
            raise StoreError(f"{self.where}: {what}: token response has no token")
        token = _Token(value, time.monotonic() + lifetime - min(TOKEN_MARGIN, lifetime / 2))
        self._tokens[scope] = token
        log.debug("%s: got a token for %s (valid %.0fs)", self.where, scope, lifetime)
        return token


def one_line(e: object) -> str:
    return " ".join(str(e).split())
