"""Registry auth: docker config credentials, Basic, and the Bearer token flow — against a
loopback fake that issues 401 challenges, and against a real registry configured for token
auth with the tests' token service (``support.TokenServer``: JWTs signed with a throwaway
certificate)."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from support import TokenServer, token_auth_registry

from imagetool.errors import AuthError
from imagetool.format import BLOB_MEDIA_TYPE
from imagetool.registry.auth import load_docker_credentials
from imagetool.registry.client import RegistryClient
from imagetool.registry.ranged import DirectBody
from imagetool.stores import StoreOptions
from imagetool.stores.registry import OCI_MANIFEST, RegistryStore

USER, PASSWORD = "alice", "s3cret-pw"
MANIFEST = b'{"schemaVersion":2}'


def write_docker_config(path: Path, host: str, style: str = "auth") -> Path:
    if style == "auth":
        entry = {"auth": base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}
    else:
        entry = {"username": USER, "password": PASSWORD}
    path.write_text(json.dumps({"auths": {f"http://{host}": entry}}))
    return path


def test_load_docker_credentials(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    write_docker_config(cfg, "reg.example:5000")
    assert load_docker_credentials(cfg, "reg.example:5000") == (USER, PASSWORD)
    assert load_docker_credentials(cfg, "other.example") is None
    write_docker_config(cfg, "reg.example:5000", style="fields")
    assert load_docker_credentials(cfg, "reg.example:5000") == (USER, PASSWORD)
    cfg.write_text(json.dumps({"auths": {"https://index.docker.io/v1/": {"auth": "dTpw"}}}))
    assert load_docker_credentials(cfg, "registry-1.docker.io") == ("u", "p")
    assert load_docker_credentials(tmp_path / "missing.json", "x") is None
    cfg.write_text("{broken")
    with pytest.raises(AuthError) as e:
        load_docker_credentials(cfg, "x")
    assert "\n" not in str(e.value)


# --- a loopback fake registry with its own token endpoint ---------------------------------


class _AuthHandler(BaseHTTPRequestHandler):
    mode = "bearer"  # or "basic"
    allow_anonymous = False
    token_requests: list[dict[str, object]]
    tokens: dict[str, str]  # token -> actions ("pull" or "pull,push")
    host: str

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _basic_ok(self) -> bool:
        expected = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        return self.headers.get("Authorization") == expected

    def _challenge(self, push: bool) -> None:
        cls = type(self)
        if cls.mode == "basic":
            header = 'Basic realm="fake"'
        else:
            actions = "pull,push" if push else "pull"
            header = (
                f'Bearer realm="http://{cls.host}/token",service="fake",'
                f'scope="repository:lb/test:{actions}"'
            )
        self._reply(401, b'{"errors":[{"code":"UNAUTHORIZED"}]}', {"WWW-Authenticate": header})

    def _authorized(self, push: bool) -> bool:
        cls = type(self)
        if cls.mode == "basic":
            return self._basic_ok()
        auth = self.headers.get("Authorization", "")
        actions = cls.tokens.get(auth.removeprefix("Bearer "))
        return (
            auth.startswith("Bearer ") and actions is not None and (not push or "push" in actions)
        )

    def do_GET(self) -> None:  # noqa: N802
        cls = type(self)
        url = urlsplit(self.path)
        if url.path == "/token":
            query = parse_qs(url.query)
            has_auth = "Authorization" in self.headers
            cls.token_requests.append({"scope": query.get("scope", [""])[0], "auth": has_auth})
            if (has_auth and not self._basic_ok()) or (not has_auth and not cls.allow_anonymous):
                self._reply(401)
                return
            token = uuid.uuid4().hex
            cls.tokens[token] = query["scope"][0].rsplit(":", 1)[1]
            self._reply(200, json.dumps({"token": token, "expires_in": 300}).encode())
            return
        if not self._authorized(push=False):
            self._challenge(push=False)
            return
        self._reply(200, MANIFEST, {"Content-Type": OCI_MANIFEST})

    def do_PUT(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if not self._authorized(push=True):
            self._challenge(push=True)
            return
        self._reply(201)


@pytest.fixture
def auth_server(http_server: Callable) -> Iterator[type[_AuthHandler]]:
    handler = type("AuthHandler", (_AuthHandler,), {"token_requests": [], "tokens": {}})
    handler.host = http_server(handler)
    yield handler


def _client(host: str, config: Path) -> RegistryClient:
    options = StoreOptions(plain_http=True, timeout=5.0, retries=0, docker_config=config)
    return RegistryClient(host, "lb/test", options)


def test_bearer_flow_with_credentials(auth_server, tmp_path: Path) -> None:
    config = write_docker_config(tmp_path / "config.json", auth_server.host)
    with _client(auth_server.host, config) as client:
        assert client.get_manifest("v1", [OCI_MANIFEST])[0] == MANIFEST
        assert client.get_manifest("v1", [OCI_MANIFEST])[0] == MANIFEST  # cached token
        assert auth_server.token_requests == [{"scope": "repository:lb/test:pull", "auth": True}]
        client.put_manifest("v2", MANIFEST, OCI_MANIFEST)
        assert auth_server.token_requests[-1]["scope"] == "repository:lb/test:pull,push"
        # The registry forgets its tokens: the next 401 makes the client fetch a new one.
        auth_server.tokens.clear()
        assert client.get_manifest("v1", [OCI_MANIFEST])[0] == MANIFEST
        assert len(auth_server.token_requests) == 3
        # An expired token is renewed before it is sent.
        for token in client.auth._tokens.values():
            token.expires = 0.0
        assert client.get_manifest("v1", [OCI_MANIFEST])[0] == MANIFEST
        assert len(auth_server.token_requests) == 4


def test_bearer_flow_anonymous(auth_server, tmp_path: Path) -> None:
    auth_server.allow_anonymous = True
    with _client(auth_server.host, tmp_path / "none.json") as client:
        assert client.get_manifest("v1", [OCI_MANIFEST])[0] == MANIFEST
    assert auth_server.token_requests == [{"scope": "repository:lb/test:pull", "auth": False}]


def test_bearer_flow_refused(auth_server, tmp_path: Path) -> None:
    with _client(auth_server.host, tmp_path / "none.json") as client:
        with pytest.raises(AuthError, match="anonymous"):
            client.get_manifest("v1", [OCI_MANIFEST])
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps({"auths": {auth_server.host: {"username": USER, "password": "x"}}})
    )
    with _client(auth_server.host, config) as client:
        with pytest.raises(AuthError) as e:
            client.get_manifest("v1", [OCI_MANIFEST])
    assert "refused" in str(e.value) and PASSWORD not in str(e.value)


def test_basic_flow(auth_server, tmp_path: Path, monkeypatch) -> None:
    auth_server.mode = "basic"
    with _client(auth_server.host, tmp_path / "none.json") as client:
        with pytest.raises(AuthError, match="requires credentials"):
            client.get_manifest("v1", [OCI_MANIFEST])
    # No docker_config option: $DOCKER_CONFIG/config.json is used.
    write_docker_config(tmp_path / "config.json", auth_server.host, style="fields")
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    options = StoreOptions(plain_http=True, timeout=5.0, retries=0)
    with RegistryClient(auth_server.host, "lb/test", options) as client:
        assert client.get_manifest("v1", [OCI_MANIFEST])[0] == MANIFEST
        client.put_manifest("v2", MANIFEST, OCI_MANIFEST)


# --- a real registry with token auth --------------------------------------------------------


@pytest.fixture
def token_registry(tmp_path: Path) -> Iterator[tuple[str, TokenServer]]:
    with token_auth_registry(tmp_path, {USER: PASSWORD}, expires_in=300) as registry:
        assert registry.tokens is not None
        yield registry.host, registry.tokens


@pytest.mark.integration
def test_real_registry_token_auth(token_registry, tmp_path: Path, tiny_image) -> None:
    host, tokens = token_registry
    image = tiny_image(7)
    anonymous = StoreOptions(plain_http=True, timeout=10, docker_config=tmp_path / "none.json")
    with RegistryStore(host, "lb/secure", anonymous) as store, pytest.raises(AuthError):
        store.list_tags()
    config = write_docker_config(tmp_path / "config.json", host)
    options = StoreOptions(plain_http=True, timeout=10, docker_config=config)
    with RegistryStore(host, "lb/secure", options) as store:
        store.put_blob(image.blob_digest, image.blob, BLOB_MEDIA_TYPE)
        assert store.publish("v1", image.index_bytes) == image.index_digest
        assert store.resolve("v1") == image.index_digest
        assert store.read_range(image.blob_digest, 1, 10) == image.blob[1:11]
        # Ranged reads go through http.client with the token the challenge got (an answer
        # other than the range would have been asked again through httpx).
        with store.open_range(image.blob_digest, 2, 10) as body:
            assert isinstance(body, DirectBody)
            got = bytearray(10)
            body.readinto(memoryview(got))
            assert got == image.blob[2:12]
        assert store.list_tags() == ["v1"]
    assert tokens.granted("repository:lb/secure:pull,push")
    assert tokens.granted("repository:lb/secure:pull")
