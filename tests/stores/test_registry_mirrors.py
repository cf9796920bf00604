"""Blob reads through a registry's mirrors (``imagetool.registry.mirrors``), configured by a
real hosts directory, in front of a real registry: the order of hosts, ``?ns=``, headers,
back-off after errors, timeouts and rejected bytes, failover in the middle of a range, 404s
passed over, and where credentials go."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import MirrorServer, token_auth_registry

from imagetool.errors import StoreError
from imagetool.format import BLOB_MEDIA_TYPE
from imagetool.registry.hosts import load_hosts_dir
from imagetool.stores import StoreOptions
from imagetool.stores.registry import RegistryStore

BLOB = bytes(range(256)) * 8192  # 2 MiB

pytestmark = pytest.mark.usefixtures("fresh_mirror_health")


@pytest.fixture
def mirror_factory() -> Iterator[Callable[[str], MirrorServer]]:
    made: list[MirrorServer] = []

    def make(upstream: str) -> MirrorServer:
        made.append(MirrorServer(upstream))
        return made[-1]

    yield make
    for m in made:
        m.stop()


def _hosts(tmp_path: Path, registry: str, toml: str) -> StoreOptions:
    ns = tmp_path / "certs.d" / registry
    ns.mkdir(parents=True, exist_ok=True)
    (ns / "hosts.toml").write_text(toml)
    return StoreOptions(
        timeout=10, retries=0, docker_config=tmp_path / "none.json",
        registry_hosts=load_hosts_dir(tmp_path / "certs.d"),
        mirror_timeout=0.5, mirror_backoff=1.0,
    )  # fmt: skip


def _mirror_then_server(mirror: str, server: str) -> str:
    return f'server = "http://{server}"\n[host."http://{mirror}"]\n'


def _one_mirror(
    registry, tmp_path: Path, mirror_factory, mode: str = "pass"
) -> tuple[str, str, MirrorServer, StoreOptions]:
    """The test blob pushed, and options with one mirror (in ``mode``) before the registry."""
    repo, digest = _push(registry.host, tmp_path)
    mirror = mirror_factory(registry.host)
    mirror.mode = mode
    return (
        repo,
        digest,
        mirror,
        _hosts(tmp_path, registry.host, _mirror_then_server(mirror.host, registry.host)),
    )


def _push(registry_host: str, tmp_path: Path) -> tuple[str, str]:
    repo = f"lb/mirror{uuid.uuid4().hex[:8]}"
    digest = "sha256:" + hashlib.sha256(BLOB).hexdigest()
    options = StoreOptions(plain_http=True, docker_config=tmp_path / "none.json")
    with RegistryStore(registry_host, repo, options) as store:
        store.put_blob(digest, BLOB, BLOB_MEDIA_TYPE)
    return repo, digest


def _read(
    store: RegistryStore, digest: str, offset: int, length: int, piece: int = 0
) -> tuple[bytes, object]:
    """The range, read in pieces of ``piece`` bytes (as the fetcher reads a sector at a
    time), or at once."""
    out = memoryview(bytearray(length))
    piece = piece or length
    with store.open_range(digest, offset, length) as body:
        for at in range(0, length, piece):
            body.readinto(out[at : at + piece])
    return bytes(out), body


def _stats(store: RegistryStore) -> dict[str, dict]:
    return {
        s["role"] + ("" if s["role"] == "server" else s["url"]): s for s in store.source_stats()
    }


def test_mirrors_first_in_order_with_ns_and_headers(registry, tmp_path, mirror_factory) -> None:
    repo, digest = _push(registry.host, tmp_path)
    first, second = mirror_factory(registry.host), mirror_factory(registry.host)
    first.mode = "missing"  # does not hold the blob: passed over, not backed off
    options = _hosts(
        tmp_path, registry.host,
        f'server = "http://{registry.host}"\n'
        f'[host."http://{first.host}"]\n  capabilities = ["pull"]\n'
        f'[host."http://{second.host}"]\n  capabilities = ["pull"]\n'
        f'  [host."http://{second.host}".header]\n    x-tier = ["a", "b"]\n'
        '[host."http://127.0.0.1:9"]\n  capabilities = ["push"]\n',  # never asked for blobs
    )  # fmt: skip
    with RegistryStore(registry.host, repo, options) as store:
        for offset in (0, 1 << 20):
            data, _ = _read(store, digest, offset, 300_000)
            assert data == BLOB[offset : offset + 300_000]
        assert store.read_range(digest, 5, 10) == BLOB[5:15]
        stats = store.source_stats()
    # A 404 is asked again through httpx (the answer to anything but the range), as at the
    # registry: 2 requests each.
    assert first.blob_reads() == 6 and second.blob_reads() == 3
    path, query, headers = second.seen[0]
    assert path == f"/v2/{repo}/blobs/{digest}"
    assert query == {"ns": [registry.host]}
    assert headers["x-tier"] == "a, b" and "Authorization" not in headers
    assert [(s["role"], s["requests"], s["not_found"], s["bytes"]) for s in stats] == [
        ("mirror", 3, 3, 0), ("mirror", 3, 0, 600_010), ("server", 0, 0, 0),
    ]  # fmt: skip


def test_failing_mirror_backs_off_and_comes_back(registry, tmp_path, mirror_factory) -> None:
    repo, digest, mirror, options = _one_mirror(registry, tmp_path, mirror_factory)
    with RegistryStore(registry.host, repo, options) as store:
        mirror.mode = "error"
        assert store.read_range(digest, 0, 1000) == BLOB[:1000]  # from the server
        assert store.read_range(digest, 0, 1000) == BLOB[:1000]  # mirror skipped
        asked = mirror.blob_reads()
        time.sleep(1.1)  # the back-off (1 s) is over
        mirror.mode = "pass"
        assert store.read_range(digest, 7, 1000) == BLOB[7:1007]
        mirror_stats, server_stats = store.source_stats()
    assert mirror.blob_reads() == asked + 1
    assert mirror_stats["errors"] == 1 and mirror_stats["skipped"] == 1
    assert mirror_stats["bytes"] == 1000 and mirror_stats["backoff_seconds"] == 0
    assert server_stats["requests"] == 2 and server_stats["bytes"] == 2000


def test_unreachable_mirror_costs_the_mirror_timeout(registry, tmp_path, mirror_factory) -> None:
    repo, digest = _push(registry.host, tmp_path)
    mirror = mirror_factory(registry.host)
    mirror.mode = "hang"  # accepts, never answers
    options = _hosts(tmp_path, registry.host, f'[host."http://{mirror.host}"]\n')
    options = dataclasses.replace(options, plain_http=True)
    with RegistryStore(registry.host, repo, options) as store:
        start = time.monotonic()
        assert store.read_range(digest, 0, 1000) == BLOB[:1000]
        assert time.monotonic() - start < 3  # 0.5 s for the mirror, then the registry
        assert store.source_stats()[0]["timeouts"] == 1


@pytest.mark.parametrize("mode", ["cut", "stall"])
def test_mirror_failing_mid_range_hands_over_the_rest(
    registry, tmp_path, mirror_factory, mode: str
) -> None:
    repo, digest, mirror, options = _one_mirror(registry, tmp_path, mirror_factory)
    mirror.mode, mirror.cut_after = mode, 100_000
    with RegistryStore(registry.host, repo, options) as store:
        data, _ = _read(store, digest, 10, 1_500_000, 65536)
        stats = store.source_stats()
    assert data == BLOB[10:1_500_010]
    mirror_stats, server_stats = stats
    # What the mirror sent before it failed was used, the rest came from the registry.
    assert 65536 <= mirror_stats["bytes"] <= 100_000 and server_stats["requests"] == 1
    assert mirror_stats["bytes"] + server_stats["bytes"] == 1_500_000
    assert mirror_stats["errors" if mode == "cut" else "timeouts"] == 1
    assert mirror_stats["backoff_seconds"] > 0


def test_rejected_bytes_back_the_mirror_off(registry, tmp_path, mirror_factory) -> None:
    repo, digest, mirror, options = _one_mirror(registry, tmp_path, mirror_factory, "corrupt")
    with RegistryStore(registry.host, repo, options) as store:
        data, body = _read(store, digest, 0, 4096)
        assert data != BLOB[:4096]  # the mirror lied; the caller checks (the fetcher does)
        body.reject("sector 0: checksum mismatch")
        data, _ = _read(store, digest, 0, 4096)
        assert data == BLOB[:4096]
        mirror_stats, server_stats = store.source_stats()
    assert mirror_stats["rejected"] == 1 and mirror_stats["skipped"] == 1
    assert mirror_stats["backoff_seconds"] > 0 and server_stats["bytes"] == 4096


def test_the_last_host_is_asked_even_while_backing_off(registry, tmp_path, mirror_factory):
    repo, digest = _push(registry.host, tmp_path)
    mirror = mirror_factory(registry.host)
    # The mirror is the server: no other host to try.
    options = _hosts(tmp_path, registry.host, f'server = "http://{mirror.host}"\n')
    with RegistryStore(registry.host, repo, options) as store:
        mirror.mode = "error"
        with pytest.raises(StoreError, match="HTTP 502"):
            store.read_range(digest, 0, 10)
        mirror.mode = "pass"
        assert store.read_range(digest, 0, 10) == BLOB[:10]
        assert store.source_stats() == []  # one host: nothing to compare


def test_credentials_go_where_containerd_sends_them(tmp_path, mirror_factory) -> None:
    """A CRI pull's credentials (for the image's registry) reach the registry only; a
    mirror gets docker config.json's for its own host, after its own challenge."""
    users = {"alice": "wonder", "mirroruser": "m"}
    (tmp_path / "reg").mkdir()
    with token_auth_registry(tmp_path / "reg", users, expires_in=300) as reg:
        repo = f"lb/cred{uuid.uuid4().hex[:8]}"
        digest = "sha256:" + hashlib.sha256(BLOB).hexdigest()
        pusher = StoreOptions(
            plain_http=True, credentials=("alice", "wonder"), docker_config=tmp_path / "n.json"
        )
        with RegistryStore(reg.host, repo, pusher) as store:
            store.put_blob(digest, BLOB, BLOB_MEDIA_TYPE)
        mirror = mirror_factory(reg.host)
        mirror.mode = "challenge"
        docker_config = tmp_path / "config.json"
        secret = base64.b64encode(b"mirroruser:m").decode()
        docker_config.write_text(json.dumps({"auths": {mirror.host: {"auth": secret}}}))
        options = _hosts(tmp_path, reg.host, _mirror_then_server(mirror.host, reg.host))
        options = dataclasses.replace(
            options, credentials=("alice", "wonder"), docker_config=docker_config
        )
        with RegistryStore(reg.host, repo, options) as store:
            # The mirror answers 401 with a challenge, then (with its own credentials) fails
            # upstream without a token: the read goes on at the registry with alice's.
            assert store.read_range(digest, 0, 100) == BLOB[:100]
        sent = [h.get("Authorization") for _, _, h in mirror.seen]
        assert sent[0] is None and f"Basic {secret}" in sent
        assert set(sent) == {None, f"Basic {secret}"}  # never alice's, never a token


def test_whole_blobs_that_do_not_match_come_from_the_next_host(
    registry, tmp_path, mirror_factory
) -> None:
    repo, digest, mirror, options = _one_mirror(registry, tmp_path, mirror_factory, "corrupt")
    with RegistryStore(registry.host, repo, options) as store:
        assert store.read_blob(digest) == BLOB  # e.g. the index, at mount
        mirror_stats, server_stats = store.source_stats()
    assert mirror_stats["rejected"] == 1 and server_stats["bytes"] == len(BLOB)
