"""Registries that require credentials, for real: Debian's docker-registry with token auth
(a token service written here, issuing short-lived JWTs signed with a key made here) and
with htpasswd Basic auth.

imagetool and a lazy mount keep working after their first token expired (the token service
sees the renewal), wrong credentials give one clear line, and no secret (password, its
base64, or a token) ever appears in a log.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from mounthelp import with_store_options
from support import AuthRegistry, TokenServer, require_tool, token_auth_registry

from imagetool.stores import StoreOptions
from imagetool.stores.registry import RegistryStore
from snapshotter.config import MountConfig
from snapshotter.mount import api

pytestmark = [pytest.mark.root, pytest.mark.integration]

USER = "puller"
PASSWORD = "pw-" + uuid.uuid4().hex  # unique: any trace of it in a log is a leak
LIFETIME = 3  # seconds a token lives


def _docker_config(directory: Path, host: str, password: str = PASSWORD) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    auth = base64.b64encode(f"{USER}:{password}".encode()).decode()
    (directory / "config.json").write_text(json.dumps({"auths": {host: {"auth": auth}}}))
    return directory / "config.json"


def _run(tool: str, *args: str, docker_config: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DOCKER_CONFIG": str(docker_config.parent)}
    return subprocess.run(
        [sys.executable, "-m", f"{tool}.cli", *args], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip


def _secrets(tokens: TokenServer | None = None) -> list[str]:
    found = [PASSWORD, base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()]
    if tokens is not None:
        # a JWT's signature part is what makes it a credential
        found += [t.rsplit(".", 1)[1] for t in tokens.tokens]
    return found


def _assert_no_secret(text: str, tokens: TokenServer | None = None) -> None:
    for secret in _secrets(tokens):
        assert secret not in text, "a secret appears in a log"


@pytest.fixture(params=["expires_in", "early_expiry"])
def token_registry(request, tmp_path: Path) -> Iterator[AuthRegistry]:  # noqa: ANN001
    """A registry with token auth. ``expires_in``: the service says how long its tokens
    live (clients renew them in time); ``early_expiry``: the tokens die long before the
    service says (clients learn it from the registry's 401)."""
    expires_in = LIFETIME if request.param == "expires_in" else 300
    yield from _token_registry(tmp_path, expires_in)


def _token_registry(tmp_path: Path, expires_in: int) -> Iterator[AuthRegistry]:
    with token_auth_registry(
        tmp_path, {USER: PASSWORD}, expires_in=expires_in, lifetime=LIFETIME
    ) as reg:
        yield reg


def _convert(umoci_source: tuple[Path, Path], ref: str, docker_config: Path) -> str:
    res = _run("imagetool", "-vv", "--plain-http", "convert", "-q", "--sector-size", "64KiB",
               f"oci:{umoci_source[0]}:v1", ref, docker_config=docker_config)  # fmt: skip
    assert res.returncode == 0, res.stderr
    return res.stderr


def _mount_config(config: MountConfig, docker_config: Path) -> MountConfig:
    cfg = with_store_options(config, plain_http=True, docker_config=docker_config)
    return replace(cfg, readahead_bytes=0)  # read exactly what the test reads


def test_imagetool_and_mount_keep_working_across_token_expiry(
    token_registry: AuthRegistry, config: MountConfig, umoci_source, tmp_path: Path
) -> None:  # noqa: ANN001
    tokens = token_registry.tokens
    assert tokens is not None
    host = token_registry.host
    docker_config = _docker_config(tmp_path / "docker", host)
    repo = "lb/secure"
    scope = f"repository:{repo}:pull"
    logs = _convert(umoci_source, f"docker://{host}/{repo}:v1", docker_config)
    assert tokens.granted(f"repository:{repo}:pull,push")

    # One client (what imagetool's commands use) across its token's death.
    options = StoreOptions(plain_http=True, timeout=10, docker_config=docker_config)
    with RegistryStore(host, repo, options) as store:
        index_digest = store.resolve("v1")
        first = len(tokens.granted(scope))
        time.sleep(LIFETIME + 1)
        assert store.resolve("v1") == index_digest
        assert len(tokens.granted(scope)) > first

    # A lazy mount reads data it never fetched after its first token died.
    cfg = _mount_config(config, docker_config)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    info = api.mount(f"docker://{host}/{repo}:v1", mnt, cfg, log_level=logging.DEBUG)
    source = umoci_source[1]
    assert (mnt / "etc/hostname").read_bytes() == (source / "etc/hostname").read_bytes()
    before = len(tokens.granted(scope))
    mounted_at = time.time()
    time.sleep(LIFETIME + 1)
    assert (mnt / "data/big.bin").read_bytes() == (source / "data/big.bin").read_bytes()
    assert [t for t in tokens.granted(scope)[before:] if t > mounted_at + LIFETIME - 1]
    stats = api.stats(mnt, cfg)
    assert stats["fetch"]["fetch_errors"] == 0 and stats["reads"]["errors"] == 0
    logs += (info.state_dir / "server.log").read_text()
    assert "mounted docker://" in logs  # the log is the mount server's, at debug level
    _assert_no_secret(logs, tokens)
    _assert_no_secret(token_registry.log.read_text(), tokens)


def test_wrong_credentials_give_one_clear_line(
    token_registry: AuthRegistry, config: MountConfig, umoci_source, tmp_path: Path
) -> None:  # noqa: ANN001
    host = token_registry.host
    good = _docker_config(tmp_path / "good", host)
    _convert(umoci_source, f"docker://{host}/lb/app:v1", good)
    wrong_password = "wrong-" + uuid.uuid4().hex
    bad = _docker_config(tmp_path / "bad", host, wrong_password)

    res = _run("imagetool", "--plain-http", "inspect", f"docker://{host}/lb/app:v1",
               docker_config=bad)  # fmt: skip
    assert res.returncode == 3
    assert res.stderr.count("\n") == 1 and "AuthError" in res.stderr
    assert "refused our credentials" in res.stderr and host in res.stderr
    assert wrong_password not in res.stderr

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = _run("snapshotter", "mount", f"docker://{host}/lb/app:v1", str(mnt),
               "--state-dir", str(config.state_dir), "--cache-dir", str(config.cache_dir),
               "--set", "store.plain_http=true", "--set", f"store.docker_config={bad}",
               docker_config=bad)  # fmt: skip
    assert res.returncode == 3
    assert res.stderr.count("\n") == 1 and "AuthError" in res.stderr, res.stderr
    assert "refused our credentials" in res.stderr
    assert wrong_password not in res.stderr
    assert api.list_mounts(config) == []


def test_htpasswd_basic_auth(config: MountConfig, umoci_source, tmp_path: Path) -> None:  # noqa: ANN001
    require_tool("docker-registry")
    (tmp_path / "registry").mkdir()
    reg = AuthRegistry(tmp_path / "registry", {USER: PASSWORD})
    try:
        docker_config = _docker_config(tmp_path / "docker", reg.host)
        logs = _convert(umoci_source, f"docker://{reg.host}/lb/basic:v1", docker_config)
        cfg = _mount_config(config, docker_config)
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        info = api.mount(f"docker://{reg.host}/lb/basic:v1", mnt, cfg, log_level=logging.DEBUG)
        source = umoci_source[1]
        assert (mnt / "data/big.bin").read_bytes() == (source / "data/big.bin").read_bytes()
        logs += (info.state_dir / "server.log").read_text()
        _assert_no_secret(logs)

        bad = _docker_config(tmp_path / "bad", reg.host, "nope-" + uuid.uuid4().hex)
        res = _run("imagetool", "--plain-http", "inspect", f"docker://{reg.host}/lb/basic:v1",
                   docker_config=bad)  # fmt: skip
        assert res.returncode == 3 and res.stderr.count("\n") == 1
        assert "AuthError" in res.stderr and "refused our credentials" in res.stderr
    finally:
        reg.stop()


def test_daemon_credentials_follow_a_rotated_secret(
    config: MountConfig, umoci_source, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:  # noqa: ANN001
    """The containerd-facing daemon's path: credentials from a mounted Kubernetes secret
    (``.dockerconfigjson``), merged for the mount servers; a rotated secret is used by the
    next mount without a restart, and nothing secret reaches a log."""
    from snapshotter.config import Config, ServiceConfig
    from snapshotter.containerd.handshake import RemoteLayers

    registries = _token_registry(tmp_path, LIFETIME)
    reg = next(registries)
    try:
        tokens = reg.tokens
        assert tokens is not None
        ref = f"docker://{reg.host}/lb/daemon:v1"
        _convert(umoci_source, ref, _docker_config(tmp_path / "admin", reg.host))
        secret = tmp_path / "secret"
        _docker_config(secret, reg.host).rename(secret / ".dockerconfigjson")
        mount_config = replace(config, store=replace(config.store, docker_config=secret))
        service = ServiceConfig(root=tmp_path / "root", insecure_registries=(reg.host,))
        remote = RemoteLayers.create(Config(mount=mount_config, service=service))
        source = umoci_source[1]
        caplog.set_level(logging.DEBUG)

        remote.mounter.mount(ref, tmp_path / "mnt1")
        assert (tmp_path / "mnt1/etc/hostname").read_bytes() == (
            source / "etc/hostname"
        ).read_bytes()
        merged = tmp_path / "root" / "auth" / "config.json"
        assert merged.stat().st_mode & 0o777 == 0o600
        assert reg.host in json.loads(merged.read_text())["auths"]

        # The registry's password is rotated, and so is the secret (as the kubelet does).
        rotated = "rotated-" + uuid.uuid4().hex
        tokens.users[USER] = rotated
        (secret / ".dockerconfigjson").unlink()
        _docker_config(secret, reg.host, rotated).rename(secret / ".dockerconfigjson")
        granted = len(tokens.requests)
        remote.mounter.mount(ref, tmp_path / "mnt2")
        assert (tmp_path / "mnt2/data/big.bin").read_bytes() == (
            source / "data/big.bin"
        ).read_bytes()
        assert any(r["ok"] for r in tokens.requests[granted:])
        assert not any(not r["ok"] for r in tokens.requests[granted:])

        logs = caplog.text + "".join(
            (m.state_dir / "server.log").read_text() for m in api.list_mounts(config)
        )
        assert "registry credentials" in logs  # the merge was logged, by host and file only
        _assert_no_secret(logs, tokens)
        assert rotated not in logs
    finally:
        for mnt in ("mnt1", "mnt2"):
            api.unmount(tmp_path / mnt, config, lazy=True)
        registries.close()
