"""Fixtures for the store tests: a tiny valid block image, every backend, loopback servers."""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import zstandard

from imagetool.format import MIN_SECTOR_SIZE, Blob, Index, Sector, sector_checksum, sha256_digest
from imagetool.registry import mirrors
from imagetool.stores import StoreOptions
from imagetool.stores.base import Store

BACKENDS = ["dir", "s3", "registry"]


@dataclass(frozen=True)
class TinyImage:
    index: Index
    index_bytes: bytes
    index_digest: str
    blob: bytes
    blob_digest: str


def make_image(seed: int = 0) -> TinyImage:
    """A valid three-sector block image (data, all zeros, short tail), built by hand."""
    rng = random.Random(seed)
    sector_size = MIN_SECTOR_SIZE
    raw = [
        rng.randbytes(sector_size // 2) + bytes(sector_size // 2),
        bytes(sector_size),
        rng.randbytes(1000),
    ]
    sectors: list[Sector] = []
    stored: list[bytes] = []
    offset = 0
    for data in raw:
        if not any(data):
            sectors.append(Sector(0, 0, sector_checksum(data)))
            continue
        packed = zstandard.ZstdCompressor(level=3).compress(data)
        sectors.append(Sector(offset, len(packed), sector_checksum(data)))
        stored.append(packed)
        offset += len(packed)
    blob = b"".join(stored)
    index = Index(
        image_size=2 * sector_size + 1000,
        sector_size=sector_size,
        sectors=tuple(sectors),
        metadata_sectors=1,
        blobs=(Blob(sha256_digest(blob), len(blob)),),
        prefetch=(0, 2),
        manifest_digest=sha256_digest(b"source manifest %d" % seed),
        platform="linux/amd64",
        config={"Entrypoint": ["/bin/sh"], "Env": ["PATH=/usr/bin:/bin"], "WorkingDir": "/"},
        version=1,
    )
    index_bytes = index.to_blob()  # as imagetool convert publishes it
    return TinyImage(index, index_bytes, sha256_digest(index_bytes), blob, sha256_digest(blob))


@pytest.fixture
def image() -> TinyImage:
    return make_image(0)


def unique_name() -> str:
    return "img" + uuid.uuid4().hex[:12]


def _options(tmp_path: Path, **kw: object) -> StoreOptions:
    """Short timeouts, few retries, and no user docker config leaking in."""
    defaults: dict[str, object] = {
        "timeout": 10.0,
        "retries": 1,
        "docker_config": tmp_path / "no-docker-config.json",
    }
    defaults.update(kw)
    return StoreOptions(**defaults)  # type: ignore[arg-type]


@pytest.fixture
def make_options(tmp_path: Path) -> Callable[..., StoreOptions]:
    """``make_options(**overrides)``: test StoreOptions (see ``_options``)."""
    return lambda **kw: _options(tmp_path, **kw)


@pytest.fixture
def tiny_image() -> Callable[[int], TinyImage]:
    """``tiny_image(seed)``: a different valid block image per seed."""
    return make_image


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """A fresh, empty image name in each backend."""
    name = unique_name()
    if request.param == "dir":
        from imagetool.stores.dir import DirStore

        s: Store = DirStore(tmp_path / "store", name)
    elif request.param == "s3":
        from imagetool.stores.s3 import S3Store

        bucket = request.getfixturevalue("s3_bucket")
        s = S3Store(bucket, "some/prefix", name, _options(tmp_path))
    else:
        from imagetool.stores.registry import RegistryStore

        registry = request.getfixturevalue("registry")
        s = RegistryStore(registry.host, f"lb/{name}", _options(tmp_path, plain_http=True))
    with s:
        yield s


Handler = type[BaseHTTPRequestHandler]


@pytest.fixture
def http_server() -> Iterator[Callable[[Handler], str]]:
    """Start loopback HTTP servers for handler classes; yields ``start(handler) -> host``."""
    servers: list[ThreadingHTTPServer] = []

    def start(handler: Handler) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return f"127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def fresh_mirror_health() -> Iterator[None]:
    """Mirrors' back-off and counts are per process: the test starts with none, and leaves
    none."""
    mirrors._health.clear()
    yield
    mirrors._health.clear()
