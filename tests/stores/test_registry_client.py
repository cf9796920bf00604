"""RegistryClient and RegistryStore specifics: the manifest layout, chunked uploads, streaming,
and misbehaving registries (hangs, ignored ranges, 5xx) on loopback."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from imagetool.errors import (
    DigestMismatchError,
    FormatError,
    NotFoundError,
    StoreError,
    StoreTimeoutError,
)
from imagetool.format import (
    ANNOTATION_BLOB_DIGEST,
    ANNOTATION_INDEX_DIGEST,
    ANNOTATION_ROLE,
    ANNOTATION_SNAPSHOT_ROLE,
    BLOB_MEDIA_TYPE,
    INDEX_MEDIA_TYPE,
    sha256_digest,
)
from imagetool.registry.auth import parse_challenge
from imagetool.registry.client import RegistryClient
from imagetool.stores import open_store, parse_ref
from imagetool.stores.registry import OCI_CONFIG, OCI_MANIFEST, RegistryStore

# --- against the real registry ------------------------------------------------------------


@pytest.fixture
def reg_store(registry, make_options) -> Iterator[RegistryStore]:
    import uuid

    store = open_store(
        f"docker://{registry.host}/lb/r{uuid.uuid4().hex[:10]}:v1",
        make_options(plain_http=True),
    )
    assert isinstance(store, RegistryStore)
    with store:
        yield store


def test_published_manifest_layout(reg_store: RegistryStore, image) -> None:
    reg_store.put_blob(image.blob_digest, image.blob, BLOB_MEDIA_TYPE)
    reg_store.publish("v1", image.index_bytes)
    body, media_type, manifest_digest = reg_store.client.get_manifest("v1", [OCI_MANIFEST])
    assert media_type == OCI_MANIFEST
    assert manifest_digest == sha256_digest(body)
    manifest = json.loads(body)
    blob_layer, index_layer = manifest["layers"]
    assert blob_layer["mediaType"] == BLOB_MEDIA_TYPE
    assert blob_layer["digest"] == image.blob_digest
    assert blob_layer["size"] == len(image.blob)
    assert blob_layer["annotations"] == {ANNOTATION_ROLE: "blob", ANNOTATION_SNAPSHOT_ROLE: "blob"}
    assert index_layer["mediaType"] == INDEX_MEDIA_TYPE
    assert index_layer["digest"] == image.index_digest
    assert index_layer["annotations"][ANNOTATION_ROLE] == "index"
    assert index_layer["annotations"][ANNOTATION_SNAPSHOT_ROLE] == "index"
    assert index_layer["annotations"][ANNOTATION_INDEX_DIGEST] == image.index_digest
    assert index_layer["annotations"][ANNOTATION_BLOB_DIGEST] == image.blob_digest
    assert manifest["annotations"][ANNOTATION_INDEX_DIGEST] == image.index_digest
    assert manifest["config"]["mediaType"] == OCI_CONFIG
    config = json.loads(reg_store.read_blob(manifest["config"]["digest"]))
    assert config["architecture"] == "amd64" and config["os"] == "linux"
    assert config["config"] == image.index.config
    assert config["rootfs"] == {
        "type": "layers",
        "diff_ids": [image.blob_digest, image.index_digest],
    }
    # @sha256: in a docker:// reference is the manifest digest.
    ref = parse_ref(f"{reg_store.url}@{manifest_digest}")
    assert reg_store.resolve_ref(ref) == image.index_digest
    assert reg_store.resolve_ref(parse_ref(f"{reg_store.url}:v1")) == image.index_digest
    with pytest.raises(NotFoundError):
        reg_store.resolve_ref(parse_ref(f"{reg_store.url}@sha256:{'1' * 64}"))


def test_resolve_ordinary_image(reg_store: RegistryStore) -> None:
    client = reg_store.client
    config = b'{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}'
    layer = b"not really a tar"
    client.upload_blob(sha256_digest(config), config)
    client.upload_blob(sha256_digest(layer), layer)
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": sha256_digest(config), "size": len(config)},
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": sha256_digest(layer),
                "size": len(layer),
            }
        ],
    }
    client.put_manifest("plain", json.dumps(manifest).encode(), OCI_MANIFEST)
    assert reg_store.list_tags() == ["plain"]
    with pytest.raises(FormatError, match="ordinary container image"):
        reg_store.resolve("plain")


def test_chunked_upload_and_streaming(reg_store: RegistryStore, tmp_path: Path) -> None:
    client = reg_store.client
    client.monolithic_limit = 1000
    client.upload_chunk = 4096
    data = bytes(range(256)) * 70  # 17920 bytes: five chunks, the last one short
    path = tmp_path / "big"
    path.write_bytes(data)
    digest = sha256_digest(data)
    client.upload_blob(digest, path)
    assert client.blob_size(digest) == len(data)
    assert client.read_range(digest, 4000, 200) == data[4000:4200]
    with client.open_blob(digest) as f:
        parts = []
        while chunk := f.read(1000):
            parts.append(chunk)
    assert b"".join(parts) == data
    # A chunked upload whose content does not match its digest is refused, and not visible.
    wrong = sha256_digest(b"other")
    with pytest.raises(DigestMismatchError):
        client.upload_blob(wrong, path)
    assert not client.has_blob(wrong)


def test_get_manifest_verifies_digest_reference(reg_store: RegistryStore, image) -> None:
    reg_store.put_blob(image.blob_digest, image.blob, BLOB_MEDIA_TYPE)
    reg_store.publish("v1", image.index_bytes)
    _, _, digest = reg_store.client.get_manifest("v1", [OCI_MANIFEST])
    body, _, again = reg_store.client.get_manifest(digest, [OCI_MANIFEST])
    assert again == digest == sha256_digest(body)


# --- misbehaving servers ------------------------------------------------------------------

BLOB = b"0123456789" * 100
BLOB_DIGEST = sha256_digest(BLOB)


def _client(host: str, tmp_path: Path, **kw: object) -> RegistryClient:
    from imagetool.stores import StoreOptions

    options = {"plain_http": True, "timeout": 5.0, "retries": 2}
    options.update(kw)
    return RegistryClient(
        host, "lb/test", StoreOptions(docker_config=tmp_path / "none.json", **options)
    )  # type: ignore[arg-type]


def test_hanging_registry_times_out(tmp_path: Path) -> None:
    """A server that accepts connections and never answers: StoreTimeoutError, no hang."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    host = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        with _client(host, tmp_path, timeout=0.5) as client:
            with pytest.raises(StoreTimeoutError):
                client.get_manifest("v1", [OCI_MANIFEST])
            with pytest.raises(StoreTimeoutError):
                client.read_range(BLOB_DIGEST, 0, 10)
            with pytest.raises(StoreTimeoutError):
                client.upload_blob(BLOB_DIGEST, BLOB)
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        listener.close()


class _BlobServer(BaseHTTPRequestHandler):
    """Serves BLOB; behaviour switches are class attributes set per test."""

    ignore_range = False
    failures_left = 0
    requests = 0

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        cls = type(self)
        cls.requests += 1
        if cls.failures_left > 0:
            cls.failures_left -= 1
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if not self.path.endswith(f"/blobs/{BLOB_DIGEST}"):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data, status = BLOB, 200
        rng = self.headers.get("Range")
        if rng and not cls.ignore_range:
            start, end = (int(x) for x in rng.removeprefix("bytes=").split("-"))
            data, status = BLOB[start : end + 1], 206
        self.send_response(status)
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(BLOB)}")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)


@pytest.fixture
def blob_server(http_server: Callable) -> Iterator[type[_BlobServer]]:
    handler = type("BlobServer", (_BlobServer,), {})
    handler.host = http_server(handler)  # type: ignore[attr-defined]
    yield handler


def test_range_ignored_is_an_error(blob_server, tmp_path: Path) -> None:
    blob_server.ignore_range = True
    with _client(blob_server.host, tmp_path) as client:
        with pytest.raises(StoreError, match="ignored the Range header"):
            client.read_range(BLOB_DIGEST, 10, 20)
        # A successful answer that is not the range: no more direct (http.client) attempts,
        # each of which would be a wasted request.
        assert client._ranges.disabled and blob_server.requests == 2
        with pytest.raises(StoreError, match="ignored the Range header"):
            client.read_range(BLOB_DIGEST, 10, 20)
        assert blob_server.requests == 3


def test_ranged_read_and_missing(blob_server, tmp_path: Path) -> None:
    with _client(blob_server.host, tmp_path) as client:
        assert client.read_range(BLOB_DIGEST, 10, 20) == BLOB[10:30]
        assert client.blob_size(BLOB_DIGEST) == len(BLOB)
        with pytest.raises(NotFoundError, match="lb/test"):
            client.blob_size("sha256:" + "a" * 64)


def test_retries_on_5xx(blob_server, tmp_path: Path) -> None:
    blob_server.failures_left = 2
    with _client(blob_server.host, tmp_path, retries=2) as client:
        assert client.read_range(BLOB_DIGEST, 0, 5) == BLOB[:5]
    assert blob_server.requests == 3
    blob_server.failures_left = 5
    with _client(blob_server.host, tmp_path, retries=1) as client:
        with pytest.raises(StoreError, match="HTTP 503"):
            client.read_range(BLOB_DIGEST, 0, 5)


def test_open_blob_detects_corruption(blob_server, tmp_path: Path) -> None:
    with _client(blob_server.host, tmp_path) as client:
        with client.open_blob(BLOB_DIGEST) as f:
            assert f.read() == BLOB
    # Serve BLOB under another digest: reading it to the end must fail.
    bad = sha256_digest(b"x")
    blob_server.ignore_range = False
    original = _BlobServer._serve

    def serve_any(self: _BlobServer, body: bool) -> None:
        self.path = self.path.replace(bad, BLOB_DIGEST)
        original(self, body)

    blob_server._serve = serve_any
    with _client(blob_server.host, tmp_path) as client:
        with pytest.raises(DigestMismatchError):
            with client.open_blob(bad) as f:
                f.read()


@pytest.mark.parametrize(
    ("header", "scheme", "params"),
    [
        (
            'Bearer realm="https://auth.example/token",service="registry.example",'
            'scope="repository:a/b:pull"',
            "bearer",
            {
                "realm": "https://auth.example/token",
                "service": "registry.example",
                "scope": "repository:a/b:pull",
            },
        ),
        ('Basic realm="Registry Realm"', "basic", {"realm": "Registry Realm"}),
        ("Bearer realm=http://x/t, service=s", "bearer", {"realm": "http://x/t", "service": "s"}),
    ],
)
def test_parse_challenge(header: str, scheme: str, params: dict[str, str]) -> None:
    challenge = parse_challenge(header)
    assert challenge is not None
    assert challenge.scheme == scheme
    assert challenge.params == params
